"""What a tracker holds of each parameter: its local tensor, where that sits, its version.

A tracker is given ``model.named_parameters()`` and nothing else. A parameter is either a plain
tensor (the whole parameter on this process) or an FSDP2 DTensor (``fully_shard``), whose
local shard is what this rank stores, steps and publishes. :func:`watch` derives, from the
DTensor itself, where that local shard sits in the full parameter (:class:`LocalShard`: mesh
coordinate, placements, global shape, FSDP2's uneven last shard; the padding FSDP2 keeps
behind the last rows is not part of the local tensor) and refuses placements it cannot map
(tensor parallel ``Shard(d)`` with ``d > 0``, ``Partial``, strided shards of FSDP2 + TP),
naming the parameter and the placement.

It also reads each parameter's *version*: PyTorch bumps a per-tensor counter on every
in-place write through the tensor or any view of it (an optimizer step, ``copy_`` in
``load_state_dict``, ``mul_`` under ``no_grad``). A DTensor has two counters, its own (writes
through the DTensor) and its local tensor's (writes to ``to_local()``); both are read. Writes
through ``.data`` go to a tensor with its own counter and are invisible here.

:class:`OutOfBandWatch` turns those counters into the guard for edits outside the optimizer: it
records each watched parameter's counters at a baseline (construction, right after every
optimizer step, ``clear()``) and, when asked to check, flags every parameter whose counters
moved since: such a parameter must be reported changed in full for the current version,
because nothing bounds what the write did. Flags stick until :meth:`OutOfBandWatch.clear`. Each
flag is logged once, as an operator must know a full send happened. Writes through ``.data``
and other non-view aliases are invisible, and so are ``torch._foreach_*_`` in-place ops on
DTensors (torch 2.13 moves neither counter for them); :meth:`OutOfBandWatch.mark` is the
caller's remedy.

This module knows tensors, DTensor placements and names; nothing about optimizers, bits or
publishing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError, ParamsEditedError
from deltasync.trainer.protocol import LocalShard

Version = tuple[int, ...]


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed tensors
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor this process holds for ``t`` (a DTensor's local shard), detached.

    Shares storage and version counter with what the optimizer updates in place."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()  # type: ignore[attr-defined]
    return t.detach()  # records no graph whatever the grad mode (no_grad cost ~5 us a call)


def version_of(t: torch.Tensor) -> Version:
    """The in-place write counters of ``t`` (and of its local shard, for a DTensor), with the
    address of the memory it holds: swapping a tensor's contents (``torch.utils.swap_tensors``,
    as ``load_state_dict(assign=True)`` does under swap-tensors loading) swaps its counter too,
    which may then equal the old one, but never keeps the address."""
    if is_dtensor(t):
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            with torch.no_grad():
                inner = t.to_local()  # type: ignore[attr-defined]
        return (t._version, inner._version, inner.data_ptr())
    return (t._version, t.data_ptr())


def _phrase(names: tuple[str, ...], most: int = 5) -> str:
    """``parameters 'a', 'b' (and 3 more) were`` (or ``parameter 'a' was``), for a message."""
    shown = ", ".join(repr(n) for n in names[:most])
    more = f" (and {len(names) - most} more)" if len(names) > most else ""
    return f"parameter {shown} was" if len(names) == 1 else f"parameters {shown}{more} were"


class ReadWindow:
    """An overlapped sender's version that reads the params after the sender's call returned
    (until the next optimizer step), and the writes it can see there: every param's version
    counters from when its reads began, of the tensor the version reads and of the one the
    tracker was given (an FSDP2 DTensor: an in-place op through it moves its own counter, not
    its local shard's, which is what a sender reads).

    ``refuse_if_written`` is the sender's check once the version reads nothing more (a write
    by then may have mixed old and new bits into what it read); ``settle``, once it is done and
    its detection has ended, before the next optimizer step moves every counter, marks each
    param written meanwhile changed in the tracker, so the next version sends it in full: a
    tracker whose ``clear()`` came after the write took the moved counter as its baseline and
    cannot see the write by itself."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        version: int,
        *,
        window: str,
        tracker: object = None,
    ) -> None:
        """Args:
        params: the params the version reads.
        version: the version, for messages.
        window: when the params must not be written, for messages.
        tracker: the tracker whose detection the version runs; one that reads optimizer
            state (its ``seal_state``) has that state watched too.
        """
        self.version, self.window = version, window
        tracked = getattr(tracker, "tracked_params", None)
        self._tracked = tracked() if callable(tracked) else {}
        # the optimizer updates the tracker saw of each param: a fused one moves no counter
        updates = getattr(tracker, "updates_seen", None)
        self._updates = updates if callable(updates) else None
        self.counters = self._counters(params)
        seal = getattr(tracker, "seal_state", None)
        self._state = seal() if callable(seal) else None
        # mark_changed() calls from here on: writes the counters cannot see (through .data)
        marks = getattr(tracker, "marks", None)
        self._marks_from = marks() if callable(marks) else None
        self._marked_since = getattr(tracker, "marked_since", None)

    def _counters(self, params: Mapping[str, torch.Tensor]) -> dict[str, Version]:
        """Every param's version counters (~1-3 us each), with its tracked tensor's and the
        count of its optimizer updates the tracker saw."""
        tracked, updates = self._tracked, self._updates
        return {
            n: version_of(p)
            + (version_of(tracked[n]) if n in tracked else ())
            + ((updates(n),) if updates is not None else ())
            for n, p in params.items()
        }

    def _written(self, params: Mapping[str, torch.Tensor]) -> tuple[tuple[str, ...], str]:
        """The params written since (or marked changed by the caller since), with the
        optimizer state of params replaced or written since (in ``params`` order), and what
        was written, for messages."""
        now, then = self._counters(params), self.counters
        edited = tuple(n for n in params if n in then and now[n] != then[n])
        marked: set[str] = set()
        if self._marks_from is not None and callable(self._marked_since):
            marked = self._marked_since(self._marks_from)
            edited = tuple(n for n in params if n in marked or n in edited)
        moved = set(self._state.moved()) if self._state is not None else set()
        if not moved:
            if marked:
                return edited, "written in place, or marked changed, while the version read them"
            return edited, "written in place while the version read them"
        names = tuple(n for n in params if n in moved or n in edited)
        if not edited:
            return names, (
                "detected from optimizer state that was replaced or written in place while "
                "the version read it"
            )
        return names, (
            "written in place, or detected from optimizer state replaced or written in "
            "place, while the version read them"
        )

    def refuse_if_written(self, params: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`ParamsEditedError` when a param, or the optimizer state detection
        reads for it, was written since."""
        edited, what = self._written(params)
        if edited:
            raise ParamsEditedError(
                f"version {self.version} was not committed: {_phrase(edited)} {what} "
                f"({self.window}): sent in full with the next version. "
                "Write parameters (and optimizer state) before the version is captured or "
                "after the sender's wait()",
                version=self.version,
                names=edited,
            )

    def settle(self, params: Mapping[str, torch.Tensor], tracker: object) -> tuple[str, ...]:
        """Mark the params written since (or whose optimizer state was) in ``tracker`` (its
        ``mark_changed``; a tracker that compares bits has none and needs none); returns
        their names."""
        edited, what = self._written(params)
        if edited:
            log.warning(
                "version %d: %s %s (%s): sent in full with the next version",
                self.version,
                _phrase(edited),
                what,
                self.window,
            )
            mark = getattr(tracker, "mark_changed", None)
            if callable(mark):
                mark(*edited)
        return edited


def chunk_rows(dim0: int, index: int, count: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that ``torch.chunk`` semantics give shard ``index`` of
    ``count`` (FSDP2 and DTensor ``Shard(0)``: chunk ``ceil(dim0 / count)``, trailing shards
    short or empty)."""
    chunk = -(-dim0 // count)
    start = min(index * chunk, dim0)
    return start, min(start + chunk, dim0)


def shard_of(name: str, t: torch.Tensor) -> LocalShard:
    """Where ``t``'s local tensor sits in the full parameter.

    Raises:
        ConfigError: a DTensor placement other than ``Replicate()`` or one ``Shard(0)``, or a
            local shard whose shape is not the one ``Shard(0)`` implies.
    """
    shape = tuple(int(d) for d in t.shape)
    if not is_dtensor(t):
        return LocalShard(global_shape=shape, row_start=0, row_stop=shape[0] if shape else 1)
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh  # type: ignore[attr-defined]
    placements = tuple(t.placements)  # type: ignore[attr-defined]
    coord = mesh.get_coordinate()
    if coord is None:
        raise ConfigError(f"parameter {name!r}: this rank is not in its device mesh {mesh}")
    shard_dim: int | None = None
    replica, replicas = 0, 1
    for dim, pl in enumerate(placements):
        if type(pl) is Replicate:
            replica = replica * mesh.size(dim) + coord[dim]
            replicas *= mesh.size(dim)
        elif type(pl) is Shard and pl.dim == 0 and shard_dim is None and shape:
            shard_dim = dim
        else:
            raise ConfigError(
                f"parameter {name!r} has DTensor placement {pl!r} (placements {placements}); "
                "only FSDP2's Shard(0) on one mesh dimension and Replicate() are supported. "
                "Tensor-parallel or partial placements: track the full tensor per TP rank "
                "(e.g. its to_local() under a name of its own) or gather it first"
            )
    if shard_dim is None:
        start, stop, rank, world = 0, (shape[0] if shape else 1), 0, 1
    else:
        rank, world = coord[shard_dim], mesh.size(shard_dim)
        start, stop = chunk_rows(shape[0], rank, world)
    spec = LocalShard(
        global_shape=shape,
        row_start=start,
        row_stop=stop,
        rank=rank,
        world_size=world,
        replica=replica,
        replicas=replicas,
    )
    local = t.to_local()  # type: ignore[attr-defined]
    want = (stop - start, *shape[1:]) if shape else ()
    if tuple(local.shape) != want:
        raise ConfigError(
            f"parameter {name!r}: local shard has shape {tuple(local.shape)}, but {placements} "
            f"of global shape {shape} on mesh coordinate {coord} implies {want}"
        )
    return spec


@dataclass(frozen=True)
class Watched:
    """One tracked parameter: the object given (plain or DTensor) and its local view."""

    name: str
    param: torch.Tensor
    shard: LocalShard

    def local(self) -> torch.Tensor:
        return local_of(self.param)

    def version(self) -> Version:
        return version_of(self.param)

    def local_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return self.shard.local_numel * torch.empty(0, dtype=dtype).element_size()


def watch(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Watched]:
    """Validate ``named_params`` (unique names, floating-point tensors, supported placements)
    and describe each parameter, in the given order.

    Raises:
        ConfigError: naming the parameter.
    """
    out: dict[str, Watched] = {}
    for item in named_params:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ConfigError(
                f"named_params must yield (name, tensor) pairs, got {type(item).__name__}"
            )
        name, p = item
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise ConfigError(
                f"named_params must yield (str, Tensor) pairs, got ({type(name).__name__}, {type(p).__name__})"
            )
        if name in out:
            raise ConfigError(
                f"parameter name {name!r} appears twice in named_params; names must be unique"
            )
        if not p.is_floating_point():
            raise ConfigError(
                f"parameter {name!r} has dtype {p.dtype}; only floating-point tensors can be tracked"
            )
        if p.is_meta:
            raise ConfigError(
                f"parameter {name!r} is on the meta device; materialize the model first"
            )
        out[name] = Watched(name, p, shard_of(name, p))
    return out


log = logging.getLogger("deltasync.trainer.adamw_tracker")  # one logger for the tracker's decisions


class Marks:
    """Every ``mark_changed`` of a tracker, numbered and never reset: a read window asks which
    parameters were marked after its start (see :class:`ReadWindow`)."""

    def __init__(self) -> None:
        self.count = 0
        self._at: dict[str, int] = {}  # name -> the number of its latest mark

    def add(self, name: str) -> None:
        self.count += 1
        self._at[name] = self.count

    def since(self, count: int) -> set[str]:
        """The parameters marked after the ``count``-th mark (a read window asks on its own
        thread while marks are added: it reads a copy, taken in one call)."""
        return {n for n, at in list(self._at.items()) if at > count}


class OutOfBandWatch:
    """Version-counter baselines and the out-of-band flags of a set of parameters."""

    def __init__(self, watched: Mapping[str, Watched]) -> None:
        """Args:
        watched: the parameters to watch (those on an exact snapshot path need not be).
        """
        self._watched = dict(watched)
        self._versions: dict[str, Version] = {}
        self._flags: dict[str, str] = {}  # name -> why, since the last clear()
        self.marks = Marks()  # kept across clear(): a read window counts from its own start
        self.record()

    def record(self, names: Iterable[str] | None = None) -> None:
        """Take the current counters of ``names`` (default: every parameter) as their
        baseline (flags are kept)."""
        if names is None:
            names = self._watched
        for name in names:
            w = self._watched.get(name)
            if w is not None:
                self._versions[name] = w.version()

    def check(self) -> None:
        """Flag every parameter whose counters moved since they were recorded."""
        for name, w in self._watched.items():
            now = w.version()
            before = self._versions[name]
            if now != before:
                self._versions[name] = now
                if name not in self._flags:
                    self._flag(name, f"modified outside the optimizer (version {before} -> {now})")

    def mark(self, name: str, why: str = "marked changed by the caller") -> None:
        """Flag ``name`` as changed outside the optimizer (a write the counter cannot see).
        Any name is counted among the marks (a read window needs them all: a parameter whose
        bits a snapshot compares was written too); only a watched one is flagged."""
        self.marks.add(name)
        if name in self._watched and name not in self._flags:
            self._flag(name, why)

    def flag(self, name: str, why: str) -> None:
        """Flag ``name`` changed in full for this version (not counted among the marks: what
        detection itself finds, in the version it reads)."""
        if name in self._watched and name not in self._flags:
            self._flag(name, why)

    def _flag(self, name: str, why: str) -> None:
        self._flags[name] = why
        log.warning(
            "parameter %r was %s: all %d local elements are reported changed for this version",
            name,
            why,
            self._watched[name].shard.local_numel,
        )

    def __contains__(self, name: object) -> bool:
        return name in self._flags

    def flagged(self) -> dict[str, str]:
        """``{name: why}`` of the parameters flagged since the last :meth:`clear`."""
        return dict(self._flags)

    def clear(self) -> None:
        """A new version baseline: drop the flags and record the counters."""
        self._flags.clear()
        self.record()
