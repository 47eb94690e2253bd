from __future__ import annotations

import signal
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


class _CtrlCOnPut:
    """A queue whose next ``put`` is preceded by a Ctrl-C, as if it landed right there."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def put(self, item) -> None:
        signal.raise_signal(signal.SIGINT)
        self.inner.put(item)

    def get(self):
        return self.inner.get()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["close", "fail"])
def test_a_ctrl_c_as_the_handoff_settles_still_ends_the_consumer(end) -> None:
    handoff: Handoff[int] = Handoff()
    handoff.put("a", 1)
    handoff._items = _CtrlCOnPut(handoff._items)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            handoff.close() if end == "close" else handoff.fail(RuntimeError("detection"))
    finally:
        signal.signal(signal.SIGINT, previous)
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(_consume(handoff)), daemon=True)
    consumer.start()
    consumer.join(10)
    assert not consumer.is_alive(), "the consumer waits for an end that was never queued"
    assert got == [["a"] if end == "close" else "CaptureAbandonedError"]


def _consume(handoff: Handoff) -> list[str] | str:
    try:
        return [name for name, _ in handoff]
    except CaptureAbandonedError as exc:
        return type(exc).__name__
