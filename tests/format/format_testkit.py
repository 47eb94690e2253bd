"""Helpers for the format tests: update comparison and hand-crafted (hostile) blobs (bitwise
equality of tensors comes from the test kit).

Crafted blobs carry a CORRECT digest, so the decoder's structural checks, not the digest, are
what the hostile tests exercise.
"""

from __future__ import annotations

import struct

import torch
import xxhash
import zstandard
from kit import bits_equal

from deltasync.format import TensorUpdate
from deltasync.format.wire import (
    DIGEST_SIZE,
    END_MAGIC,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    OPEN_LEN,
    RECORD,
    SEGMENT,
    TRAILER,
)


def same_update(a: TensorUpdate, b: TensorUpdate) -> bool:
    if (a.name, a.shape, a.dtype) != (b.name, b.shape, b.dtype):
        return False
    if (a.indices is None) != (b.indices is None):
        return False
    if a.indices is not None and not torch.equal(a.indices.cpu(), b.indices.cpu()):
        return False
    return bits_equal(a.values, b.values)


def clone_all(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in targets.items()}


def reseal(blob: bytes) -> bytes:
    """``blob`` with its digest recomputed (so only structural checks can reject it)."""
    body = blob[:-DIGEST_SIZE]
    return body + xxhash.xxh3_128_digest(body)


_HEADER_FIELDS = [
    "magic",
    "format_version",
    "flags",
    "version",
    "base_version",
    "shard_len",
    "writer_len",
    "reserved",
]
_SEGMENT_FIELDS = ["section_len", "raw_len", "record_count"]
_TRAILER_FIELDS = ["end_magic", "segment_count", "total_records", "total_raw", "body_len"]


def assemble(head: dict, ids: bytes, segments: list[tuple[dict, bytes]], trailer: dict) -> bytes:
    body = b"".join(
        SEGMENT.pack(*(f[n] for n in _SEGMENT_FIELDS)) + section for f, section in segments
    )  # an open segment keeps its OPEN_LEN
    blob = (
        HEADER.pack(*(head[n] for n in _HEADER_FIELDS))
        + ids
        + body
        + TRAILER.pack(*(trailer[n] for n in _TRAILER_FIELDS))
    )
    return blob + xxhash.xxh3_128_digest(blob)


def totals(segments: list[tuple[dict, bytes]]) -> dict:
    return dict(
        end_magic=END_MAGIC,
        segment_count=len(segments),
        total_records=sum(f["record_count"] for f, _ in segments),
        total_raw=sum(f["raw_len"] for f, _ in segments),
        body_len=sum(SEGMENT.size + len(section) for _, section in segments),
    )


def split_blob(blob: bytes) -> tuple[dict, bytes, list[tuple[dict, bytes]], dict]:
    """(header fields, id bytes, [(segment fields, section bytes)], trailer fields) of a blob;
    an open segment's section is its zstd frame (found by zstd itself, not by the decoder)."""
    head = dict(zip(_HEADER_FIELDS, HEADER.unpack_from(blob), strict=True))
    at = HEADER.size + head["shard_len"] + head["writer_len"]
    ids = blob[HEADER.size : at]
    end = len(blob) - DIGEST_SIZE - TRAILER.size
    trailer = dict(zip(_TRAILER_FIELDS, TRAILER.unpack_from(blob, end), strict=True))
    segments = []
    while at < end:
        fields = dict(zip(_SEGMENT_FIELDS, SEGMENT.unpack_from(blob, at), strict=True))
        at += SEGMENT.size
        n = fields["section_len"]
        if n == OPEN_LEN:
            rest = zstandard.ZstdDecompressor().decompressobj()
            rest.decompress(blob[at:end])
            n = end - at - len(rest.unused_data)
        segments.append((fields, blob[at : at + n]))
        at += n
    return head, ids, segments, trailer


def patch_header(blob: bytes, **fields: int | bytes) -> bytes:
    """Rewrite fields of a blob by name and reseal it: header fields; ``section_len``,
    ``raw_len``, ``record_count`` of its first segment (the trailer's totals follow them unless
    given too); trailer fields (``end_magic``, ``segment_count``, ``total_records``,
    ``total_raw``, ``body_len``)."""
    head, ids, segments, _ = split_blob(blob)
    head.update({k: v for k, v in fields.items() if k in _HEADER_FIELDS})
    segments[0][0].update({k: v for k, v in fields.items() if k in _SEGMENT_FIELDS})
    trailer = totals(segments)
    trailer.update({k: v for k, v in fields.items() if k in _TRAILER_FIELDS})
    return assemble(head, ids, segments, trailer)


def record(
    name: str,
    *,
    dtype_code: int = 1,
    encoding: int = 1,
    shape: tuple[int, ...] = (16,),
    nnz: int = 0,
    first: int = 0,
    width: int = 1,
    payload: bytes = b"",
    reserved: int = 0,
    ndim: int | None = None,
) -> bytes:
    """Raw record bytes with every field under the test's control."""
    raw_name = name.encode()
    ndim = len(shape) if ndim is None else ndim
    head = RECORD.pack(len(raw_name), dtype_code, encoding, ndim, width, reserved, nnz, first)
    return head + raw_name + struct.pack(f"<{len(shape)}Q", *shape) + payload


def craft(
    records: bytes,
    count: int,
    *,
    version: int = 5,
    base_version: int = 4,
    shard: str = "tp0",
    writer: str = "w00000",
    compress: bool = True,
    tail: bytes = b"",
    **fields: int | bytes,
) -> bytes:
    """A one-segment blob around raw record bytes, with a correct digest; ``fields`` override
    header, segment and trailer fields (see :func:`patch_header`) and ``tail`` is appended to
    the (compressed) record section."""
    body = zstandard.ZstdCompressor(level=1).compress(records) if compress else records
    body += tail
    head = dict(
        magic=MAGIC,
        format_version=FORMAT_VERSION,
        flags=FLAG_ZSTD if compress else 0,
        version=version,
        base_version=base_version,
        shard_len=len(shard),
        writer_len=len(writer),
        reserved=0,
    )
    head.update({k: v for k, v in fields.items() if k in _HEADER_FIELDS})
    segment = dict(section_len=len(body), raw_len=len(records), record_count=count)
    segment.update({k: v for k, v in fields.items() if k in _SEGMENT_FIELDS})
    segments = [(segment, body)]
    trailer = totals(segments)
    trailer.update({k: v for k, v in fields.items() if k in _TRAILER_FIELDS})
    return assemble(head, shard.encode() + writer.encode(), segments, trailer)
