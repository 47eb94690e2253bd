"""encode_blob -> decode_blob reproduces every update bit for bit, in every encoding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit import bits_equal

from deltasync.format import (
    FORMAT_VERSION,
    TensorSpec,
    TensorUpdate,
    decode_blob,
    encode_blob,
    reader,
)
from deltasync.format.wire import HEADER, RECORD, SEGMENT
from deltasync.native import loader as native
from deltasync.native.ops import decode_sparse as one_pass

from format_testkit import same_update

HEAD = dict(version=12, base_version=11, shard="tp1-ep0", writer="w00003")


def roundtrip(updates, level=1, **decode_kwargs):
    blob = encode_blob(updates, **HEAD, level=level)
    return blob, decode_blob(blob, **decode_kwargs)


def first_record_header(blob: bytes) -> tuple[int, ...]:
    """Record header fields of a level-0 (uncompressed) blob's first record."""
    at = HEADER.size + len(HEAD["shard"]) + len(HEAD["writer"]) + SEGMENT.size
    return RECORD.unpack_from(blob, at)


def sparse(name, shape, indices, dtype=torch.bfloat16, values=None):
    idx = torch.tensor(indices, dtype=torch.int64)
    if values is None:
        values = (torch.arange(len(indices), dtype=torch.float32) * 0.37 - 1.5).to(dtype)
    return TensorUpdate(name=name, shape=shape, dtype=dtype, indices=idx, values=values)


def test_an_empty_blob_round_trips_with_its_header():
    for level in (0, 1):
        _, decoded = roundtrip([], level=level)
        assert decoded.updates == []
        assert decoded.total_elements() == 0
        h = decoded.header
        assert (h.format_version, h.version, h.base_version, h.shard, h.writer) == (
            FORMAT_VERSION,
            12,
            11,
            "tp1-ep0",
            "w00003",
        )


def test_an_anchor_header_has_base_version_minus_one():
    blob = encode_blob([], version=0, base_version=-1, shard="tp0", writer="w00000")
    assert decode_blob(blob).header.is_anchor


def test_a_tensor_with_zero_changed_elements_round_trips_as_an_empty_sparse_record():
    u = sparse("a", (3, 4), [])
    _blob, decoded = roundtrip([u])
    assert same_update(decoded.updates[0], u)
    assert decoded.total_elements() == 0


def test_a_single_changed_element_round_trips():
    u = sparse("a", (3, 4), [11])
    _, decoded = roundtrip([u])
    assert same_update(decoded.updates[0], u)


def test_a_tensor_with_every_element_changed_is_written_dense():
    n = 40
    u = sparse("a", (5, 8), list(range(n)))
    blob, decoded = roundtrip([u], level=0)
    assert first_record_header(blob)[2] == 0  # encoding: dense
    got = decoded.updates[0]
    assert got.indices is None and bits_equal(got.values, u.values)


def test_a_dense_update_round_trips():
    values = torch.randn(6, 7).to(torch.float16).reshape(-1)
    u = TensorUpdate(name="d", shape=(6, 7), dtype=torch.float16, indices=None, values=values)
    _, decoded = roundtrip([u])
    assert same_update(decoded.updates[0], u)


def test_gap_width_is_the_narrowest_that_fits_the_largest_gap():
    cases = [(255, 1), (256, 2), (65535, 2), (65536, 4), ((1 << 32) - 1, 4), (1 << 32, 8)]
    for gap, width in cases:
        u = sparse("g", (gap + 10,), [3, 3 + gap, 4 + gap])
        blob, decoded = roundtrip([u], level=0)
        assert first_record_header(blob)[4] == width, gap
        assert same_update(decoded.updates[0], u)


def test_a_tensor_with_more_than_2_pow_31_elements_round_trips_from_metadata_only():
    n = (1 << 33) + 5  # never allocated: only shape metadata and a few indices
    idx = [0, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 33) - 1, 1 << 33, n - 1]
    u = sparse("huge", (n,), idx)
    spec = {"huge": TensorSpec(shape=(n,), dtype=torch.bfloat16)}
    blob, decoded = roundtrip([u], level=0, expected=spec)
    assert first_record_header(blob)[4] == 8  # the gap (2^31+1) -> (2^33-1) exceeds u32
    assert same_update(decoded.updates[0], u)
    assert decoded.updates[0].numel == n


def test_a_2d_shape_beyond_2_pow_31_elements_with_u32_gaps_round_trips():
    shape = (1 << 16, (1 << 16) + 3)  # 2^32 + 3*2^16 elements
    u = sparse("wide", shape, [7, (1 << 31) + 7, (1 << 32) + 5, shape[0] * shape[1] - 1])
    blob, decoded = roundtrip([u], level=0)
    assert first_record_header(blob)[4] == 4
    assert same_update(decoded.updates[0], u)


def test_special_values_survive_bit_for_bit_in_every_dtype():
    patterns = {
        torch.bfloat16: [0x8000, 0x0000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001],
        torch.float16: [0x8000, 0x0000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0xFFFF, 0x7C01, 0x0001],
        torch.float32: [
            0x80000000,
            0,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7FC00001,
            0xFFFFFFFF,
            0x7F800001,
            0x00000001,
        ],
    }
    for dtype, bits in patterns.items():
        int_dtype = torch.int16 if dtype != torch.float32 else torch.int32
        width = 16 if int_dtype == torch.int16 else 32
        signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
        values = torch.tensor(signed, dtype=int_dtype).view(dtype)
        sp = sparse("s", (100,), list(range(0, 90, 10)), dtype=dtype, values=values)
        dense = TensorUpdate(name="d", shape=(3, 3), dtype=dtype, indices=None, values=values)
        _, decoded = roundtrip([sp, dense])
        assert same_update(decoded.updates[0], sp), dtype
        assert same_update(decoded.updates[1], dense), dtype


def test_many_tensors_keep_their_order_and_the_output_is_deterministic():
    g = torch.Generator().manual_seed(1)
    updates = []
    for k, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16] * 3):
        numel = 1000 + 137 * k
        idx = torch.randperm(numel, generator=g)[: 10 + k].sort().values
        vals = torch.randn(idx.numel(), generator=g).to(dtype)
        updates.append(
            TensorUpdate(
                name=f"layers.{k}.w", shape=(numel,), dtype=dtype, indices=idx, values=vals
            )
        )
    blob, decoded = roundtrip(updates)
    assert blob == encode_blob(updates, **HEAD)
    assert [u.name for u in decoded.updates] == [u.name for u in updates]
    assert all(same_update(a, b) for a, b in zip(decoded.updates, updates, strict=True))
    assert decoded.total_elements() == sum(u.nnz for u in updates)


def test_memoryview_and_bytearray_inputs_decode_like_bytes():
    u = sparse("a", (50,), [1, 2, 30])
    blob = encode_blob([u], **HEAD)
    for form in (memoryview(blob), bytearray(blob), memoryview(bytearray(blob))):
        assert same_update(decode_blob(form).updates[0], u)


def test_decoded_tensors_are_writable_and_do_not_alias_each_other():
    u = sparse("a", (50,), [1])
    got = decode_blob(encode_blob([u], **HEAD)).updates[0]
    got.values.add_(1)  # would warn or fail on a read-only buffer
    got.indices.add_(1)


def test_the_one_pass_decode_and_the_checked_path_give_the_same_updates(monkeypatch):
    # BF16/FP16 sparse records of a section held whole decode in one C pass; with the kernels
    # off the reader takes its checked numpy path. Every gap width, both levels, both paths.
    taken = []

    def counted(*args):
        got = one_pass(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(reader, "decode_sparse", counted)
    updates = [
        sparse("w1", (300,), [0, 5, 6, 299]),
        sparse("w2", (70_000,), [3, 9_000, 69_999], dtype=torch.float16),
        sparse("w3", (1 << 20,), [1, 1 << 17, (1 << 20) - 1]),
        sparse("w4", (1 << 33,), [2, 1 << 32]),
        sparse("one", (8,), [7]),
    ]
    for level in (0, 1):
        blob = encode_blob(updates, **HEAD, level=level)
        taken.clear()
        fast = decode_blob(blob).updates
        assert taken == [True] * len(updates)  # the one pass took every record
        native.disable()
        try:
            checked = decode_blob(blob).updates
        finally:
            native.enable()
        for got, want, u in zip(fast, checked, updates, strict=True):
            assert same_update(got, want) and same_update(got, u), u.name
            assert got.indices.dtype == want.indices.dtype


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    level=st.sampled_from([0, 1, 3]),
)
def test_random_updates_round_trip_bit_exactly(data, dtype, shape, level):
    numel = 1
    for d in shape:
        numel *= d
    chosen = sorted(data.draw(st.sets(st.integers(0, max(numel - 1, 0)), max_size=numel)))
    chosen = [i for i in chosen if i < numel]
    bits = data.draw(
        st.lists(st.integers(-(2**15), 2**15 - 1), min_size=len(chosen), max_size=len(chosen))
    )
    int_dtype = torch.int16 if dtype != torch.float32 else torch.int32
    values = torch.tensor(bits, dtype=int_dtype)
    if int_dtype == torch.int32:
        values = values * 65537
    u = TensorUpdate(
        name="r",
        shape=tuple(shape),
        dtype=dtype,
        indices=torch.tensor(chosen, dtype=torch.int64),
        values=values.view(dtype),
    )
    got = decode_blob(encode_blob([u], **HEAD, level=level)).updates[0]
    if len(chosen) == numel:  # every element named: written dense
        assert got.indices is None and bits_equal(got.values, u.values)
    else:
        assert same_update(got, u)
