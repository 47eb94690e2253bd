"""Failures in real gloo processes: every rank fails together and names the cause; none hangs."""

from __future__ import annotations

import re

import pytest

from deltasync.exchange import spawn

from exchange_testkit import (
    die_in_round_two,
    die_inside_round_one,
    fail_before_round_one,
    never_call_round_one,
    unmatched_messages,
)


@pytest.fixture(scope="module")
def failures_before_round_two() -> list[list[dict]]:
    """Four ranks: a status failure, a bad payload, a config mismatch, then a good exchange."""
    return spawn(fail_before_round_one, 4, timeout_s=25)


@pytest.mark.timeout(30)
def test_a_rank_passing_a_status_makes_every_rank_raise_the_same_peer_failed_error(
    failures_before_round_two: list[list[dict]],
) -> None:
    outcomes = [per_rank[0] for per_rank in failures_before_round_two]
    assert {o["error"] for o in outcomes} == {"PeerFailedError"}
    assert len({o["message"] for o in outcomes}) == 1
    message = outcomes[0]["message"]
    assert "round 1: rank 2 failed" in message
    assert "RuntimeError: change detection blew up" in message
    # The failing rank's own error keeps the original exception as its cause.
    assert "change detection blew up" in outcomes[2]["cause"]


@pytest.mark.timeout(30)
def test_an_unusable_payload_on_one_rank_is_reported_by_every_rank(
    failures_before_round_two: list[list[dict]],
) -> None:
    outcomes = [per_rank[1] for per_rank in failures_before_round_two]
    assert {o["error"] for o in outcomes} == {"PeerFailedError"}
    assert len({o["message"] for o in outcomes}) == 1
    assert "rank 1 failed" in outcomes[0]["message"]
    assert "float32 tensor" in outcomes[0]["message"]


@pytest.mark.timeout(30)
def test_ranks_with_different_configs_all_refuse_to_start_round_two(
    failures_before_round_two: list[list[dict]],
) -> None:
    outcomes = [per_rank[2] for per_rank in failures_before_round_two]
    assert {o["error"] for o in outcomes} == {"ExchangeError"}
    assert "rank 3: max_chunk_bytes=512" in outcomes[0]["message"]


@pytest.mark.timeout(30)
def test_the_group_still_works_after_failures_in_round_one(
    failures_before_round_two: list[list[dict]],
) -> None:
    for rank, per_rank in enumerate(failures_before_round_two):
        src = (rank - 1) % 4
        assert per_rank[3] == {"received": {src: bytes([src]) * 3000}}


@pytest.mark.timeout(30)
def test_a_rank_dying_in_round_two_makes_every_other_rank_fail_within_seconds() -> None:
    # Round 2 here is thousands of 4 KiB batches (several seconds if it ran to the end), so a
    # death 1.5 s in lands in its middle; the batch numbers below confirm it.
    death_after_s, timeout_s = 1.5, 3.0
    results = spawn(die_in_round_two, 4, 3, death_after_s, timeout_s, timeout_s=20, may_die={3})
    assert results[3] is None  # it really died
    for rank in range(3):
        outcome = results[rank]
        assert outcome["error"] in ("ExchangeError", "ExchangeTimeoutError"), outcome
        assert "exchange round 2" in outcome["message"]
        assert "rank " in outcome["message"]
        assert outcome["elapsed_s"] < death_after_s + timeout_s + 1.0, outcome
    batches = [int(re.search(r"batch (\d+) of", results[r]["message"]).group(1)) for r in range(3)]
    assert max(batches) > 1, batches
    # A rank that talked to the dead one learns of it from the closed connection, not a timeout.
    assert any("rank 3" in results[r]["message"] for r in range(3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [4, 5])
def test_a_rank_killed_inside_round_one_after_arriving_is_named_by_every_survivor(world) -> None:
    # Only the dead rank's ring neighbours see a closed connection; the other survivors still
    # wait inside the all_gather and leave no note until those neighbours give up. Every
    # rank arrived, so the neighbours must tell the dead rank from the live waiters.
    results = spawn(die_inside_round_one, world, 1, 5.0, timeout_s=45, may_die={1})
    assert results[1] is None  # it really died
    for rank in (r for r in range(world) if r != 1):
        outcome = results[rank]
        assert outcome["error"] in ("ExchangeError", "ExchangeTimeoutError"), outcome
        assert outcome["message"].startswith("rank 1 died or stopped responding"), outcome


@pytest.mark.timeout(30)
def test_ranks_time_out_in_round_one_naming_it_when_a_rank_never_calls_exchange() -> None:
    results = spawn(never_call_round_one, 3, 1.0, timeout_s=20)
    for rank in (0, 2):
        outcome = results[rank]
        assert outcome["error"] == "ExchangeTimeoutError", outcome
        assert "exchange round 1" in outcome["message"]
        assert 0.9 < outcome["elapsed_s"] < 3.0, outcome


@pytest.mark.timeout(30)
def test_a_message_whose_peer_never_posts_its_side_times_out_naming_the_peer_and_round() -> None:
    send, receive = spawn(unmatched_messages, 2, 1.0, timeout_s=20)[0]
    assert send["error"] == "ExchangeTimeoutError"
    assert (
        "exchange round 2, batch 1 of 2: send of chunk 1/2 (64 bytes) to rank 1" in send["message"]
    )
    assert receive["error"] == "ExchangeTimeoutError"
    assert "receive of chunk 1/2 (64 bytes) from rank 1" in receive["message"]
    for outcome in (send, receive):
        assert 0.9 < outcome["elapsed_s"] < 3.0, outcome
