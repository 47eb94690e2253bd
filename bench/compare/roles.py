"""The benchmark's processes: one trainer and N receivers per system run, driven over pipes.

Every role runs in its own process (spawned through :mod:`deltasync_examples.harness`, so
each starts clean) and measures its own time and peak RSS. All roles join one gloo group at
start, used only by the in-cluster path. The orchestrator (run.py) sends commands; each
answer is a plain dict. Times that two processes compare are wall-clock (``time.time()``).

This module knows the roles' life cycle; what a system ships lives in systems/.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from deltasync_bench.compare.memory import current_rss, peak_rss, reset_peak, trim
from deltasync_bench.compare.workload import ForwardBackward, Workload, build_trainer
from deltasync_examples.harness import serve

# Every collective of a run waits at most this long (a 0.6B anchor takes minutes here).
TIMEOUT_S = 900.0


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
    fwd_bwd_s: float = 0.0  # the stand-in forward/backward after each sync (trainer)
    fwd_bwd_on: str = "cpu"  # where it runs: "cpu" (computes) or "device" (the host waits)


def _init(spec: RoleSpec):
    import torch.distributed as dist

    from deltasync import ModelSpec, ReceiverLayout, TrainerLayout

    torch.set_num_threads(spec.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.port}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    mspec = ModelSpec.from_hf_config(spec.workload.hf_config())
    return TrainerLayout.build(mspec), ReceiverLayout.build(
        mspec, engine=spec.engine, tp=spec.tp, ep=spec.ep
    )


class _Link:
    """The role's one store for its whole life, behind the link rate of the current path.

    A system keeps one publisher or receiver (thread pools, caches, journal, its verified
    baseline) across versions and paths, as a deployment does; only the emulated link rate
    changes between paths. The link is full duplex (ThrottledStore's default: the rate each
    way, reads and writes in buckets of their own, like a real NIC), one per role process.
    Metadata calls stay free, as in ThrottledStore."""

    def __init__(self, root: str) -> None:
        from deltasync import LocalStore

        self.inner = LocalStore(root, durable=False)  # page cache; the link is emulated
        self._links: dict = {None: self.inner}
        self.current = self.inner

    def use(self, gbps: float | None) -> _Link:
        from deltasync.store import ThrottledStore

        if gbps not in self._links:
            self._links[gbps] = ThrottledStore(self.inner, gbps)
        self.current = self._links[gbps]
        return self

    def __getattr__(self, name: str):
        return getattr(self.current, name)


_LINK: list[_Link] = []


def _store(spec: RoleSpec, gbps: float | None) -> _Link:
    if not _LINK:
        _LINK.append(_Link(spec.store_root))
    return _LINK[0].use(gbps)


def trainer_main(spec: RoleSpec, conn) -> None:
    from deltasync_bench.compare.systems import make_trainer_side
    from deltasync_examples.oracle import reference_digests

    st: dict = {}

    def ready() -> dict:
        tlayout, rlayout = _init(spec)
        trainer = build_trainer(spec.workload)
        for k in range(spec.workload.pre_steps + 1):  # also allocates AdamW's m and v
            trainer.step(-1 - k)  # negative seeds: never the same gradients as a synced version
        fwd_bwd = ForwardBackward(spec.fwd_bwd_s, on=spec.fwd_bwd_on)
        trim()  # the baseline holds what is live: model, optimizer states, buffers
        st.update(
            tlayout=tlayout,
            rlayout=rlayout,
            trainer=trainer,
            fwd_bwd=fwd_bwd,
            rss_model_opt=current_rss(),
        )
        st["side"] = make_trainer_side(
            spec.system,
            params=trainer.params(),
            tlayout=tlayout,
            rlayout=rlayout,
            trainer=trainer,
            timeout_s=TIMEOUT_S,
            store_root=spec.store_root,
        )
        return {"ready": True}

    def expected() -> dict[str, str]:
        return reference_digests(st["trainer"].params(), st["tlayout"], st["rlayout"])

    def handle(op, *args) -> dict:
        side, trainer = st["side"], st["trainer"]
        if op == "bootstrap":
            n = side.bootstrap(_store(spec, None))
            return {
                "bytes": n,
                "expected": expected(),
                "model_bf16_bytes": trainer.model_bytes_bf16(),
            }
        if op == "step":
            # One training step: [forward/backward] optimizer step, sync, next forward/backward.
            # The same forward/backward is run once with no sync in flight first, so its
            # slowdown by a background publish is a paired difference, not a guess.
            version, path, gbps = args
            fb = st["fwd_bwd"]
            c_fb = time.process_time()
            fb_alone = fb.run()
            fb_cpu = time.process_time() - c_fb
            trainer.step(
                version
            )  # the optimizer step (deltasync: its pre-step hook is the barrier)
            detect_s = side.detect_alone(path)  # changes nothing: the sync detects again
            trim()  # free heap kept from earlier steps is not this sync's memory
            if hasattr(side, "last_bytes"):
                side.last_bytes = None  # an overlapped sync sets it at settle: this version's
            rss0 = current_rss()
            reset_peak()
            t0 = time.time()  # the end of the optimizer step: latency counts from here
            c0 = time.process_time()  # every thread of this process
            if path == "store":
                nbytes = side.store_sync(version, _store(spec, gbps))
                t_x = t1 = time.time()
            else:
                sent = side.cluster_sync(version)
                t1 = time.time()
                nbytes, t_x = sent.bytes, t0 + sent.stall_s
            fb_with = fb.run()
            t_fb = time.time()
            t_commit = side.settle()
            # CPU seconds the sync cost this process: all of its threads from the end of the
            # optimizer step to the commit, less what the forward/backward takes alone.
            sync_cpu = time.process_time() - c0 - fb_cpu
            # What the next optimizer step would wait for: the background still running after
            # the forward/backward ended.
            barrier_s = max(0.0, t_commit - t_fb)
            if getattr(side, "last_bytes", None) is not None:
                nbytes = side.last_bytes  # an overlapped sync knows its bytes at commit
            peak = peak_rss()
            return {
                "t0": t0,
                "t_exchange": t_x,
                "t1": t1,
                "t_commit": t_commit,
                "t_fb": t_fb,
                "stall_s": t1 - t0,
                "detect_s": detect_s,
                "fwd_bwd_alone_s": fb_alone,
                "fwd_bwd_cpu_s": fb_cpu,
                "sync_cpu_s": sync_cpu,
                "fwd_bwd_with_s": fb_with,
                "barrier_s": barrier_s,
                # wall of a training step with sync minus without
                "overhead_s": (t1 - t0) + (fb_with - fb_alone) + barrier_s,
                "bytes": nbytes,
                "rss_before": rss0,
                "peak_rss": peak,
                "overhead_bytes": max(0, peak - st["rss_model_opt"]),
                "kept_bytes": max(0, rss0 - st["rss_model_opt"]),
                "changed_elements": getattr(side, "last_changed_elements", None),
                "shard_elements": getattr(side, "last_shard_elements", None),
                "phases": getattr(side, "last_phases", None) if path == "cluster" else None,
            }
        if op == "expected":
            # The bench's own oracle (a full read of the model), asked for only after every
            # receiver is done: inside "step" it delayed the receivers' pulls and was counted in
            # every system's total (~1 s at 0.6B on this machine).
            return {"expected": expected()}
        raise ValueError(f"unknown trainer command {op!r}")

    serve(conn, handle, ready=ready)


def receiver_main(spec: RoleSpec, conn) -> None:
    from deltasync_bench.compare.systems import make_receiver_side
    from deltasync_examples.oracle import bits_digest

    st: dict = {}

    def ready() -> dict:
        _tlayout, rlayout = _init(spec)
        shard = rlayout.shards()[spec.rank - 1].id
        trim()
        rss_base = current_rss()  # interpreter + torch, before the shard exists
        side = make_receiver_side(
            spec.system,
            rlayout=rlayout,
            shard=shard,
            store_root=spec.store_root,
            timeout_s=TIMEOUT_S,
        )
        shard_bytes = sum(t.numel() * t.element_size() for t in side.live().values())
        st.update(side=side, shard=shard, rss_base=rss_base, shard_bytes=shard_bytes)
        return {"ready": True}

    def handle(op, *args) -> dict:
        side, shard = st["side"], st["shard"]
        if op == "bootstrap":
            # A receiver's first pull: version 0 whole (deltasync: the anchor restore every
            # receiver starting or restarting makes), its peak measured as a pull's is
            reset_peak()
            side.bootstrap(_store(spec, None))
            peak = peak_rss()
            digest = bits_digest(side.live())
            trim()  # the anchor's freed buffers are not the next pull's memory
            return {
                "digest": digest,
                "shard": shard,
                "overhead_bytes": peak - st["rss_base"],
                "shard_bytes": st["shard_bytes"],
            }
        if op == "pull":
            version, path, gbps = args
            rss0 = current_rss()
            reset_peak()
            t_call, c_call = time.time(), time.process_time()
            if path == "store":
                t0 = t_call
                got = side.store_pull(version, _store(spec, gbps))
            else:
                got = side.cluster_sync(version)
                t0 = t_call + got.wait_s  # when this rank's payload had arrived
            # The pull's CPU from the moment the version was visible (store path): the polls
            # before it span the trainer's whole step (~8 ms of CPU a receiver on the small
            # preset, outside the version's window), not the version's cost.
            c_from = c_call if got.seen_cpu is None else got.seen_cpu
            t1, cpu = time.time(), time.process_time() - c_from
            peak = peak_rss()  # before the bench's own digest below
            out = {
                "t_recv": t0,
                "t_done": t1,
                "transfer_s": got.transfer_s,
                "pause_s": got.pause_s,
                "cpu_s": cpu,
                "seen_at": got.seen_at,
                "stage_s": got.stage_s,
                "verify_s": got.verify_s,
                "bytes": got.bytes,
                "shard": shard,
                "shard_bytes": st["shard_bytes"],
                "rss_base": st["rss_base"],
                "rss_before": rss0,
                "peak_rss": peak,
            }
            return out
        if op == "check":
            # The bench's own digest (a full read of the shard) and the heap's trim, asked for
            # only once every role replied: inside "pull" they ran beside the trainer's
            # measured forward/backward and were counted as its overhead (~80 ms of CPU).
            digest = bits_digest(side.live())
            trim()  # the next pull's baseline holds what is live
            return {"digest": digest}
        raise ValueError(f"unknown receiver command {op!r}")

    serve(conn, handle, ready=ready)
