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

A piece the file cannot take (no room for it and :data:`HEADROOM` more, a failed write) is
kept in memory, as without a stash, and the stash takes no further piece.

This module knows TensorUpdate, numpy and files; it knows nothing about blobs, digests,
stores or receivers (the caller names the directory and closes the stash).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

import torch

from deltasync.format.updates import TensorUpdate

log = logging.getLogger(__name__)

STASH_MIN = 1 << 18  # decoded bytes from which a sparse piece is stashed (smaller: held)
# Room a stash leaves free in its directory: a receiver writes its journal there while its
# verify runs (a stash that took that room would fail the pull at the journal).
HEADROOM = 1 << 20
_BLOCK = 1 << 18  # indices read back this many at a time when locating chunk bounds (1 MiB)


@dataclass(frozen=True, eq=False)
class StashedPiece:
    """A sparse piece (strictly increasing flat ``nnz`` indices, their values) whose arrays
    lie in its stash's file: indices (``index_dtype``) from byte ``at``, then values. Valid
    while the stash is open; read back with :meth:`span` and :meth:`bounds`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nnz: int
    index_dtype: torch.dtype
    at: int
    file: BinaryIO

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
        while got < len(view):
            step = os.preadv(fd, [view[got:]], offset + got)
            if step <= 0:
                raise OSError(f"stash of tensor {self.name!r}: the file ends early")
            got += step
        return out

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements ``[lo, hi)`` of the piece: (indices, values), read from the file into new
        tensors."""
        isize, vsize = self.index_dtype.itemsize, self.dtype.itemsize
        idx = self._read(hi - lo, self.index_dtype, self.at + lo * isize)
        vals = self._read(hi - lo, self.dtype, self.at + self.nnz * isize + lo * vsize)
        return idx, vals

    def read_indices(self) -> torch.Tensor:
        """Every index at once (a check of several writers' pieces of one version)."""
        return self._read(self.nnz, self.index_dtype, self.at)

    def bounds(self, starts: torch.Tensor) -> list[int]:
        """``torch.searchsorted(indices, starts).tolist()``, read back a block at a time: the
        count of indices below each start, summed over blocks (the indices are sorted)."""
        out = torch.zeros(starts.numel(), dtype=torch.int64)
        isize = self.index_dtype.itemsize
        for a in range(0, self.nnz, _BLOCK):
            idx = self._read(min(_BLOCK, self.nnz - a), self.index_dtype, self.at + a * isize)
            out += torch.searchsorted(idx, starts.to(idx.dtype))
        return out.tolist()


class Stash:
    """An unlinked file in ``directory`` that takes the large sparse pieces handed to
    :meth:`keep` (a context manager: the file is closed, and its blocks freed, on exit)."""

    def __init__(self, directory: str, *, min_bytes: int | None = None) -> None:
        self.directory = directory
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
        try:
            if shutil.disk_usage(self.directory).free < size + HEADROOM:
                raise OSError(f"fewer than {size + HEADROOM} bytes free")
            if self._file is None:
                # closed by close(): the file outlives this call (its pieces are read back)
                self._file = tempfile.TemporaryFile(dir=self.directory)  # noqa: SIM115
            at = self._end
            self._file.seek(at)
            for t in (idx, vals):
                self._file.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
            self._file.flush()
        except OSError as e:
            self._off = True
            log.warning(
                "a verify keeps its large pieces in memory: its stash in %r failed (%s)",
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
        )
