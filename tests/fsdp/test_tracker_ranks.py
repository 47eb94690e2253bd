"""The tracker on real FSDP2 ranks (torchrun, two gloo ranks): each rank's shard placement
derived from the DTensor matches ``torch.chunk`` (uneven, and empty on one rank), nothing is
missed through steps and through edits via the DTensor or its local shard, and a
tensor-parallel placement is refused at construction, for all three AdamW implementations."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(130)
@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
def test_each_rank_tracks_its_uneven_fsdp2_shard_exactly(two_ranks, impl):
    for rank in (0, 1):
        assert f"rank {rank} tracker {impl} ok" in two_ranks.stdout, two_ranks.log
