"""Verify before write: the digest a shard WILL have after an update, from its live tensors.

A receiver checks the state an update leads to against the digest the trainer sent (the
manifest's shard digest on the storage path, the envelope's on the in-cluster path) while the
engine still serves, before the first live element is overwritten. It hashes each tensor as it
would be after the update, chunk by chunk: a chunk no update touches is hashed in place, a
chunk with updated elements is copied into one small scratch buffer, patched there and hashed.
The extra memory is that buffer (2 MiB) and never a copy of the shard. Tensors one sparse
piece patches, and those no update touches, are hashed a batch at a time in one C call
(:func:`~deltasync.native.ops.patched_digests16`, the xxhash library's own XXH3 through its
C API) instead of a Python pass each; a batch holds at most ``BATCH_ELEMENTS`` changed
elements besides the tensor being read.

The digest is the one definition of :mod:`deltasync.layout.digest` (its ``combine_digests`` over
per-tensor xxh3-128 digests of row-major bytes): xxh3 fed in pieces equals xxh3 of the whole,
so the value is exactly ``state_digest`` of the tensors after a scatter.

A chain of several versions is verified the same way without folding it first: each tensor's
pieces (:class:`deltasync.format.merge.TensorPieces`) patch each chunk in chain order, and a
caller that streams them (:func:`chain_state_digest` over ``iter_chain``) holds one tensor's
pieces at a time. Every sparse piece is read a chunk's share at a time (``span``), a piece
parked in a file (:class:`deltasync.format.stash.StashedPiece`) from its file, never whole.

This module knows tensors, TensorUpdate and the digest definition; it knows nothing about
stores, manifests or journals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from deltasync.format import TensorUpdate
from deltasync.format.merge import TensorPieces
from deltasync.format.updates import LazyDense, chunk_starts
from deltasync.layout.digest import combine_digests, dtype_name, tensor_digest
from deltasync.native.ops import patch16, patched_digests16, scatter16

CHUNK_ELEMENTS = 1 << 20  # 2 MiB of BF16 per scratch chunk
# Changed elements a batch of tensors waiting for one C hash call may hold beyond the tensor
# being read (192-320 KiB of decoded positions and values): a chain streamed from the store is
# still held about one tensor's pieces at a time.
BATCH_ELEMENTS = 1 << 15


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _patch(piece: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, start: int) -> None:
    """``piece[idx - start] = vals`` (a chunk of the tensor beginning at element ``start``):
    the C scatter on the indices as decoded, else torch on widened ones."""
    if not scatter16(piece, idx, vals, base=start):
        piece.index_copy_(0, (idx - start).to(torch.int64), vals)


Touched = list[tuple[torch.Tensor, torch.Tensor]]  # (indices, values) of a chunk, on the CPU


def _fill(piece: torch.Tensor, base: torch.Tensor | None, touched: Touched, start: int) -> None:
    """``piece`` = ``base`` (zeros where None) with each touched piece's elements written, in
    chain order: the chunk as the update leaves it. One sparse piece over a CPU base is
    copied and patched in one C pass."""
    if len(touched) == 1 and base is not None:
        idx, vals = touched[0]
        if patch16(piece, base, idx, vals, base=start):
            return
    if base is None:
        piece.zero_()
    else:
        piece.copy_(base)
    for idx, vals in touched:
        _patch(piece, idx, vals, start)


def patched_tensor_digest(
    live: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, chunk: int = CHUNK_ELEMENTS
) -> bytes:
    """``tensor_digest`` of ``live`` with ``values`` written at the sorted flat ``indices``,
    without writing ``live`` and without a copy of it (one ``chunk``-element buffer)."""
    spec = (tuple(live.shape), live.dtype)
    piece = TensorUpdate(
        name="patched", shape=spec[0], dtype=spec[1], indices=indices, values=values.to("cpu")
    )
    return pieces_tensor_digest(
        live,
        TensorPieces(
            name="patched", shape=spec[0], dtype=spec[1], from_zero=False, pieces=(piece,)
        ),
        chunk=chunk,
    )


class Scratch:
    """One chunk buffer per dtype, reused for every tensor of a verify: a fresh buffer per
    tensor faulted its pages in again each time (about a third of a small shard's verify)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``min(n, chunk)`` elements of ``dtype`` (contents undefined)."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < min(n, self.chunk):
            buf = self._buffers[dtype] = torch.empty(min(n, self.chunk), dtype=dtype)
        return buf[: min(n, self.chunk)]


def pieces_tensor_digest(
    live: torch.Tensor,
    tensor: TensorPieces,
    *,
    chunk: int = CHUNK_ELEMENTS,
    scratch: Scratch | None = None,
) -> bytes:
    """``tensor_digest`` of ``live`` after ``apply_pieces(tensor, ...)``, without writing
    ``live``: chunk by chunk, the chunk's base (the live bytes, the last dense piece's values,
    or zeros for an anchor) is patched with every later piece's elements in that chunk, in
    chain order, in one ``chunk``-element buffer (``scratch``'s, shared by a caller hashing
    several tensors). Untouched chunks are hashed in place."""
    flat = live.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()  # a strided view: one copy of this tensor (rare: fused views)
    flat = flat.reshape(-1)
    n = flat.numel()
    h = xxhash.xxh3_128()
    if n == 0:
        return h.digest()
    first = tensor.start()
    pieces = tensor.pieces[first:]
    dense = lazy = None
    if pieces and isinstance(pieces[0], LazyDense):
        # read chunk by chunk in element order, in step with the loop below (never whole)
        lazy = pieces[0].chunks(chunk)
        pieces = pieces[1:]
    elif pieces and pieces[0].is_dense:
        dense = pieces[0].values.to("cpu")
        pieces = pieces[1:]
    zeros = tensor.from_zero and dense is None and lazy is None
    if scratch is None or scratch.chunk != chunk:
        scratch = Scratch(chunk)
    sparse = [p for p in pieces if p.nnz]
    if n <= chunk and dense is None and lazy is None and not zeros:  # one chunk: no bookkeeping
        piece = scratch.take(n, flat.dtype)
        _fill(piece, flat, [p.span(0, p.nnz) for p in sparse], 0)
        h.update(_bytes(piece))
        return h.digest()
    starts = chunk_starts(n, chunk).tolist()
    # each sparse piece's elements are read a chunk's share at a time below (a stashed
    # piece's from its file, never whole), chain order
    bounds = [p.chunk_bounds(chunk) for p in sparse]
    buffer = scratch.take(n, flat.dtype)
    on_cpu = flat.device.type == "cpu"
    for i in range(len(starts) - 1):
        start, end = starts[i], starts[i + 1]
        if start >= end:
            break
        touched = [
            p.span(b[i], b[i + 1]) for p, b in zip(sparse, bounds, strict=True) if b[i + 1] > b[i]
        ]
        if lazy is not None:
            base = next(lazy)  # elements [start, end) of the dense piece
        elif zeros:
            base = None
        else:
            base = (dense if dense is not None else flat)[start:end]
        if not touched and not zeros:
            if dense is not None or lazy is not None:
                h.update(_bytes(base))  # the new values themselves
                continue
            if on_cpu:
                h.update(_bytes(base))  # untouched: hashed in place
                continue
        piece = buffer[: end - start]
        _fill(piece, base, touched, start)
        h.update(_bytes(piece))
    return h.digest()


def updated_state_digest(
    tensors: Mapping[str, torch.Tensor], updates: Iterable[TensorUpdate]
) -> str:
    """The state digest ``tensors`` would have after ``apply_updates(updates, tensors)``.

    Args:
        tensors: the live tensors (read only).
        updates: at most one update per tensor (a folded chain), each fitting its tensor.

    Returns:
        The hex state digest, equal to ``state_digest`` of the tensors after the scatter.
    """
    return chain_state_digest(
        tensors,
        (
            TensorPieces(name=u.name, shape=u.shape, dtype=u.dtype, from_zero=False, pieces=(u,))
            for u in updates
        ),
    )


def _one_sparse_piece(item: TensorPieces) -> TensorUpdate | None:
    """The one sparse piece that patches ``item``'s live values (a one-version chain's usual
    item), or None when the chain writes it otherwise (an anchor, a dense piece, several
    versions)."""
    if item.from_zero or item.start():
        return None
    touched = [p for p in item.pieces if p.nnz]
    if len(touched) != 1 or not isinstance(touched[0], TensorUpdate) or touched[0].is_dense:
        return None  # a stashed piece is hashed chunk by chunk (pieces_tensor_digest)
    return touched[0]


class _Batch:
    """Tensors waiting to be hashed by one :func:`patched_digests16` call (a shard's small
    tensors in one C call instead of one Python pass each), flushed once they hold
    ``max_nnz`` pieces' elements, so that a long chain is still held one tensor at a time."""

    def __init__(self, digests: dict[str, bytes], scratch: Scratch, max_nnz: int) -> None:
        self.digests, self.scratch, self.max_nnz = digests, scratch, max_nnz
        self.items: list[tuple[str, torch.Tensor, TensorPieces | None, TensorUpdate | None]] = []
        self.nnz = 0

    def add(
        self, name: str, live: torch.Tensor, item: TensorPieces | None, piece: TensorUpdate | None
    ) -> None:
        self.items.append((name, live, item, piece))
        self.nnz += 0 if piece is None else piece.nnz
        if self.nnz >= self.max_nnz:
            self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        patches = [
            (live, None, None) if piece is None else (live, piece.indices, piece.values)
            for _, live, _, piece in self.items
        ]
        chunk = self.scratch.chunk
        widest = max((live.numel() for _, live, _, piece in self.items if piece), default=1)
        buffer = self.scratch.take(min(chunk, widest), torch.int16)
        got = patched_digests16(patches, buffer, chunk)
        for k, (name, live, item, _) in enumerate(self.items):
            digest = None if got is None else got[k]
            # the Python pass takes what the kernel declined (e.g. a device tensor) and names
            # any fault
            self.digests[name] = digest if digest is not None else self._python(live, item)
        self.items.clear()
        self.nnz = 0

    def _python(self, live: torch.Tensor, item: TensorPieces | None) -> bytes:
        if item is None:
            return tensor_digest(live)
        return pieces_tensor_digest(live, item, chunk=self.scratch.chunk, scratch=self.scratch)


def _lazy_digest(record: LazyDense, chunk: int) -> bytes:
    """``tensor_digest`` of a dense record's values, read and hashed ``chunk`` at a time."""
    h = xxhash.xxh3_128()
    for values in record.chunks(chunk):
        h.update(_bytes(values))
    return h.digest()


def chain_state_digest(
    tensors: Mapping[str, torch.Tensor],
    chain: Iterable[TensorPieces],
    *,
    chunk: int = CHUNK_ELEMENTS,
) -> str:
    """The state digest ``tensors`` would have after ``apply_pieces`` of every item of
    ``chain`` (at most one per tensor; e.g. :func:`deltasync.format.merge.iter_chain`),
    consuming ``chain`` one tensor at a time.

    Tensors a single sparse piece patches, and those the chain leaves as they are, are hashed
    in batches by one C call (:func:`~deltasync.native.ops.patched_digests16`); the rest, and
    all of them where the kernel cannot take them, tensor by tensor in Python.

    Args:
        tensors: the live tensors (read only).
        chain: each touched tensor's pieces, each tensor once.
        chunk: elements per scratch chunk.

    Returns:
        The hex state digest, equal to ``state_digest`` of the tensors after the writes.
    """
    digests: dict[str, bytes] = {}
    scratch = Scratch(chunk)
    batch = _Batch(digests, scratch, max_nnz=BATCH_ELEMENTS)
    listed: set[str] = set()
    for item in chain:
        t = tensors[item.name]
        assert item.name not in listed, item.name  # iter_chain yields each tensor once
        listed.add(item.name)
        if not item.pieces or (item.nnz == 0 and not item.from_zero):
            batch.add(item.name, t, None, None)
        elif isinstance(item.pieces[-1], LazyDense):  # the whole new tensor, read in chunks
            digests[item.name] = _lazy_digest(item.pieces[-1], chunk)
        elif item.pieces[-1].is_dense:
            digests[item.name] = tensor_digest(item.pieces[-1].values)  # the whole new tensor
        else:
            piece = _one_sparse_piece(item)
            if piece is None:
                digests[item.name] = pieces_tensor_digest(t, item, chunk=chunk, scratch=scratch)
            else:
                batch.add(item.name, t, item, piece)
        del item, t  # a dense record is freed before the chain decodes the next one
    for name, t in tensors.items():
        if name not in listed:  # no update touches it: hashed as it is
            batch.add(name, t, None, None)
    batch.flush()
    entries = [(name, dtype_name(t), tuple(t.shape), digests[name]) for name, t in tensors.items()]
    return combine_digests(entries)
