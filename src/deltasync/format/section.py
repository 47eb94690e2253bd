"""The record section as a stream: written through zstd (or raw) and read back in chunks.

The record code sees a byte sink and a byte source that it feeds and drains in bounded chunks
(planes.CHUNK bytes). Behind them, sections up to ONE_SHOT_MAX are compressed in one zstd call
(smaller and faster), and sections up to READ_ONE_SHOT_MAX decompressed in one call; larger ones
stream, so the uncompressed section is never held whole and no second shard-sized buffer
exists. Both give a
single standard zstd frame. (Fresh buffers are not free here: first-touch page faults measured
~1-2 ms per MiB on this machine, more than zstd level 1 spends compressing that MiB.)

The reader insists on a single zstd frame that declares its content size, that this size equals
the header's ``raw_len`` (already checked against ``max_decompressed_bytes``), that the frame ends
exactly where the section does, and that it yields exactly ``raw_len`` bytes; every read is
checked against the bytes that remain before it happens.

This module knows bytes and zstd only: no records, no tensors.
"""

from __future__ import annotations

import numpy as np
import zstandard

from deltasync.errors import FormatError, TruncatedBlobError

MIN_LEVEL = 0  # 0 = store the record section raw (no zstd); flags bit 0 clear
MAX_LEVEL = 22
# Sections up to this size are compressed and decompressed in one call: one-shot zstd came out
# ~1% smaller than streaming the same bytes and decompresses ~2x faster (measured on a 1% BF16
# delta), and the whole-section copy is small. Larger sections (anchors) stream in chunks, so no
# second shard-sized buffer exists.
ONE_SHOT_MAX = 32 << 20
# The reader decompresses larger sections as a stream: a receiver reads a version's sections
# twice (verify, then the scatter) and holds one per blob at a time, so a one-shot buffer is
# memory the pull holds next to the shard. A publisher's batched segments (about 2^20 changed
# elements, 3-4 MiB) stay one-shot, which decoded ~1.5x faster than streaming here; a single
# large group (a 0.6B model's embedding shard: ~13 MiB) and anchors stream.
READ_ONE_SHOT_MAX = 4 << 20
_SKIP_CHUNK = 1 << 20  # scratch bytes when skipping through a streamed section


class SectionWriter:
    """Collects the record section: bytes-like pieces in, compressed (or raw) chunks out.

    ``raw_len`` is pledged up front: zstd writes it into the frame header and refuses a
    different total. A single-threaded compressor makes the output a deterministic function of
    the input and the zstd version (measured: identical to one-shot ``compress``)."""

    def __init__(self, raw_len: int, level: int) -> None:
        self.raw_len, self.written, self.chunks = raw_len, 0, []
        self._compressor = self._stream = self._gathered = None
        if level:
            self._compressor = zstandard.ZstdCompressor(
                level=level, write_content_size=True, write_checksum=False, write_dict_id=False
            )
            if raw_len <= ONE_SHOT_MAX:
                self._gathered = np.empty(raw_len, dtype=np.uint8)  # not zero-filled
            else:
                self._stream = self._compressor.compressobj(size=raw_len)

    def write(self, piece: bytes | memoryview) -> None:
        """Append ``piece``; the caller may reuse its buffer afterwards."""
        start, self.written = self.written, self.written + len(piece)
        if self._gathered is not None:
            self._gathered[start : self.written] = np.frombuffer(piece, dtype=np.uint8)
        elif self._stream is not None:
            out = self._stream.compress(piece)
            if out:
                self.chunks.append(out)
        else:
            self.chunks.append(bytes(piece))

    def finish(self) -> list[bytes]:
        assert self.written == self.raw_len, (self.written, self.raw_len)  # planned size is exact
        if self._gathered is not None:
            return [self._compressor.compress(self._gathered)]
        if self._stream is not None:
            self.chunks.append(self._stream.flush())
        return self.chunks


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


class SectionReader:
    """Reads exactly ``raw_len`` bytes of a record section, front to back."""

    def __init__(self, section: memoryview, raw_len: int, compressed: bool, where: str) -> None:
        self.left, self.where = raw_len, where
        self._raw, self._pos, self._zstd = section, 0, None
        if not compressed:
            if len(section) != raw_len:
                raise FormatError(
                    f"{where}: uncompressed record section is {len(section)} bytes, header "
                    f"says {raw_len}"
                )
            return
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
                f"{where}: {len(section) - used} bytes follow the zstd frame inside the record "
                "section"
            )
        if raw_len > READ_ONE_SHOT_MAX:
            self._zstd = zstandard.ZstdDecompressor().stream_reader(
                section, read_across_frames=False, closefd=False
            )
            return
        try:
            raw = zstandard.ZstdDecompressor().decompress(section)
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

    def skip(self, n: int, what: str) -> None:
        """Pass over the next ``n`` bytes (a one-shot section moves its position; a stream is
        decompressed through a bounded scratch buffer)."""
        self.check(n, what)
        if self._zstd is None:
            self._pos += n
            self.left -= n
            return
        scratch = memoryview(bytearray(min(n, _SKIP_CHUNK)))
        while n:
            step = min(n, len(scratch))
            self.read_into(scratch[:step], what)
            n -= step

    def read(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), what)
        return bytes(buf)

    def read_into(self, buf: memoryview, what: str) -> None:
        """Fill ``buf`` (a writable byte view) with the next ``len(buf)`` bytes."""
        n = len(buf)
        self.check(n, what)
        if self._zstd is None:
            buf[:] = self._raw[self._pos : self._pos + n]
            self._pos += n
        else:
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

    def finish(self) -> None:
        """Check that the section holds nothing after the last byte read."""
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
