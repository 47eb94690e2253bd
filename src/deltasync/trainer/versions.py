"""Edits outside the optimizer, seen through PyTorch's per-tensor version counters.

Every in-place write through a tensor or any view of it bumps its version counter (see
``params.version_of``). :class:`OutOfBandWatch` records each watched parameter's counters at a
baseline (construction, right after every optimizer step, ``clear()``) and, when asked to
check, flags every parameter whose counters moved since: such a parameter must be reported
changed in full for the current version, because nothing bounds what the write did. Flags stick
until :meth:`clear`. Each flag is logged once, as an operator must know a full send happened.

Writes through ``.data`` (a tensor with its own counter) and other non-view aliases are
invisible here; :meth:`mark` is the caller's remedy.

This module knows parameters' version counters and names; nothing about optimizers or bits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from deltasync.trainer.params import Version, Watched

log = logging.getLogger("deltasync.trainer.adamw_tracker")  # one logger for the tracker's decisions


class OutOfBandWatch:
    """Version-counter baselines and the out-of-band flags of a set of parameters."""

    def __init__(self, watched: Mapping[str, Watched]) -> None:
        """Args:
        watched: the parameters to watch (those on an exact snapshot path need not be).
        """
        self._watched = dict(watched)
        self._versions: dict[str, Version] = {}
        self._flags: dict[str, str] = {}  # name -> why, since the last clear()
        self.record()

    def record(self) -> None:
        """Take every parameter's current counters as the baseline (flags are kept)."""
        for name, w in self._watched.items():
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

    def mark(self, name: str) -> None:
        """Flag ``name`` as changed outside the optimizer (a write the counter cannot see)."""
        if name in self._watched and name not in self._flags:
            self._flag(name, "marked changed by the caller")

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
