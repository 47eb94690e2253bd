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


def test_a_rank_keeps_only_the_arrival_marks_of_the_version_it_runs() -> None:
    with one_rank_mesh():
        store = group_store(None)
        ledger = NoteLedger()
        for version in (1, 2, 3):
            tags = [f"v{version}-x1", f"v{version}-commit"]
            for tag in tags:
                FailureNotes(None, tag=tag, rank=0, world=1).arrive()
            ledger.add(tags)
            ledger.keep_only(tags, None, 0)  # what the joint commit does once every row is in
            marks = [k for k in ("1", "2", "3") if store.check([f"deltasync/v{k}-x1/in/0"])]
            assert marks == [str(version)]
