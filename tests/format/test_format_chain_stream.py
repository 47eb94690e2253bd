"""Streaming a chain one tensor at a time (BlobRecords -> iter_chain -> apply_pieces) writes
exactly what decoding, folding and scattering the whole chain writes, and checks the same."""

from __future__ import annotations

import pytest
import torch
from kit import assert_same_bits, random_tensors, random_update

from deltasync.errors import BlobMismatchError, FormatError
from deltasync.format import (
    BlobRecords,
    Records,
    TensorSpec,
    TensorUpdate,
    apply_pieces,
    apply_updates,
    decode_blob,
    encode_blob,
    fold_chain,
    iter_chain,
    merge_writers,
)

from format_testkit import same_update

SPECS = {
    "a": TensorSpec(shape=(64, 32), dtype=torch.bfloat16),
    "b": TensorSpec(shape=(5000,), dtype=torch.bfloat16),
    "c": TensorSpec(shape=(17,), dtype=torch.float32),
}


def _sparse(name, gen, density, keep=None):
    return random_update(SPECS, name, gen, density, keep)


def _blob(version, base, updates, writer="w00000", order=None):
    ups = updates if order is None else [updates[k] for k in order]
    return encode_blob(ups, version=version, base_version=base, shard="tp0", writer=writer)


def _records(blob):
    return BlobRecords(blob, expected=SPECS, shard="tp0")


def _live(gen):
    return random_tensors(SPECS, gen)


def _folded(live, steps):
    """The reference: decode everything, merge writers, fold, scatter."""
    out = {n: t.clone() for n, t in live.items()}
    decoded = [
        (kind, merge_writers(v, [decode_blob(b).updates for b in blobs]))
        for v, kind, blobs in steps
    ]
    apply_updates(fold_chain(decoded, SPECS), out)
    return out


def _streamed(live, steps, wrap):
    out = {n: t.clone() for n, t in live.items()}
    chain = [(v, kind, [wrap(b) for b in blobs]) for v, kind, blobs in steps]
    list(iter_chain(chain, SPECS))  # the verify pass: every check, nothing written
    for item in iter_chain(chain, SPECS, check=False):
        apply_pieces(item, out)
    return out


def _records_list(blob):
    return Records(decode_blob(blob).updates)


def test_blob_records_yield_what_decode_blob_returns_and_names_read_headers_only():
    gen = torch.Generator().manual_seed(1)
    ups = [_sparse("a", gen, 0.1), _sparse("b", gen, 0.3)]
    blob = _blob(3, 2, ups)
    records = _records(blob)
    assert records.names() == ["a", "b"]
    for _ in range(2):  # iterable more than once, same records each time
        assert all(same_update(x, y) for x, y in zip(records, ups, strict=True))


def _narrow(blob):
    return BlobRecords(blob, expected=SPECS, shard="tp0", narrow_indices=True)


def test_narrow_records_carry_the_same_indices_as_int32():
    gen = torch.Generator().manual_seed(7)
    ups = [_sparse("a", gen, 0.3), _sparse("b", gen, 0.01)]
    got = list(_narrow(_blob(3, 2, ups)))
    for a, b in zip(got, ups, strict=True):
        assert a.indices.dtype == torch.int32
        assert torch.equal(a.indices.to(torch.int64), b.indices)
        assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


@pytest.mark.parametrize("wrap", [_records, _records_list, _narrow])
def test_a_three_delta_chain_with_two_writers_streams_to_the_folded_result(wrap):
    gen = torch.Generator().manual_seed(2)
    live = _live(gen)
    steps = []
    for v in (5, 6, 7):
        half = torch.zeros(5000, dtype=torch.bool)
        half[::2] = True
        w0 = [_sparse("a", gen, 0.2), _sparse("b", gen, 0.2, keep=half)]
        w1 = [_sparse("b", gen, 0.2, keep=~half), _sparse("c", gen, 0.5)]
        # the second writer lists its tensors in another order: the lockstep reads ahead
        steps.append(
            (v, "delta", [_blob(v, v - 1, w0), _blob(v, v - 1, w1, "w00001", order=[1, 0])])
        )
    assert_same_bits(_streamed(live, steps, wrap), _folded(live, steps), "3-delta chain")


def test_an_anchor_with_sparse_records_then_deltas_streams_to_the_folded_result():
    gen = torch.Generator().manual_seed(3)
    live = _live(gen)
    dense_a = TensorUpdate(
        name="a",
        shape=SPECS["a"].shape,
        dtype=torch.bfloat16,
        indices=None,
        values=torch.randn(64 * 32, generator=gen).to(torch.bfloat16),
    )
    anchor = [dense_a, _sparse("b", gen, 0.9), _sparse("c", gen, 1.0)]
    steps = [(0, "anchor", [_blob(0, -1, anchor)])]
    steps.append((1, "delta", [_blob(1, 0, [_sparse("a", gen, 0.1), _sparse("b", gen, 0.1)])]))
    streamed = _streamed(live, steps, _records)
    assert_same_bits(streamed, _folded(live, steps), "anchor + delta")
    assert int((streamed["b"].view(torch.int16) == 0).sum()) > 0  # unlisted elements: zero


def test_an_anchor_missing_a_tensor_is_refused_by_the_checking_pass():
    gen = torch.Generator().manual_seed(4)
    steps = [(0, "anchor", [_records(_blob(0, -1, [_sparse("a", gen, 1.0)]))])]
    with pytest.raises(BlobMismatchError, match="no values for tensors"):
        list(iter_chain(steps, SPECS))


def test_two_writers_sending_the_same_element_are_refused_by_the_checking_pass():
    gen = torch.Generator().manual_seed(5)
    b = _sparse("b", gen, 0.1)
    w0, w1 = _blob(1, 0, [b]), _blob(1, 0, [b], "w00001")
    with pytest.raises(BlobMismatchError, match="same element"):
        list(iter_chain([(1, "delta", [_records(w0), _records(w1)])], SPECS))


def test_a_malformed_record_fails_while_streaming_before_the_end_of_the_blob():
    gen = torch.Generator().manual_seed(6)
    ups = [_sparse("a", gen, 0.1), _sparse("b", gen, 0.1)]
    records = BlobRecords(_blob(1, 0, ups), expected={"a": SPECS["a"]}, shard="tp0")
    with pytest.raises(FormatError):
        list(iter_chain([(1, "delta", [records])], SPECS))


def test_apply_updates_takes_compact_int32_indices_like_int64_ones():
    gen = torch.Generator().manual_seed(10)
    live = _live(gen)
    ups = [_sparse("a", gen, 0.2), _sparse("b", gen, 0.1)]
    narrow = list(_narrow(_blob(1, 0, ups)))
    assert all(u.indices.dtype == torch.int32 for u in narrow)
    wide, compact = ({n: t.clone() for n, t in live.items()} for _ in range(2))
    apply_updates(ups, wide)
    apply_updates(narrow, compact)
    assert_same_bits(compact, wide, "int32 vs int64 indices")


def test_the_c_scatter_writes_what_torchs_index_copy_writes(monkeypatch):
    from deltasync.format import apply as apply_mod
    from deltasync.native import loader

    gen = torch.Generator().manual_seed(11)
    live = _live(gen)
    steps = [
        (1, "delta", [_blob(1, 0, [_sparse("a", gen, 0.2), _sparse("b", gen, 0.1)])]),
        (2, "delta", [_blob(2, 1, [_sparse("b", gen, 0.3), _sparse("c", gen, 0.5)])]),
    ]
    used = []
    real = apply_mod.scatter16
    monkeypatch.setattr(
        apply_mod, "scatter16", lambda *a, **k: used.append(a[1].dtype) or real(*a, **k)
    )
    kernel = _streamed(live, steps, _narrow)
    assert torch.int32 in used  # the decoded int32 indices went to the kernel as they are
    loader.disable()
    try:
        torch_path = _streamed(live, steps, _narrow)
    finally:
        loader.enable()
    assert_same_bits(kernel, torch_path, "C scatter vs index_copy_")
    assert_same_bits(kernel, _folded(live, steps), "streamed vs folded")


def _rows(name: str, blocks: list[tuple[int, int]], gen) -> TensorUpdate:
    """An update of ``name`` listing the elements of the flat ranges ``blocks`` (a writer's
    row blocks of a fused tensor, interleaved with another writer's)."""
    idx = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in blocks])
    vals = torch.randn(idx.numel(), generator=gen).to(SPECS[name].dtype)
    return TensorUpdate(
        name=name, shape=SPECS[name].shape, dtype=SPECS[name].dtype, indices=idx, values=vals
    )


# "a" is 64 x 32: two writers' row blocks interleave like a fused qkv tensor's
_W0 = [(0, 320), (1024, 1344), (1536, 1600)]
_W1 = [(320, 1024), (1344, 1536), (1600, 2048)]


@pytest.mark.parametrize(
    ("w0", "w1"),
    [
        ([*_W0, (700, 701)], _W1),  # one element inside the other's first block
        (_W0, [(319, 1024), *_W1[1:]]),  # a block's first element on the other's last
        (_W0, [*_W1[:2], (1599, 2048)]),  # the last block's first element, near the end
        ([(0, 2047)], [(2046, 2048)]),  # all but the last element, and the last two
    ],
)
def test_interleaved_writers_sharing_one_element_are_refused_wherever_it_lies(w0, w1, monkeypatch):
    import deltasync.format.merge as merge
    import deltasync.format.updates as updates

    monkeypatch.setattr(merge, "_CHECK_CHUNK", 100)  # many chunks over a small tensor
    monkeypatch.setattr(updates, "ORDER_CHUNK", 100)
    gen = torch.Generator().manual_seed(11)
    b0 = _blob(1, 0, [_rows("a", sorted(set(w0)), gen)])
    b1 = _blob(1, 0, [_rows("a", sorted(set(w1)), gen)], "w00001")
    with pytest.raises(BlobMismatchError, match="same element"):
        list(iter_chain([(1, "delta", [_records(b0), _records(b1)])], SPECS))
    with pytest.raises(BlobMismatchError, match="same element"):
        list(iter_chain([(1, "delta", [_records_list(b0), _records_list(b1)])], SPECS))


def test_interleaved_disjoint_writers_of_an_anchor_restore_it_exactly(monkeypatch):
    import deltasync.format.merge as merge
    import deltasync.format.updates as updates

    monkeypatch.setattr(merge, "_CHECK_CHUNK", 100)
    monkeypatch.setattr(updates, "ORDER_CHUNK", 100)
    gen = torch.Generator().manual_seed(12)
    live = _live(gen)
    w0 = [_rows("a", _W0, gen), _sparse("b", gen, 1.0), _sparse("c", gen, 1.0)]
    w1 = [_rows("a", _W1, gen)]
    steps = [(0, "anchor", [_blob(0, -1, w0), _blob(0, -1, w1, "w00001")])]
    assert_same_bits(_streamed(live, steps, _records), _folded(live, steps), "interleaved")


def test_writers_sharing_an_element_are_refused_even_from_unsorted_indices():
    from deltasync.format.merge import _share_an_element

    bf16 = torch.bfloat16

    def pieces(*indices):
        return [
            TensorUpdate("x", (16,), bf16, i, torch.zeros(i.numel(), dtype=bf16)) for i in indices
        ]

    # in-memory updates the decoder did not read (sorted order unproven): the sort decides
    assert _share_an_element(pieces(torch.tensor([9, 3, 5]), torch.tensor([4, 5])))
    assert not _share_an_element(pieces(torch.tensor([9, 3, 5]), torch.tensor([4, 6])))
    int32 = torch.tensor([1, 2], dtype=torch.int32)
    assert _share_an_element(pieces(int32, torch.tensor([2, 7])))
    assert not _share_an_element(
        pieces(int32 + torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2, 7]))
    )
