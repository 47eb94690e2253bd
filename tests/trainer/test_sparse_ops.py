"""The C kernels behind bf16_at / first_not_increasing / scatter16 / prefix_sum_ /
join_planes / decode_sparse / patched_digests16 against torch, numpy and xxhash, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from deltasync.errors import ConfigError, TensorInputError
from deltasync.format import section
from deltasync.layout.blocks import Block
from deltasync.native import loader as native
from deltasync.native.ops import (
    bf16_at,
    can_join_planes,
    column_block,
    decode_sparse,
    first_not_increasing,
    join_planes,
    patch16,
    patched_digests16,
    prefix_sum_,
    scatter16,
)


def _special_fp32(n: int, seed: int) -> torch.Tensor:
    """Midpoints, ±0, subnormals, infinities, huge values, ordinary values."""
    g = torch.Generator().manual_seed(seed)
    mids = (torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32) << 16) | 0x8000
    sub = torch.randint(1, 0x7FFFFF, (n,), generator=g, dtype=torch.int32)
    huge = torch.randint(0x7F000000, 0x7F800000, (n,), generator=g, dtype=torch.int32)
    fixed = torch.tensor(
        [0, -(2**31), 0x7F800000, 0xFF800000 - 2**32, 0x7F7FFFFF], dtype=torch.int32
    )
    bits = torch.cat([mids & 0x7FFFFFFF, mids | -(2**31), sub, huge, fixed])
    vals = torch.cat([bits.view(torch.float32), torch.randn(4 * n, generator=g)])
    return vals[torch.randperm(vals.numel(), generator=g)]


def test_the_kernels_are_built_here():
    assert native.load() is not None, native.build_error


@pytest.mark.parametrize("seed", range(4))
def test_bf16_at_equals_torchs_cast_on_every_kind_of_value(seed):
    x = _special_fp32(2000, seed)
    g = torch.Generator().manual_seed(seed)
    for keep in (1.0, 0.3, 0.01):
        idx = torch.nonzero(torch.rand(x.numel(), generator=g) < keep).reshape(-1)
        got = bf16_at(x, idx)
        want = x[idx].to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(
            got.view(torch.int16), want.view(torch.int16)
        )


def test_bf16_at_with_nan_falls_back_to_torchs_cast_and_handles_strides_and_bf16():
    x = torch.randn(64, 33)
    x[3, 4] = float("nan")
    idx = torch.arange(0, 64 * 33, 5)
    want = x.reshape(-1)[idx].to(torch.bfloat16)
    assert torch.equal(bf16_at(x, idx).view(torch.int16), want.view(torch.int16))
    xt = x.t()  # non-contiguous: gathered through the strides, never copied whole
    want_t = xt.reshape(-1)[idx].to(torch.bfloat16)
    assert torch.equal(bf16_at(xt, idx).view(torch.int16), want_t.view(torch.int16))
    xb = x.to(torch.bfloat16)
    assert torch.equal(bf16_at(xb, idx).view(torch.int16), xb.reshape(-1)[idx].view(torch.int16))
    assert bf16_at(x, torch.empty(0, dtype=torch.int64)).numel() == 0


def test_bf16_at_refuses_unsorted_or_out_of_range_indices_before_reading():
    x = torch.randn(100)
    with pytest.raises(ConfigError, match="not strictly increasing at position 2"):
        bf16_at(x, torch.tensor([1, 5, 5, 7]))
    with pytest.raises(ConfigError, match="outside the tensor's 100 elements"):
        bf16_at(x, torch.tensor([3, 100]))
    with pytest.raises(ConfigError, match="outside"):
        bf16_at(x, torch.tensor([-1, 3]))


@pytest.mark.parametrize("seed", range(5))
def test_first_not_increasing_matches_torch(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 20000, (1,), generator=g))
    x = torch.sort(torch.randperm(10 * n, generator=g)[:n]).values
    assert first_not_increasing(x) == -1
    for _ in range(3):
        y = x.clone()
        at = int(torch.randint(1, n, (1,), generator=g))
        y[at] = y[at - 1] - int(torch.randint(0, 2, (1,), generator=g))  # equal or smaller
        bad = torch.nonzero(y[1:] <= y[:-1]).reshape(-1)
        assert first_not_increasing(y) == int(bad[0]) + 1
        assert first_not_increasing(y.to(torch.int32)) == int(bad[0]) + 1  # torch path
    assert first_not_increasing(torch.tensor([7])) == -1


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bf16_cast_kernel_rounds_every_value_exactly_as_torch(seed: int) -> None:
    from deltasync.native.ops import cast_bf16_into

    vals = _special_fp32(5000, seed)  # includes subnormals: the torch path takes those
    out = torch.empty(vals.numel() + 7, dtype=torch.bfloat16)
    got = cast_bf16_into(vals, out)
    assert torch.equal(got.view(torch.int16), vals.to(torch.bfloat16).view(torch.int16))
    normal = vals[(vals.view(torch.int32) & 0x7F800000) != 0]  # the kernel's own path
    got = cast_bf16_into(normal, out)
    assert torch.equal(got.view(torch.int16), normal.to(torch.bfloat16).view(torch.int16))


def test_the_bf16_cast_of_a_column_slice_equals_torch_row_for_row() -> None:
    from deltasync.native.ops import cast_bf16_into

    g = torch.Generator().manual_seed(2)
    full = torch.randn(64, 300, generator=g)
    out = torch.empty(64 * 300, dtype=torch.bfloat16)
    for view in (full[:, :150], full[:, 150:], full[3:40, 7:261]):
        got = cast_bf16_into(view, out)
        want = view.to(torch.bfloat16).reshape(-1)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    full[10, 200] = float("nan")  # declined by the kernel: torch casts this one
    got = cast_bf16_into(full[:, 150:], out)
    want = full[:, 150:].to(torch.bfloat16).reshape(-1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_bf16_cast_into_a_too_small_buffer_is_refused() -> None:
    from deltasync.errors import TensorInputError
    from deltasync.native.ops import cast_bf16_into

    with pytest.raises(TensorInputError, match="at least 10 elements"):
        cast_bf16_into(torch.zeros(10), torch.empty(9, dtype=torch.bfloat16))


def test_bf16_at_into_a_reused_buffer_equals_a_fresh_gather() -> None:
    vals = _special_fp32(2000, 3)
    idx = torch.arange(0, vals.numel(), 3)
    buf = torch.empty(idx.numel() + 10, dtype=torch.bfloat16)
    got = bf16_at(vals, idx, out=buf)  # subnormals in there: the torch path copies into buf
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got.view(torch.int16), bf16_at(vals, idx).view(torch.int16))
    normal = torch.randn(vals.numel())
    got = bf16_at(normal, idx, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(got.view(torch.int16), normal[idx].to(torch.bfloat16).view(torch.int16))
    with pytest.raises(TensorInputError, match="at least"):
        bf16_at(normal, idx, out=buf[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_scatter16_writes_exactly_what_index_copy_writes(dtype, idx_dtype) -> None:
    g = torch.Generator().manual_seed(7)
    n, base = 50_000, 1_000
    idx = torch.randperm(n, generator=g)[:3_000].sort().values + base
    vals = torch.randint(-(2**15), 2**15, (idx.numel(),), generator=g, dtype=torch.int16).view(
        dtype
    )
    live = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16).view(dtype)
    want = live.clone()
    want.index_copy_(0, idx - base, vals)
    assert scatter16(live, idx.to(idx_dtype), vals, base=base)
    assert torch.equal(live.view(torch.int16), want.view(torch.int16))


def test_scatter16_refuses_an_index_outside_the_target_before_writing_any() -> None:
    live = torch.zeros(100, dtype=torch.bfloat16)
    vals = torch.ones(3, dtype=torch.bfloat16)
    for bad in ([5, 50, 100], [-1, 5, 6]):
        with pytest.raises(TensorInputError, match="outside"):
            scatter16(live, torch.tensor(bad, dtype=torch.int32), vals)
        assert not live.view(torch.int16).any()  # nothing written, not even the good ones
    with pytest.raises(TensorInputError, match="values"):
        scatter16(live, torch.tensor([1, 2], dtype=torch.int32), vals)


def test_scatter16_declines_what_the_kernel_cannot_take() -> None:
    idx = torch.tensor([0, 2], dtype=torch.int32)
    assert not scatter16(torch.zeros(4), idx, torch.ones(2))  # fp32: torch writes it
    strided = torch.zeros(4, 2, dtype=torch.bfloat16)[:, 0]
    assert not scatter16(strided, idx, torch.ones(2, dtype=torch.bfloat16))
    # one storage: values inside the target's span are declined (torch writes them); values
    # right after it are taken, and written
    buf = torch.zeros(8, dtype=torch.bfloat16)
    assert not scatter16(buf[:4], idx, buf[3:5])
    buf[4:6] = torch.tensor([1.5, -2.0])
    assert scatter16(buf[:4], idx, buf[4:6])
    want = torch.tensor([1.5, 0.0, -2.0, 0.0], dtype=torch.bfloat16)
    assert torch.equal(buf[:4].view(torch.int16), want.view(torch.int16))
    native.disable()
    try:
        assert not scatter16(torch.zeros(4, dtype=torch.bfloat16), idx, torch.ones(2).bfloat16())
    finally:
        native.enable()


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_patch16_writes_a_copy_with_exactly_what_index_copy_writes(idx_dtype, order) -> None:
    # more than one 4096-element step, the last one partial; shuffled with duplicates: the
    # kernel's out-of-order tail, a later duplicate winning as in index_copy_
    g = torch.Generator().manual_seed(11)
    n, base = 10_000, 300
    idx = torch.randperm(n, generator=g)[:2_000].sort().values + base
    if order == "shuffled":
        idx = torch.cat([idx[torch.randperm(idx.numel(), generator=g)], idx[:50]])
    vals = torch.randint(-(2**15), 2**15, (idx.numel(),), generator=g, dtype=torch.int16)
    source = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16)
    vals, source = vals.view(torch.bfloat16), source.view(torch.bfloat16)
    want = source.clone()
    for k in range(idx.numel()):  # one at a time: the last write of a position wins
        want[int(idx[k]) - base] = vals[k]
    target = torch.empty_like(source)
    assert patch16(target, source, idx.to(idx_dtype), vals, base=base)
    assert torch.equal(target.view(torch.int16), want.view(torch.int16))


def test_patch16_refuses_a_bad_index_before_writing_and_declines_what_it_cannot_take() -> None:
    source = torch.ones(100, dtype=torch.bfloat16)
    target = torch.zeros(100, dtype=torch.bfloat16)
    vals = torch.ones(3, dtype=torch.bfloat16)
    for bad in ([5, 50, 100], [-1, 5, 6]):
        with pytest.raises(TensorInputError, match="outside"):
            patch16(target, source, torch.tensor(bad, dtype=torch.int32), vals)
        assert not target.view(torch.int16).any()  # not even the copy
    with pytest.raises(TensorInputError, match="values"):
        patch16(target, source, torch.tensor([1, 2], dtype=torch.int32), vals)
    idx = torch.tensor([0, 2], dtype=torch.int32)
    two = torch.ones(2, dtype=torch.bfloat16)
    assert not patch16(target, source[:50], idx, two)  # sizes differ
    assert not patch16(target, source.half(), idx, two)  # dtypes differ
    assert not patch16(target[::2], source[::2], idx, two)  # strided
    assert not patch16(target, target, idx, two)  # in place: torch does it
    assert not target.view(torch.int16).any()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_sum_equals_cumsum_in_the_tensors_own_dtype_wraps_included(dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (100_003,), generator=g, dtype=dtype)
    x[:1000] = torch.randint(1, 300, (1000,), generator=g, dtype=dtype)  # small gaps too
    want = torch.cumsum(x, 0, dtype=dtype)  # wraps modulo 2^32 / 2^64 as numpy's does
    got = x.clone()
    assert prefix_sum_(got)
    assert torch.equal(got, want)
    one = torch.tensor([7], dtype=dtype)
    assert prefix_sum_(one) and one.item() == 7
    assert prefix_sum_(torch.empty(0, dtype=dtype))


def test_prefix_sum_declines_what_the_kernel_cannot_take_and_leaves_it_as_it_was() -> None:
    for x in (
        torch.arange(6, dtype=torch.int16),  # another dtype
        torch.arange(6, dtype=torch.int32).reshape(2, 3),  # not 1-D
        torch.arange(12, dtype=torch.int64)[::2],  # strided
    ):
        before = x.clone()
        assert not prefix_sum_(x)
        assert torch.equal(x, before)
    x = torch.arange(6, dtype=torch.int32)
    native.disable()
    try:
        assert not prefix_sum_(x)
    finally:
        native.enable()
    assert torch.equal(x, torch.arange(6, dtype=torch.int32))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_column_block_maps_every_index_as_the_torch_unravel_does(seed) -> None:
    # row-parallel TP splits of a (rows, src_cols) weight, with row offsets on both sides
    g = torch.Generator().manual_seed(seed)
    rows, src_cols, tp = 37, 96, 3
    width = src_cols // tp
    density = (0.9, 0.05, 0.003)[seed]  # dense rows, sparse rows, rows skipped entirely
    idx = torch.nonzero(torch.rand(rows * src_cols, generator=g) < density).reshape(-1)
    for rank in range(tp):
        block = Block(
            src_cols=src_cols,
            dst_cols=width + 5,  # a destination wider than the block: columns shift too
            src_row=0,
            dst_row=11,
            rows=rows,
            src_col=rank * width,
            dst_col=2,
            cols=width,
        )
        native_dst, native_pos = block.map_columns_native(idx, 7)
        torch_dst, torch_pos = block.map_columns(block.column_basis(idx), 7)
        assert torch.equal(native_dst, torch_dst) and torch.equal(native_pos, torch_pos)
        dst, pos = block.map_sorted(torch.cat([torch.tensor([-1]), idx]), 1, idx.numel() + 1)
        assert torch.equal(dst, torch_dst) and torch.equal(pos, torch_pos - 6)


def test_a_column_block_takes_indices_in_any_order_and_declines_what_it_cannot_take() -> None:
    idx = torch.tensor([250, 3, 17, 260, 0, 99, 5], dtype=torch.int64)
    dst, pos = column_block(idx, src_cols=10, cols=(3, 8), dst_cols=5, shift=1, pos_base=2)
    keep = [(j, int(i)) for j, i in enumerate(idx) if 3 <= int(i) % 10 < 8]
    assert pos.tolist() == [j + 2 for j, _ in keep]
    assert dst.tolist() == [(i // 10) * 5 + i % 10 + 1 for _, i in keep]
    as_int32 = column_block(idx.int(), src_cols=10, cols=(3, 8), dst_cols=5, shift=0, pos_base=0)
    strided = column_block(idx[::2], src_cols=10, cols=(3, 8), dst_cols=5, shift=0, pos_base=0)
    assert as_int32 is None and strided is None


def _planes_of(words: np.ndarray, width: int) -> bytes:
    """``words``' low ``width`` byte planes as the format's encoder writes them (its planes
    come low byte first, ``words.size`` bytes each: the first ``width`` of them)."""
    parts: list[bytes] = []
    section.write_value_planes(lambda view: parts.append(bytes(view)), words)
    return b"".join(parts)[: width * words.size]


def _source(data: bytes):
    pos = 0

    def read_into(buf: memoryview, what: str) -> None:
        nonlocal pos
        buf[:] = data[pos : pos + len(buf)]
        pos += len(buf)

    return read_into


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("n", [1, 7, section.CHUNK + 3])
def test_words_joined_from_planes_equal_the_strided_passes_for_every_width(dtype, n) -> None:
    rng = np.random.default_rng(n)
    size = np.dtype(dtype).itemsize
    for width in [w for w in (1, 2, 4, 8) if w <= size] + ([3] if size >= 4 else []):
        words = rng.integers(0, 256, n * size, dtype=np.uint8).view(dtype)
        data = _planes_of(words, width)
        got = np.full(n, -1, dtype=dtype)  # every byte written: none of the -1 survives
        assert can_join_planes(got, width)
        section.read_words(_source(data), got, width, "gaps")
        keep = np.zeros(size, dtype=np.uint8)
        keep[:width] = 0xFF
        want = words & keep.view(dtype)[0]  # the low ``width`` bytes, the rest zero
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), width
        native.disable()
        try:
            assert not can_join_planes(got, width)
            strided = np.full(n, -1, dtype=dtype)
            section.read_words(_source(data), strided, width, "gaps")
        finally:
            native.enable()
        assert np.array_equal(strided.view(np.uint8), got.view(np.uint8)), width


def test_join_planes_refuses_planes_that_do_not_cover_the_words_and_writes_nothing() -> None:
    out = np.zeros(10, dtype=np.int32)
    lower, last = np.ones(10, dtype=np.uint8), np.ones(4, dtype=np.uint8)
    join_planes(out, 2, lower, last, 6)  # words 6..9
    assert out.tolist() == [0] * 6 + [0x0101] * 4
    out[:] = 0
    for args in [
        (2, lower[:9], last, 0),  # the lower plane too short for 10 words
        (2, None, last, 0),  # no lower plane for width 2
        (2, lower, last, 7),  # past the end
        (2, lower, last, -1),
        (5, np.ones(40, dtype=np.uint8), last, 0),  # wider than the words
        (2, lower, last.astype(np.int16), 0),  # not bytes
        (2, out.view(np.uint8)[:40], last, 0),  # the plane overlaps the words
    ]:
        with pytest.raises(TensorInputError):
            join_planes(out, *args)
        assert not out.any()
    assert not can_join_planes(np.zeros(10, dtype=np.float32), 2)
    assert not can_join_planes(np.zeros((2, 5), dtype=np.int32), 2)
    assert not can_join_planes(np.zeros(20, dtype=np.int32)[::2], 2)
    lib = native.load()
    assert lib is not None  # the kernel's own checks: -1, nothing written
    p = out.ctypes.data
    assert lib.ds_planes_join(p, 3, 10, 1, None, last.ctypes.data, 0, 4) == -1  # size 3
    assert lib.ds_planes_join(p, 4, 10, 2, None, last.ctypes.data, 0, 4) == -1  # no lower
    assert lib.ds_planes_join(p, 4, 10, 1, None, last.ctypes.data, 8, 4) == -1  # a + m > n
    assert lib.ds_planes_join(p, 4, 10, 0, None, last.ctypes.data, 0, 4) == -1  # width 0
    assert not out.any()


def _sparse_payload(indices: np.ndarray, values: np.ndarray, width: int) -> np.ndarray:
    """A sparse record's payload as the encoder writes it: the gaps' planes, the values'."""
    out = bytearray()
    section.write_gap_planes(out.extend, indices.astype(np.int64), width)
    section.write_value_planes(out.extend, values)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def _checked_decode(payload, n, first, width, numel, dtype):
    """The checked numpy path of the reader: gaps read as words, validated, summed."""
    source = _source(payload.tobytes())
    got = section.read_gaps_as_indices(source, first, n, width, "gaps", dtype)
    assert got[1:].min(initial=1) >= 1
    section.sum_gaps(got)
    values = np.empty(n, dtype=np.int16)
    section.read_words(source, values, 2, "values")
    return got, values


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n", [1, 2, 9, section.CHUNK + 5])
def test_a_sparse_record_decodes_in_one_pass_exactly_as_the_checked_path(index_dtype, n) -> None:
    rng = np.random.default_rng(n)
    for width in (1, 2, 3, 4, 8) if index_dtype == np.int64 else (1, 2, 3, 4):
        room = 2**31 - 2000 if index_dtype == np.int32 else 2**61  # numel's bound for the words
        top = min(1 << (8 * width), room // n) - 1  # gaps that use every plane
        gaps = rng.integers(1, top + 1, max(n - 1, 0))
        first = int(rng.integers(0, 1000))
        indices = first + np.concatenate([[0], np.cumsum(gaps)]).astype(np.int64)
        numel = int(indices[-1]) + 1 + int(rng.integers(0, 3))
        values = rng.integers(-(2**15), 2**15, n, dtype=np.int16)
        payload = _sparse_payload(indices, values, width)
        got = decode_sparse(payload, n, first, width, numel, index_dtype)
        assert got is not None, width
        want = _checked_decode(payload, n, first, width, numel, index_dtype)
        assert got[0].dtype == np.dtype(index_dtype) and got[1].dtype == np.int16
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[0], indices), width
        assert np.array_equal(got[1].view(np.uint16), values.view(np.uint16)), width


def test_a_sparse_record_that_breaks_a_rule_is_declined_for_the_checked_path() -> None:
    indices = np.array([3, 5, 6, 40], dtype=np.int64)
    values = np.arange(4, dtype=np.int16)
    good = _sparse_payload(indices, values, 1)
    assert decode_sparse(good, 4, 3, 1, 41, np.int32) is not None
    for args in [
        (good, 4, 3, 1, 40, np.int32),  # the last index is numel
        (good, 4, 3, 1, 3, np.int64),  # first outside the tensor
        (good, 4, -1, 1, 41, np.int64),  # a negative first
        (good, 3, 3, 1, 41, np.int64),  # the payload is not that of 3 elements
        (good[:-1], 4, 3, 1, 41, np.int64),  # nor of 4
        (good, 4, 3, 1, 2**31 + 1, np.int32),  # int32 words for a tensor above 2^31
        (good, 4, 3, 1, 41, np.int16),  # not an index dtype
        (good, 0, 3, 1, 41, np.int64),  # no element
        (good.astype(np.int16), 4, 3, 1, 41, np.int64),  # not bytes
        (_sparse_payload(np.array([3, 5, 5, 40]), values, 1), 4, 3, 1, 41, np.int64),  # gap 0
    ]:
        assert decode_sparse(*args) is None, args[1:]
    # a gap of 2^64 - 1 must not wrap the running sum back into range
    wrap = _sparse_payload(np.array([7, 6]), values[:2], 8)
    assert decode_sparse(wrap, 2, 7, 8, 2**62, np.int64) is None
    lib = native.load()
    assert lib is not None  # the kernel's own argument checks: -1, nothing written
    out = np.zeros(4, dtype=np.int64)
    vals = np.zeros(4, dtype=np.int16)
    p, o, v = good.ctypes.data, out.ctypes.data, vals.ctypes.data
    assert lib.ds_decode_sparse(p, 4, 9, 3, 41, o, 8, v) == -1  # width 9
    assert lib.ds_decode_sparse(p, 4, 1, 3, 41, o, 2, v) == -1  # 2-byte indices
    assert lib.ds_decode_sparse(p, 4, 1, 3, 2**62 + 1, o, 8, v) == -1  # numel above 2^62
    assert lib.ds_decode_sparse(None, 4, 1, 3, 41, o, 8, v) == -1
    assert not out.any() and not vals.any()


def _patched(live: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> bytes:
    want = live.clone()
    want.view(-1)[idx.long()] = vals
    return xxhash.xxh3_128(want.view(torch.int16).numpy().tobytes()).digest()


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 20])
def test_patched_digests_equal_xxhash_of_the_written_tensors_and_write_nothing(chunk) -> None:
    g = torch.Generator().manual_seed(chunk)
    items, want = [], []
    for n, dtype, idx_dtype, k in [
        (5000, torch.bfloat16, torch.int32, 300),
        (3, torch.float16, torch.int64, 3),  # every element
        (2048, torch.bfloat16, torch.int64, 1),
        (0, torch.bfloat16, torch.int32, 0),  # empty
        (999, torch.float16, torch.int32, 0),  # no position: hashed as it is
    ]:
        live = torch.randn(n, 1, generator=g).to(dtype)  # 2-D: hashed in row-major order
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values.to(idx_dtype)
        vals = torch.randn(k, generator=g).to(dtype)
        items.append((live, idx, vals))
        want.append(_patched(live, idx, vals))
    items.append((items[0][0], None, None))  # untouched
    want.append(xxhash.xxh3_128(items[0][0].view(torch.int16).numpy().tobytes()).digest())
    before = [item[0].clone() for item in items]
    scratch = torch.empty(min(chunk, 5000), dtype=torch.int16)
    assert patched_digests16(items, scratch, chunk) == want
    for (live, _, _), old in zip(items, before, strict=True):
        assert torch.equal(live.view(torch.int16), old.view(torch.int16))


def test_patched_digests_decline_what_the_kernel_cannot_take() -> None:
    live = torch.arange(100, dtype=torch.int16).view(torch.bfloat16)
    idx = torch.tensor([3, 50], dtype=torch.int32)
    vals = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    scratch = torch.empty(100, dtype=torch.int16)
    good = _patched(live, idx, vals)
    # an item the kernel cannot take is left to the caller; the others are hashed
    for odd in [
        (live.float(), None, None),  # not 2-byte
        (live[::2], None, None),  # strided
        (live, idx.to(torch.int16), vals),  # index dtype
        (live, idx, vals.half()),  # values of another dtype
        (live, idx, vals[:1]),  # a value short
        (live, idx, None),
    ]:
        assert patched_digests16([odd, (live, idx, vals)], scratch, 100) == [None, good]
    # a position out of order, negative, or outside the tensor: nothing for anyone
    for bad in ([50, 3], [3, 3], [-1, 50], [3, 100]):
        got = patched_digests16([(live, torch.tensor(bad, dtype=torch.int64), vals)], scratch, 7)
        assert got is None, bad
    assert patched_digests16([(live, idx, vals)], scratch[:6], 7) is None  # scratch too short
    assert patched_digests16([(live, idx, vals)], scratch.float(), 7) is None
    assert patched_digests16([(live, idx, vals)], scratch, 0) is None
    native.disable()
    try:
        assert patched_digests16([(live, idx, vals)], scratch, 100) is None
    finally:
        native.enable()
    lib = native.load()
    assert lib is not None  # the kernel's own argument checks
    zero = np.zeros(1, dtype=np.int64)
    p = zero.ctypes.data
    out = np.zeros(16, dtype=np.uint8)
    assert lib.ds_patched_digests16(1, p, p, p, p, p, p, None, 7, p, out.ctypes.data) == -2
    assert lib.ds_patched_digests16(1, p, p, p, p, p, p, p, 0, p, out.ctypes.data) == -2
    assert (
        lib.ds_patched_digests16(1, p, p, p, p, p, p, p, 7, zero.ctypes.data, out.ctypes.data) == -2
    )
    assert not out.any()


def test_a_base_or_first_position_outside_int64_is_refused_not_wrapped() -> None:
    # ctypes passes a Python int modulo 2^64: base 2^64 was base 0 to the kernel, and a base
    # near 2^63 made a far negative index land inside the target.
    live = torch.zeros(8, dtype=torch.bfloat16)
    source = torch.zeros(8, dtype=torch.bfloat16)
    vals = torch.ones(1, dtype=torch.bfloat16)
    for idx, base in (([3], 2**64), ([-(2**63)], 2**63 - 1), ([3], -1), ([3], True)):
        index = torch.tensor(idx, dtype=torch.int64)
        with pytest.raises(TensorInputError, match="base"):
            scatter16(live, index, vals, base=base)
        with pytest.raises(TensorInputError, match="base"):
            patch16(live, source, index, vals, base=base)
    assert not live.view(torch.int16).any()
    assert scatter16(live, torch.tensor([5], dtype=torch.int64), vals, base=np.int64(2))
    payload = np.zeros(2 * 2 + 1, dtype=np.uint8)  # two elements, 1-byte gaps
    payload[0] = 4
    for first, numel in ((2**64 + 1, 10), (2**63, 2**63 + 5), (-1, 10)):
        assert decode_sparse(payload, 2, first, 1, numel, np.int64) is None


def test_patched_digests_never_write_into_what_they_hash() -> None:
    live = torch.arange(8, dtype=torch.int16).view(torch.bfloat16)
    idx = torch.tensor([1], dtype=torch.int64)
    vals = torch.tensor([7], dtype=torch.int16).view(torch.bfloat16)
    before = live.clone()
    for scratch in (live, live[2:], vals):  # the caller's scratch over a hashed buffer
        assert patched_digests16([(live, idx, vals)], scratch, chunk=4) is None
    assert torch.equal(live.view(torch.int16), before.view(torch.int16))
    want = before.clone()
    want[1] = vals[0]
    got = patched_digests16([(live, idx, vals)], torch.empty(8, dtype=torch.bfloat16), chunk=4)
    assert got == [xxhash.xxh3_128_digest(want.view(torch.uint8).numpy().tobytes())]
