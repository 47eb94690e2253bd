"""Verify before write: the digest a shard WILL have after an update, from its live tensors.

A receiver checks the state an update leads to against the digest the trainer sent (the
manifest's shard digest on the storage path, the envelope's on the in-cluster path) while the
engine still serves, before the first live element is overwritten. It hashes each tensor as it
would be after the update, chunk by chunk: a chunk no update touches is hashed in place, a
chunk with updated elements is copied into one small scratch buffer, patched there and hashed.
The extra memory is that buffer (a few MiB) and never a copy of the shard.

The digest is the one definition of :mod:`deltasync.layout.digest` (its ``combine_digests`` over
per-tensor xxh3-128 digests of row-major bytes): xxh3 fed in pieces equals xxh3 of the whole,
so the value is exactly ``state_digest`` of the tensors after a scatter.

This module knows tensors, TensorUpdate and the digest definition; it knows nothing about
stores, manifests or journals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from deltasync.format import TensorUpdate
from deltasync.layout.digest import combine_digests, dtype_name, tensor_digest

CHUNK_ELEMENTS = 1 << 20  # 2 MiB of BF16 per scratch chunk


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def patched_tensor_digest(
    live: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, chunk: int = CHUNK_ELEMENTS
) -> bytes:
    """``tensor_digest`` of ``live`` with ``values`` written at the sorted flat ``indices``,
    without writing ``live`` and without a copy of it (one ``chunk``-element buffer)."""
    flat = live.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()  # a strided view: one copy of this tensor (rare: fused views)
    flat = flat.reshape(-1)
    n = flat.numel()
    h = xxhash.xxh3_128()
    if n == 0:
        return h.digest()
    idx = indices.to("cpu")
    vals = values.to("cpu")
    starts = torch.arange(0, n + chunk, chunk, dtype=torch.int64).clamp_(max=n)
    bounds = torch.searchsorted(idx, starts).tolist()
    scratch = torch.empty(min(chunk, n), dtype=flat.dtype)
    on_cpu = flat.device.type == "cpu"
    for i in range(len(bounds) - 1):
        start, end = int(starts[i]), int(starts[i + 1])
        if start >= end:
            break
        lo, hi = bounds[i], bounds[i + 1]
        if lo == hi and on_cpu:
            h.update(_bytes(flat[start:end]))  # untouched: hashed in place
            continue
        piece = scratch[: end - start]
        piece.copy_(flat[start:end])
        if hi > lo:
            piece.index_copy_(0, idx[lo:hi] - start, vals[lo:hi])
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
    by_name = {u.name: u for u in updates}
    entries = []
    for name, t in tensors.items():
        u = by_name.get(name)
        if u is None or u.nnz == 0:
            digest = tensor_digest(t)
        elif u.indices is None:
            digest = tensor_digest(u.values)  # dense: the values are the whole new tensor
        else:
            digest = patched_tensor_digest(t, u.indices, u.values)
        entries.append((name, dtype_name(t), tuple(t.shape), digest))
    return combine_digests(entries)
