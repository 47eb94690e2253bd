"""Merge and fold of decoded updates (pure): several writers' blobs, and a chain of versions.

- :func:`merge_writers`: one update per local tensor from the blobs of several writers of one
  version (their elements are disjoint; an overlap is a publisher bug and refused; the records
  of a 0-element tensor, e.g. an EP rank's experts when EP exceeds the expert count, cover
  nothing and are disjoint whatever their encoding);
- :func:`fold_chain`: one update per local tensor for a whole chain: later values win; an
  anchor defines the full state (elements it does not list are zero, e.g. vLLM's vocabulary
  padding), so the result is dense from there on.

Both transports use these: a storage pull over the blobs it fetched, an in-cluster receiver
over the payloads it was sent. This module knows TensorUpdate and TensorSpec; it knows nothing
about stores, manifests or live tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltasync.errors import BlobMismatchError
from deltasync.format.updates import SparsePiece, TensorSpec, TensorUpdate, materialized


def merge_writers(version: int, per_blob: Sequence[Sequence[TensorUpdate]]) -> list[TensorUpdate]:
    """One update per tensor; updates of one tensor from several writers must be disjoint."""
    by_name: dict[str, list[TensorUpdate]] = {}
    for updates in per_blob:
        for u in updates:
            by_name.setdefault(u.name, []).append(u)
    out = []
    for name, ups in by_name.items():
        if len(ups) == 1 or _cover_nothing(ups):
            out.append(ups[0])  # a 0-element tensor's records hold nothing: keep one
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


def _cover_nothing(ups: Sequence[TensorUpdate]) -> bool:
    """Whether every one of ``ups`` is of a 0-element tensor: each writer of an anchor sends a
    record for a tensor no element of the trainer reaches (``padding_updates``), and the
    encoder writes an empty record of a 0-element tensor as dense (it names every element),
    so several writers' records of it are several dense ones, which cover nothing and so
    cannot overlap. A record of a non-empty tensor among them keeps the disjointness check."""
    return all(u.numel == 0 for u in ups)


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
                    buf.index_copy_(0, u.indices.long(), u.values)  # type: ignore[union-attr]
                dense[name] = buf
            continue
        for u in updates:
            if u.name in dense:
                if u.is_dense:
                    dense[u.name].copy_(u.values)
                elif u.nnz:
                    dense[u.name].index_copy_(0, u.indices.long(), u.values)  # type: ignore[union-attr]
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


# --- streaming: a chain's records grouped per tensor, one tensor at a time ---------------


class RecordStream(Protocol):
    """One blob's records in blob order (a :class:`~deltasync.format.decode.BlobRecords`,
    or :class:`Records` over a decoded list): iterable more than once, same records each time."""

    def __iter__(self) -> Iterator[TensorUpdate]: ...

    def names(self) -> list[str]: ...


class Records:
    """A decoded list of updates as a :class:`RecordStream`."""

    def __init__(self, updates: Sequence[TensorUpdate]) -> None:
        self.updates = list(updates)

    def __iter__(self) -> Iterator[TensorUpdate]:
        return iter(self.updates)

    def names(self) -> list[str]:
        return [u.name for u in self.updates]


class NamedOnce:
    """A blob's records (a :class:`RecordStream`) whose tensor names are read once:
    ``names()`` of a blob that stays compressed decompresses its whole record section, and a
    chain read in lockstep by those names, or read twice, asks for them again (the bytes are
    immutable)."""

    def __init__(self, records: RecordStream) -> None:
        self.records = records
        self._names: list[str] | None = None

    def __iter__(self) -> Iterator[TensorUpdate]:
        return iter(self.records)

    def names(self) -> list[str]:
        if self._names is None:
            self._names = self.records.names()
        return list(self._names)


@dataclass(frozen=True, eq=False)
class TensorPieces:
    """Everything a chain writes into one tensor, in chain order: the tensor starts from its
    live values, or from zeros when ``from_zero`` (the chain starts with an anchor: elements
    it does not list are zero), then each piece overwrites its elements (later pieces win;
    the pieces of one version come from different writers and are disjoint)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    from_zero: bool
    pieces: tuple[TensorUpdate, ...]

    @property
    def nnz(self) -> int:
        """Elements the pieces list (an element listed by two versions counts twice)."""
        return sum(p.nnz for p in self.pieces)

    def start(self) -> int:
        """Index of the first piece that matters: the last dense one (it overwrites everything
        before it), else 0."""
        for k in range(len(self.pieces) - 1, -1, -1):
            if self.pieces[k].is_dense:
                return k
        return 0


# (version, kind, the streams of that version's writers) in chain order
ChainStep = tuple[int, str, Sequence[RecordStream]]


def _check_disjoint(version: int, name: str, ups: Sequence[TensorUpdate]) -> None:
    if len(ups) < 2 or _cover_nothing(ups):
        return
    if any(u.is_dense for u in ups):
        raise BlobMismatchError(
            f"version {version}: tensor {name!r} has a dense update and another update from "
            "a second writer; writers' elements must be disjoint (publisher bug)"
        )
    if _share_an_element([u for u in ups if u.nnz]):
        raise BlobMismatchError(
            f"version {version}: two writers sent the same element of tensor {name!r}; "
            "writers' elements must be disjoint (publisher bug)"
        )


_CHECK_CHUNK = 1 << 16  # indices per step of the disjointness check (stays in cache)


def _share_an_element(pieces: Sequence[SparsePiece]) -> bool:
    """Whether two of ``pieces`` (sparse, one per writer) hold the same element, in memory of
    a chunk, not of the indices (a sort of their concatenation held ~24 bytes an element of
    an anchor's largest tensor: several times the tensor, and most of a multi-writer
    anchor's verify time). A piece's indices are strictly increasing when the decoder read
    them; the check is exact for any input all the same: a piece whose order is not proven
    (``index_range()`` None) is checked by that sort. Writers of dim-0 rows usually hold
    index ranges that do not even overlap (decided from the first and last index, without
    reading a stashed piece's indices back); where they interleave (a fused tensor's row
    blocks), each pair is checked chunk by chunk: the chunk's index range cut out of the
    other side, and each index of the chunk looked up there (``searchsorted``)."""
    if len(pieces) < 2:
        return False
    ranges = [p.index_range() for p in pieces]
    if any(r is None for r in ranges):
        idx = torch.sort(torch.cat([p.all_indices().to(torch.int64) for p in pieces])).values
        return idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all())
    spans = sorted((*r, k) for k, r in enumerate(ranges))  # type: ignore[misc]
    for at, (_lo, hi, k) in enumerate(spans):
        for lo2, _hi2, k2 in spans[at + 1 :]:
            if lo2 > hi:
                break  # sorted by first index: no later range reaches back into this one
            x, y = (pieces[j].all_indices().detach().cpu().numpy() for j in (k, k2))
            if _pair_shares(x, y):
                return True
    return False


def _pair_shares(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether the strictly increasing ``x`` and ``y`` hold a common value."""
    if x.size > y.size:
        x, y = y, x
    top = np.iinfo(y.dtype).max
    for a in range(0, x.size, _CHECK_CHUNK):
        chunk = x[a : a + _CHECK_CHUNK]
        if chunk.dtype != y.dtype:  # compared in y's type: a value above it is not in y
            chunk = chunk[chunk <= top].astype(y.dtype)
            if not chunk.size:
                continue
        lo = int(np.searchsorted(y, chunk[0], side="left"))
        hi = int(np.searchsorted(y, chunk[-1], side="right"))
        if hi <= lo:
            continue  # nothing of y inside this chunk's range
        part = y[lo:hi]
        at = np.searchsorted(part, chunk)
        np.minimum(at, part.size - 1, out=at)
        if bool((part[at] == chunk).any()):
            return True
    return False


def iter_chain(
    steps: Sequence[ChainStep],
    specs: Mapping[str, TensorSpec],
    *,
    check: bool = True,
    keep: Callable[[TensorUpdate], TensorUpdate] | None = None,
) -> Iterator[TensorPieces]:
    """The chain's updates one tensor at a time (tensors no step touches are not yielded).

    Holds one tensor's pieces (plus, per stream, the records read ahead of the tensor being
    gathered: none when every blob lists its tensors in the same order, as one publisher's
    writers do). One stream is read once; several are read through their record headers
    first (``names()``) to know where each tensor's pieces are. With ``check`` the writers
    of one version are proven disjoint and an anchor proven complete, both before the last
    tensor is yielded: a caller that consumes the whole iterator before writing anything has
    every check behind it.

    ``keep`` (several streams only) takes each record as it is read, before the next one is
    decoded, and returns what the tensor's pieces hold in its place (e.g.
    :meth:`deltasync.format.stash.Stash.keep`: a large sparse piece parked in a file).

    Raises BlobMismatchError (an incomplete anchor, overlapping writers); the streams raise
    their own FormatErrors."""
    if any(kind == "anchor" for _, kind, _ in steps[1:]):
        raise BlobMismatchError("an anchor in the middle of a chain: plan it first")
    from_zero = bool(steps) and steps[0][1] == "anchor"
    flat = [(version, stream) for version, _, streams in steps for stream in streams]
    grouped = _alone(*flat[0]) if len(flat) == 1 else _lockstep(flat, keep)
    given: set[str] = set()
    # No reference to a tensor's pieces outlives its turn (``del`` below, and in the
    # groupers): a dense record (an anchor's embedding: a large part of a shard) must be
    # freed before the next one is decoded, or a pull holds two.
    for name, pieces in grouped:
        spec = specs.get(name)
        if spec is None:  # the streams check names against the specs; this guards Records
            raise BlobMismatchError(f"tensor {name!r} is not one of the shard's tensors")
        if check:
            _check_writers(name, pieces)
        if from_zero and pieces[0][0] == steps[0][0]:
            given.add(name)
        item = TensorPieces(
            name=name,
            shape=spec.shape,
            dtype=spec.dtype,
            from_zero=from_zero,
            pieces=tuple(u for _, u in pieces),
        )
        del pieces
        yield item
        del item
    if check and from_zero:
        check_anchor_complete(steps[0][0], given, specs)


def _check_writers(name: str, pieces: Sequence[tuple[int, TensorUpdate]]) -> None:
    """The pieces of one version (several writers' records of ``name``) are disjoint."""
    by_version: dict[int, list[TensorUpdate]] = {}
    for version, u in pieces:
        by_version.setdefault(version, []).append(u)
    for version, ups in by_version.items():
        _check_disjoint(version, name, ups)


def _alone(
    version: int, stream: RecordStream
) -> Iterator[tuple[str, list[tuple[int, TensorUpdate]]]]:
    """One stream's records, each as its tensor's only piece."""
    for u in stream:
        name, pieces = u.name, [(version, u)]
        del u  # the record is the caller's alone while the next one is read
        yield name, pieces
        del pieces


def _kept(keep: Callable[[TensorUpdate], TensorUpdate] | None, u: TensorUpdate) -> TensorUpdate:
    return u if keep is None else keep(u)


def check_anchor_complete(
    version: int, given: Collection[str], specs: Mapping[str, TensorSpec], shard: str | None = None
) -> None:
    """An anchor restores every local tensor: refuse one that leaves a tensor out, before
    anything is written. (Elements it does not list, e.g. vLLM's vocabulary padding, are zero;
    the state digest, checked before the write, proves that they are.)

    Raises:
        BlobMismatchError: naming the anchor, the missing tensors and the remedy.
    """
    missing = [name for name in specs if name not in given]
    if missing:
        of = f" of shard {shard!r}" if shard is not None else ""
        raise BlobMismatchError(
            f"anchor version {version} has no values for tensors {missing[:5]}{of} "
            f"({len(missing)} of {len(specs)}): an incomplete anchor cannot restore the "
            "shard; nothing was applied. Publish a new anchor"
        )


def _lockstep(
    flat: Sequence[tuple[int, RecordStream]],
    keep: Callable[[TensorUpdate], TensorUpdate] | None = None,
) -> Iterator[tuple[str, list[tuple[int, TensorUpdate]]]]:
    """Group several streams' records per tensor, reading every stream front to back once."""
    listed = [stream.names() for _, stream in flat]
    holders: dict[str, list[int]] = {}
    rank: dict[str, float] = {}
    for s, names in enumerate(listed):
        for pos, name in enumerate(names):
            holders.setdefault(name, []).append(s)
            # visit tensors where the streams list them (relative position), so that aligned
            # streams never read ahead
            rank[name] = min(rank.get(name, 1.0), pos / max(1, len(names)))
    iters = [iter(stream) for _, stream in flat]
    ahead: list[dict[str, TensorUpdate]] = [{} for _ in flat]
    for name in sorted(holders, key=lambda n: rank[n]):
        pieces = []
        for s in holders[name]:  # stream order is chain order
            u = ahead[s].pop(name, None)
            while u is None:
                nxt = next(iters[s])  # the headers said this stream holds ``name``
                if nxt.name == name:
                    u = nxt
                else:
                    # read whole: a lazy record is unreadable once its stream moves on
                    ahead[s][nxt.name] = _kept(keep, materialized(nxt))
            pieces.append((flat[s][0], _kept(keep, u)))
            # Dropped before the next stream's record is decoded (a kept, stashed, piece's
            # arrays are freed here), and so the pieces are the caller's alone while the
            # next tensor is read.
            u = nxt = None
        yield name, pieces
        del pieces
    for it in iters:  # run each stream's end-of-blob checks
        for extra in it:
            raise AssertionError(f"record {extra.name!r} not in the stream's headers")
