"""GroupRouter: a publisher's change stream -> routed segments, parameter group by group.

A publisher hands over a stream of ``(name, indices, values or None)`` in ``params`` order (a
tracker's lazy detection, a list, or an overlapped sender's captured ``Positions`` with no
values). Each parameter group (:mod:`deltasync.layout.groups`: the params feeding common
receiver tensors) is routed (:mod:`deltasync.layout.routing`) and appended as one segment of
every shard's blob (:class:`.streams.ShardStreams`) as soon as its last parameter has been seen;
consecutive small groups may be batched into one segment. Captured positions are decoded and
their values read here, group by group; a parameter whose receiver tensors no other tensor feeds
and that splits into row pieces (the vocab-parallel embedding: one piece per TP rank) is
routed piece by piece and each piece's records written a slice of positions at a time, so
neither its int64 positions nor its values ever exist whole.

Detection can run ahead on its own thread (:class:`Prefetch`): detecting a parameter and
routing and encoding a group both release the GIL in their heavy parts (the C detection
kernels, numpy, zstd), so running the stream on a producer thread lets detection of the next
parameters overlap routing and encoding of the previous group; ``depth`` bounds how many
detected parameters wait (their indices and values are the memory this costs). The consumer
owns the lifetime: leaving the ``with`` block (normally or by an exception) stops the producer
and joins it, so the tracker behind the stream is never used by two threads and is idle again
when the publisher returns (a TrainerSync clears it right after); an exception raised by the
stream is re-raised in the consumer, at the position it happened. :class:`Ready` marks a
stream that needs no prefetch thread.

This module knows the stream's order rules, groups, pieces, threads and ShardStreams; it
knows nothing about versions, manifests or the commit.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

import torch

from deltasync.errors import ConfigError
from deltasync.format import TensorUpdate
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.groups import ParamGroup, param_groups
from deltasync.layout.routing import (
    RowPiece,
    narrowed,
    parted_pieces,
    row_pieces,
    shard_updates,
    stream_rank,
)
from deltasync.native.loader import HeapRelease
from deltasync.native.ops import bf16_at
from deltasync.publish.streams import ShardStreams
from deltasync.trainer.positions import Positions

Params = Mapping[str, torch.Tensor]

# A parameter routed row piece by row piece (the vocab-parallel embedding) holds at least this
# many changed elements; below it the whole parameter's int64 indices and values are a few
# MiB at most, and routing it whole skips the pieces' slice-by-slice work (the small preset's
# embedding and LM head: ~1.5 ms less of a ~34 ms inline publish).
PIECES_FROM = 1 << 18


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


class GroupRouter:
    """Routes one writer's change streams for one (trainer layout, receiver layout) pair;
    caches the parameter groups and row pieces between versions."""

    def __init__(
        self,
        *,
        trainer_layout: TrainerLayout,
        receiver_layout: ReceiverLayout,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.trainer_layout, self.receiver_layout = trainer_layout, receiver_layout
        self.rank, self.world_size = rank, world_size
        # (param names, their groups, param -> group index), for the params last routed
        self._grouping: tuple[tuple[str, ...], list[ParamGroup], dict[str, int]] | None = None
        self._piece_cache: dict[str, tuple[RowPiece, ...] | None] = {}

    def stream(
        self,
        streams: ShardStreams,
        source,
        params: Params,
        *,
        prefetch: int,
        batch_elements: int = 0,
        touched: Collection[str] | None = None,
    ) -> None:
        """Consume ``source`` (``(name, indices, values or None)`` in ``params`` order, e.g.
        straight from a tracker's detection pass, run ``prefetch`` parameters ahead on its own
        thread; 0: in this thread) and hand each parameter group's routed updates to
        ``streams`` as soon as its last parameter has been seen; with ``batch_elements``,
        consecutive complete groups are routed and appended together as one segment until
        they hold that many changed elements (the routed buffers stay bounded by it, or by
        the largest group)."""
        groups, group_of = self._groups(params)
        position = {name: i for i, name in enumerate(params)}
        pending: dict[int, dict[str, tuple]] = {}
        batch: list[dict[str, tuple]] = []  # complete groups not yet routed, in order
        held = 0  # their changed elements
        # the heap's free pages (routed buffers and records, gone by then) handed back
        release = HeapRelease()

        def route(changes: list[dict[str, tuple]]) -> None:
            # Group by group: each group's int64 positions and values exist only while it is
            # routed (a batch of 2^20 changed elements held them all at once, with the
            # routing's own copies), and the routed indices are kept as int32 where the
            # tensor allows it (the encoder writes the same bytes) until the segment is
            # encoded. A receiver tensor is fed by one group only, so routing the groups one
            # by one gives the same updates as routing them together.
            out: dict[str, list[TensorUpdate]] = {}
            while changes:
                group = changes.pop(0)
                changed, given, routed_positions = {}, {}, []
                for n, (idx, vals) in group.items():
                    if isinstance(idx, Positions):  # captured positions: values are read
                        routed_positions.append(idx)  # now unless detection handed them over
                        idx = idx.indices()
                        if vals is None:
                            vals = bf16_at(_local(params[n]), idx, trusted=True)
                    changed[n] = idx
                    if vals is not None:
                        given[n] = vals
                group.clear()
                routed = shard_updates(
                    changed,
                    params,
                    trainer_layout=self.trainer_layout,
                    receiver_layout=self.receiver_layout,
                    rank=self.rank,
                    world_size=self.world_size,
                    values=given or None,
                )
                del changed, given
                for pos in routed_positions:  # routed: from now on only a retry reads them
                    pos.pack()
                for shard, ups in routed.items():
                    out.setdefault(shard, []).extend(narrowed(u) for u in ups)
                del routed
            # Each shard's records in stream order (a parameter's before a later one's), as
            # the segments come: one publisher's blobs, anchors too, list their tensors in one
            # order however they were cut into segments, so a receiver reads an anchor and
            # the deltas after it in lockstep without reading ahead (one routing gives the
            # shard's local order, which lists lm_head second).
            for shard, ups in out.items():
                rank = stream_rank(self.receiver_layout, shard)
                ups.sort(key=lambda u, rank=rank: rank.get(u.name, len(rank)))
            streams.add(out)

        def flush(g: int | None) -> None:
            nonlocal batch, held
            if g is not None:
                got = pending.pop(g, None) or {}
                if len(got) == 1:
                    ((name, (idx, vals)),) = got.items()
                    pieces = (
                        self._pieces(name)
                        if isinstance(idx, Positions) and len(idx) >= PIECES_FROM
                        else None
                    )
                    if pieces is not None:
                        if batch:  # the groups before it go out first: segment order is stable
                            route(batch)
                            batch, held = [], 0
                        got.clear()
                        self._route_pieces(streams, name, idx, pieces, params, vals)
                        idx.pack()
                        return
                if got:
                    batch.append(got)
                    held += sum(len(idx) for idx, _ in got.values())
                if held < batch_elements or not batch:
                    return
            if not batch:
                return
            changes, count = batch, held
            batch, held = [], 0
            route(changes)
            release.count(count)

        done = 0  # groups[:done] are flushed
        last, last_name = -1, None
        with Prefetch(source, depth=prefetch) as items:
            for name, indices, vals in items:
                pos = position.get(name)
                if pos is None:
                    raise ConfigError(
                        f"the tracker reports changes in {name!r}, which is not in params; pass "
                        "the same named parameters the tracker watches"
                    )
                if pos <= last:
                    raise ConfigError(
                        f"changes for {name!r} came after those for {last_name!r}; a stream of "
                        "changes must follow the order of params (a tracker built on the same "
                        "named parameters does), each parameter at most once"
                    )
                last, last_name = pos, name
                if touched is not None and name not in touched:
                    raise ConfigError(
                        f"changes for {name!r}, which the caller's touched parameters do not "
                        "name: its receiver tensors' digests would be reused unread"
                    )
                while done < len(groups) and groups[done].last < pos:
                    flush(done)
                    done += 1
                pending.setdefault(group_of[name], {})[name] = (indices, vals)
        while done < len(groups):
            flush(done)
            done += 1
        flush(None)  # what the batch still holds

    def _pieces(self, name: str) -> tuple[RowPiece, ...] | None:
        """The row pieces ``name`` is routed in (:func:`row_pieces`; cached per name)."""
        if name not in self._piece_cache:
            self._piece_cache[name] = row_pieces(
                name,
                trainer_layout=self.trainer_layout,
                receiver_layout=self.receiver_layout,
                world_size=self.world_size,
            )
        return self._piece_cache[name]

    def _route_pieces(
        self,
        streams: ShardStreams,
        name: str,
        positions: Positions,
        pieces: tuple[RowPiece, ...],
        params: Params,
        values: torch.Tensor | None = None,
    ) -> None:
        """One captured parameter routed piece by piece (the vocab-parallel embedding: one
        piece per TP rank), each piece's records written slice by slice
        (:func:`parted_pieces`): its positions decoded, values read and bytes written a bounded
        slice at a time, so this parameter never holds more than one slice as int64 indices
        and values (the segment's record bytes and their compressed form are what grows with
        the piece); ``values``, detection's values at every position, are sliced instead."""
        # the piece's record section and its int64 slices, once a piece was large enough to
        # leave pages worth handing back (a small model's pieces: ~0.3 ms a call for nothing)
        release = HeapRelease()
        for updates in parted_pieces(
            name,
            positions,
            _local(params[name]),
            pieces,
            receiver_layout=self.receiver_layout,
            values=values,
        ):
            streams.add(updates)
            release.count(sum(u.nnz for ups in updates.values() for u in ups))
            del updates

    def _groups(self, params: Params) -> tuple[list[ParamGroup], dict[str, int]]:
        """The parameter groups of ``params`` and each param's group (cached per name list)."""
        key = tuple(params)
        if self._grouping is None or self._grouping[0] != key:
            groups = param_groups(
                key, trainer_layout=self.trainer_layout, receiver_layout=self.receiver_layout
            )
            group_of = {n: g for g, grp in enumerate(groups) for n in grp.params}
            self._grouping = (key, groups, group_of)
        return self._grouping[1], self._grouping[2]


T = TypeVar("T")
_DONE = object()


class Ready(Generic[T]):
    """A lazy stream whose items are already detected (e.g. captured positions whose values
    are read as each is reached): a prefetch thread would only add a hop, so a publisher
    iterates it in its own thread, as it does a list."""

    def __init__(self, source: Iterable[T]) -> None:
        self._source = source

    def __iter__(self) -> Iterator[T]:
        return iter(self._source)


class Prefetch(Generic[T]):
    """``with Prefetch(source, depth=2) as items: for x in items: ...``; ``depth=0`` iterates
    ``source`` in the caller's thread (no producer thread)."""

    def __init__(self, source: Iterable[T], *, depth: int = 2) -> None:
        self._source, self._depth = source, depth
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds-detect", daemon=True)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put((True, item)):
                    return
            self._put((True, _DONE))
        except BaseException as exc:  # handed to the consumer, raised there
            self._put((False, exc))

    def __enter__(self) -> Iterator[T]:
        if self._depth == 0:
            return iter(self._source)
        self._thread.start()
        return self._items()

    def _items(self) -> Iterator[T]:
        while True:
            ok, item = self._queue.get()
            if not ok:
                raise item
            if item is _DONE:
                return
            yield item

    def __exit__(self, *exc_info: object) -> None:
        if self._depth == 0:
            return
        self._stop.set()
        while self._thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
        self._thread.join()
