"""Golden bytes: the wire format is pinned byte for byte (docs/wire-format.md shows the same blob).

The uncompressed (level 0) blob pins the layout itself. The level 1 blob additionally pins the
zstd output of the pinned zstandard==0.25.0 (libzstd 1.5.7); if a zstandard upgrade changes its
output, only that test fails, and the decode tests below show old blobs still read correctly.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import zstandard

from deltasync.format import TensorUpdate, decode_blob, encode_blob
from deltasync.format.wire import HEADER, SEGMENT, TRAILER

from format_testkit import same_update

HEAD = dict(version=7, base_version=6, shard="tp0", writer="w00000")

# fmt: off
GOLDEN_LEVEL0 = (
    # header: magic, format 2, flags 0, version 7, base 6, shard 3 bytes, writer 6 bytes, reserved
    "44535942" "0200" "0000" "0700000000000000" "0600000000000000" "03" "06" "0000"
    "747030" "773030303030"  # "tp0", "w00000"
    # segment 0: section 156 bytes, raw 156 bytes, 3 records
    "9c00000000000000" "9c00000000000000" "03000000"
    # record 0: embed.weight, bf16, sparse, 2 dims, u8 gaps, nnz 2, first 1, shape (2, 4),
    # gap planes [05], value planes [80 00] [3f 80] (0x3f80 = 1.0, 0x8000 = -0.0)
    "0c00" "01" "01" "02" "01" "0000" "0200000000000000" "0100000000000000"
    "656d6265642e776569676874" "0200000000000000" "0400000000000000" "05" "8000" "3f80"
    # record 1: norm.weight, fp32, dense, 1 dim, nnz 3, shape (3,), 4 value planes
    # (0x7f800000 = inf, 0x7fc00001 = NaN with payload, 0xc0200000 = -2.5)
    "0b00" "03" "00" "01" "00" "0000" "0300000000000000" "0000000000000000"
    "6e6f726d2e776569676874" "0300000000000000" "000100" "000000" "80c020" "7f7fc0"
    # record 2: q.bias, fp16, sparse, 1 dim, u16 gaps, nnz 2, first 0, shape (300,),
    # gap planes [2b] [01] (gap 299), value planes [00 00] [3c fc] (1.0, -inf)
    "0600" "02" "01" "01" "02" "0000" "0200000000000000" "0000000000000000"
    "712e62696173" "2c01000000000000" "2b" "01" "0000" "3cfc"
    # trailer: "DSYE", 1 segment, 3 records, raw 156, body 176 (20-byte segment header + 156)
    "44535945" "01000000" "03000000" "9c00000000000000" "b000000000000000"
    # xxh3-128 digest of everything above
    "f8108d987c62c72209d1590148104f73"
)
# fmt: on

GOLDEN_LEVEL1 = (
    "44535942020001000700000000000000060000000000000003060000747030773030303030710000"
    "00000000009c000000000000000300000028b52ffd209c450300d4040c0001010201000002000100"
    "656d6265642e776569676874020004000580003f800b0003000100000003006e6f726d03000180c0"
    "207f7fc0060002010102712e626961732c00002b0100003cfc0b004d090302e6b0095804996d9565"
    "4056805b3014187800484453594501000000030000009c00000000000000850000000000000084a3"
    "b53fe5ba85d167d92a3ab149ae49"
)


def _bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    int_dtype, width = (torch.int32, 32) if dtype == torch.float32 else (torch.int16, 16)
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


def golden_updates() -> list[TensorUpdate]:
    return [
        TensorUpdate(
            name="embed.weight",
            shape=(2, 4),
            dtype=torch.bfloat16,
            indices=torch.tensor([1, 6]),
            values=_bits([0x3F80, 0x8000], torch.bfloat16),
        ),
        TensorUpdate(
            name="norm.weight",
            shape=(3,),
            dtype=torch.float32,
            indices=None,
            values=_bits([0x7F800000, 0x7FC00001, 0xC0200000], torch.float32),
        ),
        TensorUpdate(
            name="q.bias",
            shape=(300,),
            dtype=torch.float16,
            indices=torch.tensor([0, 299]),
            values=_bits([0x3C00, 0xFC00], torch.float16),
        ),
    ]


def test_the_uncompressed_blob_matches_the_pinned_bytes():
    assert encode_blob(golden_updates(), **HEAD, level=0).hex() == GOLDEN_LEVEL0


def test_the_level_1_blob_matches_the_pinned_bytes_of_zstandard_0_25_0():
    blob = encode_blob(golden_updates(), **HEAD)
    assert blob.hex() == GOLDEN_LEVEL1, (
        f"zstd output changed (zstandard {zstandard.__version__}, libzstd "
        f"{zstandard.ZSTD_VERSION}); the layout test above says whether the format changed too"
    )
    assert encode_blob(golden_updates(), **HEAD) == blob  # same process, same bytes


def test_the_pinned_zstd_section_decompresses_to_the_pinned_record_bytes():
    level0, level1 = bytes.fromhex(GOLDEN_LEVEL0), bytes.fromhex(GOLDEN_LEVEL1)
    start = HEADER.size + 3 + 6 + SEGMENT.size
    records = level0[start : -16 - TRAILER.size]
    section = level1[start : -16 - TRAILER.size]
    assert zstandard.ZstdDecompressor().decompress(section) == records


def test_both_pinned_blobs_decode_to_the_golden_updates():
    for hexed in (GOLDEN_LEVEL0, GOLDEN_LEVEL1):
        decoded = decode_blob(bytes.fromhex(hexed), version=7, base_version=6, shard="tp0")
        assert decoded.header.writer == "w00000"
        pairs = zip(decoded.updates, golden_updates(), strict=True)
        assert all(same_update(a, b) for a, b in pairs)


def test_the_example_in_docs_wire_format_md_is_the_pinned_blob():
    doc = (Path(__file__).parents[2] / "docs" / "wire-format.md").read_text()
    block = doc.split("### Example", 1)[1].split("```")[1]
    hexed = []
    for line in block.strip().splitlines():
        tokens = line.split()
        if not re.fullmatch(r"[0-9a-f]+", tokens[0]):
            tokens = tokens[1:]  # a label: header, ids, segment, record, trailer, digest
        for token in tokens:
            if not re.fullmatch(r"[0-9a-f]+", token):
                break  # the rest of the line is a comment
            hexed.append(token)
    assert "".join(hexed) == GOLDEN_LEVEL0
