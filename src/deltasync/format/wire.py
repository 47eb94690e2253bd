"""The byte layout of a deltasync blob: magic, structs, codes and decoder limits.

Every offset and width that docs/wire-format.md describes is defined here once, so the encoder,
the decoder and the golden-bytes tests cannot drift apart. All integers are little-endian.

This module knows bytes only: no tensors, no compression, no validation logic.
"""

from __future__ import annotations

import struct
import sys

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    # Values are written as raw in-memory bit patterns; a big-endian host would need byte swaps
    # the codec does not implement.
    raise ImportError("deltasync.format supports little-endian hosts only")

MAGIC = b"DSYB"
END_MAGIC = b"DSYE"  # opens the trailer: lets a decoder tell a cut-short blob from a corrupt one
# Format 2 (this one) moved the totals from the header into a trailer and split the record
# section into segments, so a writer can stream a blob while it is still producing records.
# Format 1 pledged every total in the header, which forced the whole blob to be built first.
FORMAT_VERSION = 2

# Header flags. Unknown bits are rejected by the decoder so a future flag cannot be ignored.
FLAG_ZSTD = 0x0001  # each segment's record section is one zstd frame (else it is stored raw)
# With FLAG_ZSTD: a segment's section_len may be OPEN_LEN, its zstd frame then ends it. A
# writer streams a large segment's frame out as zstd produces it instead of holding the whole
# frame until its length is known (a 0.6B embedding shard's: ~9 MiB).
FLAG_OPEN_SEGMENTS = 0x0002
KNOWN_FLAGS = FLAG_ZSTD | FLAG_OPEN_SEGMENTS

# Fixed header, 28 bytes: magic, format_version, flags, version, base_version, shard_len,
# writer_len, reserved. Nothing in it depends on the records, so it is written first.
HEADER = struct.Struct("<4sHHqqBBH")
assert HEADER.size == 28

# Segment header, 20 bytes: section_len, raw_len, record_count; the section follows.
SEGMENT = struct.Struct("<QQI")
assert SEGMENT.size == 20
OPEN_LEN = (1 << 64) - 1  # section_len of an open segment (FLAG_OPEN_SEGMENTS)

# Trailer, 28 bytes: end magic, segment_count, record_count, raw_len (all segments, uncompressed),
# body_len (bytes of all segments with their headers: from the end of the writer id to the
# trailer). Written last; the decoder reads it first.
TRAILER = struct.Struct("<4sIIQQ")
assert TRAILER.size == 28

DIGEST_SIZE = 16  # xxh3-128, canonical (big-endian) form, over every byte before it
MIN_BLOB_SIZE = HEADER.size + 2 + TRAILER.size + DIGEST_SIZE  # ids are >= 1 byte each

# Record header, 24 bytes:
# name_len, dtype_code, encoding, ndim, gap_width, reserved, nnz, first_index.
RECORD = struct.Struct("<HBBBBHQQ")
assert RECORD.size == 24

ENCODING_DENSE = 0
ENCODING_SPARSE = 1

GAP_WIDTHS = (1, 2, 4, 8)  # bytes per gap: u8, u16, u32, u64

# Limits a decoder enforces before it allocates anything.
MAX_NDIM = 64
MAX_NUMEL = 1 << 62  # keeps every index, gap and partial sum inside int64 with room to spare
MAX_NAME_BYTES = 0xFFFF
MAX_ID_BYTES = 0xFF  # shard and writer ids
# Records per blob. A shard holds at most tens of thousands of tensors (a 128-expert MoE with one
# tensor per expert and projection stays under 10^5); the limit keeps a hostile count from making
# the decoder build millions of Python objects before it can fail. Segments hold >= 1 record.
MAX_RECORDS = 1 << 20


def blob_size(shard_len: int, writer_len: int, body_len: int) -> int:
    """Total size in bytes of a blob with these variable parts."""
    return HEADER.size + shard_len + writer_len + body_len + TRAILER.size + DIGEST_SIZE


def shape_struct(ndim: int) -> struct.Struct:
    """The ``ndim`` u64 dimensions that follow a record's name."""
    return struct.Struct(f"<{ndim}Q")
