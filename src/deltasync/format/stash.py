"""A verify pass's large sparse pieces, parked decoded in a private unlinked file.

A chain of several versions is verified one tensor at a time
(:func:`deltasync.format.merge.iter_chain`), and the digest of a tensor needs its pieces of
every version at once: a catch-up's large tensors (an embedding, an lm_head that each
version's delta rewrites 1% of) held one decoded piece per version (an int32 index and a
BF16 value: 6 bytes an element) together beside the shard. Folding them into one union does
not shrink them (the versions' elements rarely coincide). A :class:`Stash` writes each large
sparse piece, as the chain read hands it over and before the next one is decoded, to a
private unlinked file and gives back a :class:`StashedPiece`; the verify reads its elements
back a chunk at a time (:meth:`StashedPiece.span`). The pieces of one tensor then cost one
decoded piece (the one being read) plus a chunk's share of each, in memory; the file holds
them until the stash closes, in the page cache, not in the process.

A stashed piece answers a verify's calls as a sparse TensorUpdate does (``span``,
``locate``, ``chunk_bounds``, ``index_range``, ``all_indices``), so a verify reads both the
same way. Its chunk bounds for the stash's ``chunk`` and its first and last index are found
as it is written, from the indices in hand: a verify that asks for them (a chunked digest,
the writers' disjointness check) reads nothing back. A piece whose indices are one run
(``first`` to ``last``, every one: an FSDP writer's whole rows of an anchor) has its values
alone written (2 bytes an element, not 6), its indices counted out as they are read.

A piece the file cannot take (no room for it and :data:`deltasync.scratch.HEADROOM` more,
a failed write) is kept in memory, as without a stash, and the stash takes no further piece.
A file that cannot be read back fails the verify, before anything is written, with a
:class:`~deltasync.errors.LocalStateError` naming the tensor and the directory.

This module knows TensorUpdate, numpy and files; it knows nothing about blobs, digests,
stores or receivers (the caller names the directory and closes the stash).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import BinaryIO

import torch

from deltasync.errors import LocalStateError
from deltasync.format.updates import TensorUpdate, chunk_starts
from deltasync.scratch import check_room, scratch_file

log = logging.getLogger(__name__)

STASH_MIN = 1 << 18  # decoded bytes from which a sparse piece is stashed (smaller: held)
_BLOCK = 1 << 18  # indices read back this many at a time when locating chunk bounds (1 MiB)


@dataclass(frozen=True, eq=False)
class StashedPiece:
    """A sparse piece (strictly increasing flat ``nnz`` indices, their values) whose arrays
    lie in its stash's file: indices (``index_dtype``) from byte ``at``, then values (a
    ``run``, every index from ``first`` to ``last``, has its values alone there), and where
    each ``chunk``-element block of the tensor starts among them (``bounds``). Valid while
    the stash is open; read back as a sparse TensorUpdate is (:meth:`span`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nnz: int
    index_dtype: torch.dtype
    at: int
    file: BinaryIO
    directory: str
    chunk: int
    bounds: tuple[int, ...]
    first: int
    last: int
    run: bool  # every index from first to last (a writer's whole rows): only values on file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_dense(self) -> bool:
        return False

    def _read(self, count: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
        out = torch.empty(count, dtype=dtype)
        view = memoryview(out.view(torch.uint8).numpy())  # any dtype, BF16 too
        fd, got = self.file.fileno(), 0
        try:
            while got < len(view):
                step = os.preadv(fd, [view[got:]], offset + got)
                if step <= 0:
                    raise OSError(f"the file ends {len(view) - got} bytes early")
                got += step
        except OSError as exc:
            raise LocalStateError(
                f"tensor {self.name!r}: its verify parked its decoded elements in an unlinked "
                f"file in the state dir {self.directory!r} and cannot read them back ({exc}). "
                "Nothing was written (the verify runs before the first live write): check the "
                "disk under that dir and pull again"
            ) from exc
        return out

    def _indices(self, lo: int, hi: int) -> torch.Tensor:
        if self.run:
            return torch.arange(self.first + lo, self.first + hi, dtype=self.index_dtype)
        return self._read(hi - lo, self.index_dtype, self.at + lo * self.index_dtype.itemsize)

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements ``[lo, hi)`` of the piece: (indices, values), read from the file (a run's
        indices counted out) into new tensors."""
        on_file = 0 if self.run else self.nnz * self.index_dtype.itemsize
        vals = self._read(hi - lo, self.dtype, self.at + on_file + lo * self.dtype.itemsize)
        return self._indices(lo, hi), vals

    def all_indices(self) -> torch.Tensor:
        """Every index at once (a check of interleaved writers' pieces of one version)."""
        return self._indices(0, self.nnz)

    def index_range(self) -> tuple[int, int]:
        """(first, last) index, kept as the piece was written (its order proven then)."""
        return self.first, self.last

    def locate(self, starts: torch.Tensor) -> list[int]:
        """As :meth:`TensorUpdate.locate`, the indices read back a block at a time: the count
        of indices below each start, summed over blocks (the indices are sorted)."""
        if self.run:  # the indices below start s: s - first of them, within [0, nnz]
            return (starts.to(torch.int64) - self.first).clamp_(0, self.nnz).tolist()
        out = torch.zeros(starts.numel(), dtype=torch.int64)
        isize = self.index_dtype.itemsize
        for a in range(0, self.nnz, _BLOCK):
            idx = self._read(min(_BLOCK, self.nnz - a), self.index_dtype, self.at + a * isize)
            out += torch.searchsorted(idx, starts.to(idx.dtype))
        return out.tolist()

    def chunk_bounds(self, chunk: int) -> list[int]:
        """As :meth:`TensorUpdate.chunk_bounds`: the bounds found as the piece was written
        for the stash's chunk (nothing read back), else :meth:`locate`."""
        if chunk == self.chunk:
            return list(self.bounds)
        return self.locate(chunk_starts(self.numel, chunk))


class Stash:
    """An unlinked file in ``directory`` that takes the large sparse pieces handed to
    :meth:`keep` (a context manager: the file is closed, and its blocks freed, on exit).
    ``chunk``: the block size of the verify that reads the pieces back (each piece's bounds
    for it are found as the piece is written)."""

    def __init__(self, directory: str, *, chunk: int, min_bytes: int | None = None) -> None:
        self.directory = directory
        self.chunk = chunk
        self.min_bytes = STASH_MIN if min_bytes is None else min_bytes
        self._file: BinaryIO | None = None
        self._end = 0
        self._off = False  # a write failed or the dir is full: keep the rest in memory

    def __enter__(self) -> Stash:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def keep(self, record: object) -> object:
        """``record`` as the chain read should keep it: a large sparse TensorUpdate written to
        the file (a :class:`StashedPiece`), anything else as it is."""
        if (
            self._off
            or not isinstance(record, TensorUpdate)
            or record.indices is None
            or record.nnz == 0
            or record.values.device.type != "cpu"
        ):
            return record
        idx, vals = record.indices, record.values
        size = idx.numel() * idx.element_size() + vals.numel() * vals.element_size()
        if size < self.min_bytes:
            return record
        span = record.index_range()
        if span is None:  # order not proven: its checks read it whole (kept in memory)
            return record
        run = span[1] - span[0] + 1 == record.nnz  # its indices are first..last: not written
        arrays = (vals,) if run else (idx, vals)
        size = sum(t.numel() * t.element_size() for t in arrays)
        try:
            if self._file is None:
                # closed by close(): the file outlives this call (its pieces are read back)
                self._file = scratch_file(self.directory, size)
            else:
                check_room(self.directory, size)
            at = self._end
            self._file.seek(at)
            for t in arrays:
                self._file.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            self._file.flush()
        except OSError as e:
            self._off = True
            log.warning(
                "a verify keeps its large decoded pieces in memory: its stash file in %r "
                "failed (%s). Free space in that dir (the receiver's state dir), or let this "
                "process write there",
                self.directory,
                e,
            )
            return record
        self._end = at + size
        return StashedPiece(
            name=record.name,
            shape=record.shape,
            dtype=record.dtype,
            nnz=record.nnz,
            index_dtype=idx.dtype,
            at=at,
            file=self._file,
            directory=self.directory,
            chunk=self.chunk,
            bounds=tuple(record.chunk_bounds(self.chunk)),
            first=span[0],
            last=span[1],
            run=run,
        )
