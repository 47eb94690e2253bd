"""What one in-cluster version sends: the tracker's changes joined with the carry, as blobs.

The carry is the union of the changed positions of every attempt since the last joint commit
(``ClusterSender``'s "Retries"): per parameter a :class:`~deltasync.trainer.positions.Positions`,
about 1 byte per changed element at RL densities. A version is captured in one of two forms:

- *positions* (the overlapped sender): the tracker is asked for positions only
  (``iter_positions()`` or ``iter_changed()`` where it has one, so the detection reads no
  values), each parameter's
  are joined with its carry and encoded as ``Positions`` as soon as it is detected, and that
  dict is both what the background routes and, until the version commits, the carry. The
  values go along only where the detection kernel wrote them with the positions and the
  handoff has room for them (:func:`iter_handed`: a bounded number not yet taken); else
  :func:`route_positions` reads them from the parameters, which nothing changes until the
  optimizer's next step (the barrier). A failed version leaves only its positions; the retry
  re-reads the values;
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
and dropped before the next batch (routed one parameter group at a time, the routed updates
waiting for the segment with int32 indices: :func:`route_by_group`). A batch closes only
between parameter groups
(:func:`~deltasync.layout.groups.param_groups`: a fused receiver tensor may appear in one
segment only) and gathers at least ``batch_elements`` changed elements unless the version ends
first. The positions may come as a finished capture or parameter by parameter while the
detection still runs (:func:`iter_captured` through a
:class:`~deltasync.trainer.handoff.Handoff`): a batch closes when the next parameter is past
every group it holds part of. A parameter that splits into row pieces whose receiver
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
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
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
    narrowed,
    parted_pieces,
    route_to_shards,
    row_pieces,
)
from deltasync.native.loader import HeapRelease, release_free_heap
from deltasync.trainer import Tracker
from deltasync.trainer.carry import merge_captured, merge_positions
from deltasync.trainer.positions import Positions
from deltasync.trainer.protocol import CastSink, sink_kwargs

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


def position_stream(tracker: Tracker) -> Iterator[tuple[str, torch.Tensor | Positions]]:
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


def iter_captured(
    tracker: Tracker, carry: Mapping[str, Positions], params: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, Positions]]:
    """The tracker's changed positions joined with ``carry``, one parameter at a time in
    ``params`` order, as detection runs (each parameter's int64 indices are dropped once
    encoded, before the next one is detected): what the overlapped sender hands its
    background, parameter by parameter.

    Args:
        tracker: asked for positions only (``iter_positions()`` or ``iter_changed()``) where
            it offers that; it must report in ``params`` order (ConfigError otherwise).
        carry: the positions of attempts since the last commit (not modified).
        params: this writer's parameters (their order).
    """
    return merge_positions(position_stream(tracker), carry, params)


def iter_handed(
    tracker: Tracker,
    carry: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    values_max: int,
    sink: CastSink | None = None,
) -> Iterator[tuple[str, Positions, torch.Tensor | None]]:
    """:func:`iter_captured` with each parameter's BF16 values where the tracker's detection
    read them with the positions (``iter_capture(0, values_max=...)``: at most
    ``values_max`` of a parameter's) and no carried positions join them; else None (the
    background reads them from the params as it routes). ``sink`` (for a tracker whose
    ``iter_capture`` takes one) gets the detection pass's casts."""
    capture = getattr(tracker, "iter_capture", None)
    if not (values_max and callable(capture)):
        for name, pos in iter_captured(tracker, carry, params):
            yield name, pos, None
        return
    stream = capture(0, values_max=values_max, **sink_kwargs(sink))
    for name, pos, change in merge_captured(stream, carry, params):
        yield name, pos, None if change is None else change[2]


def capture_positions(
    tracker: Tracker, carry: Mapping[str, Positions], params: Mapping[str, torch.Tensor]
) -> Capture:
    """:func:`iter_captured` as a whole: a :class:`Capture` whose ``positions`` hold every
    parameter with a position to send."""
    t = time.perf_counter()
    out = dict(iter_captured(tracker, carry, params))
    return Capture(positions=out, detect_s=time.perf_counter() - t)


def capture_with_values(
    tracker: Tracker, carry: Mapping[str, Positions], *, sink: CastSink | None = None
) -> Capture:
    """The tracker's ``(indices, values)`` joined with ``carry`` as int64 indices; a carried
    parameter's values are dropped (the union's are gathered from the params at routing).
    ``sink``: handed to ``tracker.iter_changes`` (one that takes it: ``takes_sink``), which
    feeds it the detection pass's casts."""
    t = time.perf_counter()
    changed: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, idx, vals in checked_changes(tracker.iter_changes(**sink_kwargs(sink))):
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
    values: Mapping[str, torch.Tensor] | None = None,
) -> ShardUpdates:
    """``{shard: [TensorUpdate]}`` of captured positions, the values read from ``params`` now
    (or taken from ``values``, detection's, where it has the parameter's).

    One parameter at a time: its int64 indices exist only while its values are gathered and
    mapped to canonical coordinates (what routing then holds is O(changed) canonical pairs)."""
    canonical: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pos in positions.items():
        given = None if values is None else values.get(name)
        routed = canonical_changes(
            {name: pos.indices()},
            params,
            trainer_layout=trainer_layout,
            rank=rank,
            world_size=world_size,
            values=None if given is None else {name: given},
        )
        for canon, pair in routed.items():
            if canon in canonical:  # the trainer table is a bijection; two params never share one
                raise LayoutError(
                    f"canonical tensor {canon!r} is reached from two params; pass each tied "
                    "parameter once (as model.named_parameters() lists them)"
                )
            canonical[canon] = pair
    return route_to_shards(canonical, receiver_layout=receiver_layout)


def route_by_group(
    batch: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    group_of: Mapping[str, int],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    rank: int = 0,
    world_size: int = 1,
    values: MutableMapping[str, torch.Tensor] | None = None,
) -> ShardUpdates:
    """:func:`route_positions` of a batch of whole parameter groups, one group at a time: the
    same updates in the same order (each shard's in its own tensor order), but only one
    group's int64 indices, canonical pairs and routing temporaries exist at once, and what is
    kept for the batch's segment waits with int32 indices where its tensor allows them (the
    encoder writes the same records). Routing the batch at once held every parameter's
    canonical pairs next to every shard's (about 20 bytes per changed element, a few hundred
    thousand elements a batch at 0.6B). A receiver tensor is fed by one group only, so the
    groups' updates never name a tensor twice. Each group's positions are packed once routed
    (from then on only a retry reads them). ``group_of``: each parameter's group; a name
    without one is a group of its own (routing then names the error). ``values``: detection's
    values of some parameters, taken out as their group is routed."""
    by_group: dict[object, dict[str, Positions]] = {}
    for name, pos in batch.items():
        by_group.setdefault(group_of.get(name, name), {})[name] = pos
    out: ShardUpdates = {}
    for group in by_group.values():
        given = None if values is None else {n: values.pop(n) for n in group if n in values}
        routed = route_positions(
            group,
            params,
            trainer_layout=trainer_layout,
            receiver_layout=receiver_layout,
            rank=rank,
            world_size=world_size,
            values=given,
        )
        for shard, ups in routed.items():
            out.setdefault(shard, []).extend(narrowed(u) for u in ups)
        del routed, given
        for captured in group.values():
            captured.pack()
    for shard, ups in out.items():
        ups.sort(key=lambda u, s=shard: receiver_layout.local_position(s, u.name))
    return out


def carry_bytes(carry: Mapping[str, Positions]) -> int:
    """Bytes the carry's positions hold (the tensors)."""
    return sum(p.nbytes for p in carry.values())


BATCH_ELEMENTS = 1 << 18  # changed elements per segment, at least (~5 MiB of transients)
# A frame chunk at least this large is offered to ``on_batch`` as soon as it is written (an
# open segment's frame comes in zstd blocks of up to 128 KiB; headers are a few bytes).
OFFER_FROM = 1 << 12


def _piece_updates(
    name: str,
    positions: Positions,
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    world_size: int,
    values: torch.Tensor | None = None,
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
    return parted_pieces(
        name, positions, local, pieces, receiver_layout=receiver_layout, values=values
    )


def streamed_blobs(
    positions: Mapping[str, Positions] | Iterable[tuple[str, Positions]],
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
    reserve: int = 0,
    on_batch: Callable[[dict[str, bytearray]], None] | None = None,
    values: MutableMapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, bytearray], dict[str, int]]:
    """Every shard's blob of the captured ``positions``, values read from ``params`` now
    (or taken from ``values``).

    Args:
        positions: per param, what this writer sends (a capture joined with its carry), or
            the same as ``(name, positions)`` pairs in ``params`` order, taken as they come
            (a :class:`~deltasync.trainer.handoff.Handoff` from a detection still running).
        params: this writer's parameters (the values at the positions are read here).
        shards: every receiver shard (each gets a blob, empty ones included).
        batch_elements: changed elements gathered per batch before it is routed.
        reserve: zero bytes in front of each blob (where the caller frames it in place,
            :func:`~deltasync.cluster.envelope.seal_envelope`).
        on_batch: called with the buffers after every batch's segments are written, and
            after every chunk of a large segment's frame (segments are open: wire
            ``FLAG_OPEN_SEGMENTS``); it may take bytes away by replacing a shard's buffer with
            a new one (later bytes go to the new one): what streams the blobs out while later
            batches are routed, and the vocab-parallel embedding's frames while they are
            compressed.
        values: BF16 values at a parameter's positions that detection read (filled by the
            producer before it hands the parameter over); each is taken out as its parameter
            comes and routed instead of reading ``params``.

    Returns:
        ``({shard: reserve zero bytes, then the blob}, {shard: elements routed to it})``
        (with ``on_batch``: what it left in the buffers). Each blob is written straight into
        its buffer as it is encoded (a large bytearray grows in place), so it is never held
        twice: as pieces and again framed.
    """
    if isinstance(positions, Mapping):
        given = positions
        items: Iterable[tuple[str, Positions]] = [(n, given[n]) for n in params if n in given]
        items += [(n, p) for n, p in given.items() if n not in params]  # routing names the error
    else:
        items = positions
    order = list(params)
    index = {name: i for i, name in enumerate(order)}
    # the last parameter (in params order) of each parameter's group: a batch may close only
    # once the items have passed the last parameter of every group it holds part of
    groups = param_groups(order, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    last_of = {name: group.last for group in groups for name in group.params}
    group_of = {name: g for g, group in enumerate(groups) for name in group.params}
    blobs = {s: bytearray(reserve) for s in shards}

    def sink(shard: str) -> Callable[[bytes], None]:
        def put(data: bytes) -> None:
            blobs[shard].extend(data)  # the buffer on_batch left in place
            if on_batch is not None and len(data) >= OFFER_FROM:
                on_batch(blobs)  # a large segment's frame streams out while it is written

        return put

    writers = {
        s: BlobWriter(
            sink(s),
            version=version,
            base_version=base_version,
            shard=s,
            writer=writer,
            level=level,
            open_segments=True,
        )
        for s in shards
    }
    elements = dict.fromkeys(shards, 0)
    layouts = {"trainer_layout": trainer_layout, "receiver_layout": receiver_layout}
    batch: dict[str, Positions] = {}
    batch_values: dict[str, torch.Tensor] = {}
    size, reach, last = 0, -1, -1  # the batch's elements and groups' end; the last item
    release = HeapRelease()  # the routed batches' free pages, handed back (segments.py)

    def write(updates: ShardUpdates | PartedShardUpdates) -> None:
        for shard, ups in updates.items():
            writers[shard].segment(ups)
            elements[shard] += sum(u.nnz for u in ups)
        if on_batch is not None:
            on_batch(blobs)

    def flush() -> None:
        nonlocal batch, batch_values, size
        if batch:
            routed = route_by_group(
                batch,
                params,
                group_of=group_of,
                **layouts,
                rank=rank,
                world_size=world_size,
                values=batch_values,
            )
            write(routed)
            del routed
            release.count(size)
            # this batch's shard pairs (and values) are gone with it
            batch, batch_values, size = {}, {}, 0

    for name, pos in items:
        vals = None if values is None else values.pop(name, None)
        i = index.get(name)
        if i is None:  # not a parameter: its own batch, which routing refuses naming it
            flush()
            batch = {name: pos}
            flush()
            continue
        if i <= last:
            raise ConfigError(
                f"positions for {name!r} came out of params order (or twice); a capture "
                "follows the order of the named parameters"
            )
        last = i
        if i > reach and size >= batch_elements:  # whole groups, and enough of them
            flush()
        # a parameter whose group is itself, past the batch's groups: routed piece by piece
        # where it splits into row pieces (the vocab-parallel embedding)
        pieces = None
        if i > reach and last_of[name] == i and len(pos) >= batch_elements:
            pieces = _piece_updates(
                name, pos, params, **layouts, world_size=world_size, values=vals
            )
        if pieces is not None:
            flush()
            for updates in pieces:
                write(updates)
                del updates  # this piece's pairs: gone before the next piece
                release_free_heap()  # its record section and slices (see segments.py)
            pos.pack()
            continue
        batch[name] = pos
        if vals is not None:
            batch_values[name] = vals
        size += len(pos)
        reach = max(reach, i, last_of[name])
    flush()
    for s in shards:
        writers[s].finish()
    return blobs, elements
