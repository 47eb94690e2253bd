"""Hostile and damaged blobs: every one raises a typed error, and nothing reaches the targets.

Crafted blobs carry a correct digest (format_testkit.craft / reseal), so these tests exercise the
structural checks behind the digest, not just the digest.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from kit import same_bits

from deltasync.errors import (
    BaseVersionMismatchError,
    BlobMismatchError,
    ConfigError,
    DigestMismatchError,
    FormatError,
    TruncatedBlobError,
)
from deltasync.format import (
    BlobBaseMismatchError,
    BlobLimitError,
    BlobRecords,
    TensorSpec,
    TensorUpdate,
    apply_updates,
    decode_blob,
    encode_blob,
)
from deltasync.format.wire import (
    DIGEST_SIZE,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    SEGMENT,
    TRAILER,
)

from format_testkit import clone_all, craft, patch_header, record, reseal

HEAD = dict(version=5, base_version=4, shard="tp0", writer="w00000")
BF16 = torch.bfloat16


def targets() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 4, generator=g).to(BF16)
    return {"a": a, "b": torch.randn(16, generator=g).to(BF16)}


def good_blob(level: int = 1) -> bytes:
    ups = [
        TensorUpdate(
            name="a",
            shape=(4, 4),
            dtype=BF16,
            indices=torch.tensor([0, 5, 15]),
            values=torch.tensor([1.0, -2.0, 3.0]).to(BF16),
        ),
        TensorUpdate(
            name="b",
            shape=(16,),
            dtype=BF16,
            indices=torch.tensor([2]),
            values=torch.tensor([7.0]).to(BF16),
        ),
    ]
    return encode_blob(ups, **HEAD, level=level)


def receive(blob: bytes, live: dict[str, torch.Tensor], layout: bool = True, **kwargs) -> int:
    """What a receiver does: decode (against its layout unless ``layout`` is False), apply."""
    spec = {k: TensorSpec(shape=tuple(v.shape), dtype=v.dtype) for k, v in live.items()}
    decoded = decode_blob(blob, expected=spec if layout else None, **kwargs)
    return apply_updates(decoded.updates, live)


def assert_rejected(
    blob: bytes,
    error: type[Exception],
    match: str | None = None,
    *,
    layout: bool = True,
    **kwargs,
) -> None:
    """Decoding and applying ``blob`` raises ``error`` and leaves the targets bit-identical.
    ``layout=False`` decodes without the receiver's layout, to reach checks that a layout
    mismatch would otherwise preempt (shapes no receiver has)."""
    live = targets()
    before = clone_all(live)
    with pytest.raises(error, match=match):
        receive(blob, live, layout=layout, **kwargs)
    assert same_bits(live, before)
    # the receiver's streamed path (int32 indices where a tensor allows) refuses it the same way
    spec = {k: TensorSpec(shape=tuple(v.shape), dtype=v.dtype) for k, v in live.items()}
    with pytest.raises(error, match=match):
        list(BlobRecords(blob, expected=spec if layout else None, narrow_indices=True, **kwargs))


def test_a_good_blob_is_accepted_by_the_same_receiver_path():
    live = targets()
    assert receive(good_blob(), live, version=5, base_version=4, shard="tp0") == 4


# --- digest, truncation, framing -------------------------------------------------------------


def test_a_flipped_bit_in_the_record_section_or_digest_is_a_digest_mismatch():
    blob = good_blob()
    start = HEADER.size + 3 + 6 + SEGMENT.size  # the first record section's first byte
    positions = [*range(start, len(blob) - DIGEST_SIZE - TRAILER.size)]
    positions += range(len(blob) - DIGEST_SIZE, len(blob))
    for pos in positions:
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        assert_rejected(bytes(damaged), DigestMismatchError, "corrupted")


def test_a_damaged_trailer_is_reported_as_a_cut_or_extended_blob():
    blob = good_blob()
    at = len(blob) - DIGEST_SIZE - TRAILER.size
    for pos in range(at, at + 4):  # the trailer's magic: the blob does not end where it should
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        assert_rejected(bytes(damaged), TruncatedBlobError, "does not end with its trailer")


def test_a_flipped_bit_anywhere_raises_a_format_error():
    blob = good_blob()
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x01
        assert_rejected(bytes(damaged), FormatError)


def test_a_blob_cut_at_every_byte_position_is_reported_as_truncated():
    for level in (0, 1):
        blob = good_blob(level)
        for cut in range(len(blob)):
            assert_rejected(blob[:cut], TruncatedBlobError, "cut short|shorter")


def test_bytes_appended_after_the_digest_are_rejected():
    assert_rejected(good_blob() + b"\x00", FormatError, "appended")


def test_bad_magic_is_rejected_even_with_a_correct_digest():
    assert_rejected(patch_header(good_blob(), magic=b"PK\x03\x04"), FormatError, "magic")


def test_an_unknown_format_version_is_rejected_and_names_the_remedy():
    blob = patch_header(good_blob(), format_version=FORMAT_VERSION + 1)
    assert_rejected(blob, FormatError, f"format version {FORMAT_VERSION + 1}.*upgrade")


def test_a_format_1_blob_is_refused_with_the_remedy():
    # Format 1 pledged its totals in a 48-byte header; its golden blob (the last release's)
    # keeps its digest, so only the version check can refuse it.
    v1_header = struct.Struct("<4sHHqqQQIBBH")
    old = v1_header.pack(b"DSYB", 1, 0, 7, 6, 24, 24, 1, 3, 6, 0) + b"tp0w00000" + bytes(24)
    old = reseal(old + bytes(DIGEST_SIZE))
    assert_rejected(old, FormatError, "format version 1; this deltasync reads version 2")


def test_unknown_header_flags_are_rejected():
    assert_rejected(patch_header(good_blob(), flags=0x8001), FormatError, "flags")


def test_an_invalid_shard_id_in_the_header_is_rejected():
    blob = good_blob()
    assert_rejected(reseal(blob.replace(b"tp0", b"../", 1)), FormatError, "shard id")


def test_a_header_with_base_not_below_version_is_rejected():
    assert_rejected(patch_header(good_blob(), base_version=5), FormatError, "base version")


def test_trailing_bytes_after_the_zstd_frame_are_rejected():
    records = record("b", shape=(16,), nnz=1, first=2, payload=b"\x00\x3f")
    assert_rejected(craft(records, 1, tail=b"junk"), FormatError, "4 bytes follow the zstd frame")
    second_frame = zstandard.ZstdCompressor(level=1).compress(b"more")
    assert_rejected(craft(records, 1, tail=second_frame), FormatError, "follow the zstd frame")


def test_a_zstd_frame_that_disagrees_with_the_declared_size_is_rejected():
    records = record("b", shape=(16,), nnz=1, first=2, payload=b"\x00\x3f")
    assert_rejected(craft(records, 1, raw_len=len(records) + 1), FormatError, "declares")


# --- absurd lengths: must raise without allocating ------------------------------------------------


def test_a_declared_decompressed_size_of_2_pow_60_raises_before_allocating():
    blob = patch_header(good_blob(), raw_len=1 << 60)
    assert_rejected(blob, BlobLimitError, "max_decompressed_bytes")
    # Even with the limit lifted, the zstd frame's own size must agree before anything is built.
    assert_rejected(blob, FormatError, "declares", max_decompressed_bytes=1 << 62)


def test_a_declared_section_length_of_2_pow_60_raises():
    assert_rejected(patch_header(good_blob(), section_len=1 << 60), TruncatedBlobError)


def test_a_record_declaring_2_pow_60_values_raises_before_allocating():
    dense = record("b", encoding=0, shape=(1 << 60,), nnz=1 << 60, width=0)
    assert_rejected(craft(dense, 1), TruncatedBlobError, "declares", layout=False)
    big = record("b", shape=(1 << 61,), nnz=1 << 60, first=0, width=8)
    assert_rejected(craft(big, 1), TruncatedBlobError, "declares", layout=False)


def zstd_frame(content_size: int, blocks: list[tuple[int, int, bytes]]) -> bytes:
    """A zstd frame by hand: an 8-byte content size, then blocks given as (type, size, stored
    bytes): raw (0, its bytes) or RLE (1, the regenerated size, one byte). The last is flagged."""
    frame = struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 0x38, content_size)  # 128 KiB window
    for k, (kind, size, stored) in enumerate(blocks):
        last = int(k == len(blocks) - 1)
        frame += ((size << 3) | (kind << 1) | last).to_bytes(3, "little") + stored
    return frame


def test_a_frame_declaring_more_than_its_blocks_hold_raises_before_allocating():
    # A 64 GiB dense record from a blob of under 200 bytes: the frame's header declares the
    # size, its blocks regenerate the record's header and 1 MiB. Allocating what the record
    # declares would be a MemoryError (or 64 GiB of address space) before the stream ran dry.
    numel = (1 << 35) - 64
    head = record("b", encoding=0, shape=(numel,), nnz=numel, width=0)
    raw_len = len(head) + 2 * numel
    frame = zstd_frame(raw_len, [(0, len(head), head)] + [(1, 128 << 10, b"\x00")] * 8)
    blob = craft(frame, 1, compress=False, flags=FLAG_ZSTD, raw_len=raw_len)
    assert len(blob) < 200
    tracemalloc.start()
    try:
        assert_rejected(blob, TruncatedBlobError, "blocks can hold at most", layout=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_shape_beyond_2_pow_62_elements_is_rejected():
    rec = record("b", shape=(1 << 40, 1 << 40), nnz=0)
    assert_rejected(craft(rec, 1), BlobLimitError, "2\\^62", layout=False)


@pytest.mark.parametrize("shape", [(1 << 63, 0), (0, (1 << 62) + 1), ((1 << 64) - 1, 0, 3)])
def test_a_dim_beyond_2_pow_62_is_rejected_although_the_tensor_has_no_elements(shape):
    # the element count is 0, in range: only the dim itself can be refused (torch cannot hold it)
    rec = record("b", shape=shape, nnz=0)
    assert_rejected(craft(rec, 1), BlobLimitError, "dim above 2\\^62", layout=False)


def test_a_dim_of_2_pow_62_in_a_tensor_of_no_elements_is_accepted():
    (update,) = decode_blob(craft(record("b", shape=(1 << 62, 0), nnz=0), 1)).updates
    assert update.shape == (1 << 62, 0) and update.nnz == 0
    assert torch.zeros(update.shape, dtype=update.dtype).numel() == 0


def test_a_blob_in_a_strided_view_or_not_a_buffer_is_a_config_error_naming_it():
    blob = good_blob()
    spaced = bytes(b for pair in zip(blob, bytes(len(blob)), strict=True) for b in pair)
    for view in (memoryview(spaced)[::2], np.frombuffer(spaced, np.uint8)[::2]):
        with pytest.raises(ConfigError, match="non-contiguous view"):
            decode_blob(view)
        with pytest.raises(ConfigError, match="non-contiguous view"):
            BlobRecords(view)
        assert len(decode_blob(bytes(view)).updates) == 2  # the same bytes, contiguous
    with pytest.raises(ConfigError, match="got str"):
        decode_blob("not a blob")  # type: ignore[arg-type]


def test_more_records_than_the_section_can_hold_are_rejected():
    assert_rejected(craft(b"", 1 << 30), BlobLimitError, "limit of 1048576")
    assert_rejected(craft(b"", 1 << 19), TruncatedBlobError, "records in 1 segments cannot fit")
    rec = record("b", shape=(16,), nnz=0)
    assert_rejected(craft(rec + rec[:20], 2), TruncatedBlobError, "record 1 header")


def test_bytes_after_the_last_record_are_rejected():
    blob = craft(record("b", shape=(16,)) + b"\x00" * 30, 1)
    assert_rejected(blob, FormatError, "follow the last")


# --- record fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(dtype_code=9), "unknown dtype code 9"),
        (dict(encoding=7), "unknown encoding 7"),
        (dict(width=3, nnz=1, first=0, payload=b"\x00\x00"), "gap width 3"),
        (dict(reserved=1), "reserved"),
        (dict(ndim=65, shape=(1,) * 65), "65 dims"),
        (dict(shape=(16,), ndim=200), "200 dims"),
        (dict(nnz=0, first=4), "first index 4"),
        (dict(nnz=17, first=0), "17 indices"),
        (dict(encoding=0, nnz=3, width=0, payload=b"\x00" * 6), "dense record"),
    ],
)
def test_malformed_record_fields_are_rejected(fields, match):
    assert_rejected(craft(record("b", **fields), 1), FormatError, match)


def test_a_name_that_is_not_utf8_is_rejected():
    rec = record("b", shape=(16,)).replace(b"b", b"\xff", 1)
    assert_rejected(craft(rec, 1), FormatError, "UTF-8")


def test_a_duplicate_tensor_name_is_rejected():
    rec = record("b", shape=(16,))
    assert_rejected(craft(rec + rec, 2), FormatError, "twice")


# --- indices --------------------------------------------------------------------------------------


def sparse_record(first: int, gaps: list[int], width: int, numel: int = 16) -> bytes:
    """A bf16 sparse record for tensor 'b' with the given gaps (byte planes built by hand)."""
    fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
    packed = struct.pack(f"<{len(gaps)}{fmt}", *gaps)
    planes = b"".join(packed[k::width] for k in range(width))
    values = b"\x00" * (len(gaps) + 1) + b"\x3f" * (len(gaps) + 1)
    return record(
        "b", shape=(numel,), nnz=len(gaps) + 1, first=first, width=width, payload=planes + values
    )


def test_a_first_index_out_of_range_is_rejected():
    assert_rejected(craft(sparse_record(16, [], 1), 1), FormatError, "first index 16")


def test_an_index_past_the_end_is_rejected():
    assert_rejected(craft(sparse_record(10, [3, 3], 1), 1), FormatError, "index 16 is out of range")


def test_a_duplicate_index_is_rejected():
    blob = craft(sparse_record(1, [2, 0, 1], 1), 1)
    assert_rejected(blob, FormatError, "not strictly increasing")


def test_a_decreasing_index_via_a_wrapping_u64_gap_is_rejected():
    # 5 + (2^64 - 2) wraps to 3 in u64 arithmetic: an unsorted pair disguised as a gap.
    blob = craft(sparse_record(5, [(1 << 64) - 2], 8), 1)
    assert_rejected(blob, FormatError, "out of range")


def test_gaps_summing_past_int32_are_rejected_not_wrapped_in_compact_indices():
    n = (1 << 31) - 1
    gaps = [(1 << 31) - 2] * 3  # each gap < numel, but the int32 sum wraps
    blob = craft(sparse_record(0, gaps, 4, numel=n), 1)
    assert_rejected(blob, FormatError, "overflow|out of range", layout=False)


def test_gaps_summing_past_int64_are_rejected_not_wrapped():
    n = 1 << 62
    gaps = [(1 << 62) - 1] * 4  # each gap < numel, but the sum wraps int64 back below n
    blob = craft(sparse_record(0, gaps, 8, numel=n), 1)
    assert_rejected(blob, FormatError, "overflow", layout=False)


# --- the blob does not fit this receiver ---------------------------------------------------------


def test_an_unknown_tensor_name_is_a_blob_mismatch():
    blob = craft(sparse_record(1, [1], 1).replace(b"b", b"z", 1), 1)
    assert_rejected(blob, BlobMismatchError, "no tensor of this name")


def test_a_wrong_shape_or_dtype_is_a_blob_mismatch():
    assert_rejected(craft(sparse_record(1, [1], 1, numel=17), 1), BlobMismatchError, "shape")
    rec = bytearray(sparse_record(1, [1], 1))
    rec[2] = 2  # fp16 instead of bf16
    assert_rejected(craft(bytes(rec), 1), BlobMismatchError, "float16")


def test_the_wrong_version_base_or_shard_is_a_blob_mismatch():
    blob = good_blob()
    assert_rejected(blob, BlobMismatchError, "expected version 6", version=6)
    assert_rejected(blob, BlobMismatchError, "shard 'tp0'.*'tp1'", shard="tp1")
    assert_rejected(blob, BlobBaseMismatchError, "base version 4.*holds 3", base_version=3)
    assert_rejected(blob, BaseVersionMismatchError, None, base_version=3)
