"""Prefetch runs a lazy stream on its own thread: same items in order, the stream's error at
its position, and leaving early stops and joins the producer (the tracker is idle after)."""

from __future__ import annotations

import threading

import pytest

from deltasync.publish.segments import Prefetch


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_come_in_order(depth):
    with Prefetch(iter(range(100)), depth=depth) as items:
        assert list(items) == list(range(100))


def test_the_streams_error_is_raised_in_the_consumer_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise ValueError("detection failed")

    seen = []
    with pytest.raises(ValueError, match="detection failed"):
        with Prefetch(source(), depth=2) as items:
            for x in items:
                seen.append(x)
    assert seen == [1, 2]


def test_leaving_early_stops_the_producer_and_joins_it():
    produced = []
    threads = []

    def source():
        threads.append(threading.current_thread())
        for k in range(10_000):
            produced.append(k)
            yield k

    with pytest.raises(RuntimeError, match="consumer failed"):
        with Prefetch(source(), depth=2) as items:
            for x in items:
                if x == 5:
                    raise RuntimeError("consumer failed")
    assert not threads[0].is_alive()
    assert len(produced) < 20  # bounded by the depth, not the stream's length
    assert threads[0] is not threading.current_thread()
