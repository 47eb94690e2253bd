from __future__ import annotations

import threading

import pytest

from deltasync.errors import CaptureAbandonedError
from deltasync.trainer.handoff import Handoff


def test_weight_counts_against_the_budget_until_the_consumer_takes_the_item():
    handoff: Handoff[str] = Handoff(budget=10)
    assert handoff.room(10) and not handoff.room(11)
    handoff.put("a", "first", weight=6)
    assert handoff.room(4) and not handoff.room(5)
    handoff.put("b", "second")  # weightless: always fits, takes nothing
    assert handoff.room(4) and not handoff.room(5)
    handoff.close()
    taken = iter(handoff)
    assert next(taken) == ("a", "first")
    assert handoff.room(10)  # taken: its weight is the consumer's now
    assert list(taken) == [("b", "second")]
    assert handoff.names() == {"a", "b"}


def test_no_budget_leaves_no_room_for_weight_and_put_never_waits():
    handoff: Handoff[int] = Handoff()
    assert handoff.room(0) and not handoff.room(1)
    for i in range(3):  # nobody consumes: put still returns at once
        handoff.put(f"p{i}", i, weight=5)
    assert not handoff.room(0)  # overdrawn by the caller's own puts: nothing more fits


def test_a_failed_producer_is_raised_where_the_consumer_reaches_it():
    handoff: Handoff[int] = Handoff(budget=4)
    handoff.put("a", 1, weight=4)
    handoff.fail(RuntimeError("kernel failed"))
    got = []
    with pytest.raises(CaptureAbandonedError, match="kernel failed"):
        for item in handoff:
            got.append(item)
    assert got == [("a", 1)] and handoff.room(4)


def test_weights_balance_across_threads():
    handoff: Handoff[int] = Handoff(budget=1 << 40)
    n = 2000

    def produce() -> None:
        for i in range(n):
            handoff.put(f"p{i}", i, weight=3)
        handoff.close()

    t = threading.Thread(target=produce)
    t.start()
    assert [i for _, i in handoff] == list(range(n))
    t.join()
    assert handoff.room(1 << 40)  # everything taken: nothing left counted
