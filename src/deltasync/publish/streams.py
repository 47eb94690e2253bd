"""ShardStreams: one blob per receiver shard, uploaded while its segments are still produced.

The publisher hands over each group's routed updates (``add``); every shard that got records
gets one more segment in its blob (:class:`deltasync.format.BlobWriter`), whose bytes go
straight into that blob's upload (``Store.put_stream``: a temp file renamed into place on
POSIX, a multipart upload on S3) on an upload thread. A blob's upload starts with its first
segment, so uploads run while the caller goes on detecting; ``finish`` closes every blob and
waits for the stores. An abort (an error anywhere) ends every upload with an exception, which
makes each store discard its partial object: nothing half-written ever lands under a blob key,
and nothing is visible to receivers before the manifest anyway.

Memory: encoded segments wait in a queue per blob until its upload thread takes them. When
every blob has an upload thread of its own the queue is bounded (``queued``, the publisher
passes ``QUEUED_SEGMENTS``): when a slow link lets it fill, ``add`` waits for the upload
(backpressure) instead of holding the blob in memory, and an upload that fails meanwhile is
raised there. With fewer upload threads than shards the queues are unbounded (a waiting
shard's whole blob is held). The routed tensors of a group are dropped once encoded.

This module knows blobs, keys and stores; it knows nothing about trackers or layouts.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deltasync import names
from deltasync.commit import BlobEntry
from deltasync.commit.model import blob_hasher
from deltasync.errors import StreamAborted
from deltasync.format import BlobWriter, TensorUpdate
from deltasync.format.updates import PartedUpdate
from deltasync.interrupts import interrupts_deferred
from deltasync.native.loader import HeapRelease
from deltasync.store import Store

_END = object()  # the blob is complete
_ABORT = object()  # the blob must not be stored
# Per blob: encoded segments waiting for their upload thread. One is double buffering (one
# uploading, one waiting): on a 1 Gbit/s link a deeper queue held the 0.6B's two 9 MiB
# embedding frames and the next layers' segments at once (~4 MiB more at the trainer's peak).
QUEUED_SEGMENTS = 1
FLUSH_BYTES = 1 << 20  # an open segment's frame bytes handed to the upload at a time
_WAIT_S = 0.05  # how often a waiting add checks that its upload is still alive
RELEASE_EVERY_BYTES = 4 << 20  # uploaded between two releases of the heap's free pages


@dataclass
class _Stream:
    key: str
    pending: list[bytes]  # the writer's sink: bytes of the segment being written
    # segments (and an open segment's pieces), waiting for the upload; None for a held blob
    chunks: queue.Queue | None
    upload: Future | None  # None: held in memory, stored whole by finish()
    writer: BlobWriter = field(init=False)
    pending_bytes: int = 0
    elements: int = 0
    # The manifest's digest of the blob (BLAKE2b-256), over exactly the bytes uploaded.
    hasher: Any = field(default_factory=blob_hasher)
    held: list[bytes] = field(default_factory=list)  # a held blob's bytes (no upload)


def _drain(chunks: queue.Queue) -> Iterator[bytes]:
    # Written segments' pages go back to the system every few MiB uploaded, not after the
    # next segments' buffers: on a slow link the queue holds the largest ones longest.
    release = HeapRelease(RELEASE_EVERY_BYTES)
    while True:
        item = chunks.get()
        if item is _END:
            return
        if item is _ABORT:
            raise StreamAborted("publish aborted; the partial blob is discarded")
        size = sum(len(part) for part in item)
        yield from item  # one segment's pieces, as the writer produced them
        del item
        release.count(size)


class ShardStreams:
    """Streamed blobs of one (version, writer); ``add`` per group, then ``finish`` or ``abort``."""

    def __init__(
        self,
        store: Store,
        pool: ThreadPoolExecutor | None,
        *,
        version: int,
        base_version: int,
        writer: str,
        level: int,
        queued: int = 0,
    ) -> None:
        """``queued``: segments each blob may hold waiting for its upload before ``add``
        waits (0: unbounded). Bound it only when every blob has an upload thread of its own:
        a blob whose upload waits for a thread would make ``add`` wait forever.

        ``pool`` None: every blob is held in memory and stored whole by ``finish`` on the
        caller's thread (a small delta, whose few hundred KiB cost less to hold than the
        hand-overs to upload threads that compete with the trainer for the cores)."""
        self.store, self._pool = store, pool
        self._queued = queued
        self._head = dict(version=version, base_version=base_version, writer=writer, level=level)
        self._streams: dict[str, _Stream] = {}
        self._held_stored: list[str] = []  # held blobs finish() stored whole
        self.encode_s = 0.0  # time spent encoding segments and handing them over

    def _open(self, shard: str) -> _Stream:
        key = names.blob_key(self._head["version"], shard, self._head["writer"])
        if self._pool is None:
            stream = self._streams[shard] = _Stream(key, [], None, None)
        else:
            chunks: queue.Queue = queue.Queue(maxsize=self._queued)
            with interrupts_deferred():  # an upload started is one abort() ends
                upload = self._pool.submit(self.store.put_stream, key, _drain(chunks))
                stream = self._streams[shard] = _Stream(key, [], chunks, upload)
        # Segments are open (wire FLAG_OPEN_SEGMENTS): a large one's frame comes to the sink
        # as zstd produces it and goes to the upload every FLUSH_BYTES, so not even the
        # compressed embedding shard (~9 MiB at 0.6B) is held whole.
        stream.writer = BlobWriter(
            lambda data: self._take(stream, data), shard=shard, open_segments=True, **self._head
        )
        return stream

    def _take(self, stream: _Stream, data: bytes) -> None:
        stream.pending.append(data)
        stream.pending_bytes += len(data)
        if stream.pending_bytes >= FLUSH_BYTES:
            self._flush(stream)

    @staticmethod
    def _put(stream: _Stream, item: object) -> None:
        """Queue ``item`` for the upload, waiting while the queue is full (backpressure); an
        upload that ended meanwhile (it failed: before _END nothing else ends it) raises."""
        if stream.upload is None:
            if item is not _END:
                stream.held.extend(item)  # type: ignore[call-overload]
            return
        while True:
            try:
                stream.chunks.put(item, timeout=_WAIT_S)
                return
            except queue.Full:
                if stream.upload.done():
                    raise stream.upload.exception() or RuntimeError(
                        f"upload of {stream.key} ended"
                    ) from None

    @classmethod
    def _flush(cls, stream: _Stream) -> None:
        # One queue item per segment, or per FLUSH_BYTES of an open one (with the header
        # before the first, the trailer after the last): the upload sees the bytes as soon
        # as a segment or a piece of its frame exists; S3's put_stream
        # gathers them into parts. The writer's pieces are handed over as they are, not
        # joined: a join would hold the segment twice (the embedding's: ~10 MiB more).
        if stream.pending:
            parts = tuple(stream.pending)
            for part in parts:
                stream.hasher.update(part)
            stream.pending.clear()
            stream.pending_bytes = 0
            cls._put(stream, parts)

    def add(self, updates: Mapping[str, Sequence[TensorUpdate | PartedUpdate]]) -> None:
        """One segment in each shard's blob that has updates here (in ``updates``' order)."""
        t = time.perf_counter()
        for shard, ups in updates.items():
            if not ups:
                continue
            stream = self._streams.get(shard) or self._open(shard)
            if (
                stream.upload is not None and stream.upload.done()
            ):  # before _END only a failed upload is done: fail fast
                raise stream.upload.exception() or RuntimeError(f"upload of {stream.key} ended")
            stream.writer.segment(ups)
            self._flush(stream)
            stream.elements += sum(u.nnz for u in ups)
        self.encode_s += time.perf_counter() - t

    def finish(self) -> tuple[list[BlobEntry], dict[str, int], dict[str, int]]:
        """Close every blob and wait for its upload: ``(entries, shard_bytes, shard_elements)``.
        An upload's error is raised after every upload has ended."""
        t = time.perf_counter()
        for stream in self._streams.values():
            stream.writer.finish()
            self._flush(stream)
            self._put(stream, _END)
        self.encode_s += time.perf_counter() - t
        for stream in self._streams.values():
            if stream.upload is None:
                self.store.put(stream.key, b"".join(stream.held))
                self._held_stored.append(stream.key)
                stream.held.clear()
        errors = [s.upload.exception() for s in self._streams.values() if s.upload is not None]
        for exc in errors:
            if exc is not None:
                raise exc
        entries = []
        for shard, s in sorted(self._streams.items()):
            entries.append(
                BlobEntry(
                    shard=shard,
                    writer=self._head["writer"],
                    key=s.key,
                    size=s.writer.size,
                    digest=s.hasher.hexdigest(),
                    elements=s.elements,
                )
            )
        return (
            entries,
            {shard: s.writer.size for shard, s in self._streams.items()},
            {shard: s.elements for shard, s in self._streams.items()},
        )

    def abort(self) -> None:
        """End every upload without storing it; waits for the upload threads."""
        for shard in [k for k, s in self._streams.items() if s.upload is None]:
            self._streams.pop(shard).held.clear()  # never stored
        for stream in self._streams.values():
            # Drop what is still queued (it must not be stored anyway), so that _ABORT fits.
            while not stream.upload.done():
                try:
                    stream.chunks.put(_ABORT, timeout=_WAIT_S)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):
                        stream.chunks.get_nowait()
        for stream in self._streams.values():
            stream.upload.exception()  # StreamAborted (or the store's own error): expected

    def stored_keys(self) -> list[str]:
        """The keys of the blobs stored whole so far; after :meth:`abort`, those whose upload
        had ended before it (a failed attempt's: the publisher deletes them)."""
        uploaded = [
            s.key
            for s in self._streams.values()
            if s.upload is not None and s.upload.done() and s.upload.exception() is None
        ]
        return self._held_stored + uploaded
