"""A demo rollout-worker process: one vLLM-convention shard, kept current by ``Receiver.pull``.

Commands arrive over a pipe: ``("pull", v)`` pulls until the shard holds version v and answers
with the pull report and a digest of the live tensors; ``("dense", key)`` measures a dense
refit of the same version (fetch + load the full shard file) into scratch memory and checks it
equals the live shard, so the summary's dense column is measured, not estimated.
"""

from __future__ import annotations

import time
import traceback


def receiver_main(store_root: str, state_dir: str, hf_config: dict, tp: int, shard: str, conn) -> None:
    import torch
    from safetensors.torch import load as st_load

    from deltasync.layout import ModelSpec, ReceiverLayout
    from deltasync.manifest import state_digest
    from deltasync.receiver import Receiver, ReceiverConfig
    from deltasync.store import LocalStore

    torch.set_num_threads(1)
    try:
        layout = ReceiverLayout.build(ModelSpec.from_hf_config(hf_config), engine="vllm", tp=tp)
        live = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(shard).items()}
        store = LocalStore(store_root)
        rx = Receiver.for_layout(store, layout, shard, live, state_dir,
                                 ReceiverConfig(receiver_id=f"demo-{shard}"))
        conn.send({"ok": True})
    except BaseException as exc:
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        try:
            def held() -> int:
                return -1 if rx.version is None or rx.dirty else rx.version

            if cmd[0] == "exit":
                return
            if cmd[0] == "pull":
                target, deadline = cmd[1], time.time() + 300
                total = {"bytes": 0, "pause_s": 0.0, "stage_s": 0.0, "total_s": 0.0, "elements": 0}
                while held() < target:  # poll like a sidecar until the version lands
                    rep = rx.pull()
                    total["bytes"] += rep.bytes_fetched
                    total["pause_s"] += rep.pause_s
                    total["stage_s"] += rep.stage_s + rep.verify_s
                    total["total_s"] += rep.total_s
                    total["elements"] += rep.elements_written
                    if time.time() > deadline:
                        raise TimeoutError(f"shard {shard} did not reach version {target}")
                    if held() < target:
                        time.sleep(0.01)
                conn.send({"ok": True, "version": rx.version, "digest": state_digest(live), **total})
            elif cmd[0] == "dense":
                t0 = time.perf_counter()
                data = store.get(cmd[1])
                loaded = st_load(data)
                scratch = {n: torch.empty_like(t) for n, t in live.items()}
                t1 = time.perf_counter()
                for n, t in scratch.items():
                    t.copy_(loaded[n])
                t2 = time.perf_counter()
                same = all(torch.equal(scratch[n].view(torch.int16), live[n].view(torch.int16)) for n in live)
                conn.send({"ok": True, "fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": len(data), "same": same})
        except BaseException as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
            return
