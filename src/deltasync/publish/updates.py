"""What a publisher streams from: a tracker's changes as ``(name, indices, values or None)``.

This module knows the tracker methods and the shape of a change stream; routing the changes
to receiver shards is :mod:`deltasync.layout.routing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from deltasync.errors import ConfigError
from deltasync.layout.routing import Change


def tracker_changes(
    tracker: object,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """``(changed, values)`` dicts from :func:`tracker_stream`, detected all at once (for
    callers that need every change before they start, or several times): with a tracker that
    reads values in its detection pass (AdamWTracker, SnapshotTracker) they save a second,
    cache-cold pass over the params; with only ``changed()``, ``values`` is None."""
    items = list(tracker_stream(tracker))
    values = {n: v for n, _, v in items if v is not None}
    return {n: idx for n, idx, _ in items}, values or None


def change_source(
    changed: Mapping[str, torch.Tensor] | Iterable[tuple],
    params: Mapping[str, torch.Tensor],
    values: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[Change]:
    """What a publisher streams from: ``(name, indices, values or None)`` in ``params`` order.

    ``changed`` is either a dict ``{name: indices}`` (a tracker's ``changed()``; ``values``
    optionally holds the BF16 values per name), checked against ``params`` before anything is
    produced, or an iterable of ``(name, indices)`` / ``(name, indices, values)`` tuples that is
    consumed lazily (a tracker's ``iter_changed()`` / ``iter_changed_values()``: detection runs
    as the publisher consumes it)."""
    if isinstance(changed, Mapping):
        unknown = [n for n in changed if n not in params]
        if unknown:
            raise ConfigError(
                f"the tracker reports changes in {unknown[:3]}, which are not in params; pass "
                "the same named parameters the tracker watches"
            )
        if values is not None and not isinstance(values, Mapping):
            raise ConfigError("values must be a dict {name: bf16 values} when changed is a dict")
        given = values or {}
        return (
            (n, changed[n], given.get(n)) for n in params if n in changed and changed[n].numel()
        )
    if values is not None:
        raise ConfigError(
            "values= goes with a changed dict; a stream of changes carries its values in each "
            "(name, indices, values) tuple"
        )
    return _tuples(changed)


def _tuples(items: Iterable[tuple]) -> Iterator[Change]:
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise ConfigError(
                f"a stream of changes yields (name, indices) or (name, indices, values) tuples, "
                f"got {type(item).__name__}"
            )
        yield (item[0], item[1], item[2] if len(item) == 3 else None)


def tracker_stream(tracker: object) -> Iterator[Change]:
    """A tracker's changes as a stream, the richest the tracker offers: ``iter_changed_values()``
    (lazy: each parameter is detected when the publisher asks for it, its BF16 values read in
    the same pass), else ``changed_values()`` (values from the detection pass, detected at
    once), else ``iter_changed()``, else ``changed()`` (values gathered later from params)."""
    t: Any = tracker
    if callable(getattr(t, "iter_changed_values", None)):
        return _tuples(t.iter_changed_values())
    if callable(getattr(t, "changed_values", None)):
        return _tuples((n, idx, vals) for n, (idx, vals) in t.changed_values().items())
    if callable(getattr(t, "iter_changed", None)):
        return _tuples(t.iter_changed())
    return _tuples(t.changed().items())
