"""BlobWriter / encode_blob: TensorUpdates -> one self-checking blob (header, segments of zstd
records, trailer, xxh3-128 digest).

:class:`BlobWriter` streams: the header goes out first, then each :meth:`BlobWriter.segment`
call turns a batch of updates into one segment as soon as the caller has them (a publisher
hands over each group of tensors while detection of the next is still running), and
:meth:`BlobWriter.finish` writes the totals and the digest. Per segment, two steps: a pure plan
per record (validation, encoding, gap width, exact byte size), then one pass that writes the
planned records through zstd. Records keep the order of the given updates and segments the
order of the calls, so equal inputs give equal bytes. A :class:`PartedUpdate` (a record too
large to hold whole: the embedding's row pieces) is planned from its summary and written part
by part, plane by plane, through the segment's compressor (one pass over its parts per byte
plane of its gaps, one for its values), so above the one-shot size its raw section never
exists; it gives exactly the bytes of the TensorUpdate with the same indices and values. :func:`encode_blob` is the one-segment
case. :func:`encode_blobs` encodes one blob per receiver shard on a few threads: the
expensive parts (numpy gap planes, zstd) release the GIL, and each blob is exactly what
:func:`encode_blob` returns for it, yielded in shard order as soon as it and those before it
are done, so the caller can upload while the rest encode.

A sparse update is gap-coded in the narrowest width that fits its largest gap; an update that
names every element is written dense (no indices), which is never larger. The choice "sparse
would be larger than dense" for updates that do not name every element belongs to whoever holds
the full tensor (see :func:`deltasync.format.build.sparse_update`); the encoder cannot invent
missing values. The encoder refuses to write an invalid record (unsorted, duplicate or
out-of-range indices, bad ids, bad versions): a blob it produces always passes decode_blob.

This module knows the byte layout, the TensorUpdate record and threads; it knows nothing about
receivers, layouts or storage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash

from deltasync.errors import InvalidUpdateError, ManifestError
from deltasync.format import section
from deltasync.format.updates import BITS_DTYPES, DTYPE_CODES, PartedUpdate, TensorUpdate
from deltasync.format.wire import (
    ENCODING_DENSE,
    ENCODING_SPARSE,
    END_MAGIC,
    FLAG_OPEN_SEGMENTS,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    MAX_ID_BYTES,
    MAX_RECORDS,
    OPEN_LEN,
    RECORD,
    SEGMENT,
    TRAILER,
    shape_struct,
)
from deltasync.names import check_token


@dataclass(frozen=True, eq=False)
class _RecordPlan:
    head: bytes  # record header + name + shape
    indices: np.ndarray | None  # int64, sparse records with nnz >= 2 only (gaps are written)
    width: int  # bytes per gap
    values: np.ndarray  # raw bit patterns, contiguous 1-D

    @property
    def size(self) -> int:
        gaps = 0 if self.indices is None else (self.indices.size - 1) * self.width
        return len(self.head) + gaps + self.values.nbytes


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _plan(update: TensorUpdate) -> _RecordPlan:
    what = f"tensor {update.name!r}"
    name = update.name.encode("utf-8")
    dims = shape_struct(len(update.shape)).pack(*update.shape)
    code, ndim = DTYPE_CODES[update.dtype], len(update.shape)
    values = _host(update.values).view(BITS_DTYPES[update.dtype]).numpy()

    indices = None if update.indices is None else _host(update.indices).numpy()
    if indices is not None and indices.size:
        first, last = int(indices[0]), int(indices[-1])
        if first < 0 or last >= update.numel:
            raise InvalidUpdateError(
                f"{what}: indices span [{first}, {last}] but the tensor has {update.numel} "
                "elements; indices are flat row-major positions in [0, numel)"
            )
        low, high = section.gap_range(indices) if indices.size > 1 else (1, 0)
        if low < 1:
            at = int(np.argmax(np.diff(indices) < 1))
            raise InvalidUpdateError(
                f"{what}: indices are not strictly increasing at position {at + 1} "
                f"({int(indices[at])} then {int(indices[at + 1])}); sort them and drop duplicates"
            )
    if indices is None or indices.size == update.numel:
        # Every element named: strictly increasing in-range indices of length numel can only be
        # 0..numel-1, so the values are already in row-major order and dense is smaller.
        head = RECORD.pack(len(name), code, ENCODING_DENSE, ndim, 0, 0, update.numel, 0)
        return _RecordPlan(head + name + dims, None, 0, values)
    if indices.size == 0:
        head = RECORD.pack(len(name), code, ENCODING_SPARSE, ndim, 1, 0, 0, 0)
        return _RecordPlan(head + name + dims, None, 1, values)
    width = section.gap_width(high)
    head = RECORD.pack(len(name), code, ENCODING_SPARSE, ndim, width, 0, indices.size, first)
    return _RecordPlan(head + name + dims, indices if indices.size > 1 else None, width, values)


@dataclass(frozen=True, eq=False)
class _PartedPlan:
    head: bytes  # record header + name + shape
    update: PartedUpdate
    width: int  # bytes per gap; 0: dense (the update names every element)

    @property
    def size(self) -> int:
        n = self.update.nnz
        gaps = (n - 1) * self.width if n >= 2 else 0
        return len(self.head) + gaps + n * self.update.dtype.itemsize


def _plan_parted(update: PartedUpdate) -> _PartedPlan:
    """The record of a parted update: the same header :func:`_plan` writes for the
    TensorUpdate holding the same indices and values (its count, first index and the narrowest
    gap width come from the update's summary; the parts are checked against it as they are
    written)."""
    name = update.name.encode("utf-8")
    dims = shape_struct(len(update.shape)).pack(*update.shape)
    code, ndim, n = DTYPE_CODES[update.dtype], len(update.shape), update.nnz
    if n == update.numel:  # every element named: dense, as _plan writes it
        head = RECORD.pack(len(name), code, ENCODING_DENSE, ndim, 0, 0, n, 0)
        return _PartedPlan(head + name + dims, update, 0)
    width = section.gap_width(update.max_gap)
    head = RECORD.pack(len(name), code, ENCODING_SPARSE, ndim, width, 0, n, update.first)
    return _PartedPlan(head + name + dims, update, width)


def _parted_parts(
    plan: _PartedPlan, *, values: bool, seen: Any
) -> Iterator[tuple[np.ndarray, torch.Tensor | None, np.ndarray]]:
    """``plan``'s parts as ``(int64 indices, values or None, the gaps they close)``, each part
    checked against the summary the header was planned from, its indices fed to the hasher
    ``seen`` (the caller compares the passes: the callables must give the same indices each
    time). Without ``values`` the update's ``indices`` callable is used where it has one. The
    gaps are those between the part's first index and the previous part's last, then between
    its own neighbours (gap ``g`` sits between indices ``g`` and ``g + 1``); they live in a
    buffer the next part reuses."""
    u = plan.update
    what = f"tensor {u.name!r}"
    n = u.nnz
    done, prev, high = 0, -1, 0
    gaps = np.empty(0, dtype=np.int64)
    from_parts = values or u.indices is None
    parts: Iterable = u.parts() if from_parts else ((idx, None) for idx in u.indices())
    for idx, vals in parts:
        if (
            not isinstance(idx, torch.Tensor)
            or idx.dtype != torch.int64
            or idx.dim() != 1
            or (
                from_parts
                and (
                    not isinstance(vals, torch.Tensor)
                    or vals.dtype != u.dtype
                    or vals.shape != idx.shape
                )
            )
        ):
            raise InvalidUpdateError(
                f"{what}: a part must be 1-D int64 indices with one {u.dtype} value each"
            )
        m = idx.numel()
        if not m:
            continue
        if done + m > n:
            raise InvalidUpdateError(f"{what}: the parts hold more than the {n} indices planned")
        a = _host(idx).numpy()
        seen.update(a)
        if done == 0 and int(a[0]) != u.first:
            raise InvalidUpdateError(
                f"{what}: the parts start at index {int(a[0])}, the update says {u.first}"
            )
        k = m if done else m - 1
        if gaps.size < k:
            gaps = np.empty(max(k, 2 * gaps.size), dtype=np.int64)
        g = gaps[:k]
        if k:
            if done:
                g[0] = a[0] - prev
                np.subtract(a[1:], a[:-1], out=g[1:])
            else:
                np.subtract(a[1:], a[:-1], out=g)
            if int(g.min()) < 1:
                raise InvalidUpdateError(
                    f"{what}: indices are not strictly increasing near position {done}; sort "
                    "them and drop duplicates"
                )
            high = max(high, int(g.max()))
        yield a, vals, g
        prev = int(a[-1])
        done += m
    if done != n or prev >= u.numel or high != u.max_gap:
        raise InvalidUpdateError(
            f"{what}: the parts hold {done} indices up to {prev} with a largest gap of {high}; "
            f"the update says {n} indices (the tensor has {u.numel} elements) and {u.max_gap}"
        )


def _write_parted(sink: Sink, plan: _PartedPlan) -> None:
    """Write ``plan``'s gap and value planes into ``sink`` in record order, part by part: one
    pass over the parts per gap plane (the positions are decoded again, cheaper than holding
    them), then one pass for the values, whose first byte plane goes out as it comes and whose
    other planes wait in one byte per element each. Nothing of the update is held whole but
    those planes (for BF16: one byte per element)."""
    u, w = plan.update, plan.width
    n, isz = u.nnz, u.dtype.itemsize
    passes = set()  # the digest of the indices each pass saw
    for plane in range(w if n >= 2 else 0):
        seen = xxhash.xxh3_64()
        for _, _, g in _parted_parts(plan, values=False, seen=seen):
            if g.size:
                sink(memoryview(np.ascontiguousarray(g.view(np.uint8).reshape(-1, 8)[:, plane])))
        passes.add(seen.intdigest())
    later = np.empty((isz - 1, n), dtype=np.uint8)
    done = 0
    seen = xxhash.xxh3_64()
    for a, vals, _ in _parted_parts(plan, values=True, seen=seen):
        assert vals is not None
        m = a.size
        v = _host(vals).view(BITS_DTYPES[u.dtype]).numpy().view(np.uint8).reshape(m, isz)
        sink(memoryview(np.ascontiguousarray(v[:, 0])))
        later[:, done : done + m] = v[:, 1:].T
        done += m
    passes.add(seen.intdigest())
    if len(passes) > 1:
        raise InvalidUpdateError(
            f"tensor {u.name!r}: its parts gave different indices on different passes (its "
            "indices callable and its parts disagree, or a callable is not repeatable); each "
            "call must give the same indices in the same order"
        )
    for plane in later:
        sink(memoryview(plane))


def _write_records(out: section.SectionWriter, plans: list) -> None:
    """Every planned record of a segment, in order, through ``out`` (parted ones part by part,
    so the bytes equal those of the same records given whole)."""
    for p in plans:
        out.write(p.head)
        if isinstance(p, _PartedPlan):
            _write_parted(out.write, p)
            continue
        if p.indices is not None:
            section.write_gap_planes(out.write, p.indices, p.width)
        section.write_value_planes(out.write, p.values)


def _check_header(version: int, base_version: int, shard: str, writer: str, level: int) -> None:
    for field, value in (("version", version), ("base_version", base_version), ("level", level)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidUpdateError(f"encode_blob: {field} must be an int, got {value!r}")
    if not 0 <= version < 1 << 63:
        raise InvalidUpdateError(f"encode_blob: version {version} must be in [0, 2^63)")
    if not -1 <= base_version < version:
        raise InvalidUpdateError(
            f"encode_blob: base_version {base_version} must be -1 (anchor) or a version below "
            f"version {version}"
        )
    if not section.MIN_LEVEL <= level <= section.MAX_LEVEL:
        raise InvalidUpdateError(
            f"encode_blob: level {level} must be in [{section.MIN_LEVEL}, {section.MAX_LEVEL}] "
            "(0 stores the records uncompressed; 1 is the recommended default)"
        )
    for field, value in (("shard", shard), ("writer", writer)):
        try:
            check_token(field, value)
        except ManifestError as e:
            raise InvalidUpdateError(f"encode_blob: {e}") from None
        if len(value.encode("utf-8")) > MAX_ID_BYTES:  # the token rule already implies this
            raise InvalidUpdateError(f"encode_blob: {field} is longer than {MAX_ID_BYTES} bytes")


Sink = Callable[[bytes], None]


class BlobWriter:
    """Writes one blob for one (version, receiver shard, writer) piece by piece into ``sink``.

    ``sink`` receives the blob's bytes in order (header, then each segment, then trailer and
    digest); the writer keeps nothing of a segment once it is handed over, so a blob of any size
    streams in the memory of its largest segment. ``size`` and ``digest`` (hex xxh3-128 of the
    whole blob, trailer digest included; the manifest lists the BLAKE2b-256
    ``commit.blob_digest`` instead) are final after :meth:`finish`. A tensor may appear in
    one segment only: the decoder refuses a name seen twice.

    With ``open_segments`` (and compression) a segment whose frame is streamed (a record
    section above the one-shot size) is written open (wire ``FLAG_OPEN_SEGMENTS``): its header
    first, then its frame to ``sink`` as zstd produces it, so not even the compressed section
    is held whole. Its parted records are then checked as they are written, after the first
    bytes went out: one that fails leaves the blob unfinishable (later calls raise) and the
    caller discards what it sent."""

    def __init__(
        self,
        sink: Sink,
        *,
        version: int,
        base_version: int,
        shard: str,
        writer: str,
        level: int = 1,
        open_segments: bool = False,
    ) -> None:
        _check_header(version, base_version, shard, writer, level)
        self._sink, self._level = sink, level
        self._open = bool(open_segments and level)
        self._broken: BaseException | None = None  # an open segment that failed half-written
        self._inner = xxhash.xxh3_128()  # the digest the blob ends with
        self._outer = xxhash.xxh3_128()  # the digest of every byte, digest included
        self._seen: set[str] = set()
        self.size = self.segments = self.records = self.raw_len = self.body_len = 0
        self.digest: str | None = None
        shard_b, writer_b = shard.encode("utf-8"), writer.encode("utf-8")
        self._put(
            HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                (FLAG_ZSTD | (FLAG_OPEN_SEGMENTS if self._open else 0)) if level else 0,
                version,
                base_version,
                len(shard_b),
                len(writer_b),
                0,
            )
            + shard_b
            + writer_b
        )

    def _put(self, data: bytes, *, inner: bool = True) -> None:
        if inner:
            self._inner.update(data)
        self._outer.update(data)
        self.size += len(data)
        self._sink(data)

    def segment(self, updates: Sequence[TensorUpdate | PartedUpdate]) -> int:
        """Write ``updates`` as one segment (nothing for an empty list); returns its bytes. A
        :class:`PartedUpdate` is written part by part and gives the bytes of the TensorUpdate
        holding the same indices and values."""
        if self.digest is not None:
            raise InvalidUpdateError("BlobWriter.segment: the blob is already finished")
        self._check_whole()
        if not updates:
            return 0
        if self.records + len(updates) > MAX_RECORDS:
            raise InvalidUpdateError(
                f"encode_blob: {self.records + len(updates)} updates exceed {MAX_RECORDS}"
            )
        plans: list[_RecordPlan | _PartedPlan] = []
        names: set[str] = set()
        for update in updates:
            if not isinstance(update, (TensorUpdate, PartedUpdate)):
                raise InvalidUpdateError(f"encode_blob: {update!r} is not a TensorUpdate")
            if update.name in self._seen or update.name in names:
                raise InvalidUpdateError(
                    f"encode_blob: tensor {update.name!r} appears twice; merge its updates first"
                )
            names.add(update.name)
            plans.append(
                _plan_parted(update) if isinstance(update, PartedUpdate) else _plan(update)
            )

        raw_len = sum(p.size for p in plans)
        out = section.SectionWriter(raw_len, self._level, sink=self._put if self._open else None)
        if out.streams and self._open:  # open: the header first, the frame as it is produced
            self._put(SEGMENT.pack(OPEN_LEN, raw_len, len(plans)))
            start = self.size
            try:
                _write_records(out, plans)
                out.finish()
            except BaseException as exc:
                self._broken = exc
                raise
            section_len = self.size - start
        else:
            # Parted records are checked as they are written: the section is complete (and
            # every part checked) before any of it reaches the sink.
            _write_records(out, plans)
            body = out.finish()
            section_len = sum(len(c) for c in body)
            self._put(SEGMENT.pack(section_len, raw_len, len(plans)))
            for chunk in body:
                self._put(chunk)
        self._seen |= names  # only once every record of the segment is valid
        self.segments += 1
        self.records += len(plans)
        self.raw_len += raw_len
        self.body_len += SEGMENT.size + section_len
        return SEGMENT.size + section_len

    def _check_whole(self) -> None:
        if self._broken is not None:
            raise InvalidUpdateError(
                "BlobWriter: an open segment failed after its first bytes were written "
                f"({type(self._broken).__name__}: {self._broken}); this blob cannot be "
                "finished: discard what was written and encode the version again"
            )

    def finish(self) -> str:
        """Write the trailer and the digest; returns the blob's hex xxh3-128 of every byte (a
        transit check; the manifest lists the BLAKE2b-256 ``commit.blob_digest``)."""
        self._check_whole()
        if self.digest is None:
            self._put(
                TRAILER.pack(END_MAGIC, self.segments, self.records, self.raw_len, self.body_len)
            )
            self._put(self._inner.digest(), inner=False)
            self.digest = self._outer.hexdigest()
        return self.digest


def encode_blob(
    updates: Sequence[TensorUpdate],
    *,
    version: int,
    base_version: int,
    shard: str,
    writer: str,
    level: int = 1,
    open_segments: bool = False,
) -> bytes:
    """Encode ``updates`` for one (version, receiver shard, writer) into a blob of one segment.

    ``base_version`` is -1 for an anchor (full) blob. ``level`` is the zstd level (1 = fast
    default; 0 = no compression, for links faster than zstd). ``open_segments``: as
    :class:`BlobWriter`'s (the bytes a streaming writer of one segment produces)."""
    chunks: list[bytes] = []
    blob = BlobWriter(
        chunks.append,
        version=version,
        base_version=base_version,
        shard=shard,
        writer=writer,
        level=level,
        open_segments=open_segments,
    )
    blob.segment(updates)
    blob.finish()
    return b"".join(chunks)


def default_threads(jobs: int) -> int:
    """One thread per blob, at most one per CPU core this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(jobs, cores))


def encode_blobs(
    updates: Mapping[str, Sequence[TensorUpdate]],
    *,
    version: int,
    base_version: int,
    writer: str,
    level: int = 1,
    threads: int | None = 1,
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(shard, blob)`` for every shard of ``updates``, in its order; ``blob`` equals
    ``encode_blob(updates[shard], version=..., base_version=..., shard=shard, writer=...)``.
    ``threads``: blobs encoded at once (1, the default, = one after another; None = one per
    core, see :func:`default_threads`).

    An error while encoding one blob (e.g. InvalidUpdateError) is raised when that blob's turn
    comes; blobs not yet yielded are still finished (or cancelled) before it propagates."""
    shards = list(updates)
    n = default_threads(len(shards)) if threads is None else max(1, threads)
    encode = partial(
        encode_blob, version=version, base_version=base_version, writer=writer, level=level
    )
    if n == 1 or len(shards) <= 1:
        for shard in shards:
            yield shard, encode(updates[shard], shard=shard)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="ds-encode") as pool:
        futures = [pool.submit(encode, updates[shard], shard=shard) for shard in shards]
        try:
            for shard, fut in zip(shards, futures, strict=False):
                yield shard, fut.result()
        finally:
            for fut in futures:
                fut.cancel()
