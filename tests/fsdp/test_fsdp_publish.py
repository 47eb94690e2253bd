"""Real multi-rank publishing: torchrun, gloo ranks on the CPU, transformers models under
FSDP2 (``fully_shard`` per layer and at the root) or DDP, AdamW in its three implementations
with a scheduler, two optimizer steps for some versions, an anchor in between and an edit
outside the optimizer. Every version reaches vLLM-convention TP=2 receivers in other
processes bit-exact against a dense split of the gathered full state; every rank's tracker
misses nothing against an exact snapshot of its shards (asserted inside the workers).

The store-path jobs share one two-rank launch (importing transformers costs each rank ~5-10 s
here), each job with its own store and receivers; each test checks its own job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from fsdp_kit import check_receivers, start_receivers, stop, torchrun

STORE_JOBS = [
    ("qwen3", "foreach", "fsdp"),
    ("qwen3", "single", "fsdp"),
    ("qwen3", "fused", "fsdp"),
    ("qwen3_moe", "foreach", "fsdp"),
    ("qwen3", "single", "ddp"),
]


@dataclass
class Launch:
    returncode: int
    stdout: str
    log: str
    receivers: dict[str, tuple[list, Path]]


def _launch(root: Path, nproc: int, jobs: list[tuple[str, str, str]], timeout: float) -> Launch:
    args: list[str] = []
    receivers: dict[str, tuple[list, Path]] = {}
    try:
        for model, impl, mode in jobs:
            out = root / f"{model}-{impl}-{mode}"
            out.mkdir()
            if mode != "cluster":
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


@pytest.fixture(scope="module")
def store_launch(tmp_path_factory):
    launch = _launch(tmp_path_factory.mktemp("fsdp"), 2, STORE_JOBS, timeout=110)
    yield launch
    for procs, _ in launch.receivers.values():
        stop(procs)


def _check_job(launch: Launch, job: tuple[str, str, str]) -> None:
    key = ":".join(job)
    assert f"rank 0 {key} published" in launch.stdout, launch.log
    assert f"rank 1 {key} published" in launch.stdout, launch.log
    procs, out = launch.receivers[key]
    check_receivers(procs, out, launch.log)


@pytest.mark.timeout(130)
@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
def test_fsdp2_qwen3_ranks_each_publish_every_version_exactly(store_launch, impl):
    _check_job(store_launch, ("qwen3", impl, "fsdp"))


@pytest.mark.timeout(130)
def test_fsdp2_qwen3_moe_ranks_publish_every_version_exactly(store_launch):
    _check_job(store_launch, ("qwen3_moe", "foreach", "fsdp"))


@pytest.mark.timeout(130)
def test_under_ddp_one_rank_writes_and_every_version_is_exact(store_launch):
    _check_job(store_launch, ("qwen3", "single", "ddp"))
    assert store_launch.returncode == 0, store_launch.log


@pytest.mark.timeout(130)
def test_fsdp2_writers_sync_every_version_exactly_to_receivers_in_the_same_process_group(tmp_path):
    launch = _launch(tmp_path, 4, [("qwen3", "fused", "cluster")], timeout=120)
    assert launch.returncode == 0, launch.log
    for rank in range(4):
        assert f"rank {rank} cluster qwen3:fused synced" in launch.stdout, launch.log
