"""The tracker on real FSDP2 ranks (torchrun, two gloo ranks): each rank's shard placement
derived from the DTensor matches ``torch.chunk`` (uneven, and empty on one rank), nothing is
missed through steps and through edits via the DTensor or its local shard, and a
tensor-parallel placement is refused at construction, for all three AdamW implementations;
under HSDP (a 2 x 2 replicate x shard mesh, four ranks) each rank's shard and replica are
derived and only replica 0 is a writer."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(200)
@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
def test_each_rank_tracks_its_uneven_fsdp2_shard_exactly(two_ranks, impl):
    for rank in (0, 1):
        assert f"rank {rank} tracker {impl} ok" in two_ranks.stdout, two_ranks.log


@pytest.mark.timeout(200)
def test_under_hsdp_each_rank_names_its_shard_and_replica_and_only_replica_0_writes(four_ranks):
    for rank in range(4):
        assert f"rank {rank} hsdp foreach ok" in four_ranks.stdout, four_ranks.log
