"""Real multi-rank publishing: torchrun, gloo ranks on the CPU, transformers models under
FSDP2 (``fully_shard`` per layer and at the root) or DDP, AdamW in its three implementations
with a scheduler, two optimizer steps for some versions, an anchor in between and an edit
outside the optimizer. Every version reaches vLLM-convention TP=2 receivers in other
processes bit-exact against a dense split of the gathered full state; every rank's tracker
misses nothing against an exact snapshot of its shards (asserted inside the workers).

The two-rank jobs share one launch (conftest.py; importing torch and transformers costs each
rank seconds here), each job with its own store and receivers; each test checks its own job."""

from __future__ import annotations

import pytest
from fsdp_kit import Launch, check_receivers


def _check_job(done: Launch, job: tuple[str, str, str]) -> None:
    key = ":".join(job)
    assert f"rank 0 {key} published" in done.stdout, done.log
    assert f"rank 1 {key} published" in done.stdout, done.log
    procs, out = done.receivers[key]
    check_receivers(procs, out, done.log)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
def test_fsdp2_qwen3_ranks_each_publish_every_version_exactly(two_ranks, impl):
    _check_job(two_ranks, ("qwen3", impl, "fsdp"))


@pytest.mark.timeout(200)
def test_fsdp2_qwen3_moe_ranks_publish_every_version_exactly(two_ranks):
    _check_job(two_ranks, ("qwen3_moe", "foreach", "fsdp"))


@pytest.mark.timeout(200)
def test_under_ddp_one_rank_writes_and_every_version_is_exact(two_ranks):
    _check_job(two_ranks, ("qwen3", "single", "ddp"))
    assert two_ranks.returncode == 0, two_ranks.log


@pytest.mark.timeout(200)
def test_fsdp2_writers_sync_every_version_exactly_to_receivers_in_the_same_process_group(
    four_ranks,
):
    for rank in range(4):
        assert f"rank {rank} cluster qwen3:fused synced" in four_ranks.stdout, four_ranks.log
    assert four_ranks.returncode == 0, four_ranks.log


@pytest.mark.timeout(250)
@pytest.mark.parametrize("mode", ["gather", "gather_overlap"])
def test_a_full_state_callable_that_gathers_publishes_every_version_exactly(gather_ranks, mode):
    # docs/integration.md: the committer's full_state is a callable gathering the full
    # parameters; that gather is a collective, so every writer must run it (with overlap too).
    # gather_overlap gathers with gather_bf16, kept by rank 0 alone; the receivers are checked
    # against an oracle from the fp32 masters
    impl = {"gather": "foreach", "gather_overlap": "fused"}[mode]
    _check_job(gather_ranks, ("qwen3", impl, mode))


@pytest.mark.timeout(250)
@pytest.mark.parametrize("job", [("qwen3", "fused", "parts"), ("qwen3_moe", "foreach", "parts")])
def test_fsdp2_writers_without_full_state_publish_parts_digests_every_version_exactly(
    gather_ranks, job
):
    # no rank gathers for the publish: each writer states its part digests, the manifests list
    # parts digests (asserted on rank 0), the receivers verify them and are checked bit-exact
    _check_job(gather_ranks, job)


@pytest.mark.timeout(200)
def test_cluster_writers_with_a_full_state_callable_that_gathers_sync_every_version_exactly(
    four_ranks_gather,
):
    # every writer runs the callable: a gather over the writers run by writer 0 alone hangs
    done = four_ranks_gather
    for rank in range(4):
        assert f"rank {rank} cluster_gather qwen3:foreach synced" in done.stdout, done.log
    assert done.returncode == 0, done.log
