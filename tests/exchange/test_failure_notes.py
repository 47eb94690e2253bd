"""Failure notes read from the group's store (``exchange.notes``): whom a survivor names, and
which marks a rank leaves there, and how long it looks. The other ranks' notes are written into
the one-rank group's store by hand, as they would have left them; the time the notes module sees
is a fake clock, so how long a survivor waits is counted, not timed."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial

import pytest
from kit import one_rank_mesh

from deltasync.exchange import notes as notes_module
from deltasync.exchange.notes import GRACE_S, FailureNotes, NoteLedger, group_store


def test_a_streamed_versions_part_names_the_rank_that_stalled_in_an_earlier_part() -> None:
    # Part 0: rank 0 (the writer) gave up on rank 2 in round 2 and left a note there. Rank 1
    # finished part 0 and waits in part 1's round 1, where ranks 0 and 2 never arrive: rank 0
    # failed earlier, alive, so the one left is named.
    with one_rank_mesh():
        store = group_store(None)
        store.set("deltasync/v2-x1/fail/0", "2|round 2: send to rank 2 timed out")
        notes = FailureNotes(None, tag="v2-x1.1", rank=1, world=3, earlier=["v2-x1"])
        notes.arrive()
        assert notes.culprit(None)[0] == 2
        unaware = FailureNotes(None, tag="v2-x1.1", rank=1, world=3)  # without the earlier tag
        assert unaware.culprit(None)[0] is None


def _marks(store) -> list[str]:
    keys = [
        f"deltasync/{attempt}-{part}/{kind}/0"
        for attempt in ("a1", "a2", "a3", "a4")
        for part in ("x1", "x1.1", "x1.2", "x2", "commit", "pre1")
        for kind in ("in", "fail")
    ]
    return [k.removeprefix("deltasync/") for k in keys if store.check([k])]


def test_a_rank_keeps_only_the_marks_of_the_attempt_it_runs() -> None:
    # a1 committed; a2 streamed three parts and failed in its last one (a note there), before
    # any joint commit; a3 failed in its first exchange; a4 commits: a1-a3 are gone then.
    with one_rank_mesh():
        store = group_store(None)
        ledger = NoteLedger()

        def enter(attempt: str, *parts: str) -> None:
            pre = ledger.preflight_tag(None, 0)  # the preflight, under the last attempt begun
            if pre is not None:
                FailureNotes(None, tag=pre, rank=0, world=1).arrive()
            ledger.begin(attempt, None, 0)
            for part in parts:
                FailureNotes(None, tag=f"{attempt}-{part}", rank=0, world=1).arrive()

        enter("a1", "x1", "commit")
        ledger.settle(None, 0)  # what the joint commit does once every row is in
        assert _marks(store) == ["a1-x1/in/0", "a1-commit/in/0"]
        enter("a2", "x1", "x1.1", "x1.2")
        FailureNotes(None, tag="a2-x1.2", rank=0, world=1).post(None, "send timed out")
        enter("a3", "x1")
        assert len(_marks(store)) == 9  # a1's 2, a1-pre1, a2's 3 and its note, a2-pre1, a3's 1
        # a new ledger of this rank on the same group (a replacement sender) takes up its
        # rank's record: the same preflight tag as the one it replaces would have used
        assert NoteLedger().preflight_tag(None, 0) == "a3-pre1"
        enter("a4", "x1", "x2", "commit")
        ledger.settle(None, 0)
        assert _marks(store) == ["a4-x1/in/0", "a4-x2/in/0", "a4-commit/in/0"]


class FakeClock:
    """Stands in for the ``time`` module in ``exchange.notes``: ``sleep`` moves ``monotonic``
    on at once and then writes what a peer had left in the store by then (a late note)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, Callable[[], None]]] = []

    def at(self, t: float, write: Callable[[], None]) -> None:
        self._due.append((t, write))

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for due in [d for d in self._due if d[0] <= self.now]:
            self._due.remove(due)
            due[1]()


# Rank 0 of 3 failed a wait with ``suspect`` and reads the notes under the tag "t" (a joint
# commit after the exchange "t-x1"). Each mark: (seconds after rank 0's wait failed, key, value).
# -> the rank it must name, and text its trail must hold.
GRACE_CASES = {
    "a rank that never arrived": (
        None,
        [(0.0, "t/in/0", "1"), (0.0, "t/in/1", "1"), (0.1, "t/fail/1", "-1|commit timed out")],
        2,
        [],
    ),
    "a rank stopped inside the collective, a peer's note late": (
        None,
        [(0.0, f"t/in/{r}", "1") for r in range(3)] + [(0.3, "t/fail/1", "-1|commit timed out")],
        2,
        [],
    ),
    "a chain whose middle note comes late": (
        1,
        [(0.3, "t/fail/1", "2|receive from rank 2 timed out")],
        2,
        ["rank 1 reported: receive from rank 2 timed out"],
    ),
    "two never arrived, one failed alive in the exchange before, its note late": (
        None,
        [(0.0, "t/in/0", "1"), (0.3, "t-x1/fail/1", "2|send to rank 2 timed out")],
        2,
        ["rank 1 reported: send to rank 2 timed out"],
    ),
}


@pytest.mark.parametrize("name", list(GRACE_CASES))
def test_a_survivor_names_the_culprit_within_one_grace_in_all(name: str, monkeypatch) -> None:
    # docs/cluster.md: every survivor raises within its timeout plus one 0.5 s grace. Waiting
    # for the arrivals and then for the note of the rank that never arrived, or for each note
    # of a chain, one grace each, took up to twice that; a note left within the grace still
    # counts (each of these cases has one come late).
    suspect, marks, named, trail = GRACE_CASES[name]
    clock = FakeClock()
    monkeypatch.setattr(notes_module, "time", clock)
    with one_rank_mesh():
        store = group_store(None)
        for at, key, value in marks:
            write = partial(store.set, f"deltasync/{key}", value)
            if at == 0.0:
                write()
            else:
                clock.at(at, write)
        notes = FailureNotes(None, tag="t", rank=0, world=3, earlier=["t-x1"])
        notes.post(suspect, "this rank's wait failed")
        assert notes.culprit(suspect) == (named, trail)
    assert clock.now <= GRACE_S + 0.05, f"waited {clock.now:.2f} s for notes"


def test_of_two_ranks_that_never_arrived_without_a_note_the_one_whose_process_is_gone_is_named(
    monkeypatch,
) -> None:
    # Rank 0 of 4 fails in a joint commit ("t") after the exchange "t-x1". Rank 1 died between
    # the exchange's rounds; rank 3 is alive, still held in a send of that exchange to a
    # receiver that gave up (no note until its own timeout). Both never arrived: it said "the
    # failing rank could not be determined (ranks [1, 3] never arrived)" (4 writers, TP=2).
    if not notes_module._machine():
        pytest.skip("no /proc")
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.1)
        marks = {1: _child_mark(dead), 3: _child_mark(live)}
        dead.kill()
        dead.wait()
        clock = FakeClock()
        monkeypatch.setattr(notes_module, "time", clock)
        with one_rank_mesh():
            store = group_store(None)
            for rank in range(4):
                store.set(f"deltasync/t-x1/in/{rank}", marks.get(rank, "1"))
            store.set("deltasync/t/in/0", "1")
            store.set("deltasync/t/in/2", "1")
            notes = FailureNotes(None, tag="t", rank=0, world=4, earlier=["t-x1"])
            notes.post(None, "commit: connection closed")
            assert notes.culprit(None) == (1, [])
    finally:
        live.kill()
        live.wait()


def _child_mark(child) -> str:
    """The arrival mark ``child``'s own ``arrive()`` would write."""
    with open(f"/proc/{child.pid}/stat") as f:
        started = f.read().rpartition(")")[2].split()[19]
    return f"{child.pid} {started} {notes_module._machine()}"


@pytest.mark.timeout(60)
def test_a_live_rank_a_sampling_profiler_pauses_is_not_taken_for_a_stopped_one() -> None:
    # py-spy (its default) ptrace-stops the process it samples for a few ms a sample: a live
    # rank waiting in the collective, judged by one look at its state, would be named "died or
    # stopped responding" whenever a check fell in a pause.
    if not notes_module._machine():
        pytest.skip("no /proc")
    libc = ctypes.CDLL(None, use_errno=True)
    attach, detach = 16, 17  # PTRACE_ATTACH, PTRACE_DETACH
    loop = "import time\nwhile True: time.sleep(0.001)"
    child = subprocess.Popen([sys.executable, "-c", loop])
    stop = threading.Event()
    attached: list[bool] = []

    def sampler() -> None:  # ~100 samples a second, each holding the process ~2 ms
        while not stop.is_set():
            if libc.ptrace(attach, child.pid, None, None) == 0:
                attached.append(True)
                os.waitpid(child.pid, 0)
                time.sleep(0.002)
                libc.ptrace(detach, child.pid, None, None)
            time.sleep(0.008)

    try:
        time.sleep(0.2)
        mark = _child_mark(child)
        thread = threading.Thread(target=sampler)
        thread.start()
        try:
            named = 0
            for k in range(100):
                named += notes_module._process_gone(mark)
                time.sleep(0.003 + 0.0007 * (k % 17))
        finally:
            stop.set()
            thread.join()
        if not attached:
            pytest.skip("ptrace is not allowed here")
        assert named == 0
        child.send_signal(signal.SIGSTOP)  # stopped for good: named
        time.sleep(0.1)
        assert notes_module._process_gone(mark)
        child.send_signal(signal.SIGCONT)
        time.sleep(0.1)
        assert not notes_module._process_gone(mark)
        child.kill()  # a zombie until reaped, then gone: named either way
        time.sleep(0.1)
        assert notes_module._process_gone(mark)
        child.wait()
        assert notes_module._process_gone(mark)
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_a_live_rank_whose_proc_entry_is_hidden_is_not_taken_for_a_dead_one(monkeypatch) -> None:
    # /proc mounted with hidepid hides another user's processes: their entries read as
    # missing, though such a live rank has not ended.
    if not notes_module._machine():
        pytest.skip("no /proc")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        mark = _child_mark(child)
        real_open = open

        def hidden(path, *args, **kwargs):
            if str(path) == f"/proc/{child.pid}/stat":
                raise FileNotFoundError(2, "No such file or directory", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(notes_module, "open", hidden, raising=False)
        assert not notes_module._process_gone(mark)
        child.kill()
        child.wait()  # reaped: kill(pid, 0) finds no process
        assert notes_module._process_gone(mark)
    finally:
        child.kill()
        child.wait()
