"""Faults in real gloo processes: a failed detection, a corrupted payload, a stale payload of
an aborted attempt applied by one receiver, a receiver killed mid-exchange. Every rank fails together, nothing is committed, retries converge, none hangs."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from deltasync.exchange import spawn
from deltasync.exchange.status_row import WAIT_BEYOND_S

from cluster_testkit import (
    Setup,
    run_death_between_versions,
    run_death_in_retry,
    run_engine_pause_faults,
    run_faults,
    run_forwarder_death,
    run_receiver_late,
    run_refused_writer_with_gathering_full_state,
    run_replacement_then_death,
    run_replacement_writer,
    run_stall_in_round_one,
    run_trainer_late,
    run_unreadable_payload,
    run_writer_death,
    run_writer_death_in_preflight,
)

SETUP = Setup(timeout_s=3.0)
# The killed version is an anchor in 32-byte chunks: its exchange takes ~2.5 s here undisturbed,
# so a death 0.25 s in lands inside it (or, on a slower machine, in round 1: the same outcome).
DEATH_AFTER_S = 0.25


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict[int, dict[str, dict]]:
    notes = tmp_path_factory.mktemp("faults") / "rank2.pickle"
    results = spawn(run_faults, 3, SETUP, 2, DEATH_AFTER_S, str(notes), timeout_s=100, may_die={2})
    assert results[2] is None  # the receiver really died
    with open(notes, "rb") as f:
        results[2] = pickle.load(f)  # what it saw before its death
    return {rank: {s["name"]: s for s in r["steps"]} for rank, r in enumerate(results)}


@pytest.mark.timeout(150)
def test_a_failed_detection_makes_every_rank_raise_the_same_peer_failed_error_promptly(
    faults,
) -> None:
    steps = [faults[r]["detection fails"] for r in (0, 1)]
    assert {s["error"] for s in steps} == {"PeerFailedError"}
    assert len({s["message"] for s in steps}) == 1
    assert "preflight of version 2: rank 0 failed before sending" in steps[0]["message"]
    assert "change detection blew up on purpose" in steps[0]["message"]
    assert all(s["elapsed_s"] < 2.0 for s in steps)
    assert faults[0]["detection fails"]["version_after"] == 1  # baseline not advanced
    for rank in (1, 2):
        receiver = faults[rank]["detection fails"]
        assert receiver["error"] == "PeerFailedError"
        assert receiver["unchanged"] and receiver["version_after"] == 1


@pytest.mark.timeout(150)
def test_the_retry_after_a_failed_detection_converges(faults) -> None:
    assert faults[0]["retry after detection failure"]["error"] is None
    for rank in (1, 2):
        step = faults[rank]["retry after detection failure"]
        assert step["error"] is None and step["exact"] and step["version_after"] == 2


@pytest.mark.timeout(150)
def test_a_corrupted_payload_aborts_the_version_on_every_rank_and_the_trainer_keeps_its_baseline(
    faults,
) -> None:
    trainer = faults[0]["corrupt payload"]
    assert trainer["error"] == "SyncAbortedError"
    assert "rank 2 (receiver tp1 replica 0): DigestMismatchError" in trainer["message"]
    assert trainer["version_after"] == 2
    corrupt = faults[2]["corrupt payload"]
    assert corrupt["error"] == "DigestMismatchError"  # the storage path's error for a bad blob
    # named where it came from, with the in-cluster remedy (not the storage path's refetch)
    assert corrupt["message"].startswith("receiver tp1 replica 0 (rank 2): payload from rank 0: ")
    assert "retry the version (sync on every rank)" in corrupt["message"]
    assert "fetch it again" not in corrupt["message"]
    assert corrupt["unchanged"] and corrupt["version_after"] == 2
    assert corrupt["journal"].applying is None  # refused before the journal: nothing written
    other = faults[1]["corrupt payload"]
    assert other["error"] == "SyncAbortedError" and other["message"] == trainer["message"]
    # It applied the attempt before learning of the failure; the journal says so, and it
    # reports no version until the retry commits (its tensors hold neither 2 nor 3).
    assert other["journal"].applying == (3, 2) and other["journal"].committed == 2
    assert other["version_after"] is None


@pytest.mark.timeout(150)
def test_the_retry_after_a_corrupted_payload_converges_on_every_receiver(faults) -> None:
    assert faults[0]["retry after corruption"]["error"] is None
    assert faults[0]["retry after corruption"]["version_after"] == 3
    for rank in (1, 2):
        step = faults[rank]["retry after corruption"]
        assert step["error"] is None and step["exact"] and step["version_after"] == 3
        assert step["journal"].applying is None


@pytest.mark.timeout(150)
def test_a_stale_payload_that_verifies_against_its_own_digest_aborts_at_the_joint_commit(
    faults,
) -> None:
    # Rank 2 applies the payload of the aborted attempt of version 4 to the retry, after the
    # trainer stepped again: it verifies against the digest it carries, so only the commit
    # row's digests (another channel) can tell. Nothing commits; the retry is exact.
    messages = {faults[r]["stale payload replayed"]["message"] for r in (0, 1, 2)}
    assert {faults[r]["stale payload replayed"]["error"] for r in (0, 1, 2)} == {"SyncAbortedError"}
    assert len(messages) == 1
    (message,) = messages
    assert "rank 0 (writer w00000)" in message
    assert "a payload other than this attempt's" in message
    assert faults[0]["stale payload replayed"]["version_after"] == 3
    for rank in (1, 2):
        assert faults[rank]["stale payload replayed"]["version_after"] is None
        retry = faults[rank]["retry after the stale payload"]
        assert retry["error"] is None and retry["exact"] and retry["version_after"] == 4


@pytest.mark.timeout(150)
def test_a_receiver_killed_mid_exchange_makes_the_others_raise_promptly_without_committing(
    faults,
) -> None:
    for rank in (0, 1):
        step = faults[rank]["receiver killed"]
        assert step["exchange_error"] and not step["peer_failed"], step
        assert "exchange round" in step["message"] or "joint commit" in step["message"], step
        assert step["message"].startswith("version 5: rank 2 died or stopped responding"), step
        # the connection closes at once; a timeout would take SETUP.timeout_s at the worst
        assert step["elapsed_s"] < DEATH_AFTER_S + SETUP.timeout_s + 2.0, step
        assert step["version_after"] == 4


@pytest.mark.timeout(150)
def test_a_rank_that_dies_in_the_retry_of_an_aborted_version_is_named() -> None:
    # The aborted attempt's exchange and commit marked every rank's arrival; the retry of the
    # same version must not read those marks, or the rank that never arrived goes unnamed.
    results = spawn(run_death_in_retry, 3, SETUP, timeout_s=100, may_die={2})
    assert results[2] is None
    for rank in (0, 1):
        aborted, retry = results[rank]["steps"]
        assert aborted["error"] == "SyncAbortedError", aborted
        assert retry["exchange_error"] and not retry["peer_failed"], retry
        assert retry["message"].startswith("version 1: rank 2 died or stopped responding"), retry


@pytest.mark.timeout(150)
def test_a_writer_killed_between_its_rounds_is_named_by_every_survivor() -> None:
    # World 4: writer 1 dies after round 1. Writer 0 sends its own payloads and waits in the
    # joint commit, where no receiver arrives: they failed in round 2 and left notes there,
    # so the one that never arrived anywhere is the one named.
    setup = Setup(num_writers=2, tracker="snapshot", timeout_s=3.0)
    results = spawn(run_writer_death, 4, setup, timeout_s=100, may_die={1})
    assert results[1] is None
    for rank in (0, 2, 3):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert fault["message"].startswith("version 2: rank 1 died or stopped responding"), fault
        assert fault["elapsed_s"] < setup.timeout_s + 2.0, fault
        assert results[rank]["version_after"] == 1  # nothing applied, nothing committed


@pytest.mark.timeout(150)
def test_a_writer_killed_between_its_rounds_is_named_by_every_survivor_of_four_writers() -> None:
    # World 6: round 2 takes two batches. Writer 1 dies after round 1; the receivers fail in
    # batch 1 and stay up, so writer 0 is held in its batch-2 send to rank 5 until its timeout,
    # leaving no note, while writers 2, 3 finished sending and wait in the joint commit. There
    # ranks 0 and 1 both never arrived, and rank 2 named no one ("the failing rank could not
    # be determined (ranks [0, 1] never arrived)"): of those, the one whose process is gone is
    # named.
    setup = Setup(num_writers=4, tracker="snapshot", timeout_s=2.0)
    results = spawn(run_writer_death, 6, setup, setup.timeout_s, timeout_s=100, may_die={1})
    assert results[1] is None
    for rank in (0, 2, 3, 4, 5):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert fault["message"].startswith("version 2: rank 1 died or stopped responding"), fault
        # the joint commit waits commit_timeout_s + WAIT_BEYOND_S, then the notes' grace
        assert fault["elapsed_s"] < setup.timeout_s + WAIT_BEYOND_S + 1.0, fault
        assert results[rank]["version_after"] == 1  # nothing applied, nothing committed


@pytest.mark.timeout(150)
@pytest.mark.parametrize("refused_first", [False, True])
def test_a_rank_killed_between_versions_is_named_by_every_survivor_in_the_preflight(
    refused_first: bool,
) -> None:
    # The preflight is the version's first collective: every rank marks its arrival under a
    # tag derived from the last version all of them began, so the one that never came is named
    # (it said "some rank of the group", and a kill between versions lands there most often).
    # A version refused in its preflight is a verdict every rank holds: it started the tags
    # over as a failed gather does, and the death after it was "some rank" again.
    setup = Setup(timeout_s=20.0)
    results = spawn(run_death_between_versions, 3, setup, refused_first, timeout_s=100, may_die={2})
    assert results[2] is None
    if refused_first:
        for rank in (0, 1):
            assert results[rank]["refused"]["peer_failed"], results[rank]["refused"]
    for rank in (0, 1):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert "rank 2 died or stopped responding" in fault["message"], fault
        assert "preflight" in fault["message"], fault
        assert fault["elapsed_s"] < 5.0, fault  # the closed connection, not the timeout
        assert results[rank]["version_after"] == 1


@pytest.mark.timeout(150)
def test_a_writer_killed_inside_the_preflight_of_four_ranks_is_named_by_every_survivor() -> None:
    # Every rank arrived, so the dead writer is the one silent rank, but only its two ring
    # neighbours see its connection close: the fourth rank still waited inside the all_gather
    # without a note, and the neighbours named no one ("some rank of the group").
    setup = Setup(num_writers=2, tracker="snapshot", timeout_s=20.0)
    results = spawn(run_writer_death_in_preflight, 4, setup, timeout_s=100, may_die={1})
    assert results[1] is None  # it really died
    for rank in (0, 2, 3):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert "rank 1 died or stopped responding" in fault["message"], fault
    for rank in (2, 3):
        assert results[rank]["version_after"] == 1


@pytest.mark.timeout(150)
def test_a_writer_killed_inside_the_preflight_of_four_writers_fails_every_survivor_promptly() -> (
    None
):
    # World 6, every survivor staying up after its error (its connections open). Only the dead
    # writer's ring neighbours (ranks 0, 2) saw the connection close; writer 3 waited out its
    # timeout naming no one and the receivers their wait_for_version_s (60 s here, 600 s by
    # default), though every rank had arrived. A rank that fails there now closes its other
    # connections once its note is left, so the failure goes round the ring at once.
    setup = Setup(num_writers=4, tracker="snapshot", timeout_s=3.0)
    results = spawn(run_writer_death_in_preflight, 6, setup, 5.0, timeout_s=100, may_die={1})
    assert results[1] is None  # it really died
    for rank in (0, 2, 3, 4, 5):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert "rank 1 died or stopped responding" in fault["message"], fault
        assert fault["elapsed_s"] < 2.0, fault  # the closed connections, not a timeout
        assert results[rank]["version_after"] == 1


@pytest.mark.timeout(150)
def test_a_replacement_sender_on_the_same_group_is_not_named_for_a_receiver_that_died() -> None:
    # A new ClusterSender took no preflight tag (its ledger was fresh): it marked no arrival,
    # and the surviving receiver named the healthy, merely late writer instead of rank 2. It
    # now takes up its rank's record in the group's store.
    results = spawn(
        run_replacement_then_death, 3, Setup(timeout_s=20.0), 4.0, 1.5, timeout_s=120, may_die={2}
    )
    assert results[2] is None
    fault = results[1]["fault"]
    assert fault["exchange_error"], fault
    assert "rank 2 died or stopped responding" in fault["message"], fault
    assert "rank 0 died" not in fault["message"], fault


@pytest.mark.timeout(150)
def test_a_rank_stopped_inside_round_one_after_arriving_is_named() -> None:
    # Every rank marked its arrival, so no rank is missing there; the stopped one is the only
    # one that leaves no failure note when the others give up on the collective.
    setup = Setup(timeout_s=3.0)
    results = spawn(run_stall_in_round_one, 3, setup, 12.0, timeout_s=100, may_die={2})
    assert results[2] is None
    for rank in (0, 1):
        fault = results[rank]["fault"]
        assert fault["error"] == "ExchangeTimeoutError", fault
        assert fault["message"].startswith("version 1: rank 2 died or stopped responding"), fault
        assert fault["elapsed_s"] < setup.timeout_s + 2.0, fault


@pytest.mark.timeout(150)
def test_a_forwarder_killed_in_the_first_exchange_is_named_in_the_forward_exchange() -> None:
    # Forward mode: rank 1 (replica 0 of tp0) dies in the anchor's first exchange while ranks
    # 3, 4 (replica 1) wait in the forward exchange, where the writer and rank 2, which failed
    # alive in the first exchange (their notes there say so), never arrive either. The forward
    # exchange passes those two over, as the joint commit does, and names rank 1; without the
    # first exchange's tags there, ranks 3, 4 said "ranks [0, 1, 2] never arrived". Where each
    # rank fails is forced (a wait for the replicas' arrival marks, the chunking), not timed;
    # each survivor fails on a connection that a failed rank closed after leaving its note, and
    # reads the other notes within the notes' grace. The timeout only bounds a run gone wrong
    # (no wait here runs to it). The writer's side of the fix (ClusterSender._forward) is not
    # reached: the writer fails in the first exchange.
    setup = Setup(replicas=2, dp_mode="forward", timeout_s=20.0, max_chunk_bytes=4096)
    results = spawn(run_forwarder_death, 5, setup, timeout_s=100, may_die={1})
    assert results[1] is None  # it really died
    for rank in (0, 2, 3, 4):
        fault = results[rank]["fault"]
        assert fault["exchange_error"] and not fault["peer_failed"], fault
        assert "never arrived" not in fault["message"], fault
    for rank in (0, 2):  # they failed in the first exchange, as the scenario needs
        message = results[rank]["fault"]["message"]
        assert message.startswith("version 0: rank 1 died or stopped responding"), message
    for rank in (3, 4):  # where the fix acts
        message = results[rank]["fault"]["message"]
        assert message.startswith(
            "version 0 (forwarding to the shard's replicas): rank 1 died or stopped responding"
        ), message


@pytest.mark.timeout(150)
def test_receivers_waiting_for_a_late_trainer_name_the_version_they_hold() -> None:
    setup = Setup(timeout_s=3.0)
    results = spawn(run_trainer_late, 3, setup, 8.0, timeout_s=100)
    for rank in (1, 2):
        fault = results[rank]["fault"]
        assert fault["error"] == "ExchangeTimeoutError", fault
        assert (
            f"receiver tp{rank - 1} replica 0 holds version 0: waiting for the trainer's next"
            in (fault["message"])
        ), fault
        # the preflight waits its patience and the clocks' allowance (WAIT_BEYOND_S)
        assert fault["elapsed_s"] < setup.timeout_s + WAIT_BEYOND_S + 2.0, fault
        assert results[rank]["version_after"] == 0  # still the version it holds


@pytest.mark.timeout(150)
def test_a_receiver_late_for_the_preflight_is_named_not_the_writer_that_gave_up() -> None:
    # The writer waits 3 s in the preflight and gives up; receiver rank 2 comes 6 s late and
    # the all_gather still completes on the receivers with the writer's row. They refuse there,
    # naming the late receiver, instead of timing out in round 1 and blaming the writer.
    setup = Setup(timeout_s=3.0)
    results = spawn(run_receiver_late, 3, setup, 6.0, timeout_s=100)
    assert results[0]["fault"]["error"] == "ExchangeTimeoutError", results[0]
    for rank in (1, 2):
        fault = results[rank]["fault"]
        assert fault["error"] == "ExchangeTimeoutError", fault
        assert "rank 2 (receiver tp1 replica 0)" in fault["message"], fault
        assert "rank 0 (writer w00000) had stopped waiting" in fault["message"], fault
        assert "died or stopped responding" not in fault["message"], fault
        assert results[rank]["version_after"] == 0


@pytest.mark.timeout(150)
def test_a_replacement_writer_never_reuses_a_number_the_receivers_committed() -> None:
    # A writer restored from an older checkpoint numbers its next version 2 again, which the
    # receivers committed with other weights: every rank refuses it, anchor or delta, naming
    # the committed version and the number to send instead; version 3 then lands exact.
    results = spawn(run_replacement_writer, 3, Setup(timeout_s=10.0), timeout_s=120)
    writer, receivers = results[0], results[1:]
    assert [s["error"] for s in writer["steps"][:3]] == [None, None, None]
    for rank, r in enumerate(results):
        for refused in r["steps"][3:5]:
            assert refused["error"] == "SyncAbortedError", (rank, refused)
            assert not refused["anchor_required"], (rank, refused)
            message = refused["message"]
            assert message.startswith("preflight: version 2 refused on every rank"), message
            assert "receiver tp0 replica 0) committed version 2" in message, message
            assert "send a version above 2 (sync(3, anchor=True)" in message, message
        assert r["steps"][5]["error"] is None, (rank, r["steps"][5])
        assert r["version"] == 3
    for r in receivers:
        states: dict[int, set[str]] = {}
        for version, digest in r["seen"]:
            states.setdefault(version, set()).add(digest)
        assert all(len(d) == 1 for d in states.values()), (r["rank"], r["seen"])
        assert r["mismatched"] == [], r


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["whole", "streamed", "forwarded"])
def test_a_payload_too_short_for_its_framing_is_voted_and_every_rank_fails_promptly(case) -> None:
    # The receiver raised while joining it, outside the joint commit: the others waited the
    # whole commit timeout, blamed it as dead and broke the group; a retry at once aborted
    # the writer's process in gloo (a preflight meeting a joint commit).
    commit_s = 8.0
    setup = Setup(timeout_s=commit_s, overlap=case == "streamed")
    if case == "streamed":
        setup = replace(setup, part_bytes=1024)
    if case == "forwarded":  # rank 2 forwards to its replica, rank 4: it forwards nothing
        setup = replace(setup, replicas=2, dp_mode="forward")
    ranks = 1 + setup.tp * setup.replicas
    results = spawn(run_unreadable_payload, ranks, setup, case == "streamed", timeout_s=120)
    failed = {rank: r["steps"][1] for rank, r in enumerate(results)}
    where = "receiver tp1 replica 0 (rank 2): version 1: payload from rank 0"
    assert failed[2]["error"] == "EnvelopeError", failed[2]
    assert failed[2]["message"].startswith(where) and "48-byte framing" in failed[2]["message"]
    assert failed[2]["version_after"] == 0
    if case == "forwarded":
        assert (
            failed[4]["error"] == "MissingBlobError"
            and "no payload from ranks [2]" in (failed[4]["message"])
        )
    # overlapped, the writer's wait() names the joint commit's error as its cause
    writer = "SendFailedError" if case == "streamed" else "SyncAbortedError"
    assert failed[0]["error"] == writer, failed[0]
    others = (0, 1, 3) if case == "forwarded" else (0, 1)
    for rank in others:  # promptly; the group stays usable: the retry below converges
        if rank:
            assert failed[rank]["error"] == "SyncAbortedError", failed[rank]
        assert f"rank 2 (receiver tp1 replica 0): EnvelopeError: {where}" in failed[rank]["message"]
        assert failed[rank]["elapsed_s"] < commit_s / 2
    assert results[0]["steps"][2]["error"] is None
    assert results[0]["steps"][2]["version_after"] == 1
    for rank in range(1, ranks):
        retry = results[rank]["steps"][2]
        assert retry["error"] is None and retry["exact"] and retry["version_after"] == 1, retry


@pytest.mark.timeout(150)
def test_an_engine_pause_that_refuses_or_hides_a_failed_scatter_fails_the_version_typed() -> None:
    """A RuntimeError from rank 2's pause hook was voted, then re-raised raw on that rank,
    which marked its group broken: the retry failed on every rank. A hook that suppressed the
    scatter's error let rank 2 vote ok and report version 2 over tensors holding part of it."""
    results = spawn(run_engine_pause_faults, 3, SETUP, timeout_s=120)
    steps = [{s["name"]: s for s in r["steps"]} for r in results]
    assert [steps[r]["pause refused"]["error"] for r in (0, 1, 2)] == ["SyncAbortedError"] * 3
    assert "the engine refuses to pause" in steps[0]["pause refused"]["message"]
    suppressed = [steps[r]["scatter error suppressed"]["error"] for r in (0, 1, 2)]
    assert suppressed == ["SyncAbortedError", "SyncAbortedError", "IntegrityError"]
    assert "suppressed the error" in steps[2]["scatter error suppressed"]["message"]
    assert steps[2]["scatter error suppressed"]["version_after"] is None  # holds no version
    # torn, not drifted: the journal's attempt is repaired by the retry's union, no anchor
    assert [steps[r]["scatter error suppressed"]["anchor_required"] for r in (0, 1)] == [False] * 2
    for name, version in (("retry", 1), ("retry 2", 2)):
        assert steps[0][name]["error"] is None and steps[0][name]["version_after"] == version
        for rank in (1, 2):
            step = steps[rank][name]
            assert step["error"] is None and step["exact"] and step["version_after"] == version


@pytest.mark.timeout(150)
@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_writer_that_refuses_a_version_still_joins_a_gathering_full_state(overlap) -> None:
    # The full_state callable gathers over the writers (a collective). Writer 1 refuses the
    # version in its own checks; if it skipped the gather, writer 0 would wait in it until its
    # group's timeout instead of hearing of the refusal in the preflight.
    setup = Setup(
        num_writers=2, tracker="snapshot", timeout_s=20.0, overlap=overlap, digest_every=1
    )
    results = spawn(run_refused_writer_with_gathering_full_state, 4, setup, timeout_s=100)
    for rank in (0, 1):
        assert results[rank]["gathers"] == 2, results[rank]  # the anchor's and this version's
    refusal = "rank 1 failed before sending (rank 1: VersionError: version 0 is not after"
    for rank in range(4):
        fault = results[rank]["fault"]
        # an overlapped writer's wait() raises SendFailedError naming the preflight's verdict
        writer_overlapped = overlap and rank < 2
        assert fault["error"] == ("SendFailedError" if writer_overlapped else "PeerFailedError")
        assert refusal in fault["message"], fault
        assert fault["elapsed_s"] < 10.0, fault  # the preflight's verdict, not a timeout
    for rank in (2, 3):
        assert results[rank]["version_after"] == 0
