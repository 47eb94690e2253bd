"""The record section's bytes: gap and plane coding, through zstd (or raw), in bounded chunks.

The record code sees a byte sink and a byte source that it feeds and drains in bounded chunks
(CHUNK bytes). Behind them, sections up to ONE_SHOT_MAX are compressed in one zstd call
from a gathered copy, and sections up to READ_ONE_SHOT_MAX decompressed in one call; larger ones
stream, so the uncompressed section is never held whole and no second shard-sized buffer
exists. Both give a
single standard zstd frame. (Fresh buffers are not free here: first-touch page faults measured
~1-2 ms per MiB on this machine, more than zstd level 1 spends compressing that MiB.)

The reader insists on a single zstd frame that declares its content size, that this size equals
the header's ``raw_len`` (already checked against ``max_decompressed_bytes``), that the frame ends
exactly where the section does, and that it yields exactly ``raw_len`` bytes; every read is
checked against the bytes that remain before it happens.

Inside the section, gap coding and byte planes (numpy, vectorized per chunk): strictly
increasing indices i0 < i1 < ... become ``first = i0`` and the gaps ``i[k] - i[k-1]`` (all >= 1),
stored in the narrowest unsigned width w that holds the largest; n elements of w bytes are
written as w planes of n bytes, plane k holding byte k (little-endian order) of every element.
High bytes of gaps and the sign/exponent byte of BF16 values repeat a lot; planes put the
repeats next to each other, where zstd finds them (measured on a 1% BF16 delta: 13% smaller
than interleaved bytes, 2.4x smaller than int32 indices + values). Planes are moved CHUNK
elements at a time through one small reusable buffer, so neither side ever holds a second
full-size copy of a tensor's bytes; the loops run over planes and chunks, never over elements.
The one exception is the decoder's C path (:func:`read_words`): it holds the planes below the
last one (``width - 1`` bytes a word: a quarter of an int32 index array of 2-byte gaps, half of
a BF16 value array) while the last plane streams in, so that each word is written once.

This module knows numpy arrays, bytes and zstd (and the C kernel that joins planes) only: no
records, no tensors, no error messages about tensors (callers validate and name the tensor).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import numpy as np
import zstandard

from deltasync.errors import FormatError, TruncatedBlobError
from deltasync.native.ops import can_join_planes, join_planes

MIN_LEVEL = 0  # 0 = store the record section raw (no zstd); flags bit 0 clear
MAX_LEVEL = 22
# Sections up to this size are compressed in one call from a gathered copy (one call is
# cheaper than many for small sections, and the copy is small). Larger ones (the 0.6B's
# embedding pieces, anchors) stream through a pledged-size compressor, so neither a second
# copy of the raw section nor, for a parted record, the raw section itself ever exists: the
# trainer holds the compressed frame only (a 13-18 MiB embedding piece: 9 MiB). A streamed
# frame's bytes do not depend on how the input is cut (they may differ from one-shot's).
ONE_SHOT_MAX = 4 << 20
# The reader decompresses larger sections as a stream: a receiver reads a version's sections
# twice (verify, then the scatter) and holds one per blob at a time, so a one-shot buffer is
# memory the pull holds next to the shard. A publisher's batched segments (about 2^20 changed
# elements, 3-4 MiB) stay one-shot, which decoded ~1.5x faster than streaming here; a single
# large group (a 0.6B model's embedding shard: ~13 MiB) and anchors stream.
READ_ONE_SHOT_MAX = 4 << 20
BLOCK_MAX = 128 << 10  # the zstd format's largest block: what one block can regenerate
_SKIP_CHUNK = 1 << 20  # scratch bytes when skipping through a streamed section

# One-shot zstd calls reuse a context per thread and level: a fresh ZstdCompressor costs ~25 us
# and a fresh ZstdDecompressor ~17 us here, against ~1-2 us for the call on a small section
# (a version has one section per record: hundreds at 0.6B, on both sides). A reused context
# writes the same frame: each one-shot call starts a new frame from the same parameters.
# Streams keep a context of their own (their state lives across calls, and a thread may
# interleave several: a verify pass reads every writer's blob in lockstep).
_CONTEXTS = threading.local()


def _one_shot_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_CONTEXTS, "compressors", None)
    if cache is None:
        cache = _CONTEXTS.compressors = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = _new_compressor(level)
    return c


def _new_compressor(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(
        level=level, write_content_size=True, write_checksum=False, write_dict_id=False
    )


def _one_shot_decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_CONTEXTS, "decompressor", None)
    if d is None:
        d = _CONTEXTS.decompressor = zstandard.ZstdDecompressor()
    return d


class SectionWriter:
    """Collects the record section: bytes-like pieces in, compressed (or raw) chunks out.

    ``raw_len`` is pledged up front: zstd writes it into the frame header and refuses a
    different total. A single-threaded compressor makes the output a deterministic function of
    the input and the zstd version: a streamed frame's bytes do not depend on how the writes
    cut the input (they may differ from one-shot ``compress`` of the same bytes, which is why
    the size alone chooses the path). A streamed frame (:attr:`streams`) goes to ``sink`` as
    zstd produces it when one is given, instead of being collected for :meth:`finish`."""

    def __init__(
        self, raw_len: int, level: int, sink: Callable[[bytes], None] | None = None
    ) -> None:
        self.raw_len, self.written, self.chunks = raw_len, 0, []
        self._level, self._stream, self._gathered = level, None, None
        self._out: Callable[[bytes], None] = self.chunks.append
        if level:
            if raw_len <= ONE_SHOT_MAX:
                self._gathered = np.empty(raw_len, dtype=np.uint8)  # not zero-filled
            else:
                self._stream = _new_compressor(level).compressobj(size=raw_len)
                if sink is not None:
                    self._out = sink

    @property
    def streams(self) -> bool:
        """Whether the section is a streamed zstd frame (what a ``sink`` receives)."""
        return self._stream is not None

    def write(self, piece: bytes | memoryview) -> None:
        """Append ``piece``; the caller may reuse its buffer afterwards."""
        start, self.written = self.written, self.written + len(piece)
        if self._gathered is not None:
            self._gathered[start : self.written] = np.frombuffer(piece, dtype=np.uint8)
        elif self._stream is not None:
            out = self._stream.compress(piece)
            if out:
                self._out(out)
        else:
            self.chunks.append(bytes(piece))

    def finish(self) -> list[bytes]:
        """The section's chunks not yet handed to the sink (all of them without one)."""
        assert self.written == self.raw_len, (self.written, self.raw_len)  # planned size is exact
        if self._gathered is not None:
            return [_one_shot_compressor(self._level).compress(self._gathered)]
        if self._stream is not None:
            self._out(self._stream.flush())
        return self.chunks


# The most bytes a zstd frame header takes (magic, descriptor, window, dict id, content size).
_FRAME_HEADER_MAX = 18


class FileSpan:
    """``length`` bytes of an open file from ``start``: a blob a receiver spilled to a private
    file, or a section of one. Read by ``os.pread``, never mapped (the touched pages of a
    mapping count in the process's RSS, which is what the spill saves). Slicing gives a span
    (nothing is read); ``bytes(span)`` reads it; :meth:`read` reads it front to back from
    its own position (what zstd's ``stream_reader`` takes as a source).

    The file object, not its number, is held: read after the file was closed, a span raises
    (ValueError) instead of reading whatever file reused the number."""

    def __init__(self, file, start: int = 0, length: int | None = None) -> None:
        self.file, self.start = file, start
        self.length = os.fstat(file.fileno()).st_size - start if length is None else length
        self._pos = 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | slice) -> FileSpan | int:
        if isinstance(key, slice):
            a, b, step = key.indices(self.length)
            assert step == 1, key  # sections are read front to back
            return FileSpan(self.file, self.start + a, max(b - a, 0))
        if not 0 <= key < self.length:
            raise IndexError(key)
        return self.pread(key, 1)[0]

    def __bytes__(self) -> bytes:
        return self.pread(0, self.length)

    def pread(self, at: int, n: int) -> bytes:
        """``n`` bytes from ``at`` (relative to the span); the file holds them: it was written
        whole and checked before any span of it was read."""
        fd = self.file.fileno()  # ValueError once closed
        parts, got = [], 0
        while got < n:
            part = os.pread(fd, n - got, self.start + at + got)
            if not part:
                raise TruncatedBlobError(
                    f"the spilled blob file ends {n - got} bytes early at offset "
                    f"{self.start + at + got}: it changed after it was checked; pull again"
                )
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def pread_into(self, buf: memoryview, at: int) -> None:
        """Fill ``buf`` (a writable byte view) with the span's bytes from ``at``, read
        straight into it (no bytes object of that size beside it)."""
        fd = self.file.fileno()  # ValueError once closed
        got, n = 0, len(buf)
        while got < n:
            step = os.preadv(fd, [buf[got:]], self.start + at + got)
            if not step:
                raise TruncatedBlobError(
                    f"the spilled blob file ends {n - got} bytes early at offset "
                    f"{self.start + at + got}: it changed after it was checked; pull again"
                )
            got += step

    def read(self, n: int = -1) -> bytes:
        """The next ``n`` bytes of the span (all that remain when ``n`` < 0), fewer at its end."""
        left = self.length - self._pos
        n = left if n < 0 else min(n, left)
        data = self.pread(self._pos, n) if n else b""
        self._pos += n
        return data


def frame_size(section: memoryview | FileSpan, where: str) -> int:
    """Bytes taken by the zstd frame that starts ``section``, found by walking its block headers
    (one step per 128 KiB block, not per byte)."""
    return frame_extent(section, where)[0]


def frame_extent(section: memoryview | FileSpan, where: str) -> tuple[int, int]:
    """(bytes taken by the zstd frame that starts ``section``, the most content its blocks can
    regenerate). A raw or RLE block regenerates the size its header states, a compressed one
    at most ``BLOCK_MAX`` bytes (the format's block limit): a frame's declared content size
    above that bound is a lie, refused before anything is allocated for it."""
    n = len(section)
    try:
        pos = zstandard.frame_header_size(bytes(section[:_FRAME_HEADER_MAX]))
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: the record section is not a zstd frame ({e})") from None
    if pos > n:
        raise TruncatedBlobError(f"{where}: the zstd frame header runs past the record section")
    has_checksum = section[4] & 0x04
    most = 0
    while True:
        if pos + 3 > n:
            raise TruncatedBlobError(f"{where}: the zstd frame ends before its last block")
        block = int.from_bytes(bytes(section[pos : pos + 3]), "little")
        pos += 3
        block_type = (block >> 1) & 0x3
        if block_type == 3:
            raise FormatError(f"{where}: the zstd frame holds a reserved block type")
        if block_type == 2:  # compressed: the header states the compressed size
            pos += block >> 3
            most += BLOCK_MAX
        else:  # raw, or RLE (one byte stored): the header states the regenerated size
            pos += 1 if block_type == 1 else block >> 3
            most += block >> 3
        if block & 0x1:
            break
    if has_checksum:
        pos += 4
    if pos > n:
        raise TruncatedBlobError(f"{where}: the zstd frame runs past the record section")
    return pos, most


class SectionReader:
    """Reads exactly ``raw_len`` bytes of a record section, front to back.

    A section in a file (:class:`FileSpan`) is checked as one in memory; a streamed one is
    decompressed from the file as it is read, and an uncompressed one is read from the file
    as it is read too (never whole: at level 0 one section can hold a whole anchor); a
    one-shot one (at most READ_ONE_SHOT_MAX) is read into memory and decompressed whole.
    With ``stream`` a compressed section streams whatever its size: a verify reads a spilled
    chain in lockstep, one section per blob at a time, and held whole a catch-up's deltas
    held one decompressed section each (up to READ_ONE_SHOT_MAX) together, where a stream
    holds its window (512 KiB at the publisher's level) and the record being decoded."""

    def __init__(
        self,
        section: memoryview | FileSpan,
        raw_len: int,
        compressed: bool,
        where: str,
        *,
        stream: bool = False,
    ) -> None:
        self.left, self.where = raw_len, where
        self._raw, self._pos, self._zstd = section, 0, None
        self._raw_len, self._section = raw_len, section
        # the second cursor (see :meth:`read_at_into`) and the lazy words waiting to be read
        self._second, self._second_at = None, 0
        self._pending: LazyPlanes | None = None
        if not compressed:
            if len(section) != raw_len:
                raise FormatError(
                    f"{where}: uncompressed record section is {len(section)} bytes, header "
                    f"says {raw_len}"
                )
            return
        try:
            declared = zstandard.frame_content_size(bytes(section[:_FRAME_HEADER_MAX]))
        except zstandard.ZstdError as e:
            raise FormatError(f"{where}: the record section is not a zstd frame ({e})") from None
        if declared != raw_len:
            raise FormatError(
                f"{where}: the zstd frame declares {declared} content bytes but the header says "
                f"{raw_len} (-1 means undeclared, which this format forbids)"
            )
        used, most = frame_extent(section, where)
        if used != len(section):
            raise FormatError(
                f"{where}: {len(section) - used} bytes follow the zstd frame inside the record "
                "section"
            )
        if raw_len > most:
            raise TruncatedBlobError(
                f"{where}: the zstd frame declares {raw_len} content bytes but its blocks can "
                f"hold at most {most}; the blob is malformed although its digest matched: do "
                "not apply it; re-publish this version from a fixed writer"
            )
        if raw_len > READ_ONE_SHOT_MAX or stream:
            self._zstd = zstandard.ZstdDecompressor().stream_reader(
                section, read_across_frames=False, closefd=False
            )
            return
        if isinstance(section, FileSpan):
            section = memoryview(bytes(section))  # its frame is checked: at most its blocks
        try:
            raw = _one_shot_decompressor().decompress(section)
        except zstandard.ZstdError as e:
            raise FormatError(f"{where}: the record section does not decompress ({e})") from None
        if len(raw) != raw_len:  # zstd checks this too; a wrong size must never reach the parser
            raise FormatError(f"{where}: decompressed {len(raw)} bytes, header says {raw_len}")
        self._raw = memoryview(raw)

    def check(self, n: int, what: str) -> None:
        """Raise unless ``n`` more bytes remain; call before allocating anything for them."""
        if n > self.left:
            raise TruncatedBlobError(
                f"{self.where}: {what} declares {n} bytes but only {self.left} remain in the "
                "record section; the blob is malformed although its digest matched: do not "
                "apply it; re-publish this version from a fixed writer"
            )

    @property
    def offset(self) -> int:
        """Bytes of the section read so far (the position of the next byte)."""
        return self._raw_len - self.left

    def skip(self, n: int, what: str) -> None:
        """Pass over the next ``n`` bytes (a one-shot section moves its position; a stream is
        decompressed through a bounded scratch buffer)."""
        self._settle()
        self._skip(n, what)

    def _skip(self, n: int, what: str) -> None:
        self.check(n, what)
        if self._zstd is None:
            self._pos += n
            self.left -= n
            self._release_if_read()
            return
        scratch = memoryview(bytearray(min(n, _SKIP_CHUNK)))
        while n:
            step = min(n, len(scratch))
            self._read_into(scratch[:step], what)
            n -= step

    def _release_if_read(self) -> None:
        """Drop a held section once its last byte is read: a chain read in lockstep keeps
        each stream's reader until that stream's next record is asked for, and a section
        decompressed whole (up to READ_ONE_SHOT_MAX) would stay beside the record decoded
        from it (a catch-up's deltas: one such section per version, held together while
        the tensor they end with is gathered). Records decoded from it own their arrays
        (the C decode and the checked path copy out); a caller still holding a
        :meth:`held` view keeps the bytes alive through it."""
        if not self.left and self._raw is not self._section:
            self._raw = memoryview(b"")

    def held(self, n: int) -> np.ndarray | None:
        """The next ``n`` bytes as a read-only uint8 view, without moving past them, when the
        section is held whole (decompressed in one call, or raw in memory); None for a streamed
        one or one read from its file.
        The caller has checked that ``n`` bytes remain."""
        if self._zstd is not None or isinstance(self._raw, FileSpan):
            return None
        return np.frombuffer(self._raw, dtype=np.uint8, count=n, offset=self._pos)

    def _raw_into(self, buf: memoryview, at: int) -> None:
        """Fill ``buf`` with bytes ``[at, at + len(buf))`` of a section held uncompressed:
        copied from memory, or read from its file straight into ``buf`` (an uncompressed
        section in a file is never read whole, nor a record's plane beside its tensor)."""
        if isinstance(self._raw, FileSpan):
            self._raw.pread_into(buf, at)
        else:
            buf[:] = self._raw[at : at + len(buf)]

    def read(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), what)
        return bytes(buf)

    def read_into(self, buf: memoryview, what: str) -> None:
        """Fill ``buf`` (a writable byte view) with the next ``len(buf)`` bytes."""
        self._settle()
        self._read_into(buf, what)

    def _read_into(self, buf: memoryview, what: str) -> None:
        n = len(buf)
        self.check(n, what)
        if self._zstd is None:
            self._raw_into(buf, self._pos)
            self._pos += n
            self.left -= n
            self._release_if_read()
            return
        got = 0
        try:
            while got < n:
                step = self._zstd.readinto(buf[got:])
                if step == 0:
                    raise TruncatedBlobError(
                        f"{self.where}: the zstd frame ends inside {what}; do not apply it"
                    )
                got += step
        except zstandard.ZstdError as e:
            raise FormatError(f"{self.where}: {what} does not decompress ({e})") from None
        self.left -= n

    def lazy_words(self, n: int, what: str) -> LazyPlanes:
        """The next ``n`` 2-byte words (two byte planes: ``n`` low bytes, then ``n`` high ones),
        read only when asked (:class:`LazyPlanes`); the reader moves past them before its
        next read. The caller has checked that ``2 * n`` bytes remain."""
        self._settle()
        self._pending = LazyPlanes(self, n, what)
        return self._pending

    def read_at_into(self, buf: memoryview, at: int, what: str) -> None:
        """Fill ``buf`` with the section's bytes ``[at, at + len(buf))`` through a second
        cursor, which only moves forward (``at`` at or past where its last read ended): a
        held section is sliced, a streamed one decompressed a second time by a stream of
        its own over the same immutable bytes (a copy of a :class:`FileSpan`, for its own
        read position), so the section is decompressed about twice in all, not once per
        read. The primary cursor proves the bytes: this one never runs past what it checked
        would be there (``at + len(buf) <= raw_len``)."""
        n = len(buf)
        assert self._second_at <= at and at + n <= self._raw_len, (self._second_at, at, n)
        if self._zstd is None:
            self._raw_into(buf, at)
            self._second_at = at + n
            return
        if self._second is None:
            section = self._section
            source = section[0 : len(section)] if isinstance(section, FileSpan) else section
            self._second = zstandard.ZstdDecompressor().stream_reader(
                source, read_across_frames=False, closefd=False
            )
        scratch = None
        try:
            while self._second_at < at:  # forward to ``at``, through a bounded scratch buffer
                if scratch is None:
                    scratch = memoryview(bytearray(min(at - self._second_at, _SKIP_CHUNK)))
                step = min(at - self._second_at, len(scratch))
                self._second_at += self._fill(scratch[:step], what)
            self._second_at += self._fill(buf, what)
        except zstandard.ZstdError as e:
            raise FormatError(f"{self.where}: {what} does not decompress ({e})") from None

    def _fill(self, buf: memoryview, what: str) -> int:
        got = 0
        while got < len(buf):
            step = self._second.readinto(buf[got:])  # type: ignore[union-attr]
            if step == 0:
                raise TruncatedBlobError(
                    f"{self.where}: the zstd frame ends inside {what}; do not apply it"
                )
            got += step
        return got

    def _settle(self) -> None:
        """Move past the lazy words nobody finished reading, before the next read: they can
        no longer be read (:class:`LazyPlanes` raises)."""
        lazy, self._pending = self._pending, None
        if lazy is not None:
            self._skip(lazy.unread(), lazy.what)

    def finish(self) -> None:
        """Check that the section holds nothing after the last byte read."""
        self._settle()
        if self.left:
            raise FormatError(
                f"{self.where}: {self.left} bytes follow the last record; the blob is malformed "
                "although its digest matched: do not apply it"
            )
        if self._zstd is not None:
            try:
                extra = self._zstd.read(1)  # also lets zstd run its end-of-frame checks
            except zstandard.ZstdError as e:
                raise FormatError(f"{self.where}: the zstd frame is corrupt ({e})") from None
            if extra:
                raise FormatError(f"{self.where}: the zstd frame holds more than the header says")


class LazyPlanes:
    """``n`` 2-byte words of a section (BF16/FP16 values: ``n`` low bytes, then ``n`` high
    ones), read when asked, in element order, without holding a plane: the section's own
    (primary) cursor reads the low plane chunk by chunk while a second cursor
    (:meth:`SectionReader.read_at_into`) reads the same chunk of the high plane; then the
    primary moves past the high plane. Memory: a chunk of words and its two planes.

    Readable once, and only while its reader has not moved on: a read after the reader read
    anything else (the next record), or after a first read, raises (FormatError) instead of
    returning other bytes."""

    def __init__(self, reader: SectionReader, n: int, what: str) -> None:
        self.n, self.what = n, what
        self._reader: SectionReader | None = reader
        self._at = reader.offset  # the low plane's first byte
        self._low = 0  # low-plane bytes the primary cursor has read

    def unread(self) -> int:
        """Section bytes of these words the primary cursor has not read yet."""
        return 2 * self.n - self._low

    def _take(self) -> SectionReader:
        reader, self._reader = self._reader, None  # one read only
        if reader is None or reader._pending is not self:
            raise FormatError(
                f"{self.what}: read after its record section moved on (a lazily read record "
                "is readable once, before the next record is read); read it in its turn"
            )
        return reader

    def chunks(self, m: int) -> Iterator[np.ndarray]:
        """The words in order, ``m`` at a time (the last chunk shorter), as int16 arrays
        that are reused: each is valid until the next one is asked for."""
        reader, n = self._take(), self.n
        low = np.empty(min(n, m), dtype=np.uint8)
        high = np.empty(min(n, m), dtype=np.uint8)
        words = np.empty(min(n, m), dtype="<i2")
        join = can_join_planes(words, 2)
        for a in range(0, n, m):
            k = min(m, n - a)
            if reader._pending is not self:
                raise FormatError(f"{self.what}: read after its record section moved on")
            reader._read_into(memoryview(low[:k]), self.what)
            self._low += k
            reader.read_at_into(memoryview(high[:k]), self._at + n + a, self.what)
            out = words[:k]
            if join:
                join_planes(out, 2, low[:k], high[:k], 0)
            else:
                bits = out.view(np.uint16)
                np.left_shift(high[:k], 8, out=bits, dtype=np.uint16)
                np.bitwise_or(bits, low[:k], out=bits)
            yield out
        if reader._pending is self:
            reader._settle()  # past the high plane: the section's next bytes

    def read(self) -> np.ndarray:
        """All the words, as a new int16 array (no plane held beside it)."""
        out = np.empty(self.n, dtype="<i2")
        for a, words in zip(range(0, self.n, CHUNK), self.chunks(CHUNK), strict=True):
            out[a : a + words.size] = words
        return out


CHUNK = 1 << 18  # elements per plane chunk: 256 KiB of plane bytes, stays in L2

Sink = Callable[[memoryview], None]  # takes the next bytes of the section (may not keep them)
Source = Callable[[memoryview, str], None]  # fills a buffer with the next bytes of the section


def gap_width(max_gap: int) -> int:
    """Bytes per gap: the narrowest of 1, 2, 4, 8 that holds ``max_gap``."""
    if max_gap <= 0xFF:
        return 1
    if max_gap <= 0xFFFF:
        return 2
    if max_gap <= 0xFFFFFFFF:
        return 4
    return 8


def _gaps_into(indices: np.ndarray, a: int, b: int, out: np.ndarray) -> np.ndarray:
    """Gaps a..b-1 (gap j = indices[j+1] - indices[j]) as int64, written into ``out``."""
    return np.subtract(indices[a + 1 : b + 1], indices[a:b], out=out[: b - a])


def gap_range(indices: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) gap of a 1-D int64 array with at least 2 elements, chunk by chunk."""
    n = indices.size - 1
    buf = np.empty(min(n, CHUNK), dtype=np.int64)
    low, high = None, None
    for a in range(0, n, CHUNK):
        gaps = _gaps_into(indices, a, min(a + CHUNK, n), buf)
        lo, hi = int(gaps.min()), int(gaps.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return low, high  # type: ignore[return-value]


def write_value_planes(sink: Sink, values: np.ndarray) -> None:
    """The byte planes of a contiguous 1-D array, in plane order."""
    n, w = values.size, values.dtype.itemsize
    as_bytes = values.view(np.uint8).reshape(n, w)
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(w):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            np.copyto(buf[:m], as_bytes[a : a + m, k])
            sink(memoryview(buf[:m]))


def write_gap_planes(sink: Sink, indices: np.ndarray, width: int) -> None:
    """The ``width`` byte planes of the gaps of ``indices`` (recomputed per plane: a subtract
    over a cached chunk costs less than holding a full gap array)."""
    n = indices.size - 1
    gaps = np.empty(min(n, CHUNK), dtype=np.int64)
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(width):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            chunk = _gaps_into(indices, a, a + m, gaps)
            np.copyto(buf[:m], chunk.view(np.uint8).reshape(m, 8)[:, k])
            sink(memoryview(buf[:m]))


def read_planes_into(source: Source, columns: np.ndarray, what: str) -> None:
    """Fill a (n, w) uint8 view, plane k into column k, from the next ``n * w`` section bytes.

    ``columns`` is usually the byte view of the output array itself (for int64 indices: its low
    w bytes), so the planes land in place without a staging copy of the tensor."""
    n, w = columns.shape
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(w):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            source(memoryview(buf[:m]), what)
            columns[a : a + m, k] = buf[:m]


def read_words(source: Source, out: np.ndarray, width: int, what: str) -> None:
    """Fill the contiguous 1-D integer array ``out`` from the next ``out.size * width``
    section bytes: ``width`` byte planes, low byte first; the bytes from ``width`` up are zero.

    In the C kernel (:func:`deltasync.native.ops.join_planes`) the planes below the last are
    read whole (``width - 1`` bytes a word, held while the last is read) and the last one
    chunk by chunk, each chunk's words written once and whole; else a zeroed array and one
    strided pass per plane (:func:`read_planes_into`)."""
    n = out.size
    size = out.dtype.itemsize
    assert 1 <= width <= size, (width, size)
    if n == 0:
        return
    if not can_join_planes(out, width):
        if width < size:
            out.fill(0)  # the bytes above ``width`` must read as 0
        read_planes_into(source, out.view(np.uint8).reshape(n, size)[:, :width], what)
        return
    lower = None
    if width > 1:
        lower = np.empty((width - 1) * n, dtype=np.uint8)
        source(memoryview(lower), what)
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for a in range(0, n, CHUNK):
        m = min(CHUNK, n - a)
        source(memoryview(buf[:m]), what)
        join_planes(out, width, lower, buf[:m], a)


def read_words_in_place(source: Source, out: np.ndarray, what: str) -> None:
    """Fill the contiguous 1-D 2-byte integer array ``out`` (n words) from the next ``2 * n``
    section bytes (its low plane, then its high one) without a plane-sized scratch: the low
    plane is read into the upper half of ``out``'s own bytes (``[n, 2n)``), then the words
    are joined front to back a chunk at a time, each chunk's low bytes copied out first.
    Words ``[a, b)`` take bytes ``[2a, 2b)``, and ``2b <= n + b`` for ``b <= n``: a write
    never reaches a low byte not yet copied. Memory: three chunks (:func:`read_words` holds
    the n-byte low plane). For a decode into a live tensor that is written anyway; a failed
    read leaves ``out`` half written."""
    n = out.size
    assert out.dtype.itemsize == 2 and out.flags.c_contiguous and out.flags.writeable, out.dtype
    if n == 0:
        return
    planes = out.view(np.uint8)
    source(memoryview(planes[n:]), what)
    low = np.empty(min(n, CHUNK), dtype=np.uint8)
    high = np.empty(min(n, CHUNK), dtype=np.uint8)
    join = can_join_planes(out, 2)
    for a in range(0, n, CHUNK):
        m = min(CHUNK, n - a)
        low[:m] = planes[n + a : n + a + m]  # before words [a, a + m) overwrite it
        source(memoryview(high[:m]), what)
        if join:
            join_planes(out[a : a + m], 2, low[:m], high[:m], 0)
        else:
            bits = out[a : a + m].view(np.uint16)
            np.left_shift(high[:m], 8, out=bits, dtype=np.uint16)
            np.bitwise_or(bits, low[:m], out=bits)


def read_gaps_as_indices(
    source: Source, first: int, n: int, width: int, what: str, dtype: type = np.int64
) -> np.ndarray:
    """``dtype`` (int64, or int32 when ``width`` <= 4) array: ``first``, then the n-1 gaps (NOT
    yet summed: the caller validates the gaps, then sums them in place with :func:`sum_gaps`)."""
    out = np.empty(n, dtype=dtype)
    out[0] = first
    read_words(source, out[1:], width, what)
    return out


def sum_gaps(indices: np.ndarray) -> np.ndarray:
    """In place: turn ``first, gap, gap, ...`` into the running sums (int64 or int32; overflow
    is the caller's to rule out)."""
    # the accumulator is the array's own dtype: no int64 temporary for int32 indices
    return np.cumsum(indices, dtype=indices.dtype, out=indices)
