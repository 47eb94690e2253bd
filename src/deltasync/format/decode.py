"""decode_blob: bytes -> DecodedBlob, validating everything before returning anything.

Order of checks, each before the work it protects:
1. size >= the fixed minimum, then the xxh3-128 digest over every byte before it (a failed
   digest is reported as truncation when the blob does not end with an intact trailer, or the
   trailer declares more bytes than arrived);
2. magic, format version, flags, versions, shard and writer ids; the trailer: its magic and
   the total size it declares;
3. the header against what the caller expects (version, base_version, shard);
4. the trailer's totals (decompressed bytes against ``max_decompressed_bytes``, records
   against MAX_RECORDS) before any segment is read; then per segment its header against what
   remains of the body and of the totals, and one exact zstd frame (section.py), streamed in
   chunks straight into the output arrays; at the end, the segments add up to the totals;
5. every record (reader.py): lengths, dtype codes, shapes, index order and range, duplicate
   names (across segments), and names/shapes/dtypes against ``expected``.

This module knows the blob header and its digest; it does not know how updates are applied.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
import xxhash

from deltasync.errors import (
    BlobBaseMismatchError,
    BlobLimitError,
    BlobMismatchError,
    ConfigError,
    DigestMismatchError,
    FormatError,
    TruncatedBlobError,
)
from deltasync.format import section
from deltasync.format.reader import iter_records
from deltasync.format.section import FileSpan
from deltasync.format.updates import BlobHeader, DecodedBlob, LazyDense, TensorSpec, TensorUpdate
from deltasync.format.wire import (
    DIGEST_SIZE,
    END_MAGIC,
    FLAG_OPEN_SEGMENTS,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    KNOWN_FLAGS,
    MAGIC,
    MAX_RECORDS,
    MIN_BLOB_SIZE,
    OPEN_LEN,
    RECORD,
    SEGMENT,
    TRAILER,
    blob_size,
)

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,127}$")  # same rule as names.check_token
# Dense records from this many value bytes up are read lazily by a verify pass
# (:meth:`BlobRecords.lazily`): smaller ones cost less held whole than a second decompression
# cursor; an anchor's embedding (tens of MiB) is hashed a chunk at a time.
LAZY_MIN = 4 << 20
REFETCH = "fetch it again"  # the advice of a blob check; a caller that knows better drops it


def restated(exc: FormatError, where: str, remedy: str) -> FormatError:
    """A blob check's error again, of its own type, said at ``where`` with the caller's
    ``remedy`` in place of the advice to fetch it again (which that caller knows is wrong)."""
    return type(exc)(f"{where}: {str(exc).removesuffix(f': {REFETCH}')}{remedy}")


def _bytes_view(blob: bytes | bytearray | memoryview) -> memoryview:
    """The blob's bytes as one flat view, never copied: a strided view (``memoryview(b)[::2]``,
    a numpy slice) is refused, since neither the digest nor the reads can take it whole."""
    try:
        view = memoryview(blob)
    except TypeError:
        raise ConfigError(
            f"blob must be bytes, a bytearray or a memoryview, got {type(blob).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ConfigError(
            f"blob is a non-contiguous view (strides {view.strides}): pass contiguous bytes "
            "(e.g. bytes(view)); nothing was decoded"
        )
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _trailer(view: memoryview | FileSpan) -> tuple[bytes, int, int, int, int]:
    """(end magic, segment_count, record_count, raw_len, body_len) of the (unverified) trailer."""
    at = len(view) - DIGEST_SIZE - TRAILER.size
    return TRAILER.unpack(bytes(view[at : at + TRAILER.size]))


def _declared_size(view: memoryview) -> int | None:
    """Total size the (unverified) header and trailer declare, or None if they are not intact
    (a blob cut short has lost its trailer)."""
    magic, *_, shard_len, writer_len, _ = HEADER.unpack_from(view)
    end_magic, *_, body_len = _trailer(view)
    if magic != MAGIC or end_magic != END_MAGIC:
        return None
    return blob_size(shard_len, writer_len, body_len)


def _check_digest(view: memoryview) -> None:
    n = len(view)
    if n < MIN_BLOB_SIZE:
        raise TruncatedBlobError(
            f"blob is {n} bytes, shorter than the {MIN_BLOB_SIZE}-byte minimum (header, ids, "
            f"trailer and digest); it was cut short: {REFETCH}"
        )
    if xxhash.xxh3_128_digest(view[: n - DIGEST_SIZE]) == view[n - DIGEST_SIZE :]:
        return
    declared = _declared_size(view)
    if declared is None:
        raise TruncatedBlobError(
            f"blob of {n} bytes does not end with its trailer and digest; it was cut short (or "
            f"bytes were appended in transit): {REFETCH}"
        )
    if declared > n:
        raise TruncatedBlobError(
            f"blob is {n} bytes but its trailer declares {declared}; it was cut short: {REFETCH}"
        )
    if declared < n:
        raise FormatError(
            f"blob is {n} bytes but its trailer declares {declared}: {n - declared} extra bytes "
            f"were appended (concatenated or padded in transit): {REFETCH}"
        )
    raise DigestMismatchError(
        f"blob digest (xxh3-128 over its first {n - DIGEST_SIZE} bytes) does not match: the blob "
        f"was corrupted in transit or storage: {REFETCH}"
    )


def _read_header(view: memoryview | FileSpan) -> tuple[BlobHeader, int, int]:
    """Header fields after the digest matched: (header, flags, offset of the first segment)."""
    fields = HEADER.unpack(bytes(view[: HEADER.size]))
    magic, fmt, flags, version, base, shard_len, writer_len, reserved = fields
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
    if flags & FLAG_OPEN_SEGMENTS and not flags & FLAG_ZSTD:
        raise FormatError(
            f"blob header flags {flags:#06x} open segments without compressing them (only a "
            "zstd frame can end a segment); the writer produced an inconsistent header"
        )
    if HEADER.size + shard_len + writer_len + TRAILER.size + DIGEST_SIZE > len(view):
        raise FormatError(
            f"blob header declares ids of {shard_len} + {writer_len} bytes, more than the "
            f"{len(view)}-byte blob holds; the writer produced an inconsistent header"
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
    return header, flags, at


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


class BlobRecords:
    """A blob whose digest, header and trailer are verified, read record by record.

    ``blob`` is its bytes, or a :class:`~deltasync.format.section.FileSpan` of a private
    file this process wrote the blob into and checked its digest as it wrote it (a
    receiver's spill of a large blob, ``receiver.staging.spill_blob``): its digest is not
    computed again (check 1 is its size alone), checks 2-4 run as for bytes, and the records are read from the file.

    Construction runs checks 1-4 of the module docstring up to the first segment; each
    iteration decodes the records afresh, segment by segment (checks 4-5 as it goes, the
    totals at the end), so a caller can hold one record at a time instead of the whole blob.
    A record yielded before the iteration ends is not yet proven to come from a well-formed
    blob: whoever writes anything must first iterate to the end once (the bytes are immutable,
    so a second iteration yields the same records). ``names()`` walks the record headers only.
    With ``narrow_indices`` a tensor of at most 2^31 elements gets int32 indices.
    """

    def __init__(
        self,
        blob: bytes | bytearray | memoryview | FileSpan,
        *,
        expected: Mapping[str, TensorSpec] | None = None,
        version: int | None = None,
        base_version: int | None = None,
        shard: str | None = None,
        max_decompressed_bytes: int = 1 << 36,
        narrow_indices: bool = False,
    ) -> None:
        if not isinstance(max_decompressed_bytes, int) or max_decompressed_bytes < 0:
            raise ConfigError(
                f"max_decompressed_bytes must be an int >= 0, got {max_decompressed_bytes!r}"
            )
        if isinstance(blob, FileSpan):
            # Not hashed again: the process that spilled it hashed every byte as it wrote
            # them, against the manifest's digest and against its own (the trailer's), and
            # the file is private (unlinked, this process's fd alone), so what is read here
            # is what was checked.
            view: memoryview | FileSpan = blob
            if len(view) < MIN_BLOB_SIZE:
                raise TruncatedBlobError(
                    f"blob is {len(view)} bytes, shorter than the {MIN_BLOB_SIZE}-byte minimum "
                    f"(header, ids, trailer and digest); it was cut short: {REFETCH}"
                )
        else:
            view = _bytes_view(blob)
            _check_digest(view)
        header, flags, at = _read_header(view)
        _check_wanted(header, version, base_version, shard)
        where = f"blob {header.shard}/{header.writer} v{header.version}"
        end_magic, segments, count, raw_len, body_len = _trailer(view)
        if end_magic != END_MAGIC:
            raise FormatError(
                f"{where}: trailer magic is {bytes(end_magic)!r}, expected {END_MAGIC!r}"
            )
        end = len(view) - DIGEST_SIZE - TRAILER.size
        if at + body_len != end:
            raise FormatError(
                f"{where}: trailer declares {body_len} bytes of segments, the blob holds "
                f"{end - at}; the writer produced an inconsistent trailer: do not apply it"
            )
        if raw_len > max_decompressed_bytes:
            raise BlobLimitError(
                f"{where}: segments declare {raw_len} decompressed bytes, above "
                f"max_decompressed_bytes={max_decompressed_bytes}; raise the limit if the blob "
                "is trusted, else drop it"
            )
        if count > MAX_RECORDS:
            raise BlobLimitError(
                f"{where}: {count} records exceed the limit of {MAX_RECORDS} per blob; split "
                "the shard's updates over several writers"
            )
        if count * RECORD.size > raw_len or segments > count or (count and not segments):
            raise TruncatedBlobError(
                f"{where}: {count} records in {segments} segments cannot fit in {raw_len} "
                "decompressed bytes; the writer produced an inconsistent trailer: do not apply it"
            )
        self.header = header
        self.record_count = count
        self.raw_len = raw_len  # decompressed bytes of all segments (bounded above)
        self._view, self._flags, self._start, self._end = view, flags, at, end
        self._segments, self._expected, self._where = segments, expected, where
        self._narrow = narrow_indices

    def __iter__(self) -> Iterator[TensorUpdate]:
        return self._records(headers_only=False)

    def writing_into(self, targets: Mapping[str, torch.Tensor]) -> DecodedInto:
        """These records, read with each dense one decoded straight into its tensor of
        ``targets`` where it can be (see :func:`deltasync.format.reader.iter_records`): the
        write pass of a caller that has read them all once already (the first read proves
        them; the bytes are immutable, so the second is the same records)."""
        return DecodedInto(self, targets)

    @property
    def in_file(self) -> bool:
        """Whether the records are read from a file (a receiver's spill of a large blob)."""
        return isinstance(self._view, FileSpan)

    def lazily(self, min_bytes: int = LAZY_MIN) -> ReadLazily:
        """These records, with each dense BF16/FP16 one of at least ``min_bytes`` value bytes
        as a :class:`~deltasync.format.updates.LazyDense` (see
        :func:`deltasync.format.reader.iter_records`): for a verify pass that hashes a large
        record chunk by chunk instead of holding it whole. Every check runs as in a plain
        read: a lazy record's bytes are still decompressed and counted, and the end-of-blob
        checks still run when the iteration ends. Every compressed section is streamed (its
        window held, not the section: a chain read in lockstep holds one section per blob);
        a sparse BF16/FP16 record's payload up to ``reader.PAYLOAD_MAX`` is read out whole
        for the C decode."""
        return ReadLazily(self, min_bytes)

    def names(self) -> list[str]:
        """The tensor names in record order, from the record headers alone (payloads are
        decompressed but not decoded; they are checked when the records are iterated)."""
        return [name for name, _ in self._records(headers_only=True)]

    def _records(
        self,
        *,
        headers_only: bool,
        into: Mapping[str, torch.Tensor] | None = None,
        lazy_min: int | None = None,
    ) -> Iterator:
        view, end, where = self._view, self._end, self._where
        at = self._start
        seen: set[str] = set()
        left_raw, left_count = self.raw_len, self.record_count
        for k in range(self._segments):
            seg = f"{where} segment {k}"
            if at + SEGMENT.size > end:
                raise TruncatedBlobError(f"{seg}: its header runs past the segments' end")
            section_len, seg_raw, seg_count = SEGMENT.unpack(bytes(view[at : at + SEGMENT.size]))
            at += SEGMENT.size
            if section_len == OPEN_LEN and self._flags & FLAG_OPEN_SEGMENTS:
                section_len = section.frame_size(view[at:end], seg)  # the frame ends it
            if section_len > end - at or seg_raw > left_raw or seg_count > left_count:
                raise TruncatedBlobError(
                    f"{seg} declares {section_len} bytes, {seg_raw} decompressed bytes and "
                    f"{seg_count} records; only {end - at}, {left_raw} and {left_count} remain: "
                    "the blob is malformed although its digest matched: do not apply it"
                )
            if not seg_count or seg_count * RECORD.size > seg_raw:
                raise FormatError(
                    f"{seg}: {seg_count} records cannot fill {seg_raw} decompressed bytes (a "
                    "segment holds at least one record); do not apply it"
                )
            body = section.SectionReader(
                view[at : at + section_len],
                seg_raw,
                bool(self._flags & FLAG_ZSTD),
                seg,
                stream=lazy_min is not None,  # a verify's lockstep read: see lazily()
            )
            yield from iter_records(
                body,
                seg_count,
                self._expected,
                seen=seen,
                headers_only=headers_only,
                narrow=self._narrow,
                into=into,
                lazy_min=lazy_min,
            )
            del body  # one segment's decompressed section at a time
            at += section_len
            left_raw -= seg_raw
            left_count -= seg_count
        if at != end or left_raw or left_count:
            raise FormatError(
                f"{where}: the segments end at byte {at} with {left_raw} decompressed bytes and "
                f"{left_count} records unaccounted for; the trailer says they end at {end}: do "
                "not apply it"
            )


class DecodedInto:
    """A :class:`BlobRecords` read with its dense records decoded into ``targets``: a
    record stream (:class:`deltasync.format.merge.RecordStream`) of the same records."""

    def __init__(self, records: BlobRecords, targets: Mapping[str, torch.Tensor]) -> None:
        self.records, self.targets = records, targets

    def __iter__(self) -> Iterator[TensorUpdate]:
        return self.records._records(headers_only=False, into=self.targets)

    def names(self) -> list[str]:
        return self.records.names()


class ReadLazily:
    """A :class:`BlobRecords` read with its large dense records as
    :class:`~deltasync.format.updates.LazyDense`: a record stream
    (:class:`deltasync.format.merge.RecordStream`) of the same records."""

    def __init__(self, records: BlobRecords, min_bytes: int) -> None:
        self.records, self.min_bytes = records, min_bytes

    def __iter__(self) -> Iterator[TensorUpdate | LazyDense]:
        return self.records._records(headers_only=False, lazy_min=self.min_bytes)

    def names(self) -> list[str]:
        return self.records.names()


def decode_blob(
    blob: bytes | bytearray | memoryview,
    *,
    expected: Mapping[str, TensorSpec] | None = None,
    version: int | None = None,
    base_version: int | None = None,
    shard: str | None = None,
    max_decompressed_bytes: int = 1 << 36,
) -> DecodedBlob:
    """Verify and decode a blob written by :class:`BlobWriter` / :func:`encode_blob`.

    Raises a FormatError subclass (TruncatedBlobError, DigestMismatchError, BlobLimitError,
    BlobMismatchError, ...) on any problem; returns only fully validated updates.

    Memory: the decoded arrays (values at their own size, indices widened to int64: at most ~4x
    the section bytes that hold them, and the section is <= ``max_decompressed_bytes``) plus
    one segment's decompressed section at a time (up to 32 MiB) or, above that, chunk buffers of
    a few hundred KiB: a large section is streamed, never held whole. :class:`BlobRecords`
    reads the same blob one record at a time."""
    records = BlobRecords(
        blob,
        expected=expected,
        version=version,
        base_version=base_version,
        shard=shard,
        max_decompressed_bytes=max_decompressed_bytes,
    )
    return DecodedBlob(header=records.header, updates=list(records))
