"""Real multi-rank publishing: torchrun, two gloo ranks on the CPU, transformers models under
FSDP2 (``fully_shard`` per layer and at the root) or DDP, AdamW in its three implementations
with a scheduler, two optimizer steps for some versions, an anchor in between and an edit
outside the optimizer. Every version reaches vLLM-convention TP=2 receivers in other
processes bit-exact against a dense split of the gathered full state; every rank's tracker
misses nothing against an exact snapshot of its shards."""

from __future__ import annotations

import pytest

from fsdp_kit import check_receivers, start_receivers, stop, torchrun


def _launch(tmp_path, nproc: int, jobs: list[tuple[str, str, str]], timeout: float) -> None:
    runs, receivers = [], []
    try:
        for model, impl, mode in jobs:
            out = tmp_path / f"{model}-{impl}-{mode}"
            out.mkdir()
            if mode != "cluster":
                receivers.append((start_receivers(out / "store", model, out), out))
            runs += ["--job", f"{model}:{impl}:{mode}:{out}"]
        done = torchrun(nproc, *runs, timeout=timeout)
        log = done.stdout + done.stderr
        assert done.returncode == 0, log[-6000:]
        for model, impl, mode in jobs:
            assert f"{model}:{impl}" in done.stdout, log[-3000:]
        for procs, out in receivers:
            check_receivers(procs, out, log)
    finally:
        for procs, _ in receivers:
            stop(procs)


@pytest.mark.timeout(150)
def test_fsdp2_qwen3_ranks_publish_every_version_exactly_with_each_adamw_implementation(tmp_path):
    jobs = [("qwen3", impl, "fsdp") for impl in ("foreach", "single", "fused")]
    _launch(tmp_path, 2, jobs, timeout=140)


@pytest.mark.timeout(150)
def test_fsdp2_qwen3_moe_ranks_and_a_ddp_writer_publish_every_version_exactly(tmp_path):
    _launch(tmp_path, 2, [("qwen3_moe", "foreach", "fsdp"), ("qwen3", "single", "ddp")], timeout=140)


@pytest.mark.timeout(150)
def test_fsdp2_writers_sync_every_version_exactly_to_receivers_in_the_same_process_group(tmp_path):
    _launch(tmp_path, 4, [("qwen3", "fused", "cluster")], timeout=140)
