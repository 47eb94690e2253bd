"""Compression of the record section: exactly one zstd frame, or the raw bytes.

The decoder insists on a single zstd frame that declares its content size, that this size equals
the header's ``raw_len`` (already checked against ``max_decompressed_bytes``), and that the frame
ends exactly where the section does, so no byte of a blob goes unchecked and zstd never allocates
more than the caller allowed.

This module knows bytes and zstd only: no records, no tensors.
"""

from __future__ import annotations

import zstandard

from deltasync.errors import FormatError, TruncatedBlobError

MIN_LEVEL = 0  # 0 = store the record section raw (no zstd); flags bit 0 clear
MAX_LEVEL = 22


def compress(raw: bytes | bytearray | memoryview, level: int) -> bytes:
    """One zstd frame over ``raw`` with its content size written (single-threaded, so the
    output is a deterministic function of the input and the zstd version)."""
    compressor = zstandard.ZstdCompressor(
        level=level, write_content_size=True, write_checksum=False, write_dict_id=False
    )
    return compressor.compress(raw)


def frame_size(section: memoryview, where: str) -> int:
    """Bytes taken by the zstd frame that starts ``section``, found by walking its block headers
    (one step per 128 KiB block, not per byte)."""
    n = len(section)
    try:
        pos = zstandard.frame_header_size(section)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: the record section is not a zstd frame ({e})") from None
    if pos > n:
        raise TruncatedBlobError(f"{where}: the zstd frame header runs past the record section")
    has_checksum = section[4] & 0x04
    while True:
        if pos + 3 > n:
            raise TruncatedBlobError(f"{where}: the zstd frame ends before its last block")
        block = int.from_bytes(section[pos : pos + 3], "little")
        pos += 3
        block_type = (block >> 1) & 0x3
        if block_type == 3:
            raise FormatError(f"{where}: the zstd frame holds a reserved block type")
        pos += 1 if block_type == 1 else block >> 3  # RLE blocks store one byte
        if block & 0x1:
            break
    if has_checksum:
        pos += 4
    if pos > n:
        raise TruncatedBlobError(f"{where}: the zstd frame runs past the record section")
    return pos


def decompress(section: memoryview, raw_len: int, where: str) -> bytes:
    """The ``raw_len`` bytes of a single-frame zstd section; FormatError on anything else.

    ``raw_len`` must already be within the caller's allocation limit."""
    try:
        declared = zstandard.frame_content_size(section)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: the record section is not a zstd frame ({e})") from None
    if declared != raw_len:
        raise FormatError(
            f"{where}: the zstd frame declares {declared} content bytes but the header says "
            f"{raw_len} (-1 means undeclared, which this format forbids)"
        )
    used = frame_size(section, where)
    if used != len(section):
        raise FormatError(
            f"{where}: {len(section) - used} bytes follow the zstd frame inside the record section"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(section)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: the record section does not decompress ({e})") from None
    if len(raw) != raw_len:  # zstd checks this too; a wrong length must never reach the parser
        raise FormatError(f"{where}: decompressed {len(raw)} bytes, header says {raw_len}")
    return raw
