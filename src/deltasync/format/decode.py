"""decode_blob: bytes -> DecodedBlob, validating everything before returning anything.

Order of checks, each before the work it protects:
1. size >= the fixed minimum, then the xxh3-128 digest over every byte before it (a failed
   digest is reported as truncation when the intact header declares more bytes than arrived);
2. magic, format version, flags, declared total size, versions, shard and writer ids;
3. the header against what the caller expects (version, base_version, shard);
4. the declared decompressed size against ``max_decompressed_bytes``, then one exact zstd frame
   (section.py), streamed in chunks straight into the output arrays;
5. every record (reader.py): lengths, dtype codes, shapes, index order and range, duplicate
   names, and names/shapes/dtypes against ``expected``.

This module knows the blob header and its digest; it does not know how updates are applied.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import xxhash

from deltasync.errors import (
    BlobMismatchError,
    ConfigError,
    DigestMismatchError,
    FormatError,
    TruncatedBlobError,
)
from deltasync.format import section
from deltasync.format.errors import BlobBaseMismatchError, BlobLimitError
from deltasync.format.layout import (
    DIGEST_SIZE,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    KNOWN_FLAGS,
    MAGIC,
    MAX_RECORDS,
    MIN_BLOB_SIZE,
    RECORD,
    blob_size,
)
from deltasync.format.reader import parse_records
from deltasync.format.records import BlobHeader, DecodedBlob, TensorSpec

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,127}$")  # same rule as names.check_token
_REFETCH = "fetch it again"


def _bytes_view(blob: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(blob)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _declared_size(view: memoryview) -> int | None:
    """Total size the (unverified) fixed header declares, or None if it is not a header."""
    magic, *_, section_len, _raw, _count, shard_len, writer_len, _ = HEADER.unpack_from(view)
    if magic != MAGIC:
        return None
    return blob_size(shard_len, writer_len, section_len)


def _check_digest(view: memoryview) -> None:
    n = len(view)
    if n < MIN_BLOB_SIZE:
        raise TruncatedBlobError(
            f"blob is {n} bytes, shorter than the {MIN_BLOB_SIZE}-byte minimum (header and "
            f"digest); it was cut short: {_REFETCH}"
        )
    if xxhash.xxh3_128_digest(view[: n - DIGEST_SIZE]) == view[n - DIGEST_SIZE :]:
        return
    declared = _declared_size(view)
    if declared is not None and declared > n:
        raise TruncatedBlobError(
            f"blob is {n} bytes but its header declares {declared}; it was cut short: {_REFETCH}"
        )
    if declared is not None and declared < n:
        raise FormatError(
            f"blob is {n} bytes but its header declares {declared}: {n - declared} extra bytes "
            f"were appended (concatenated or padded in transit): {_REFETCH}"
        )
    raise DigestMismatchError(
        f"blob digest (xxh3-128 over its first {n - DIGEST_SIZE} bytes) does not match: the blob "
        f"was corrupted in transit or storage: {_REFETCH}"
    )


def _read_header(view: memoryview) -> tuple[BlobHeader, int, int, int, int, int]:
    """Header fields after the digest matched: (header, flags, offset, section_len, raw_len,
    record_count)."""
    (
        magic,
        fmt,
        flags,
        version,
        base,
        section_len,
        raw_len,
        count,
        shard_len,
        writer_len,
        reserved,
    ) = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(f"not a deltasync blob: magic is {bytes(magic)!r}, expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise FormatError(
            f"blob has format version {fmt}; this deltasync reads version {FORMAT_VERSION}: "
            "upgrade the receiver (newer format) or re-publish with a matching writer"
        )
    if flags & ~KNOWN_FLAGS or reserved:
        raise FormatError(
            f"blob header has unknown flags {flags:#06x} or reserved {reserved}: it was written "
            "by an incompatible writer; upgrade the receiver"
        )
    declared = blob_size(shard_len, writer_len, section_len)
    if declared != len(view):
        cls = TruncatedBlobError if declared > len(view) else FormatError
        raise cls(
            f"blob is {len(view)} bytes but its header declares {declared} (record section "
            f"{section_len} bytes); the writer produced an inconsistent header: do not apply it"
        )
    ids = []
    at = HEADER.size
    for field, length in (("shard", shard_len), ("writer", writer_len)):
        try:
            value = bytes(view[at : at + length]).decode("utf-8")
        except UnicodeDecodeError:
            value = ""
        if not _ID.match(value) or ".." in value:
            raise FormatError(f"blob header: {field} id {value!r} is not a valid id")
        ids.append(value)
        at += length
    where = f"blob {ids[0]}/{ids[1]} v{version}"
    if version < 0 or not -1 <= base < version:
        raise FormatError(
            f"{where}: base version {base} must be -1 (anchor) or below version {version}, "
            "and version must be >= 0; the writer produced an invalid header: do not apply it"
        )
    header = BlobHeader(FORMAT_VERSION, version, base, ids[0], ids[1])
    return header, flags, at, section_len, raw_len, count


def _check_wanted(
    header: BlobHeader, version: int | None, base_version: int | None, shard: str | None
) -> None:
    where = f"blob {header.shard}/{header.writer} v{header.version}"
    if shard is not None and header.shard != shard:
        raise BlobMismatchError(
            f"{where} is for shard {header.shard!r}, this receiver is {shard!r}: fetch the blob "
            "under this receiver's shard id"
        )
    if version is not None and header.version != version:
        raise BlobMismatchError(
            f"{where} brings version {header.version}, expected version {version}: fetch the "
            f"blob of version {version}"
        )
    if base_version is not None and header.base_version != base_version:
        raise BlobBaseMismatchError(
            f"{where} applies on base version {header.base_version}, this receiver holds "
            f"{base_version}: replay the versions in between or restore the newest anchor"
        )


def decode_blob(
    blob: bytes | bytearray | memoryview,
    *,
    expected: Mapping[str, TensorSpec] | None = None,
    version: int | None = None,
    base_version: int | None = None,
    shard: str | None = None,
    max_decompressed_bytes: int = 1 << 36,
) -> DecodedBlob:
    """Verify and decode a blob written by :func:`encode_blob`.

    Raises a FormatError subclass (TruncatedBlobError, DigestMismatchError, BlobLimitError,
    BlobMismatchError, ...) on any problem; returns only fully validated updates.

    Memory: the decoded arrays (values at their own size, indices widened to int64: at most ~4x
    the section bytes that hold them, and the section is <= ``max_decompressed_bytes``) plus
    either the decompressed section (up to 32 MiB) or, above that, chunk buffers of a few
    hundred KiB: a large section is streamed, never held whole."""
    if not isinstance(max_decompressed_bytes, int) or max_decompressed_bytes < 0:
        raise ConfigError(
            f"max_decompressed_bytes must be an int >= 0, got {max_decompressed_bytes!r}"
        )
    view = _bytes_view(blob)
    _check_digest(view)
    header, flags, at, section_len, raw_len, count = _read_header(view)
    _check_wanted(header, version, base_version, shard)
    where = f"blob {header.shard}/{header.writer} v{header.version}"
    if raw_len > max_decompressed_bytes:
        raise BlobLimitError(
            f"{where}: record section declares {raw_len} bytes, above max_decompressed_bytes="
            f"{max_decompressed_bytes}; raise the limit if the blob is trusted, else drop it"
        )
    if count > MAX_RECORDS:
        raise BlobLimitError(
            f"{where}: {count} records exceed the limit of {MAX_RECORDS} per blob; split the "
            "shard's updates over several writers"
        )
    if count * RECORD.size > raw_len:
        raise TruncatedBlobError(
            f"{where}: {count} records cannot fit in a {raw_len}-byte record section; the writer "
            "produced an inconsistent header: do not apply it"
        )
    body = section.SectionReader(
        view[at : at + section_len], raw_len, bool(flags & FLAG_ZSTD), where
    )
    updates = parse_records(body, count, expected)
    return DecodedBlob(header=header, updates=updates)
