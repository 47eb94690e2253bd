"""The benchmark's processes: one trainer and N receivers per system run, driven over pipes.

Every role runs in its own process (spawned, so each starts clean) and measures its own time
and peak RSS. All roles join one gloo group at start, used only by the in-cluster path. The
orchestrator (run.py) sends commands; each answer is a plain dict.

This module knows the roles' life cycle; what a system ships lives in systems/.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import torch

from deltasync.bench.compare.memory import current_rss, peak_rss, reset_peak
from deltasync.bench.compare.workload import Trainer, Workload


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    system: str
    workload: Workload
    engine: str
    tp: int
    ep: int
    store_root: str
    rank: int
    world_size: int
    port: int
    threads: int


def _init(spec: RoleSpec):
    import torch.distributed as dist

    from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout

    torch.set_num_threads(spec.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=spec.rank,
                            world_size=spec.world_size, timeout=__import__("datetime").timedelta(seconds=900))
    mspec = ModelSpec.from_hf_config(spec.workload.hf_config())
    return TrainerLayout.build(mspec), ReceiverLayout.build(mspec, engine=spec.engine, tp=spec.tp, ep=spec.ep)


def _store(spec: RoleSpec, gbps: float | None):
    from deltasync.store import LocalStore, ThrottledStore

    inner = LocalStore(spec.store_root, durable=False)  # page-cache speed; the link is emulated
    return ThrottledStore(inner, gbps) if gbps else inner


def _serve(conn, handler) -> None:
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            conn.send({"ok": True})
            return
        try:
            conn.send({"ok": True, **handler(*cmd)})
        except BaseException as exc:  # report, then die: the orchestrator tears the run down
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
            return


def trainer_main(spec: RoleSpec, conn) -> None:
    from deltasync.bench.compare.systems import make_trainer_side
    from deltasync.exchange import ExchangeConfig, exchange
    tlayout, rlayout = _init(spec)
    trainer = Trainer(spec.workload)
    for k in range(spec.workload.pre_steps + 1):  # also allocates AdamW's m and v
        trainer.step(-1 - k)  # negative seeds: never the same gradients as a synced version
    rss_model_opt = current_rss()
    side = make_trainer_side(spec.system, params=trainer.params(), tlayout=tlayout, rlayout=rlayout,
                             trainer=trainer)
    shard_rank = {s.id: 1 + i for i, s in enumerate(rlayout.shards())}
    xcfg = ExchangeConfig(timeout_s=900.0)

    def expected() -> dict[str, str]:
        from deltasync.bench.compare.systems.base import canonical_bf16
        from deltasync.layout.digests import shard_state_digests

        # digests of split(bf16(trainer)) without materializing the split (memory)
        return shard_state_digests(rlayout.table, canonical_bf16(trainer.params(), tlayout))

    def handle(op, *args):
        if op == "bootstrap":
            n = side.bootstrap(_store(spec, None))
            return {"bytes": n, "expected": expected(), "model_bf16_bytes": trainer.model_bytes_bf16()}
        if op == "step":
            version, path, gbps = args
            trainer.step(version)  # untimed: the optimizer step itself is not the sync
            rss0 = current_rss()
            reset_peak()
            t0 = time.time()
            if path == "store":
                nbytes = side.store_sync(version, _store(spec, gbps))
                t_x = t1 = time.time()
            else:
                payloads = side.cluster_payloads(version)
                t_x = time.time()
                exchange({shard_rank[s]: p for s, p in payloads.items()}, config=xcfg)
                nbytes = sum(len(p) for p in payloads.values())
                t1 = time.time()
            peak = peak_rss()
            return {"t0": t0, "t_exchange": t_x, "t1": t1, "stall_s": t1 - t0, "bytes": nbytes,
                    "rss_before": rss0, "peak_rss": peak, "overhead_bytes": max(0, peak - rss_model_opt),
                    "changed_elements": getattr(side, "last_changed_elements", None)}
        if op == "expected":
            # The bench's own oracle (a full read of the model), asked for only after every
            # receiver is done: inside "step" it delayed the receivers' pulls and was counted in
            # every system's total (~1 s at 0.6B on this machine).
            return {"expected": expected()}
        raise ValueError(op)

    conn.send({"ok": True, "ready": True})
    _serve(conn, handle)


def receiver_main(spec: RoleSpec, conn) -> None:
    from deltasync.bench.compare.systems import make_receiver_side
    from deltasync.exchange import ExchangeConfig, exchange
    from deltasync.manifest import state_digest

    tlayout, rlayout = _init(spec)
    shard = rlayout.shards()[spec.rank - 1].id
    rss_base = current_rss()  # interpreter + torch, before the shard exists
    side = make_receiver_side(spec.system, rlayout=rlayout, shard=shard, store_root=spec.store_root)
    shard_bytes = sum(t.numel() * t.element_size() for t in side.live().values())
    xcfg = ExchangeConfig(timeout_s=900.0)

    def handle(op, *args):
        if op == "bootstrap":
            side.bootstrap(_store(spec, None))
            return {"digest": state_digest(side.live()), "shard": shard}
        if op == "pull":
            version, path, gbps = args
            rss0 = current_rss()
            reset_peak()
            if path == "store":
                t0 = time.time()
                st = side.store_pull(version, _store(spec, gbps))
            else:
                got = exchange({}, config=xcfg)
                t0 = time.time()
                payload = bytes(got[0].numpy()) if 0 in got else b""
                st = side.cluster_apply(version, payload)
            t1 = time.time()
            return {"t_recv": t0, "t_done": t1, "transfer_s": st.transfer_s, "pause_s": st.pause_s,
                    "bytes": st.bytes, "digest": state_digest(side.live()), "shard": shard,
                    "shard_bytes": shard_bytes, "rss_base": rss_base, "rss_before": rss0,
                    "peak_rss": peak_rss()}
        raise ValueError(op)

    conn.send({"ok": True, "ready": True})
    _serve(conn, handle)
