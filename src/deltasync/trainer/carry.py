"""The carry joined with a new capture, in parameter order, one parameter at a time.

An overlapped sender keeps, per parameter, the changed positions of every version it captured
since the last commit (the *carry*, :class:`~deltasync.trainer.positions.Positions`); each new
capture is joined with it so a version that failed is sent again with the next one, never
lost. Both overlapped senders (``TrainerSync``, ``ClusterSender``) join it here, lazily, so each
parameter's int64 indices are dropped before the next parameter is detected.

This module knows ``Positions`` and the stream's order rules; nothing about threads or senders.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from deltasync.errors import ConfigError
from deltasync.trainer.positions import Positions

# (name, sorted int64 indices or their Positions, the BF16 values at them)
Change = tuple[str, torch.Tensor | Positions, torch.Tensor]
Params = Mapping[str, torch.Tensor]


def merge_positions(
    changes: Iterable[tuple[str, torch.Tensor | Positions]],
    carry: Mapping[str, Positions],
    params: Params,
) -> Iterator[tuple[str, Positions]]:
    """The tracker's changed positions since the last capture joined with ``carry`` (the
    positions of earlier versions that never committed), in ``params`` order, compactly
    encoded (:class:`Positions`); lazily, one parameter at a time, so each parameter's int64
    indices are dropped before the next one is detected."""
    for name, pos, _ in merge_captured(((n, p, None) for n, p in changes), carry, params):
        yield name, pos


def merge_captured(
    changes: Iterable[tuple[str, torch.Tensor | Positions, torch.Tensor | None]],
    carry: Mapping[str, Positions],
    params: Params,
    *,
    encode: bool = True,
) -> Iterator[tuple[str, Positions, Change | None]]:
    """:func:`merge_positions` over ``(name, positions, values or None)`` triples: each item
    also carries the change as ``(name, int64 indices or Positions, values)`` where the
    tracker read the values with the positions and no carried positions join them (then the
    values would miss the carried elements: they are read from the params instead).
    ``encode=False``: int64 indices the tracker gave become :meth:`Positions.held` (the
    caller compacts what it keeps)."""
    stream = iter(changes)
    nxt, ended = None, False
    for name in params:
        if nxt is None and not ended:  # the next detection runs only once this one is out
            nxt = next(stream, None)
            ended = nxt is None
        got = vals = None
        if nxt is not None and nxt[0] == name:
            (_, got, vals), nxt = nxt, None
        old = carry.get(name)
        if old is None:
            if got is None or not len(got):
                continue
            if isinstance(got, Positions):
                yield name, got, None if vals is None else (name, got, vals)
            else:
                change = None if vals is None else (name, got, vals)
                yield name, Positions.of(got) if encode else Positions.held(got), change
        elif got is None:
            yield name, old, None
        else:
            yield name, old.union(got.indices() if isinstance(got, Positions) else got), None
    if nxt is None and not ended:
        nxt = next(stream, None)
    if nxt is not None:
        raise ConfigError(
            f"the tracker reports changes in {nxt[0]!r}, which is not in params (or out of "
            "params order); pass the same named parameters the tracker watches"
        )
