"""Positions: chunked encoding, slice and range decoding equal the whole-tensor round trip."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import TensorInputError
from deltasync.native import loader
from deltasync.trainer.positions import Positions


@pytest.fixture(params=["kernels", "torch"])
def path(request):
    """Both implementations: the C passes and the torch expressions (GPU tensors, no compiler)."""
    if request.param == "torch":
        loader.disable()
        yield request.param
        loader.enable()
    else:
        assert loader.load() is not None, loader.build_error
        yield request.param


def _sorted_positions(n: int, spread: int, seed: int, offset: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.unique(torch.randint(0, max(1, n * spread), (n,), generator=g)) + offset


CASES = [
    (3000, 2, 0, 0),
    (3000, 40, 1, 0),
    (3000, 400, 2, 0),
    (500, 10**6, 3, 0),
    (800, 30, 4, 2**31),
]


@pytest.mark.parametrize(("n", "spread", "seed", "offset"), CASES)
def test_positions_encoded_chunk_by_chunk_equal_the_whole_encoding(n, spread, seed, offset, path):
    idx = _sorted_positions(n, spread, seed, offset)
    whole = Positions.of(idx)
    for size in (1, 7, 1000, n + 5):
        chunked = Positions.from_chunks(list(torch.split(idx, size)))
        assert repr(chunked) == repr(whole)
        assert torch.equal(chunked.indices(), idx)


@pytest.mark.parametrize(("n", "spread", "seed", "offset"), CASES)
def test_slices_and_ranges_decode_exactly_the_positions_inside(n, spread, seed, offset, path):
    idx = _sorted_positions(n, spread, seed, offset)
    pos = Positions.of(idx)
    lo, hi = int(idx[0]), int(idx[-1])
    bounds = [lo + 1, lo + (hi - lo) // 3, lo + (hi - lo) // 2, hi]  # drops the first and last
    for size in (1, 13, 10**6):
        assert torch.equal(torch.cat(list(pos.slices(size))), idx)
        ranges = list(pos.ranges(bounds, size=size))
        assert len(ranges) == len(bounds) - 1
        for i, got in enumerate(ranges):
            assert torch.equal(got, idx[(idx >= bounds[i]) & (idx < bounds[i + 1])])


def test_escapes_at_the_255_256_edge_round_trip_through_chunks(path) -> None:
    idx = torch.tensor([0, 255, 511, 512, 768, 1024, 1025, 1281, 100_000])
    got = Positions.from_chunks([idx[:3], idx[3:4], idx[4:]])
    assert torch.equal(got.indices(), idx)
    assert torch.equal(torch.cat(list(got.ranges([0, 512, 100_001], size=2))), idx)


def test_positions_that_do_not_strictly_increase_are_refused() -> None:  # the C pass checks
    with pytest.raises(TensorInputError, match="strictly increase"):
        Positions.from_chunks([torch.tensor([1, 5, 9]), torch.tensor([9, 12])])


def test_reused_ranges_are_views_of_one_buffer_and_each_is_exact_when_yielded(path) -> None:
    idx = _sorted_positions(4000, 30, 9)
    pos = Positions.of(idx)
    bounds = [0, int(idx[1000]), int(idx[3500]), int(idx[-1]) + 1]
    storages = set()
    for i, got in enumerate(pos.ranges(bounds, size=64, reuse=True)):
        assert torch.equal(got, idx[(idx >= bounds[i]) & (idx < bounds[i + 1])])
        storages.add(got.untyped_storage().data_ptr())
    assert len(storages) == 1


@pytest.mark.parametrize("spread", [25, 400])
def test_packed_positions_decode_exactly_and_hold_fewer_bytes(spread, path) -> None:
    # a routed parameter's positions wait for the commit compressed; every read still exact
    idx = _sorted_positions(200_000, spread, 5, 7)
    pos = Positions.of(idx)
    before = pos.nbytes
    pos.pack()
    assert pos.packed is not None and pos.gaps is None and "packed" in repr(pos)
    assert pos.nbytes < 0.9 * before
    assert torch.equal(pos.indices(), idx)
    assert torch.equal(torch.cat(list(pos.slices(4097))), idx)
    lo, hi = int(idx[0]), int(idx[-1])
    bounds = [lo, lo + (hi - lo) // 3, hi + 1]
    for reuse in (False, True):
        got = [r.clone() for r in pos.ranges(bounds, size=1000, reuse=reuse)]
        assert torch.equal(torch.cat(got), idx)
    more = torch.tensor([hi + 5, hi + 9])
    assert torch.equal(pos.union(more).indices(), torch.cat([idx, more]))
    pos.pack()  # a second pack changes nothing
    assert torch.equal(pos.indices(), idx)


def test_small_or_incompressible_positions_are_not_packed() -> None:
    small = Positions.of(_sorted_positions(3000, 40, 1))
    small.pack()
    assert small.packed is None and small.gaps is not None
    g = torch.Generator().manual_seed(9)
    steps = torch.randint(1, 255, (200_000,), generator=g)  # uniform gaps: zstd cannot shrink
    noisy = Positions.of(torch.cumsum(steps, 0))
    noisy.pack()
    assert noisy.packed is None and noisy.gaps is not None


@pytest.mark.parametrize(("n", "spread", "seed", "offset"), [*CASES, (1, 5, 5, 7), (0, 1, 6, 0)])
def test_held_positions_read_as_the_encoded_ones_and_compact_to_them(n, spread, seed, offset):
    idx = _sorted_positions(n, spread, seed, offset)[:n]
    held, whole = Positions.held(idx), Positions.of(idx)
    assert len(held) == len(whole) == idx.numel()
    assert torch.equal(held.indices(), idx)
    if idx.numel() > 1:
        assert held.wide is idx  # held as given: nothing encoded or copied
        lo, hi = int(idx[0]), int(idx[-1])
        bounds = [lo + 1, lo + (hi - lo) // 2, hi]
        for size in (1, 13, 10**6):
            assert torch.equal(torch.cat(list(held.slices(size))), idx)
            pairs = zip(
                held.ranges(bounds, size=size), whole.ranges(bounds, size=size), strict=True
            )
            for a, b in pairs:
                assert torch.equal(a, b)
        more = idx[-1:] + torch.tensor([3, 9])
        assert torch.equal(held.union(more).indices(), whole.union(more).indices())
    compact = held.compact()
    assert repr(compact) == repr(whole) and torch.equal(compact.indices(), idx)
    assert compact.compact() is compact
    if idx.numel() > 1:
        assert compact.nbytes < held.nbytes
