"""Staging: everything a pull does BEFORE the first write into live tensors.

- :func:`check_chain`: the chain starts where the tensors are (an anchor, or a delta whose
  base is the local version) and every later step builds on the one before; a wrong base is
  refused here, before anything is fetched;
- :func:`fetch_version`: fetch this shard's blobs of one version and verify each against the
  manifest (present, exact size, xxh3-128 digest) and then itself (``decode_blob`` with the
  shard's expected tensor specs, version, base and shard; writer id);
- :func:`merge_writers` (pure): one update per local tensor from the blobs of several writers
  (their elements are disjoint; an overlap is a publisher bug and refused);
- :func:`fold_chain` (pure): one update per local tensor for a whole chain: later values win;
  an anchor defines the full state (elements it does not list are zero, e.g. vLLM's
  vocabulary padding), so the result is dense from there on.

The engine keeps serving during all of this; only the final scatter pauses it. This module
knows manifests, blobs and TensorUpdate; it never touches live tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltasync.errors import (
    BaseVersionMismatchError,
    BlobMismatchError,
    DigestMismatchError,
    FormatError,
    KeyNotFoundError,
    ManifestError,
    MissingBlobError,
    TruncatedBlobError,
)
from deltasync.format import TensorSpec, TensorUpdate, decode_blob
from deltasync.manifest import Manifest, blob_digest
from deltasync.store import Store


def check_chain(manifests: Sequence[Manifest], from_version: int | None, shard: str) -> None:
    """Refuse a chain that does not start at ``from_version`` (None: only an anchor can start
    it) or whose steps do not follow each other, or that does not define ``shard``."""
    if not manifests:
        raise ManifestError("empty chain: nothing to apply")
    prev = from_version
    for i, m in enumerate(manifests):
        if shard not in m.shard_digests:
            raise ManifestError(
                f"version {m.version} does not define receiver shard {shard!r} (it has "
                f"{list(m.shard_digests)[:8]}): this store is published for another layout"
            )
        if m.kind == "anchor":
            if i:
                raise ManifestError(f"anchor {m.version} in the middle of a chain: plan it first")
        elif prev is None:
            raise BaseVersionMismatchError(
                f"delta version {m.version} (base {m.base_version}) cannot be applied on tensors "
                "that hold no verified version; restore an anchor first"
            )
        elif m.base_version != prev:
            raise BaseVersionMismatchError(
                f"delta version {m.version} applies on base {m.base_version}, but the tensors "
                f"hold version {prev}; refusing it before any write (replay the versions in "
                "between or restore the newest anchor)"
            )
        prev = m.version


def fetch_version(
    store: Store,
    manifest: Manifest,
    shard: str,
    specs: Mapping[str, TensorSpec],
    *,
    max_decompressed_bytes: int = 1 << 36,
) -> tuple[list[TensorUpdate], int]:
    """Verified, decoded updates of ``shard`` in ``manifest`` (one per local tensor) and the
    bytes fetched."""
    per_blob: list[list[TensorUpdate]] = []
    fetched = 0
    base = -1 if manifest.kind == "anchor" else manifest.base_version
    for entry in manifest.blobs_for(shard):
        where = f"version {manifest.version} blob {entry.key!r}"
        try:
            data = store.get(entry.key)
        except KeyNotFoundError:
            raise MissingBlobError(
                f"{where} is listed in the committed manifest but missing from the store "
                "(deleted by retention or never uploaded); nothing was applied"
            ) from None
        fetched += len(data)
        if len(data) != entry.size:
            cls = TruncatedBlobError if len(data) < entry.size else FormatError
            raise cls(
                f"{where} is {len(data)} bytes but the manifest says {entry.size}: "
                f"{'truncated' if len(data) < entry.size else 'extended'} in storage or "
                "transit, or replaced by another blob; nothing was applied"
            )
        if blob_digest(data) != entry.digest:
            raise DigestMismatchError(
                f"{where} does not match the manifest's digest {entry.digest}: corrupted, or "
                "replaced by another blob (a replay or a racing publisher); nothing was applied"
            )
        decoded = decode_blob(
            data, expected=specs, version=manifest.version, base_version=base, shard=shard,
            max_decompressed_bytes=max_decompressed_bytes,
        )  # fmt: skip
        if decoded.header.writer != entry.writer:
            raise BlobMismatchError(
                f"{where} was written by {decoded.header.writer!r}, the manifest says "
                f"{entry.writer!r}: a blob copied from another writer; nothing was applied"
            )
        per_blob.append(decoded.updates)
    return merge_writers(manifest.version, per_blob), fetched


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
        out.append(TensorUpdate(
            name=name, shape=u0.shape, dtype=u0.dtype, indices=idx, values=vals[order]
        ))  # fmt: skip
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
            out.append(TensorUpdate(
                name=name, shape=spec.shape, dtype=spec.dtype, indices=None, values=dense[name]
            ))  # fmt: skip
        elif name in sparse:
            idx, vals = _last_wins(sparse[name])
            out.append(TensorUpdate(
                name=name, shape=spec.shape, dtype=spec.dtype, indices=idx, values=vals
            ))  # fmt: skip
    return out
