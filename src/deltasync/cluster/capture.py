"""What one in-cluster version sends: the tracker's changes joined with the carry, as blobs.

The carry is the union of the changed positions of every attempt since the last joint commit
(``ClusterSender``'s "Retries"): per parameter a :class:`~deltasync.trainer.positions.Positions`,
about 1 byte per changed element at RL densities. A version is captured in one of two forms:

- *positions* (the overlapped sender): the tracker is asked for positions only
  (``iter_positions()`` or ``iter_changed()`` where it has one, so the detection reads no
  values), each parameter's
  are joined with its carry and encoded as ``Positions`` as soon as it is detected, and that
  dict is both what the background routes and, until the version commits, the carry. No BF16
  value is held between the capture and the background: :func:`route_positions` reads the
  values from the parameters there, which nothing changes until the optimizer's next step (the
  barrier). A failed version leaves only its positions; the retry re-reads the values;
- *indices and values* (the blocking sender): the tracker's ``(name, indices, values)`` triples,
  the carried parameters' indices widened to the union and their values gathered at routing.

Either way the union is sorted and unique, values are the parameters' current BF16 bits, and
an anchor (every element) is captured as neither.

The overlapped sender's blobs are then built batch by batch (:func:`streamed_blobs`), so
nothing O(changed) but the compressed blobs and the captured positions lives at once: routing
every captured position at once would hold, next to the positions, every changed element's
canonical pair (int64 index + BF16 value) and again each receiver shard's (about 20 bytes per
element). Each batch's positions are decoded, its values read from the params, routed to every
shard and written as one segment of that shard's blob (:class:`~deltasync.format.BlobWriter`),
and dropped before the next batch. A batch closes only between parameter groups
(:func:`closing_points`, from :func:`~deltasync.layout.groups.param_groups`: a fused receiver
tensor may appear in one segment only) and gathers at least ``batch_elements`` changed
elements unless the version ends first. A parameter that splits into row pieces whose receiver
tensors no other piece writes (the vocab-parallel embedding,
:func:`~deltasync.layout.routing.row_pieces`) is routed piece by piece, one segment each,
each piece's records written a slice of positions at a time
(:func:`~deltasync.layout.routing.parted_pieces`). The
bytes differ from a one-segment blob of the same updates; what a receiver decodes from them is
the same (tests pin both).

This module knows the tracker protocol, ``Positions``, layouts, routing and the blob writer;
nothing about envelopes, process groups, threads or receivers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError, LayoutError
from deltasync.format import BlobWriter
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.groups import param_groups
from deltasync.layout.routing import (
    PartedShardUpdates,
    ShardUpdates,
    canonical_changes,
    check_param,
    checked_changes,
    parted_pieces,
    route_to_shards,
    row_pieces,
)
from deltasync.native.loader import HeapRelease, release_free_heap
from deltasync.trainer import Tracker
from deltasync.trainer.positions import Positions

Carry = dict[str, Positions]

_INTEGER = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


@dataclass(frozen=True, eq=False)
class Capture:
    """One version's captured changes.

    ``positions``: per param, what the overlapped background routes (values read there);
    ``changed``/``values``: the blocking form (int64 indices; the BF16 values the detection
    read, params absent from ``values`` gathered at routing). All three None: an anchor."""

    positions: Carry | None = None
    changed: dict[str, torch.Tensor] | None = None
    values: dict[str, torch.Tensor] | None = None
    detect_s: float = 0.0

    @property
    def anchor(self) -> bool:
        return self.positions is None and self.changed is None

    @property
    def sent(self) -> Mapping[str, Positions | torch.Tensor] | None:
        """Per param, every position this version sends (None for an anchor)."""
        return self.positions if self.positions is not None else self.changed


def _position_stream(tracker: Tracker) -> Iterator[tuple[str, torch.Tensor | Positions]]:
    """The tracker's changed positions, without values where the tracker can give them so:
    already encoded (``iter_positions()``: a whole parameter's int64 positions never exist),
    else as indices (``iter_changed()``), else from its triples."""
    encoded = getattr(tracker, "iter_positions", None)
    method = "iter_positions" if callable(encoded) else "iter_changed"
    positions_only = encoded if callable(encoded) else getattr(tracker, "iter_changed", None)
    if callable(positions_only):
        for item in positions_only():
            if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
                raise ConfigError(
                    f"a tracker's {method}() yields (name, positions) pairs, got "
                    f"{type(item).__name__}"
                )
            name, idx = item
            if isinstance(idx, Positions):
                yield name, idx
                continue
            if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in _INTEGER:
                raise ConfigError(
                    f"changes for {name!r}: indices must be a 1-D integer tensor of flat indices"
                )
            yield name, idx
        return
    for name, idx, _ in checked_changes(tracker.iter_changes()):
        yield name, idx


def capture_positions(tracker: Tracker, carry: Mapping[str, Positions]) -> Capture:
    """The tracker's changed positions joined with ``carry``, one parameter at a time (each
    parameter's int64 indices are dropped once encoded, before the next one is detected).

    Args:
        tracker: asked for positions only (``iter_positions()`` or ``iter_changed()``) where
            it offers that.
        carry: the positions of attempts since the last commit (not modified).

    Returns:
        A :class:`Capture` whose ``positions`` hold every parameter with a position to send.
    """
    t = time.perf_counter()
    out: Carry = {}
    for name, got in _position_stream(tracker):
        if not len(got):
            continue
        old = out.get(name, carry.get(name))  # a name given twice: both are sent
        if isinstance(got, Positions):
            out[name] = got if old is None else old.union(got.indices())
        else:
            out[name] = Positions.of(got) if old is None else old.union(got)
    for name, old in carry.items():
        if name not in out and len(old):
            out[name] = old
    return Capture(positions=out, detect_s=time.perf_counter() - t)


def capture_with_values(tracker: Tracker, carry: Mapping[str, Positions]) -> Capture:
    """The tracker's ``(indices, values)`` joined with ``carry`` as int64 indices; a carried
    parameter's values are dropped (the union's are gathered from the params at routing)."""
    t = time.perf_counter()
    changed: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, idx, vals in checked_changes(tracker.iter_changes()):
        if not idx.numel():
            continue
        changed[name] = idx
        values[name] = vals
    for name, old in carry.items():
        if name in changed:
            changed[name] = old.union(changed[name]).indices()
            del values[name]
        elif len(old):
            changed[name] = old.indices()
    return Capture(changed=changed, values=values, detect_s=time.perf_counter() - t)


def carry_of(sent: Mapping[str, Positions | torch.Tensor]) -> Carry:
    """What the sender keeps of a version whose payloads may reach receivers: each param's
    positions as :class:`Positions` (a private encoding: a tracker may reuse its buffers)."""
    return {
        n: p if isinstance(p, Positions) else Positions.of(p)
        for n, p in sent.items()
        if (len(p) if isinstance(p, Positions) else p.numel())
    }


def route_positions(
    positions: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    rank: int = 0,
    world_size: int = 1,
) -> ShardUpdates:
    """``{shard: [TensorUpdate]}`` of captured positions, the values read from ``params`` now.

    One parameter at a time: its int64 indices exist only while its values are gathered and
    mapped to canonical coordinates (what routing then holds is O(changed) canonical pairs)."""
    canonical: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pos in positions.items():
        routed = canonical_changes(
            {name: pos.indices()},
            params,
            trainer_layout=trainer_layout,
            rank=rank,
            world_size=world_size,
        )
        for canon, pair in routed.items():
            if canon in canonical:  # the trainer table is a bijection; two params never share one
                raise LayoutError(f"canonical tensor {canon!r} is reached from two params")
            canonical[canon] = pair
    return route_to_shards(canonical, receiver_layout=receiver_layout)


def carry_bytes(carry: Mapping[str, Positions]) -> int:
    """Bytes the carry's positions hold (the tensors)."""
    return sum(p.nbytes for p in carry.values())


BATCH_ELEMENTS = 1 << 18  # changed elements per segment, at least (~5 MiB of transients)


def closing_points(
    names: Sequence[str], *, trainer_layout: TrainerLayout, receiver_layout: ReceiverLayout
) -> list[int]:
    """Per position ``i`` of ``names``: the last position whose parameter feeds a local tensor
    that one of ``names[:i+1]`` still feeds. A batch ``names[a:b]`` may close at ``b`` only
    when ``closing_points(...)[b - 1] < b``: the batch is then a union of whole parameter
    groups (:func:`~deltasync.layout.groups.param_groups`, the grouping the store path routes
    by). A name outside the layout feeds nothing (routing raises its error)."""
    groups = param_groups(names, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    last_of = {name: group.last for group in groups for name in group.params}
    out, reach = [], -1
    for i, name in enumerate(names):
        reach = max(reach, i, last_of[name])
        out.append(reach)
    return out


def _piece_updates(
    name: str,
    positions: Positions,
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    world_size: int,
) -> Iterator[PartedShardUpdates] | None:
    """``name``'s updates piece by piece (None when it is not routed in row pieces)."""
    if name not in params:
        return None
    pieces = row_pieces(
        name, trainer_layout=trainer_layout, receiver_layout=receiver_layout, world_size=world_size
    )
    if pieces is None:
        return None
    local = check_param(name, params[name])
    local = local.to_local() if hasattr(local, "to_local") else local
    # each piece's records written a slice at a time, as on the store path: a piece's int64
    # indices and values never exist whole (same bytes as routing the piece whole)
    return parted_pieces(name, positions, local, pieces, receiver_layout=receiver_layout)


def streamed_blobs(
    positions: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    shards: Sequence[str],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    version: int,
    base_version: int,
    writer: str,
    rank: int = 0,
    world_size: int = 1,
    level: int = 1,
    batch_elements: int = BATCH_ELEMENTS,
) -> tuple[dict[str, list[bytes]], dict[str, int]]:
    """Every shard's blob of the captured ``positions``, values read from ``params`` now.

    Args:
        positions: per param, what this writer sends (a capture joined with its carry).
        params: this writer's parameters (the values at the positions are read here).
        shards: every receiver shard (each gets a blob, empty ones included).
        batch_elements: changed elements gathered per batch before it is routed.

    Returns:
        ``({shard: the blob's pieces in order}, {shard: elements routed to it})``: the pieces
        are framed without joining them first (``pack_envelope`` takes a list).
    """
    names = [n for n in params if n in positions]
    names += [n for n in positions if n not in params]  # routing names the error
    reach = closing_points(names, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    chunks: dict[str, list[bytes]] = {s: [] for s in shards}
    writers = {
        s: BlobWriter(
            chunks[s].append,
            version=version,
            base_version=base_version,
            shard=s,
            writer=writer,
            level=level,
        )
        for s in shards
    }
    elements = dict.fromkeys(shards, 0)
    batch: dict[str, Positions] = {}
    size = 0
    release = HeapRelease()  # the routed batches' free pages, handed back (segments.py)

    def write(updates: ShardUpdates | PartedShardUpdates) -> None:
        for shard, ups in updates.items():
            writers[shard].segment(ups)
            elements[shard] += sum(u.nnz for u in ups)

    layouts = {"trainer_layout": trainer_layout, "receiver_layout": receiver_layout}
    for i, name in enumerate(names):
        # feeds tensors no other changed param feeds: the batch so far may close before it
        alone = reach[i] == i and (i == 0 or reach[i - 1] < i)
        pieces = None
        if alone and len(positions[name]) >= batch_elements:
            pieces = _piece_updates(name, positions[name], params, **layouts, world_size=world_size)
        if pieces is not None:
            if batch:
                write(route_positions(batch, params, **layouts, rank=rank, world_size=world_size))
                batch, size = {}, 0
            for updates in pieces:
                write(updates)
                del updates  # this piece's pairs: gone before the next piece
                release_free_heap()  # its record section and slices (see segments.py)
            continue
        batch[name] = positions[name]
        size += len(positions[name])
        if reach[i] > i or (size < batch_elements and i + 1 < len(names)):
            continue
        write(route_positions(batch, params, **layouts, rank=rank, world_size=world_size))
        release.count(size)
        batch, size = {}, 0  # this batch's canonical and shard pairs are gone with it
    for s in shards:
        writers[s].finish()
    return chunks, elements
