"""Verify before write: the digest a shard WILL have after an update, from its live tensors.

A receiver checks the state an update leads to against the digest the trainer sent (the
manifest's shard digest on the storage path, the envelope's on the in-cluster path) while the
engine still serves, before the first live element is overwritten. It hashes each tensor as it
would be after the update, chunk by chunk: a chunk no update touches is hashed in place, a
chunk with updated elements is copied into one small scratch buffer, patched there and hashed.
The extra memory is that buffer (2 MiB) and never a copy of the shard.

The digest is the one definition of :mod:`deltasync.layout.digest` (its ``combine_digests`` over
per-tensor xxh3-128 digests of row-major bytes): xxh3 fed in pieces equals xxh3 of the whole,
so the value is exactly ``state_digest`` of the tensors after a scatter.

A chain of several versions is verified the same way without folding it first: each tensor's
pieces (:class:`deltasync.format.merge.TensorPieces`) patch each chunk in chain order, and a
caller that streams them (:func:`chain_state_digest` over ``iter_chain``) holds one tensor's
pieces at a time.

This module knows tensors, TensorUpdate and the digest definition; it knows nothing about
stores, manifests or journals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from deltasync.format import TensorUpdate
from deltasync.format.merge import TensorPieces
from deltasync.layout.digest import combine_digests, dtype_name, tensor_digest
from deltasync.native.ops import patch16, scatter16

CHUNK_ELEMENTS = 1 << 20  # 2 MiB of BF16 per scratch chunk


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _patch(piece: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, start: int) -> None:
    """``piece[idx - start] = vals`` (a chunk of the tensor beginning at element ``start``):
    the C scatter on the indices as decoded, else torch on widened ones."""
    if not scatter16(piece, idx, vals, base=start):
        piece.index_copy_(0, (idx - start).to(torch.int64), vals)


Touched = list[tuple[torch.Tensor, torch.Tensor, int, int]]  # (indices, values, lo, hi)


def _fill(piece: torch.Tensor, base: torch.Tensor | None, touched: Touched, start: int) -> None:
    """``piece`` = ``base`` (zeros where None) with each touched piece's ``[lo, hi)`` elements
    written, in chain order: the chunk as the update leaves it. One sparse piece over a CPU
    base is copied and patched in one C pass."""
    if len(touched) == 1 and base is not None:
        idx, vals, lo, hi = touched[0]
        if patch16(piece, base, idx[lo:hi], vals[lo:hi], base=start):
            return
    if base is None:
        piece.zero_()
    else:
        piece.copy_(base)
    for idx, vals, lo, hi in touched:
        _patch(piece, idx[lo:hi], vals[lo:hi], start)


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
    dense = None
    if pieces and pieces[0].is_dense:
        dense = pieces[0].values.to("cpu")
        pieces = pieces[1:]
    zeros = tensor.from_zero and dense is None
    if scratch is None or scratch.chunk != chunk:
        scratch = Scratch(chunk)
    if n <= chunk and dense is None and not zeros:  # one chunk: skip the chunk bookkeeping
        piece = scratch.take(n, flat.dtype)
        touched: Touched = [
            (p.indices.to("cpu"), p.values.to("cpu"), 0, p.nnz)  # type: ignore[union-attr]
            for p in pieces
            if p.nnz
        ]
        _fill(piece, flat, touched, 0)
        h.update(_bytes(piece))
        return h.digest()
    starts = torch.arange(0, n + chunk, chunk, dtype=torch.int64).clamp_(max=n)
    sparse = []  # (indices, values, chunk bounds) of each sparse piece, chain order
    for p in pieces:
        if p.nnz == 0:
            continue
        idx = p.indices.to("cpu")  # type: ignore[union-attr]
        bounds = torch.searchsorted(idx, starts.to(idx.dtype)).tolist()
        sparse.append((idx, p.values.to("cpu"), bounds))
    buffer = scratch.take(n, flat.dtype)
    on_cpu = flat.device.type == "cpu"
    for i in range(len(starts) - 1):
        start, end = int(starts[i]), int(starts[i + 1])
        if start >= end:
            break
        touched = [(idx, vals, b[i], b[i + 1]) for idx, vals, b in sparse if b[i + 1] > b[i]]
        if not touched and not zeros:
            if dense is not None:
                h.update(_bytes(dense[start:end]))  # the new values themselves
                continue
            if on_cpu:
                h.update(_bytes(flat[start:end]))  # untouched: hashed in place
                continue
        piece = buffer[: end - start]
        base = None if zeros else (dense if dense is not None else flat)[start:end]
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


def chain_state_digest(
    tensors: Mapping[str, torch.Tensor],
    chain: Iterable[TensorPieces],
    *,
    chunk: int = CHUNK_ELEMENTS,
) -> str:
    """The state digest ``tensors`` would have after ``apply_pieces`` of every item of
    ``chain`` (at most one per tensor; e.g. :func:`deltasync.format.merge.iter_chain`),
    consuming ``chain`` one tensor at a time.

    Args:
        tensors: the live tensors (read only).
        chain: each touched tensor's pieces, each tensor once.
        chunk: elements per scratch chunk.

    Returns:
        The hex state digest, equal to ``state_digest`` of the tensors after the writes.
    """
    digests: dict[str, bytes] = {}
    scratch = Scratch(chunk)
    for item in chain:
        t = tensors[item.name]
        assert item.name not in digests, item.name  # iter_chain yields each tensor once
        if not item.pieces or (item.nnz == 0 and not item.from_zero):
            digests[item.name] = tensor_digest(t)
        elif item.pieces[-1].is_dense:
            digests[item.name] = tensor_digest(item.pieces[-1].values)  # the whole new tensor
        else:
            digests[item.name] = pieces_tensor_digest(t, item, chunk=chunk, scratch=scratch)
    entries = []
    for name, t in tensors.items():
        digest = digests.get(name)
        if digest is None:
            digest = tensor_digest(t)
        entries.append((name, dtype_name(t), tuple(t.shape), digest))
    return combine_digests(entries)
