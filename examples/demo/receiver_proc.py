"""A demo rollout-worker process: one vLLM-convention shard, kept current by ``Receiver.pull``.

It runs on :func:`deltasync_examples.harness.serve`. ``("pull", v)`` pulls until the shard holds
version v and answers with the pull report and a digest of the live tensors; ``("dense", key)``
measures a dense refit of the same version (fetch + load the full shard file) into scratch
memory and checks it equals the live shard, so the summary's dense column is measured, not
estimated.

This module knows one receiver's commands; the trainer side lives in ``run.py``.
"""

from __future__ import annotations

import time

from deltasync_examples.harness import serve
from deltasync_examples.oracle import bits_digest


def open_demo_store(root: str, link_gbps: float):
    """The store at ``root`` as one process reaches it: behind its own emulated link of
    ``link_gbps`` (0: the local disk directly)."""
    from deltasync import LocalStore
    from deltasync.store import ThrottledStore

    local = LocalStore(root)
    return ThrottledStore(local, link_gbps) if link_gbps else local


def receiver_main(
    store_root: str,
    link_gbps: float,
    state_dir: str,
    hf_config: dict,
    tp: int,
    shard: str,
    conn,
) -> None:
    import torch
    from safetensors.torch import load as st_load

    from deltasync import ModelSpec, Receiver, ReceiverConfig, ReceiverLayout

    torch.set_num_threads(1)
    state: dict = {}

    def ready() -> dict:
        layout = ReceiverLayout.build(ModelSpec.from_hf_config(hf_config), engine="vllm", tp=tp)
        state["live"] = {
            n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(shard).items()
        }
        state["store"] = open_demo_store(store_root, link_gbps)  # this host's own link
        state["rx"] = Receiver.for_layout(
            state["store"],
            layout,
            shard,
            state["live"],
            state_dir,
            ReceiverConfig(receiver_id=f"demo-{shard}"),
        )
        return {}

    def held() -> int:
        rx = state["rx"]
        return -1 if rx.version is None or rx.dirty else rx.version

    def handle(op: str, *args) -> dict:
        rx, live = state["rx"], state["live"]
        if op == "pull":
            target, deadline = args[0], time.time() + 300
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
            return {"version": rx.version, "digest": bits_digest(live), **total}
        if op == "dense":
            t0 = time.perf_counter()
            data = state["store"].get(args[0])
            loaded = st_load(data)
            scratch = {n: torch.empty_like(t) for n, t in live.items()}
            t1 = time.perf_counter()
            for n, t in scratch.items():
                t.copy_(loaded[n])
            t2 = time.perf_counter()
            same = all(
                torch.equal(scratch[n].view(torch.int16), live[n].view(torch.int16)) for n in live
            )
            return {"fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": len(data), "same": same}
        raise ValueError(f"unknown demo receiver command {op!r}")

    serve(conn, handle, ready=ready)
