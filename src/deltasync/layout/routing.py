"""Routing: trainer coordinates -> canonical coordinates -> every receiver shard that holds them.

Pure tensor planning (no I/O, no store, no process group; the storage publisher and the
in-cluster sender both call it)::

    (param, sorted local flat indices, BF16 values)   one tracker change, or every element
      -> TrainerLayout: param (or its FSDP dim-0 shard) coords -> canonical coords
      -> ReceiverLayout.route_changes: canonical -> every shard holding the element, merged per
         local tensor (q/k/v land in one sorted qkv_proj update)
      -> {shard: [TensorUpdate, ...]} in the shard's local tensor order

Values are absolute BF16 values (round to nearest even from an fp32 master, exactly what the
trainer's own BF16 copy holds; never a difference). For anchors, :func:`full_shard_tensors`
builds every shard's complete BF16 state from the FULL parameters (never from a delta), so an
anchor cannot inherit a detection miss; its cost is a transient BF16 copy of the model, which
this module deliberately does not hide.

A parameter split into row pieces (the vocab-parallel embedding, :func:`row_pieces`) is
routed piece by piece: :func:`routed_pieces` gives each piece's updates with its int64
indices and values, :func:`parted_pieces` gives each target a :class:`PartedUpdate` whose
indices and values the encoder reads a bounded slice at a time (the store path's background:
nothing of a piece exists whole but the record's bytes).

This module knows layouts, TensorUpdate and PartedUpdate; it knows nothing about trackers,
blobs, keys or stores.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError, LayoutError
from deltasync.format import TensorUpdate
from deltasync.format.updates import INT32_NUMEL, Part, PartedUpdate
from deltasync.layout.blocks import numel
from deltasync.layout.receiver_layout import ReceiverLayout
from deltasync.layout.trainer_layout import TrainerLayout
from deltasync.native.ops import bf16_at, first_not_increasing

ShardUpdates = dict[str, list[TensorUpdate]]
PartedShardUpdates = dict[str, list[PartedUpdate]]
Change = tuple[str, torch.Tensor, torch.Tensor | None]  # (param, sorted indices, bf16 values)
ShardTensors = dict[str, dict[str, torch.Tensor]]

# Sources whose cast to BF16 is the trainer's own (documented) rounding, or exact.
_SOURCE_DTYPES = (torch.float32, torch.bfloat16)


def check_param(name: str, p: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, torch.Tensor):
        raise ConfigError(f"param {name!r} is a {type(p).__name__}, not a tensor")
    if p.dtype not in _SOURCE_DTYPES:
        raise ConfigError(
            f"param {name!r} is {p.dtype}; deltasync sends BF16 cast from an fp32 master or BF16 "
            "params (a cast from another dtype would not be what the trainer's BF16 copy holds)"
        )
    if p.is_meta:
        raise ConfigError(
            f"param {name!r} is on the meta device and holds no values; pass the materialized "
            "parameter (e.g. after to_empty() and loading its weights)"
        )
    return p.detach()


def gather_bf16(name: str, param: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """BF16 values of ``param`` at sorted flat row-major ``indices`` (RNE cast from fp32)."""
    p = check_param(name, param)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise ConfigError(f"changed[{name!r}] must be a 1-D tensor of flat indices")
    idx = indices.to(device=p.device, dtype=torch.int64)
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= p.numel()):
        raise ConfigError(
            f"changed[{name!r}] spans [{int(idx[0])}, {int(idx[-1])}] outside the param's "
            f"{p.numel()} elements (are the indices local to this rank's shard?)"
        )
    try:
        return bf16_at(p, idx)
    except ConfigError as e:
        raise ConfigError(f"changed[{name!r}]: {e}") from None


def _given_values(name: str, count: int, values: torch.Tensor) -> torch.Tensor:
    """Values the caller captured with ``count`` 1-D indices (a tracker's
    ``changed_values()``)."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.bfloat16:
        raise ConfigError(
            f"values[{name!r}] must be a BF16 tensor (the current params' BF16 values at the "
            f"changed indices), got {getattr(values, 'dtype', type(values).__name__)}"
        )
    if values.dim() != 1 or values.numel() != count:
        raise ConfigError(
            f"values[{name!r}] holds {values.numel()} values for {count} changed "
            "indices; pass the pair from one changed_values() call"
        )
    return values.cpu()


def checked_changes(changes: Iterable[Change], *, lazy: tuple[type, ...] = ()) -> Iterator[Change]:
    """A tracker's change stream (``iter_changes()``), checked lazily item by item.

    Args:
        changes: ``(name, sorted int64 indices, bf16 values)`` triples.
        lazy: types the caller decodes itself, standing in for the indices (the publisher's
            captured positions, with the values None or as many as they hold).

    Returns:
        The same triples; a malformed item raises ConfigError when it is reached, before
        anything of it is routed.
    """
    if isinstance(changes, Mapping):
        raise ConfigError(
            "changes must be a stream of (name, indices, bf16 values) triples, e.g. "
            "tracker.iter_changes(), not a dict"
        )
    for item in changes:
        if not isinstance(item, tuple) or len(item) != 3 or not isinstance(item[0], str):
            raise ConfigError(
                "a stream of changes yields (name, indices, bf16 values) triples (a tracker's "
                f"iter_changes()), got {type(item).__name__}"
                + (f" of length {len(item)}" if isinstance(item, tuple) else "")
            )
        name, indices, values = item
        if lazy and isinstance(indices, lazy):
            if values is not None:
                _given_values(name, len(indices), values)
            yield item
            continue
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ConfigError(f"changes for {name!r}: indices must be a 1-D tensor of flat indices")
        _given_values(name, indices.numel(), values)
        yield item


def canonical_changes(
    changed: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    rank: int = 0,
    world_size: int = 1,
    values: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{canonical name: (sorted int64 indices, bf16 values)}`` of every changed element.

    ``params`` and the indices in ``changed`` are this rank's (FSDP dim-0 shard of the) trainer
    parameters; ``rank``/``world_size`` place the shard in the full tensor. ``values``, when
    given, are the params' current BF16 values at those indices (captured by the detection
    pass); otherwise they are gathered from ``params`` here."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, indices in changed.items():
        if name not in params:
            raise ConfigError(
                f"the tracker reports changes in {name!r}, which is not in params; pass the same "
                "named parameters the tracker watches"
            )
        if indices.numel() == 0:
            continue
        idx = indices.to(torch.int64).cpu()
        if values is not None and name in values:
            check_param(name, params[name])
            vals = _given_values(name, idx.numel(), values[name])
        else:
            vals = gather_bf16(name, params[name], idx)
        routed = trainer_layout.route_values(name, idx, vals, rank=rank, world_size=world_size)
        for canon, pair in routed.items():
            if canon in out:  # the trainer table is a bijection; two params never share one
                raise LayoutError(
                    f"canonical tensor {canon!r} is reached from two params; pass each tied "
                    "parameter once (as model.named_parameters() lists them)"
                )
            out[canon] = pair
    return out


def narrowed(u: TensorUpdate) -> TensorUpdate:
    """``u`` with int32 indices where its tensor has fewer than 2^31 elements (half the bytes
    while routed updates wait for their encoding; the encoder writes the same record)."""
    if u.indices is None or u.indices.dtype != torch.int64 or u.numel > INT32_NUMEL:
        return u
    return TensorUpdate(
        name=u.name, shape=u.shape, dtype=u.dtype, indices=u.indices.int(), values=u.values
    )


def route_to_shards(
    changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, receiver_layout: ReceiverLayout
) -> ShardUpdates:
    """Canonical changes -> one list of sparse updates per receiver shard (empty if none), in
    each shard's own tensor order (deterministic bytes). Costs what was routed, not the size of
    the layout: a streaming publisher calls it once per parameter group."""
    routed = receiver_layout.route_changes(changes) if changes else {}
    dtype = receiver_layout.spec.dtype
    out: ShardUpdates = {}
    for info in receiver_layout.shards():
        mine = routed.get(info.id)
        if not mine:
            out[info.id] = []
            continue
        shapes = receiver_layout.table.dst_shapes[info.id]
        locals_ = sorted(mine, key=lambda n, s=info.id: receiver_layout.local_position(s, n))
        out[info.id] = [
            TensorUpdate(
                name=local,
                shape=shapes[local],
                dtype=dtype,
                indices=mine[local][0],
                values=mine[local][1],
            )
            for local in locals_
            if mine[local][0].numel()
        ]
    return out


def shard_updates(
    changed: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    rank: int = 0,
    world_size: int = 1,
    values: Mapping[str, torch.Tensor] | None = None,
) -> ShardUpdates:
    """Tracker output -> ``{shard: [TensorUpdate]}`` with current BF16 values (``values``:
    see :func:`canonical_changes`)."""
    changes = canonical_changes(
        changed,
        params,
        trainer_layout=trainer_layout,
        rank=rank,
        world_size=world_size,
        values=values,
    )
    return route_to_shards(changes, receiver_layout=receiver_layout)


def padding_updates(receiver_layout: ReceiverLayout, shards: Iterable[str]) -> ShardUpdates:
    """An anchor's records for the local tensors no source element reaches: empty ones, which
    the receivers apply by zeroing the tensor. An anchor defines every local tensor, but one
    routed from the trainer's elements (several writers, the in-cluster sender) has nothing
    for these; the receivers would refuse it as incomplete."""
    out: ShardUpdates = {}
    for shard in shards:
        specs = receiver_layout.local_specs(shard)
        out[shard] = [
            TensorUpdate(
                name=name,
                shape=specs[name].shape,
                dtype=specs[name].dtype,
                indices=torch.empty(0, dtype=torch.int64),
                values=torch.empty(0, dtype=specs[name].dtype),
            )
            for name in receiver_layout.table.uncovered(shard)
        ]
    return out


@dataclass(frozen=True)
class RowPiece:
    """A flat range ``[start, stop)`` of one trainer parameter whose elements land, by a
    constant shift, in receiver tensors that no other piece of the parameter writes:
    ``targets`` are ``(shard, local, shift, local shape)``. Routing a parameter piece by piece
    (:func:`piece_updates`) gives each target its complete, final update from that piece
    alone, so only one piece's indices ever exist (the vocab-parallel embedding: one piece
    per TP rank)."""

    start: int
    stop: int
    targets: tuple[tuple[str, str, int, tuple[int, ...]], ...]


def row_pieces(
    param_name: str,
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    world_size: int = 1,
) -> tuple[RowPiece, ...] | None:
    """The pieces of ``param_name`` (see :class:`RowPiece`), or None when the parameter is not
    one contiguous canonical tensor split into full-width row blocks with two or more distinct
    row ranges, each into receiver tensors no other tensor feeds (then it is routed whole, by
    :func:`shard_updates`). Pure planning over the
    tables; an FSDP writer's shard (``world_size > 1``) is routed whole."""
    if world_size != 1:
        return None
    try:
        tname = trainer_layout.resolve(param_name)
    except LayoutError:
        return None
    tpls = trainer_layout._table.placements.get(tname, [])  # params -> canonical
    if len(tpls) != 1 or not tpls[0].block.contiguous:
        return None
    tb, canon = tpls[0].block, tpls[0].local
    p_start, p_stop = tb.src_span()
    if p_start != 0 or p_stop != numel(trainer_layout._table.src_shapes[tname]):
        return None
    c_start = tb.dst_span()[0]  # canonical flat = param flat + c_start
    ranges: dict[tuple[int, int], list[tuple[str, str, int, tuple[int, ...]]]] = {}
    owner: dict[tuple[str, str], tuple[int, int]] = {}
    table = receiver_layout.table
    for pl in table.placements.get(canon, []):
        b = pl.block
        if not b.size:
            continue
        if not b.contiguous:
            return None
        a, z = b.src_span()
        key = (a - c_start, z - c_start)
        if owner.setdefault((pl.shard, pl.local), key) != key:
            return None  # one receiver tensor fed from two row ranges: route whole
        shift = b.dst_span()[0] - a + c_start
        ranges.setdefault(key, []).append(
            (pl.shard, pl.local, shift, tuple(table.dst_shapes[pl.shard][pl.local]))
        )
    if len(ranges) < 2:
        return None
    # A target must be fed by this canonical tensor alone (not a fused qkv_proj that q, k and
    # v share): its update is then complete from this parameter's pieces.
    for other, pls in table.placements.items():
        if other != canon and any((pl.shard, pl.local) in owner for pl in pls if pl.block.size):
            return None
    ordered = sorted(ranges)
    if any(x[1] != y[0] for x, y in itertools.pairwise(ordered)):
        return None  # not a partition of the parameter into consecutive ranges
    if ordered[0][0] != 0 or ordered[-1][1] != p_stop:
        return None
    return tuple(
        RowPiece(
            start=a,
            stop=z,
            targets=tuple(
                sorted(ranges[(a, z)], key=lambda t: receiver_layout.local_position(t[0], t[1]))
            ),
        )
        for a, z in ordered
    )


def piece_updates(
    name: str,
    piece: RowPiece,
    indices: torch.Tensor,
    values: torch.Tensor,
    *,
    receiver_layout: ReceiverLayout,
) -> ShardUpdates:
    """One piece's changes (sorted int64 flat indices of ``name`` inside the piece, and their
    BF16 values) as ``{shard: [TensorUpdate]}``: each target's complete update. ``indices``
    is consumed: shifted in place into the first target's coordinates (no copy of the piece's
    indices; replicas with another shift get their own).

    Raises:
        ConfigError: indices outside the piece, unsorted or duplicated, or not one value each.
    """
    if indices.dtype != torch.int64 or indices.dim() != 1 or values.shape != indices.shape:
        raise ConfigError(
            f"changes for {name!r}: a piece needs 1-D int64 indices and one BF16 value each"
        )
    n = indices.numel()
    if n == 0:
        return {}
    if int(indices[0]) < piece.start or int(indices[-1]) >= piece.stop:
        raise ConfigError(
            f"changes for {name!r} span [{int(indices[0])}, {int(indices[-1])}] outside the "
            f"piece [{piece.start}, {piece.stop})"
        )
    bad = first_not_increasing(indices) if indices.device.type == "cpu" else -1
    if bad >= 0:
        raise ConfigError(f"changes for {name!r} are not strictly increasing at position {bad}")
    values = values.cpu()
    dtype = receiver_layout.spec.dtype
    out: ShardUpdates = {}
    current = 0  # the shift ``indices`` holds now
    shifted: dict[int, torch.Tensor] = {}
    for shard, local, shift, shape in piece.targets:
        dst = shifted.get(shift)
        if dst is None:
            if not shifted:
                dst = indices.add_(shift - current) if shift != current else indices
                current = shift
            else:
                dst = indices + (shift - current)
            shifted[shift] = dst
        out.setdefault(shard, []).append(
            TensorUpdate(name=local, shape=shape, dtype=dtype, indices=dst.cpu(), values=values)
        )
    return out


def routed_pieces(
    name: str,
    positions,
    local: torch.Tensor,
    pieces: tuple[RowPiece, ...],
    *,
    receiver_layout: ReceiverLayout,
) -> Iterator[ShardUpdates]:
    """``name``'s captured changes routed piece by piece (the vocab-parallel embedding: one piece
    per TP rank), for both senders: each piece's positions decoded, its BF16 values read from
    ``local`` (this rank's tensor) and its targets' updates yielded before the next piece is
    decoded, so one piece's indices and values are the most this parameter ever holds (never
    the whole parameter's int64 positions). One index buffer and one value buffer serve every
    piece: the caller must be done with a piece's updates (encoded them) before it asks for
    the next.

    ``positions`` is the parameter's captured ``Positions`` (anything with ``len()`` and
    ``ranges(bounds, reuse=True)``).

    Raises:
        ConfigError: positions outside the parameter's elements.
    """
    bounds = [p.start for p in pieces] + [pieces[-1].stop]
    seen = 0
    values: torch.Tensor | None = None
    for piece, idx in zip(pieces, positions.ranges(bounds, reuse=True), strict=True):
        seen += idx.numel()
        if not idx.numel():
            continue
        if values is None or values.numel() < idx.numel():  # sized as the index buffer
            largest = max(idx.numel(), idx.untyped_storage().nbytes() // idx.element_size())
            values = torch.empty(largest, dtype=torch.bfloat16)
        vals = bf16_at(local, idx, trusted=True, out=values)  # ranges() clips to the bounds
        updates = piece_updates(name, piece, idx, vals, receiver_layout=receiver_layout)
        del idx, vals
        yield updates
    if seen != len(positions):
        raise ConfigError(
            f"{len(positions) - seen} changed position(s) of {name!r} lie outside its "
            f"{pieces[-1].stop} elements (are the indices local to this rank?)"
        )


# Positions decoded, read and encoded at a time by parted_pieces: its working set (about 10
# bytes per position: the int64 slice, its shifted copy, its BF16 values) is a few hundred
# KiB whatever the piece holds, and slices this small decoded faster here than 2^20 ones.
SLICE = 1 << 16


class _Cursor:
    """Walks one parameter's captured positions in order, a slice at a time, and hands out
    the positions inside ``[start, stop)`` ranges: ranges asked for in ascending order cost one
    decoding pass in all (a slice that straddles a range end is kept for the next range); a
    range that starts behind the walk starts it again (correct, just slower). Each handed-out
    slice comes with its ordinal: how many positions of the parameter come before it."""

    def __init__(self, positions, size: int) -> None:
        self._positions, self._size = positions, size
        self._slices: Iterator[torch.Tensor] | None = None
        self._held: torch.Tensor | None = None
        self._held_at = 0  # the ordinal of the held slice's first position
        self._next_at = 0  # the ordinal of the next slice's first position
        self._at = 0  # every position below this has been handed out or skipped

    def take(self, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int]]:
        if self._slices is None or start < self._at:
            self._slices, self._held = iter(self._positions.slices(self._size)), None
            self._next_at = 0
        self._at = stop
        cuts = torch.tensor([start, stop], dtype=torch.int64)
        while True:
            if self._held is not None:
                part, at, self._held = self._held, self._held_at, None
            else:
                part, at = next(self._slices, None), self._next_at
                if part is None:
                    return
                self._next_at += part.numel()
            part = part.cpu()  # a GPU tracker's positions: the slices are read on the host
            lo, hi = torch.searchsorted(part, cuts).tolist()
            if hi < part.numel():
                self._held, self._held_at = part[hi:], at + hi
            if lo < hi:
                yield part[lo:hi], at + lo
            if self._held is not None:
                return


def _piece_summaries(
    name: str, positions, pieces: tuple[RowPiece, ...], size: int
) -> list[tuple[int, int, int]]:
    """Per piece ``(count, first, largest gap)`` of the captured positions inside it, in one
    decoding pass (what a parted record's header needs before its first byte).

    Raises:
        ConfigError: positions outside the parameter's elements.
    """
    bounds = [p.start for p in pieces] + [pieces[-1].stop]
    cuts = torch.tensor(bounds, dtype=torch.int64)
    out = [[0, 0, 0] for _ in pieces]
    last = [0] * len(pieces)
    gaps = torch.empty(size, dtype=torch.int64)
    outside = 0
    for part in positions.slices(size):
        part = part.cpu()
        at = torch.searchsorted(part, cuts).tolist()
        outside += at[0] + part.numel() - at[-1]
        for i, row in enumerate(out):
            a, b = at[i], at[i + 1]
            if a == b:
                continue
            seg = part[a:b]
            if row[0]:
                row[2] = max(row[2], int(seg[0]) - last[i])
            else:
                row[1] = int(seg[0])
            if b - a > 1:
                g = torch.sub(seg[1:], seg[:-1], out=gaps[: b - a - 1])
                row[2] = max(row[2], int(g.max()))
            row[0] += b - a
            last[i] = int(seg[-1])
    if outside:
        raise ConfigError(
            f"{outside} changed position(s) of {name!r} lie outside its {pieces[-1].stop} "
            "elements (are the indices local to this rank?)"
        )
    return [(c, f, g) for c, f, g in out]


def parted_pieces(
    name: str,
    positions,
    local: torch.Tensor,
    pieces: tuple[RowPiece, ...],
    *,
    receiver_layout: ReceiverLayout,
    size: int = SLICE,
    values: torch.Tensor | None = None,
) -> Iterator[PartedShardUpdates]:
    """``name``'s captured changes routed piece by piece like :func:`routed_pieces`, each
    target's update a :class:`PartedUpdate` whose parts are ``size``-position slices of the
    captured positions (shifted into the target's coordinates) and the BF16 values read from
    ``local`` at them: the encoder writes each slice into the record and asks for the next,
    so neither a piece's int64 indices nor its values ever exist whole (a piece of the 0.6B's
    embedding: ~4 M changed elements, 40 MB as int64 indices and values). One decoding pass
    summarises every piece (count, first index, largest gap: the record headers); encoding the
    pieces in order decodes the positions once more. The slice buffers are shared: encode one
    update's parts before iterating another's.

    ``positions`` is the parameter's captured ``Positions`` (anything with ``len()`` and
    ``slices(size)``); ``values``, when given, the BF16 values at all of them (detection's),
    sliced instead of read from ``local``.

    Raises:
        ConfigError: positions outside the parameter's elements (before any value is read).
    """
    assert size >= 1
    summaries = _piece_summaries(name, positions, pieces, size)
    if values is not None:
        _given_values(name, len(positions), values)
    cursor = _Cursor(positions, size)
    shifted = torch.empty(size, dtype=torch.int64)
    read = torch.empty(size, dtype=torch.bfloat16)
    dtype = receiver_layout.spec.dtype

    def indices(piece: RowPiece, shift: int) -> Iterator[torch.Tensor]:
        for idx, _ in cursor.take(piece.start, piece.stop):
            yield torch.add(idx, shift, out=shifted[: idx.numel()]) if shift else idx

    def parts(piece: RowPiece, shift: int) -> Iterator[Part]:
        for idx, at in cursor.take(piece.start, piece.stop):
            m = idx.numel()
            if values is not None:
                vals = values[at : at + m]
            else:  # checked by the summary pass
                vals = bf16_at(local, idx, trusted=True, out=read)
            yield (torch.add(idx, shift, out=shifted[:m]) if shift else idx), vals

    for piece, (count, first, max_gap) in zip(pieces, summaries, strict=True):
        if not count:
            continue
        out: PartedShardUpdates = {}
        for shard, local_name, shift, shape in piece.targets:
            out.setdefault(shard, []).append(
                PartedUpdate(
                    name=local_name,
                    shape=shape,
                    dtype=dtype,
                    nnz=count,
                    first=first + shift,
                    max_gap=max_gap,
                    parts=lambda piece=piece, shift=shift: parts(piece, shift),
                    indices=lambda piece=piece, shift=shift: indices(piece, shift),
                )
            )
        yield out


def every_element_stream(params: Mapping[str, torch.Tensor]) -> Iterator[Change]:
    """A change stream naming every element of every param (a writer's part of an anchor), one
    param at a time, so the index tensors never exist all at once."""
    for n, p in params.items():
        yield n, torch.arange(p.numel(), dtype=torch.int64), None


def every_element(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`every_element_stream` as a ``changed`` dict."""
    return {n: idx for n, idx, _ in every_element_stream(params)}


def canonical_bf16(
    params: Mapping[str, torch.Tensor], *, trainer_layout: TrainerLayout
) -> dict[str, torch.Tensor]:
    """The FULL trainer params (all names, full shapes) as canonical BF16 tensors."""
    bf16 = {n: check_param(n, p).to(torch.bfloat16).cpu() for n, p in params.items()}
    return trainer_layout.to_canonical(bf16)


def full_shard_tensors(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> ShardTensors:
    """Every receiver shard's complete BF16 state from the FULL trainer params (all names,
    full shapes): what a dense refit writes, vLLM vocabulary padding zero."""
    return receiver_layout.split(canonical_bf16(params, trainer_layout=trainer_layout))


def in_stream_order(
    receiver_layout: ReceiverLayout, shard: str, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` (local tensors of ``shard``) in the order a delta routed parameter by
    parameter lists them: by the first canonical tensor (in the layout's order) each holds
    elements of. An anchor written in this order is read in lockstep with the deltas after it
    without reading any of their records ahead (a streamed delta lists ``lm_head`` last, where
    the shard's own order has it second: a receiver restoring the anchor and catching up in
    one pull held every delta's other records meanwhile)."""
    rank = stream_rank(receiver_layout, shard)
    return dict(sorted(tensors.items(), key=lambda item: rank.get(item[0], len(rank))))


@functools.lru_cache(maxsize=64)
def stream_rank(receiver_layout: ReceiverLayout, shard: str) -> dict[str, int]:
    """``{local tensor of shard: its place}`` in the order a stream of the canonical tensors
    (in the layout's order, as a trainer's parameters come) first reaches each: the order
    every blob of one publisher lists its records in (anchors, and each segment of a delta;
    the segments themselves come in parameter order)."""
    rank: dict[str, int] = {}
    for name in receiver_layout.canonical_specs():
        for s, local in receiver_layout.holders(name):
            if s == shard:
                rank.setdefault(local, len(rank))
    return rank


def count_elements(updates: list[TensorUpdate]) -> int:
    return sum(u.nnz for u in updates)
