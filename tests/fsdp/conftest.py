"""The shared two-rank torchrun launch of tests/fsdp.

Starting a rank (importing torch and transformers, a gloo rendezvous) costs seconds per
process on this 2-core machine, so every two-rank job of the folder runs in ONE launch,
started once per session (the tracker checks, then the store-path jobs, each with its own
store and its own receiver processes), and every four-rank job in another (HSDP, then the
in-cluster path). Each test then checks its own job's lines and results.
"""

from __future__ import annotations

import pytest
from fsdp_kit import launch, stop

TRACKER_JOBS = [("none", impl, "tracker") for impl in ("foreach", "single", "fused")]
STORE_JOBS = [
    ("qwen3", "foreach", "fsdp"),
    ("qwen3", "single", "fsdp"),
    ("qwen3", "fused", "fsdp"),
    ("qwen3_moe", "foreach", "fsdp"),
    ("qwen3", "single", "ddp"),
]


# full_state as a gathering callable: a launch of its own, so a hang there fails only itself
GATHER_JOBS = [("qwen3", "foreach", "gather"), ("qwen3", "fused", "gather_overlap")]
# no full_state at all (parts digests): in the same launch
PARTS_JOBS = [("qwen3", "fused", "parts"), ("qwen3_moe", "foreach", "parts")]
FOUR_RANK_GATHER_JOBS = [("qwen3", "foreach", "cluster_gather")]

FOUR_RANK_JOBS = [("none", "foreach", "hsdp"), ("qwen3", "fused", "cluster")]


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    done = launch(tmp_path_factory.mktemp("fsdp4"), 4, FOUR_RANK_JOBS, timeout=150)
    yield done


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    done = launch(tmp_path_factory.mktemp("fsdp"), 2, TRACKER_JOBS + STORE_JOBS, timeout=150)
    yield done
    for procs, _ in done.receivers.values():
        stop(procs)


@pytest.fixture(scope="session")
def gather_ranks(tmp_path_factory):
    done = launch(tmp_path_factory.mktemp("fsdp-gather"), 2, GATHER_JOBS + PARTS_JOBS, timeout=200)
    yield done
    for procs, _ in done.receivers.values():
        stop(procs)


@pytest.fixture(scope="session")
def four_ranks_gather(tmp_path_factory):
    done = launch(tmp_path_factory.mktemp("fsdp4-gather"), 4, FOUR_RANK_GATHER_JOBS, timeout=150)
    yield done
