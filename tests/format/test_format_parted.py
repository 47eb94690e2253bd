"""PartedUpdate: a record written a part at a time gives exactly the bytes of the TensorUpdate
holding the same indices and values, and a parted update whose parts disagree with its
summary is refused before anything of its segment reaches the sink."""

from __future__ import annotations

import pytest
import torch

from deltasync.format import (
    BlobWriter,
    InvalidUpdateError,
    TensorUpdate,
    decode_blob,
    encode_blob,
    section,
)
from deltasync.format.updates import PartedUpdate

from format_testkit import same_update

HEAD = dict(version=4, base_version=3, shard="tp0", writer="w00000")


def whole(shape, density: float, seed: int, dtype=torch.bfloat16, stretch: int = 1) -> TensorUpdate:
    """A sparse update of a tensor of ``shape``; ``stretch`` spreads the indices out (wider
    gaps) over a tensor ``stretch`` times larger along the first dim."""
    g = torch.Generator().manual_seed(seed)
    shape = (shape[0] * stretch, *shape[1:])
    numel = torch.Size(shape).numel()
    idx = torch.nonzero(torch.rand(numel, generator=g) < density / stretch).reshape(-1)
    if idx.numel() == 0:
        idx = torch.tensor([numel // 2])
    vals = torch.randn(idx.numel(), generator=g).to(dtype)
    return TensorUpdate(name="w", shape=shape, dtype=dtype, indices=idx, values=vals)


def parted(u: TensorUpdate, cut: int, *, with_indices: bool = False, **override) -> PartedUpdate:
    """``u`` as a parted update of ``cut``-element parts; ``with_indices`` also gives the
    indices-only callable the encoder's gap passes use."""
    idx, vals = u.indices, u.values
    if idx is None:  # dense: every element, in order
        idx = torch.arange(u.numel)

    def parts():
        for a in range(0, idx.numel(), cut):
            yield idx[a : a + cut].clone(), vals[a : a + cut].clone()

    def indices():
        for a in range(0, idx.numel(), cut):
            yield idx[a : a + cut].clone()

    gaps = idx[1:] - idx[:-1]
    summary = dict(
        nnz=idx.numel(), first=int(idx[0]), max_gap=int(gaps.max()) if gaps.numel() else 0
    )
    summary.update(override)
    return PartedUpdate(
        name=u.name,
        shape=u.shape,
        dtype=u.dtype,
        parts=parts,
        indices=indices if with_indices else None,
        **summary,
    )


CASES = [
    pytest.param((300, 64), 0.05, torch.bfloat16, 1, id="1-byte-gaps"),
    pytest.param((300, 64), 0.05, torch.bfloat16, 200, id="2-byte-gaps"),
    pytest.param((40, 64), 0.3, torch.float32, 1, id="fp32"),
    pytest.param((1, 1), 1.0, torch.bfloat16, 1, id="one-element-tensor"),
    pytest.param((7, 9), 1.1, torch.bfloat16, 1, id="every-element-dense"),
    pytest.param((100, 100), 0.00001, torch.bfloat16, 1, id="one-index"),
]


@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("level", [0, 1, 3])
@pytest.mark.parametrize("cut", [1, 7, 1 << 16])
@pytest.mark.parametrize(("shape", "density", "dtype", "stretch"), CASES)
def test_a_parted_update_encodes_to_the_bytes_of_the_same_update_given_whole(
    shape, density, dtype, stretch, cut, level, with_indices
) -> None:
    u = whole(shape, density, seed=cut + level, dtype=dtype, stretch=stretch)
    given = encode_blob([u], **HEAD, level=level)
    written = encode_blob([parted(u, cut, with_indices=with_indices)], **HEAD, level=level)
    assert written == given
    (back,) = decode_blob(written).updates
    assert same_update(back, u) or (u.nnz == u.numel and back.is_dense)


def test_a_segment_mixing_parted_and_whole_records_keeps_their_order_and_bytes() -> None:
    a = whole((50, 64), 0.1, seed=1)
    b = TensorUpdate(name="b", shape=a.shape, dtype=a.dtype, indices=a.indices, values=a.values)
    c = TensorUpdate(name="c", shape=(3,), dtype=a.dtype, indices=None, values=a.values[:3])
    given = encode_blob([a, b, c], **HEAD)
    mixed = [parted(a, 100), b, parted(c, 2)]
    assert encode_blob(mixed, **HEAD) == given


@pytest.mark.parametrize("stretch", [1, 200])
def test_a_parted_section_above_the_one_shot_size_streams_the_same_bytes(
    monkeypatch, stretch
) -> None:
    u = whole((400, 64), 0.2, seed=3, stretch=stretch)
    monkeypatch.setattr(section, "ONE_SHOT_MAX", 1000)  # both writers stream this section
    given = encode_blob([u], **HEAD)
    assert encode_blob([parted(u, 333)], **HEAD) == given
    assert encode_blob([parted(u, 333, with_indices=True)], **HEAD) == given


def _moved_index(u: TensorUpdate) -> torch.Tensor:
    """``u``'s indices with one moved down by one where that keeps them sorted, the first
    index, the count and the largest gap unchanged: only a comparison of the passes sees it."""
    idx = u.indices
    gaps = idx[1:] - idx[:-1]
    top = int(gaps.max())
    k = next(
        k
        for k in range(1, idx.numel() - 1)
        if gaps[k - 1] > 1 and gaps[k] < top - 1 and int(gaps[k - 1]) != top
    )
    moved = idx.clone()
    moved[k] -= 1
    assert int((moved[1:] - moved[:-1]).max()) == top
    return moved


def _with_indices(u: TensorUpdate, indices) -> PartedUpdate:
    p = parted(u, 50)
    return PartedUpdate(
        name="w",
        shape=u.shape,
        dtype=u.dtype,
        parts=p.parts,
        indices=lambda: iter([indices]),
        **_clean(u),
    )


def _clean(u: TensorUpdate) -> dict:
    p = parted(u, 50)
    return dict(nnz=p.nnz, first=p.first, max_gap=p.max_gap)


def _with_parts(u: TensorUpdate, parts) -> PartedUpdate:
    return PartedUpdate(name="w", shape=u.shape, dtype=u.dtype, parts=parts, **_clean(u))


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda u: parted(u, 50, nnz=u.nnz - 1), id="more-parts-than-planned"),
        pytest.param(lambda u: parted(u, 50, nnz=u.nnz + 1), id="fewer-parts-than-planned"),
        pytest.param(lambda u: parted(u, 50, first=int(u.indices[0]) + 1), id="wrong-first"),
        pytest.param(lambda u: parted(u, 50, max_gap=_clean(u)["max_gap"] + 1), id="wrong-gap"),
        pytest.param(
            lambda u: _with_parts(u, lambda: iter([(u.indices[[0, 2, 1, 3]], u.values[:4])])),
            id="unsorted",
        ),
        pytest.param(
            lambda u: _with_parts(u, lambda: iter([(u.indices.int(), u.values)])),
            id="int32-part",
        ),
        pytest.param(
            lambda u: _with_parts(u, lambda: iter([(u.indices, u.values.float())])),
            id="wrong-value-dtype",
        ),
        pytest.param(lambda u: _with_indices(u, _moved_index(u)), id="indices-disagree"),
        pytest.param(lambda u: _with_indices(u, u.indices[:-1]), id="indices-short"),
        pytest.param(lambda u: _with_indices(u, u.indices.int()), id="int32-indices"),
    ],
)
def test_a_parted_update_whose_parts_disagree_with_it_is_refused_and_nothing_is_written(
    spoil,
) -> None:
    u = whole((100, 64), 0.1, seed=9)
    chunks: list[bytes] = []
    writer = BlobWriter(chunks.append, **HEAD)
    header = len(chunks)
    with pytest.raises(InvalidUpdateError, match="'w'"):
        writer.segment([spoil(u)])
    assert len(chunks) == header and writer.segments == 0
    writer.segment([u])  # the refused record's name was not taken: the blob goes on
    writer.finish()
    (back,) = decode_blob(b"".join(chunks)).updates
    assert same_update(back, u)


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        (dict(nnz=0, first=0, max_gap=0), "writes 1 to"),
        (dict(nnz=5, first=10, max_gap=1), "do not fit"),
        (dict(nnz=3, first=2, max_gap=0), "do not fit"),
        (dict(nnz=3, first=6, max_gap=3), "run past"),
        (dict(nnz=-1, first=0, max_gap=0), "nnz must be"),
    ],
)
def test_a_parted_update_with_an_impossible_summary_is_refused_naming_it(fields, word) -> None:
    with pytest.raises(InvalidUpdateError, match=word):
        PartedUpdate(name="w", shape=(10,), dtype=torch.bfloat16, parts=lambda: iter(()), **fields)
