"""Merge and fold of decoded updates (pure): several writers' blobs, and a chain of versions.

- :func:`merge_writers`: one update per local tensor from the blobs of several writers of one
  version (their elements are disjoint; an overlap is a publisher bug and refused);
- :func:`fold_chain`: one update per local tensor for a whole chain: later values win; an
  anchor defines the full state (elements it does not list are zero, e.g. vLLM's vocabulary
  padding), so the result is dense from there on.

Both transports use these: a storage pull over the blobs it fetched, an in-cluster receiver
over the payloads it was sent. This module knows TensorUpdate and TensorSpec; it knows nothing
about stores, manifests or live tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltasync.errors import BlobMismatchError
from deltasync.format.updates import TensorSpec, TensorUpdate


def merge_writers(version: int, per_blob: Sequence[Sequence[TensorUpdate]]) -> list[TensorUpdate]:
    """One update per tensor; updates of one tensor from several writers must be disjoint."""
    by_name: dict[str, list[TensorUpdate]] = {}
    for updates in per_blob:
        for u in updates:
            by_name.setdefault(u.name, []).append(u)
    out = []
    for name, ups in by_name.items():
        if len(ups) == 1:
            out.append(ups[0])
            continue
        if any(u.is_dense for u in ups):
            raise BlobMismatchError(
                f"version {version}: tensor {name!r} has a dense update and another update from "
                "a second writer; writers' elements must be disjoint (publisher bug)"
            )
        idx = torch.cat([u.indices for u in ups])  # type: ignore[misc]
        vals = torch.cat([u.values for u in ups])
        idx, order = torch.sort(idx)
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise BlobMismatchError(
                f"version {version}: two writers sent the same element of tensor {name!r}; "
                "writers' elements must be disjoint (publisher bug)"
            )
        u0 = ups[0]
        out.append(
            TensorUpdate(name=name, shape=u0.shape, dtype=u0.dtype, indices=idx, values=vals[order])
        )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


Pair = tuple[torch.Tensor, torch.Tensor]


def _last_wins(pieces: list[Pair]) -> Pair:
    if len(pieces) == 1:
        return pieces[0]
    idx = torch.cat([p[0] for p in pieces])
    vals = torch.cat([p[1] for p in pieces])
    # A stable sort keeps equal indices in chain order, so the last of each run is the newest.
    idx, order = torch.sort(idx, stable=True)
    keep = torch.ones(idx.numel(), dtype=torch.bool)
    keep[:-1] = idx[1:] != idx[:-1]
    return idx[keep], vals[order][keep]


def fold_chain(
    steps: Sequence[tuple[str, Sequence[TensorUpdate]]], specs: Mapping[str, TensorSpec]
) -> list[TensorUpdate]:
    """The single set of updates that takes a shard through ``steps`` ((kind, updates) in
    chain order), in ``specs`` order."""
    dense: dict[str, torch.Tensor] = {}  # flat buffers this function owns
    sparse: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for kind, updates in steps:
        if kind == "anchor":
            dense.clear()
            sparse.clear()
            given = {u.name: u for u in updates}
            for name, spec in specs.items():
                u = given.get(name)
                if u is not None and u.is_dense:
                    dense[name] = u.values  # decoded for us alone: safe to patch in place
                    continue
                buf = torch.zeros(_numel(spec.shape), dtype=spec.dtype)
                if u is not None and u.nnz:
                    buf.index_copy_(0, u.indices, u.values)
                dense[name] = buf
            continue
        for u in updates:
            if u.name in dense:
                if u.is_dense:
                    dense[u.name].copy_(u.values)
                elif u.nnz:
                    dense[u.name].index_copy_(0, u.indices, u.values)
            elif u.is_dense:
                dense[u.name] = u.values
                sparse.pop(u.name, None)
            elif u.nnz:
                sparse.setdefault(u.name, []).append((u.indices, u.values))
    out = []
    for name, spec in specs.items():
        if name in dense:
            out.append(
                TensorUpdate(
                    name=name, shape=spec.shape, dtype=spec.dtype, indices=None, values=dense[name]
                )
            )
        elif name in sparse:
            idx, vals = _last_wins(sparse[name])
            out.append(
                TensorUpdate(
                    name=name, shape=spec.shape, dtype=spec.dtype, indices=idx, values=vals
                )
            )
    return out
