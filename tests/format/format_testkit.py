"""Helpers for the format tests: bitwise comparisons and hand-crafted (hostile) blobs.

Crafted blobs carry a CORRECT digest, so the decoder's structural checks, not the digest, are
what the hostile tests exercise.
"""

from __future__ import annotations

import struct

import torch
import xxhash
import zstandard

from deltasync.format import TensorUpdate
from deltasync.format.layout import DIGEST_SIZE, FLAG_ZSTD, FORMAT_VERSION, HEADER, MAGIC, RECORD

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from +0.0 and compares NaN payloads)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.detach().cpu().view(BITS[a.dtype]), b.detach().cpu().view(BITS[b.dtype]))
    )


def same_update(a: TensorUpdate, b: TensorUpdate) -> bool:
    if (a.name, a.shape, a.dtype) != (b.name, b.shape, b.dtype):
        return False
    if (a.indices is None) != (b.indices is None):
        return False
    if a.indices is not None and not torch.equal(a.indices.cpu(), b.indices.cpu()):
        return False
    return same_bits(a.values, b.values)


def clone_all(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in targets.items()}


def all_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


def reseal(blob: bytes) -> bytes:
    """``blob`` with its digest recomputed (so only structural checks can reject it)."""
    body = blob[:-DIGEST_SIZE]
    return body + xxhash.xxh3_128_digest(body)


def patch_header(blob: bytes, **fields: int | bytes) -> bytes:
    """Rewrite fixed-header fields of a blob by name and reseal it."""
    names = [
        "magic",
        "format_version",
        "flags",
        "version",
        "base_version",
        "section_len",
        "raw_len",
        "record_count",
        "shard_len",
        "writer_len",
        "reserved",
    ]
    values = dict(zip(names, HEADER.unpack_from(blob), strict=True))
    values.update(fields)
    return reseal(HEADER.pack(*(values[n] for n in names)) + blob[HEADER.size :])


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
    **header: int | bytes,
) -> bytes:
    """A blob around raw record bytes, with a correct digest; ``header`` overrides fields and
    ``tail`` is appended to the (compressed) record section."""
    body = zstandard.ZstdCompressor(level=1).compress(records) if compress else records
    body += tail
    fields = dict(
        magic=MAGIC,
        format_version=FORMAT_VERSION,
        flags=FLAG_ZSTD if compress else 0,
        version=version,
        base_version=base_version,
        section_len=len(body),
        raw_len=len(records),
        record_count=count,
        shard_len=len(shard),
        writer_len=len(writer),
        reserved=0,
    )
    fields.update(header)
    head = HEADER.pack(*fields.values())
    blob = head + shard.encode() + writer.encode() + body
    return blob + xxhash.xxh3_128_digest(blob)
