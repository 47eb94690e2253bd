"""The in-cluster promise in real gloo processes on 127.0.0.1: a retried version leaves every
receiver exact whatever the tracker; ranks built for another model, TP or vocabulary are
refused everywhere before any write; a receiver killed or a writer hung in round 2 makes every
survivor raise within the exchange timeout naming that rank; recovery ends exact."""

from __future__ import annotations

import pytest
from promise_testkit import (
    FAULT_AFTER_S,
    RetrySetup,
    run_failure,
    run_late_writer_in_commit,
    run_preflight,
    run_retry,
    run_slow_commit,
)

from deltasync.exchange import spawn

TIMEOUT_S = 3.0  # the exchange timeout of the failure scenarios
SLACK_S = 3.0  # preflight grace, note reading and a loaded 2-core machine


@pytest.fixture(scope="module")
def two_snapshot_writers() -> list[dict]:
    return spawn(run_retry, 4, RetrySetup(writers=2, tracker="snapshot"), timeout_s=150)


@pytest.mark.timeout(200)
def test_a_retry_after_an_aborted_attempt_and_more_training_is_exact_with_two_snapshot_writers(
    two_snapshot_writers,
) -> None:
    writers, (applied, refused) = two_snapshot_writers[:2], two_snapshot_writers[2:]
    for w in writers:
        assert w["steps"]["corrupted attempt"]["error"] == "SyncAbortedError"
        assert w["steps"]["retry"]["error"] is None and w["version"] == 2
    # The case the union exists for happened: elements the attempt sent are back at base bits.
    assert writers[0]["back_at_base"] > 0 and writers[1]["back_at_base"] > 0
    assert all(w["pending_elements"] > 0 for w in writers)
    attempt = applied["steps"]["corrupted attempt"]
    assert attempt["error"] == "SyncAbortedError"
    assert attempt["journal"].applying == (2, 1)
    # It holds the attempt's values, so it serves no version until the retry commits.
    assert attempt["version"] is None and attempt["committed"] == 1
    assert refused["steps"]["corrupted attempt"]["error"] == "DigestMismatchError"
    assert refused["steps"]["corrupted attempt"]["version"] == 1
    for r in (applied, refused):
        retry = r["steps"]["retry"]
        assert retry["error"] is None and retry["exact"] and retry["version"] == 2


@pytest.mark.timeout(200)
def test_a_retry_after_an_aborted_attempt_and_more_training_is_exact_with_the_adamw_tracker() -> (
    None
):
    writer, *receivers = spawn(run_retry, 3, RetrySetup(writers=1, tracker="adamw"), timeout_s=150)
    assert writer["back_at_base"] > 0 and writer["steps"]["retry"]["error"] is None
    assert receivers[0]["steps"]["corrupted attempt"]["journal"].applying == (2, 1)
    for r in receivers:
        assert r["steps"]["retry"]["exact"] and r["steps"]["retry"]["version"] == 2


KINDS = ["intermediate", "tp", "vocab"]


@pytest.fixture(scope="module")
def preflight_runs() -> list[dict]:
    return spawn(run_preflight, 3, KINDS, timeout_s=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("intermediate", ["I=256", "I=128"]),
        ("tp", ["tp=4", "tp=2"]),
        ("vocab", ["V=1010", "V=1000"]),
    ],
)
def test_a_rank_built_for_another_model_or_tp_is_refused_on_every_rank_before_any_write(
    preflight_runs, kind: str, words: list[str]
) -> None:
    steps = [r["steps"][kind] for r in preflight_runs]
    assert {s["error"] for s in steps} == {"FingerprintMismatchError"}, steps
    assert len({s["message"] for s in steps}) == 1  # the same text on every rank
    message = steps[0]["message"]
    for rank in (0, 1, 2):
        assert f"rank {rank}:" in message  # each rank's configuration is named
    for word in words:
        assert word in message
    assert all(s["elapsed_s"] < 10.0 for s in steps)
    assert steps[1]["untouched"] and steps[1]["version"] == 0


@pytest.mark.timeout(150)
def test_once_every_rank_agrees_the_delta_commits_exact(preflight_runs) -> None:
    steps = [r["steps"]["fixed"] for r in preflight_runs]
    assert {s["error"] for s in steps} == {None}
    assert steps[1]["exact"] and steps[2]["exact"]


@pytest.fixture(scope="module")
def receiver_killed() -> list[dict]:
    return spawn(run_failure, 4, 2, "kill", TIMEOUT_S, 3, timeout_s=150, may_die={2})


@pytest.mark.timeout(200)
def test_a_receiver_killed_in_round_two_makes_every_survivor_raise_in_time_naming_it(
    receiver_killed,
) -> None:
    assert receiver_killed[2] is None  # really dead
    for rank in (0, 1):
        fault = receiver_killed[rank]["fault"]
        assert fault["error"] in ("ExchangeError", "ExchangeTimeoutError"), fault
        assert "rank 2 died or stopped responding" in fault["message"], fault
        assert fault["elapsed_s"] < FAULT_AFTER_S + TIMEOUT_S + SLACK_S, fault
    assert receiver_killed[1]["version_after_fault"] == 1


@pytest.mark.timeout(200)
def test_after_a_death_a_replacement_rank_joins_a_new_group_and_an_anchor_makes_everyone_exact(
    receiver_killed,
) -> None:
    writer, survivor, standby = receiver_killed[0], receiver_killed[1], receiver_killed[3]
    for r in (writer, survivor, standby):
        assert r["retry"]["error"] == "SyncAbortedError" and r["retry"]["anchor_required"], r
        assert r["anchor"]["error"] is None, r
        assert r["version"] == 2
    assert "holds no verified version" in writer["retry"]["message"]
    assert survivor["exact"] and standby["exact"]


@pytest.mark.timeout(200)
def test_a_writer_hung_in_round_two_makes_every_receiver_raise_in_time_naming_it() -> None:
    results = spawn(run_failure, 3, 0, "hang", TIMEOUT_S, None, timeout_s=150, may_die={0})
    for rank in (1, 2):
        fault = results[rank]["fault"]
        assert fault["error"] in ("ExchangeError", "ExchangeTimeoutError"), fault
        assert "rank 0 died or stopped responding" in fault["message"], fault
        assert fault["elapsed_s"] < FAULT_AFTER_S + TIMEOUT_S + SLACK_S, fault
        assert results[rank]["version_after_fault"] == 1


@pytest.mark.timeout(200)
def test_a_version_a_slow_receiver_committed_alone_is_never_sent_again_as_another_state() -> None:
    # Rank 2 stalls past the commit timeout before its commit row: the writer and rank 1 time
    # out, but rank 2, continuing, completes the all_gather from the rows already sent and
    # commits version 2. The writer cannot know; the version it failed must not be sent again
    # under the same number with the next step's weights, or rank 2 reports version 2 for two
    # different states.
    results = spawn(run_slow_commit, 3, 8.0, 2.0, timeout_s=150)  # past 2 s + WAIT_BEYOND_S
    writer, receivers = results[0], results[1:]
    assert writer["steps"][0]["error"] == "ExchangeTimeoutError", writer["steps"][0]
    assert "version 2" in writer["steps"][0]["message"]
    for r in receivers:
        states: dict[int, set[str]] = {}
        for version, digest in r["seen"]:
            states.setdefault(version, set()).add(digest)
        assert all(len(d) == 1 for d in states.values()), (r["rank"], r["seen"])
        assert r["exact"] and r["version"] == writer["version"], r


@pytest.mark.timeout(200)
def test_a_rank_late_to_the_commit_within_the_clocks_allowance_commits_on_every_rank() -> None:
    # Rank 2 reaches the joint commit 0.4 s after the others' commit_timeout_s. The verdict
    # takes that as on time (the clocks' allowance), so the others must still be waiting:
    # they had given up, and rank 2 committed version 2 alone.
    results = spawn(run_slow_commit, 3, 2.4, 2.0, timeout_s=150)
    writer, receivers = results[0], results[1:]
    assert writer["steps"][0]["error"] is None, writer["steps"][0]
    for r in receivers:
        assert r["steps"][2]["error"] is None, (r["rank"], r["steps"][2])
        assert [v for v, _ in r["seen"]][:3] == [0, 1, 2], r["seen"]
        assert r["exact"] and r["version"] == writer["version"] == 3, r


@pytest.mark.timeout(200)
def test_two_writers_split_by_a_late_writer_in_the_commit_converge_by_the_recovery_recipe() -> None:
    # Writer 1 stalls past the commit timeout before its commit row. Writer 0 and the receiver
    # give up without a verdict, so writer 0 never sends version 2 again; writer 1, continuing,
    # completes the all_gather and gets the abort for lateness. It must retire version 2 too:
    # otherwise its sync() picks 2 and writer 0's picks 3, and every preflight of the recipe
    # refuses the pair ("the writers send different versions"), anchors included.
    writer, late, receiver = spawn(run_late_writer_in_commit, 3, 8.0, 2.0, timeout_s=150)
    assert writer["steps"][2]["error"] == "ExchangeTimeoutError", writer["steps"][2]
    assert receiver["steps"][2]["error"] == "ExchangeTimeoutError", receiver["steps"][2]
    stalled = late["steps"][2]
    assert stalled["error"] == "SyncAbortedError" and "stopped waiting" in stalled["message"]
    for r in (writer, late, receiver):
        assert [s["error"] for s in r["steps"][3:]] == [None], (r["rank"], r["steps"][3:])
        assert r["version"] == 3
    assert receiver["exact"]
    assert "version 2 is not sent again (sync() picks 3)" in stalled["message"]
