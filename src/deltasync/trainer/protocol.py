"""The one contract between change detection and publishing: what a tracker yields.

A tracker (``AdamWTracker``, ``SnapshotTracker``, or any user class with these methods)
reports, per parameter, the flat row-major positions *into the tensor this process holds*
whose BF16 bits may differ from those at the last ``clear()``, with the BF16 values at those
positions read by the detection pass itself. For an FSDP2 (``fully_shard``) parameter that
tensor is the rank's local shard; :class:`LocalShard` says where it sits in the full
parameter, so a publisher can map local positions to canonical ones without a collective.

This module knows the shape of the contract; nothing about optimizers, layouts or transport.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deltasync.errors import ConfigError


@runtime_checkable
class Tracker(Protocol):
    """What a publisher consumes from a tracker.

    ``iter_changes()`` yields ``(name, indices, values)`` per changed parameter, in the order
    the parameters were given: ``indices`` a sorted, unique, 1-D int64 tensor of flat
    positions into the locally held tensor (the whole parameter, or the rank's FSDP2 shard),
    ``values`` the BF16 values at those positions (CPU, same length; the indices live on
    the parameter's device). Unchanged parameters are
    omitted. Every element whose BF16 bits changed is included; a few unchanged ones may be.
    ``clear()`` makes the current values the new baseline.
    """

    def iter_changes(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]: ...

    def clear(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class LocalShard:
    """Where a rank's local tensor sits in the full parameter: rows ``[row_start, row_stop)``
    of dim 0 of ``global_shape`` (FSDP2's ``Shard(0)``: ``torch.chunk`` semantics, chunk
    ``ceil(D0 / world_size)`` rows, trailing ranks short or empty, padding excluded).

    A whole (unsharded or replicated) parameter has ``row_start == 0`` and
    ``row_stop == global_shape[0]``; ``rank``/``world_size`` are the coordinate and size of
    the mesh dimension that shards dim 0 (``0``/``1`` when none does). ``replica`` of
    ``replicas`` counts the ``Replicate()`` mesh dimensions (HSDP's replica groups, or a
    ``replicate()``d module): ranks with the same ``rank`` and different ``replica`` hold the
    same bits, and only ``replica == 0`` needs to publish them.
    """

    global_shape: tuple[int, ...]
    row_start: int
    row_stop: int
    rank: int = 0
    world_size: int = 1
    replica: int = 0
    replicas: int = 1

    @property
    def offset(self) -> int:
        """Flat position in the full parameter of the local tensor's element 0."""
        per_row = 1
        for d in self.global_shape[1:]:
            per_row *= d
        return self.row_start * per_row

    @property
    def local_numel(self) -> int:
        per_row = 1
        for d in self.global_shape[1:]:
            per_row *= d
        return (self.row_stop - self.row_start) * per_row

    @property
    def is_whole(self) -> bool:
        return self.row_start == 0 and (
            not self.global_shape or self.row_stop == self.global_shape[0]
        )


@dataclass(frozen=True, kw_only=True)
class PublishRole:
    """Whether this process publishes, and as which writer (``PublisherConfig.writer_rank``
    / ``num_writers``)."""

    writes: bool
    writer_rank: int
    num_writers: int


def publish_role(shards: Mapping[str, LocalShard], *, dp_rank: int = 0) -> PublishRole:
    """Who writes, derived from where each local tensor sits (a tracker's ``shards``).

    Replicated state is written by ONE rank, never deduplicated after the fact: ranks holding
    the same bits (``replica > 0`` of a ``Replicate()`` mesh dimension, or ``dp_rank > 0``
    under DDP, whose plain tensors do not say they are replicated) do not publish. Sharded
    parameters make every shard rank a writer, ``writer_rank`` its mesh coordinate.

    Args:
        shards: per param, its :class:`LocalShard` (``tracker.shards``).
        dp_rank: this rank's index among data-parallel replicas that the tensors themselves do
            not describe (DDP: ``dist.get_rank()``; FSDP2 or a single process: 0).

    Raises:
        ValueError: params sharded over different mesh sizes or coordinates (one publisher
            cannot route them with one ``writer_rank``).
        ConfigError: some params sharded and others whole (``fully_shard`` applied to the
            layers but not to the root module): the whole ones would be routed as if they
            were this rank's shard of them.
    """
    sharded = {(s.rank, s.world_size) for s in shards.values() if s.world_size > 1}
    if len(sharded) > 1:
        raise ValueError(
            f"params are sharded over different mesh coordinates {sorted(sharded)}; one "
            "publisher routes one (writer_rank, num_writers)"
        )
    whole = [n for n, s in shards.items() if s.world_size == 1]
    if sharded and whole:
        ((_, world),) = sharded
        shown = ", ".join(repr(n) for n in whole[:5]) + (" ..." if len(whole) > 5 else "")
        raise ConfigError(
            f"{len(whole)} param(s) are not sharded ({shown}) while the others are sharded "
            f"over {world} ranks: one publisher routes every param as this rank's shard of "
            "it. Shard the root module too (fully_shard(model) after the layers), so every "
            "param is a Shard(0) DTensor"
        )
    rank, world = sharded.pop() if sharded else (0, 1)
    replica = max((s.replica for s in shards.values()), default=0)
    return PublishRole(writes=replica == 0 and dp_rank == 0, writer_rank=rank, num_writers=world)


class CastSink(Protocol):
    """Takes whole parameters' BF16 bits as a detection pass casts them (e.g.
    :class:`deltasync.layout.digest_feed.DigestFeed`, which hashes the receivers' tensors from
    them). Called on the pass's consuming thread, each parameter's chunks in order."""

    def wants(self, name: str) -> bool:
        """Whether parameter ``name``'s bits are wanted."""
        ...

    def feed(self, name: str, start: int, bits: torch.Tensor) -> None:
        """Flat elements ``[start, start + bits.numel())`` of parameter ``name``, as BF16."""
        ...

    def fail(self, name: str) -> None:
        """Parameter ``name``'s bits will not all come (nothing more is fed for it)."""
        ...


def takes_sink(tracker: object, method: str = "iter_capture") -> bool:
    """Whether ``tracker.<method>`` (``iter_capture``, or ``iter_changes`` for a sender that
    takes indices and values whole) takes a ``sink`` (a :class:`CastSink`): only then can a
    sender have the receivers' digests hashed by the detection pass."""
    fn = getattr(tracker, method, None)
    return callable(fn) and "sink" in inspect.signature(fn).parameters


def sink_kwargs(sink: CastSink | None) -> dict[str, CastSink]:
    """The keyword arguments that hand ``sink`` to a detection method (none without one, so a
    tracker whose methods take no ``sink`` is called as before)."""
    return {} if sink is None else {"sink": sink}
