"""Test kit for tests/fsdp: tiny transformers configs, torchrun launches, store receivers.

- ``CONFIGS``: a dense Qwen3 and a Qwen3-MoE small enough that two gloo ranks on two cores
  train, gather and publish a handful of versions in seconds.
- ``torchrun``: launch ``fsdp_worker.py`` under ``torch.distributed.run`` with a hard timeout;
  its stdout/stderr come back for the assertion message.
- ``launch``: start receivers for every store job, then run all jobs in one torchrun launch.
- ``receiver_main``: a vLLM-convention TP receiver shard in its own process, pulling every
  version from a local store and comparing it, bit for bit, with the dense split of the
  gathered full state that trainer rank 0 wrote for that version (the oracle).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltasync import LocalStore, ModelSpec, Receiver, ReceiverConfig, ReceiverLayout
from deltasync_examples.models import tiny_qwen3

HERE = Path(__file__).resolve().parent
VERSIONS = 5  # anchors at 0 and 3 (anchor_every=3); 2 optimizer steps for odd versions
ANCHOR_EVERY = 3

# The one tiny Qwen3, smaller still (hidden 32, vocab 97): four torchrun ranks share two cores.
_SMALL = dict(
    vocab_size=97, hidden_size=32, head_dim=8, intermediate_size=48, max_position_embeddings=32
)
CONFIGS: dict[str, dict] = {
    "qwen3": tiny_qwen3(**_SMALL),
    "qwen3_moe": tiny_qwen3(
        **_SMALL,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        moe_intermediate_size=16,
        num_experts=5,
        num_experts_per_tok=2,
    ),
}


def layouts(model: str) -> tuple[ModelSpec, ReceiverLayout]:
    spec = ModelSpec.from_hf_config(CONFIGS[model])
    return spec, ReceiverLayout.build(spec, "vllm", 2)


def torchrun(nproc: int, *args: str, timeout: float = 100.0) -> subprocess.CompletedProcess:
    """Run ``fsdp_worker.py args`` on ``nproc`` local gloo ranks (CPU), killed at ``timeout``."""
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT, SIGSEGV) prints every Python thread's
    # stack to the stderr the test shows, so an abort is diagnosed from the log of one run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / "fsdp_worker.py"),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def receiver_main(
    store_path: str, model: str, shard: str, out: str, ready, deadline_s: float
) -> None:
    """Register, then pull until the last version, checking each version against the oracle."""
    torch.set_num_threads(1)
    _, rl = layouts(model)
    specs = rl.local_specs(shard)
    tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
    rec = Receiver.for_layout(
        LocalStore(store_path, durable=False),
        rl,
        shard,
        tensors,
        str(Path(out) / f"state-{shard}"),
        ReceiverConfig(receiver_id=f"r-{shard}", durable=False),
    )
    ready.set()  # registered: the publisher's bounded staleness now waits for this receiver
    seen: list[dict] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        rec.pull()
        v = rec.version
        if v is not None and (not seen or seen[-1]["version"] != v):
            want = torch.load(Path(out) / "oracle" / f"v{v}.pt")[shard]
            bad = [
                n
                for n in want
                if not torch.equal(rec.tensors[n].view(torch.int16), want[n].view(torch.int16))
            ]
            seen.append(
                {"version": v, "bad": bad, "same_names": sorted(want) == sorted(rec.tensors)}
            )
            if v == VERSIONS - 1:
                break
        time.sleep(0.1)  # ~10 receivers poll at once on two cores
    Path(out, f"seen-{shard}.json").write_text(json.dumps(seen))


def start_receivers(store_path: Path, model: str, out: Path, deadline_s: float = 160.0) -> list:
    """One forked process per TP shard, each registered before this returns."""
    ctx = mp.get_context("fork")
    procs = []
    for shard in ("tp0", "tp1"):
        ready = ctx.Event()
        p = ctx.Process(
            target=receiver_main, args=(str(store_path), model, shard, str(out), ready, deadline_s)
        )
        p.start()
        assert ready.wait(30), f"receiver {shard} did not register"
        procs.append(p)
    return procs


def stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def check_receivers(procs: list, out: Path, log: str) -> None:
    """Every receiver saw every version, each bit-exact against the oracle."""
    for p in procs:
        p.join(30)
    stop(procs)
    for shard in ("tp0", "tp1"):
        path = out / f"seen-{shard}.json"
        assert path.exists(), f"receiver {shard} wrote no result\n{log[-3000:]}"
        seen = json.loads(path.read_text())
        assert [s["version"] for s in seen] == list(range(VERSIONS)), (
            f"{shard}: {seen}\n{log[-3000:]}"
        )
        for s in seen:
            assert s["same_names"] and s["bad"] == [], (
                f"{shard} v{s['version']} differs: {s['bad'][:5]}"
            )


@dataclass
class Launch:
    returncode: int
    stdout: str
    log: str
    receivers: dict[str, tuple[list, Path]]


def launch(root: Path, nproc: int, jobs: list[tuple[str, str, str]], timeout: float) -> Launch:
    """Start receivers for every store job, then run all ``jobs`` in one torchrun launch."""
    args: list[str] = []
    receivers: dict[str, tuple[list, Path]] = {}
    try:
        for model, impl, mode in jobs:
            out = root / f"{model}-{impl}-{mode}"
            out.mkdir()
            if mode in ("fsdp", "ddp", "gather", "gather_overlap", "parts"):
                receivers[f"{model}:{impl}:{mode}"] = (
                    start_receivers(out / "store", model, out),
                    out,
                )
            args += ["--job", f"{model}:{impl}:{mode}:{out}"]
        done = torchrun(nproc, *args, timeout=timeout)
    except BaseException:
        for procs, _ in receivers.values():
            stop(procs)
        raise
    if done.returncode:
        for procs, _ in receivers.values():
            stop(procs)
    return Launch(done.returncode, done.stdout, (done.stdout + done.stderr)[-6000:], receivers)
