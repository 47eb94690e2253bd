"""Handoff: captured parameters passed from detection to a background sender as each is found.

An overlapped sender (``TrainerSync(overlap=True)``, ``ClusterSender(overlap=True)``) captures
a version's changed positions on the caller's thread. With a handoff its background thread
routes and encodes each parameter while detection of the next ones still runs, instead of
starting when the last parameter is captured. The caller :meth:`Handoff.put`\\ s each captured
``(name, positions)`` in parameter order and ends with :meth:`Handoff.close`, or with
:meth:`Handoff.fail` when detection raised: the background's iteration then raises
:class:`~deltasync.errors.CaptureAbandonedError` at that point, before its commit.

Every item is also held by the caller's capture (it is the carry until the version commits),
so the queue holds nothing of its own beyond how far the background lags detection, except
what an item carries besides (a parameter's BF16 values, read by detection): that is weighed
(:meth:`Handoff.room`, ``put(..., weight=)``) against the handoff's ``budget``, so a
background far behind detection never makes the queue grow with the model.

This module knows threads and a queue; nothing about trackers, layouts or stores.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Generic, TypeVar

import torch

from deltasync.errors import CaptureAbandonedError, SendInterruptedError
from deltasync.interrupts import interrupts_deferred

T = TypeVar("T")
P = TypeVar("P")

# An overlapped version with fewer changed elements runs on the caller's thread instead
# (``TrainerSync.inline_below``, ``ClusterSender.inline_below``): a background thread competing
# with the forward/backward for a two-core trainer's cores made such a version's latency about
# twice the inline one's, for 25-50 ms of routing, encoding and commit on this machine.
INLINE_BELOW = 1 << 18

# The most BF16 values (4 MiB) a large version's detection hands over beside the positions and
# the background has not taken yet; beyond that the background reads a parameter's values
# itself as it routes it (a second, cache-cold read of the parameter). One 0.6B version in one
# process read 0.29 CPU-s of values that way with no values handed over, 0.16 s with this
# budget, 0.08 s with twice it; the bound is 0.35% of that model's BF16 bytes.
VALUES_IN_FLIGHT = 1 << 21


class Handoff(Generic[T]):
    """``(name, item)`` pairs from one producer thread to one consumer thread, in order; the
    names of everything put, once the producer is done."""

    _END = object()

    def __init__(self, budget: int = 0) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._names: list[str] = []
        self._settled = threading.Event()
        self.error: BaseException | None = None  # what the producer failed with, if it did
        self.budget = budget  # the most weight queued at once (see room)
        self._weight = 0  # of the items put and not yet taken
        self._lock = threading.Lock()

    def room(self, weight: int) -> bool:
        """Whether an item of ``weight`` (e.g. its values' element count) fits in the budget
        beside what is queued now. The producer asks before it puts a weighed item and puts
        it without what it weighs when not (the consumer reads that again itself): the queue
        never waits, so a consumer that stopped cannot block detection."""
        with self._lock:
            return self._weight + weight <= self.budget

    def put(self, name: str, item: T, weight: int = 0) -> None:
        """Queue ``item``; ``weight`` counts against the budget until the consumer takes it."""
        self._names.append(name)
        with self._lock:
            self._weight += weight
        self._items.put((name, item, weight))

    def close(self) -> None:
        """Everything is put: the iteration ends. A handoff that already failed stays failed."""
        self._settle(None)

    def fail(self, exc: BaseException) -> None:
        """The producer failed: the iteration raises once it reaches this point. A handoff
        already closed stays closed (what it held goes on to its commit)."""
        self._settle(exc)

    def _settle(self, error: BaseException | None) -> None:
        # one step for an interrupt: settled is a consumer's end queued
        with interrupts_deferred(), self._lock:
            if self._settled.is_set():
                return  # the first of close() and fail() decides
            self.error = error
            self._settled.set()
            self._items.put(self._END)

    def _raise_if_failed(self) -> None:
        if self.error is None:
            return
        what = (
            f"failed ({type(self.error).__name__}: {self.error})"
            if isinstance(self.error, Exception)
            else f"was interrupted ({type(self.error).__name__}) on the caller's thread"
        )
        raise CaptureAbandonedError(
            f"detection {what} while this version was being sent; nothing of it was committed"
        ) from self.error

    def __iter__(self) -> Iterator[tuple[str, T]]:
        while True:
            got = self._items.get()
            if got is self._END:
                self._raise_if_failed()
                return
            name, item, weight = got
            if weight:
                with self._lock:
                    self._weight -= weight
            yield name, item

    def names(self) -> frozenset[str]:
        """Every name put; waits until the producer closed (raises if it failed)."""
        self._settled.wait()
        self._raise_if_failed()
        return frozenset(self._names)


def hand_over(
    handoff: Handoff[tuple[P, torch.Tensor | None]],
    name: str,
    positions: P,
    values: torch.Tensor | None,
) -> None:
    """Queue one captured parameter as ``(positions, values)``, the values (detection's) only
    when the handoff has room for them, else ``(positions, None)``: the consumer then reads
    them itself as it routes the parameter."""
    if values is not None and not handoff.room(values.numel()):
        values = None
    handoff.put(name, (positions, values), weight=0 if values is None else values.numel())


def run_into(future: Future, work: Callable[[], T], what: str) -> None:
    """Run ``work`` on the caller's thread with a background's contract: its result or its
    error goes to ``future`` for the sender's next call; an interrupt goes there as
    :class:`~deltasync.errors.SendInterruptedError` about ``what``, and is raised here too."""
    try:
        result = work()
    except BaseException as exc:
        future.set_exception(SendInterruptedError.of(exc, what))
        if not isinstance(exc, Exception):
            raise
    else:
        future.set_result(result)
