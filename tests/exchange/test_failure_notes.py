"""Failure notes read from the group's store (``exchange.notes``): whom a survivor names, and
which marks a rank leaves there. The other ranks' notes are written into the one-rank group's
store by hand, as they would have left them."""

from __future__ import annotations

from kit import one_rank_mesh

from deltasync.exchange.notes import FailureNotes, NoteLedger, group_store


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
        for part in ("x1", "x1.1", "x1.2", "x2", "commit")
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
            ledger.begin(attempt)
            for part in parts:
                FailureNotes(None, tag=f"{attempt}-{part}", rank=0, world=1).arrive()

        enter("a1", "x1", "commit")
        ledger.settle(None, 0)  # what the joint commit does once every row is in
        assert _marks(store) == ["a1-x1/in/0", "a1-commit/in/0"]
        enter("a2", "x1", "x1.1", "x1.2")
        FailureNotes(None, tag="a2-x1.2", rank=0, world=1).post(None, "send timed out")
        enter("a3", "x1")
        assert len(_marks(store)) == 7
        enter("a4", "x1", "x2", "commit")
        ledger.settle(None, 0)
        assert _marks(store) == ["a4-x1/in/0", "a4-x2/in/0", "a4-commit/in/0"]
