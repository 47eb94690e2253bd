"""Prefetch: run a lazy change stream (a tracker's detection) one step ahead on its own thread.

A streaming publisher alternates "detect a parameter" and "route and encode a group". Both
release the GIL in their heavy parts (the C detection kernels, numpy, zstd), so running the
stream on a producer thread lets detection of the next parameters overlap routing and encoding
of the previous group. ``depth`` bounds how many detected parameters wait (their indices and
values are the memory this costs).

The consumer owns the lifetime: leaving the ``with`` block (normally or by an exception) stops
the producer and joins it, so the tracker behind the stream is never used by two threads and
is idle again when the publisher returns (a TrainerSync clears it right after). An exception
raised by the stream is re-raised in the consumer, at the position it happened.

:class:`Ready` marks a stream that needs no prefetch thread. This module knows threads and
iterators only.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

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
