"""Real gloo processes exchange payloads; every rank checks what it got bit for bit."""

from __future__ import annotations

import random

import pytest

from deltasync.exchange import spawn

from exchange_testkit import Case, run_cases, stream_in_parts


def cases_for(w: int) -> list[Case]:
    rng = random.Random(w)
    # Larger worlds get smaller payloads: six processes share two cores.
    biggest = 6000 // w
    random_sizes = tuple(
        tuple(0 if rng.random() < 0.25 else rng.randint(1, biggest) for _ in range(w))
        for _ in range(w)
    )
    quiet = tuple(
        tuple(0 if src in (0, w - 1) or dst == 1 else rng.randint(1, biggest) for dst in range(w))
        for src in range(w)
    )
    one_big_pair = tuple(
        tuple(300_000 // w if (src, dst) == (0, w - 1) else 3 for dst in range(w))
        for src in range(w)
    )
    return [
        Case("random sizes", random_sizes, max_chunk_bytes=256, max_inflight_ops=4),
        Case("zero rows and a zero column", quiet, max_chunk_bytes=512, max_inflight_ops=3),
        Case("one pair far above the chunk bound", one_big_pair, max_chunk_bytes=2048),
        Case("single bytes", tuple((1,) * w for _ in range(w)), max_chunk_bytes=1),
        Case("nothing at all", tuple((0,) * w for _ in range(w))),
        Case("default config", random_sizes),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("w", [2, 3, 4, 5, 6])
def test_every_rank_receives_exactly_the_bytes_sent_to_it(w: int) -> None:
    cases = cases_for(w)
    results = spawn(run_cases, w, cases, timeout_s=25)
    for rank, summaries in enumerate(results):
        for case, summary in zip(cases, summaries, strict=True):
            where = f"rank {rank}, case {case.name!r}"
            assert summary["sources"] == summary["expected_sources"], where
            assert summary["mismatched"] == [], where
            assert summary["dtypes"] in ([], ["torch.uint8"]), where
            # On gloo every payload already lives on the CPU: nothing is staged.
            assert summary["peak_staging_bytes"] == 0, where
            expected = sum(case.matrix[src][rank] for src in range(w) if src != rank)
            assert summary["bytes_received"] == expected, where


@pytest.mark.timeout(30)
def test_a_pair_far_above_the_chunk_bound_travels_as_many_bounded_messages() -> None:
    w = 2
    big = Case("big", ((0, 1_000_000), (0, 0)), max_chunk_bytes=4096, max_inflight_ops=8)
    sender, receiver = spawn(run_cases, w, [big], timeout_s=25)
    assert receiver[0]["mismatched"] == [] and receiver[0]["sources"] == [0]
    chunks = -(-1_000_000 // 4096)
    assert sender[0]["messages"] == chunks == receiver[0]["messages"]


@pytest.mark.timeout(30)
def test_ranks_streaming_different_numbers_of_parts_agree_on_every_exchange() -> None:
    parts = [3, 0, 1, 5]
    results = spawn(stream_in_parts, 4, parts, timeout_s=25)
    for rank, res in enumerate(results):
        # every rank ran exactly as many exchanges as the longest stream, and was told
        # "more follows" after all but the last
        assert res["rounds"] == 5, rank
        assert res["more_seen"] == [True] * 4 + [False], rank
        assert res["exact"] == {0: True, 2: True, 3: True}, rank
