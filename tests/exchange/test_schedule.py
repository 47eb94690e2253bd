"""The round-2 plan as a table: pure, no processes."""

from __future__ import annotations

import itertools
import random

import pytest

from deltasync.errors import ConfigError, ExchangeError
from deltasync.exchange import Batch, Chunk, Schedule, plan_schedule


def all_ops(schedule: Schedule):
    """(rank, batch index, 'send'|'recv', chunk) for every operation of every rank."""
    for rank in range(schedule.world_size):
        for batch in schedule.batches_for(rank):
            for c in batch.sends:
                yield rank, batch.index, "send", c
            for c in batch.recvs:
                yield rank, batch.index, "recv", c


def random_matrix(rng: random.Random, w: int, zero_share: float, biggest: int) -> list[list[int]]:
    return [
        [0 if rng.random() < zero_share else rng.randint(1, biggest) for _ in range(w)]
        for _ in range(w)
    ]


def simulate(schedule: Schedule, plans: dict[int, tuple[Batch, ...]] | None = None) -> bool:
    """Run the executor's protocol abstractly: a rank posts its whole current batch, an
    operation completes once both ends have posted it (gloo sends wait for the receive) and
    stays complete, and a rank moves on when every operation of its batch completed. True when
    every rank finishes, False on deadlock."""
    w = schedule.world_size
    plans = plans or {r: schedule.batches_for(r) for r in range(w)}
    position = dict.fromkeys(range(w), 0)
    done: set[tuple[int, int, int]] = set()  # (src, dst, chunk index) of finished messages

    def posted(rank: int) -> set[tuple[str, int, int, int]]:
        if position[rank] >= len(plans[rank]):
            return set()
        b = plans[rank][position[rank]]
        return {("send", rank, c.peer, c.index) for c in b.sends} | {
            ("recv", c.peer, rank, c.index) for c in b.recvs
        }

    while any(position[r] < len(plans[r]) for r in range(w)):
        everything = set().union(*(posted(r) for r in range(w)))
        newly = {
            (src, dst, i)
            for kind, src, dst, i in everything
            if kind == "send" and ("recv", src, dst, i) in everything
        }
        done |= newly
        movers = [r for r in range(w) if posted(r) and all(op[1:] in done for op in posted(r))]
        if not movers:
            return False
        for r in movers:
            position[r] += 1
    return True


def test_a_small_plan_matches_the_table_written_out_by_hand() -> None:
    # 0 -> 1: 25 bytes (3 chunks of <= 10); 1 -> 0: 5 bytes; rank 2 neither sends nor receives.
    schedule = plan_schedule(
        [[0, 25, 0], [5, 0, 0], [0, 0, 0]], max_chunk_bytes=10, max_inflight_ops=2
    )
    # Slots chunk-major: (step 1, chunk 0), (step 2, chunk 0), (step 1, chunk 1), (step 1, chunk 2).
    assert list(schedule.slots()) == [(1, 0), (2, 0), (1, 1), (1, 2)]
    assert schedule.batches_for(0) == (
        Batch(0, sends=(Chunk(1, 0, 10, 0, 3),), recvs=()),
        Batch(1, sends=(), recvs=(Chunk(1, 0, 5, 0, 1),)),
        Batch(2, sends=(Chunk(1, 10, 10, 1, 3),), recvs=()),
        Batch(3, sends=(Chunk(1, 20, 5, 2, 3),), recvs=()),
    )
    assert schedule.batches_for(1) == (
        Batch(0, sends=(), recvs=(Chunk(0, 0, 10, 0, 3),)),
        Batch(1, sends=(Chunk(0, 0, 5, 0, 1),), recvs=()),
        Batch(2, sends=(), recvs=(Chunk(0, 10, 10, 1, 3),)),
        Batch(3, sends=(), recvs=(Chunk(0, 20, 5, 2, 3),)),
    )
    assert schedule.batches_for(2) == ()


def test_an_all_zero_matrix_schedules_no_operation() -> None:
    schedule = plan_schedule([[0] * 5] * 5, max_chunk_bytes=8, max_inflight_ops=4)
    assert schedule.num_slots == 0
    assert schedule.num_batches == 0
    assert list(all_ops(schedule)) == []


def test_a_rank_with_a_zero_row_sends_nothing_but_still_receives() -> None:
    matrix = [[0, 0, 0, 0], [7, 0, 3, 9], [1, 2, 0, 0], [0, 5, 5, 0]]
    schedule = plan_schedule(matrix, max_chunk_bytes=4, max_inflight_ops=4)
    ops = list(all_ops(schedule))
    assert not [op for op in ops if op[0] == 0 and op[2] == "send"]
    assert sum(c.nbytes for r, _, kind, c in ops if r == 0 and kind == "recv") == 7 + 1


def test_self_sends_and_zero_pairs_get_no_operation_on_either_side() -> None:
    matrix = [[9, 0, 4], [0, 9, 0], [6, 0, 9]]
    schedule = plan_schedule(matrix, max_chunk_bytes=100, max_inflight_ops=8)
    pairs = {(r, c.peer) if kind == "send" else (c.peer, r) for r, _, kind, c in all_ops(schedule)}
    assert pairs == {(0, 2), (2, 0)}
    assert all(c.nbytes > 0 for *_, c in all_ops(schedule))


@pytest.mark.parametrize(
    ("w", "max_chunk_bytes", "max_inflight_ops", "zero_share", "biggest"),
    [
        (1, 4, 2, 0.0, 100),
        (2, 1, 2, 0.0, 9),
        (3, 7, 3, 0.3, 100),
        (4, 10, 8, 0.5, 1000),
        (5, 1 << 20, 8, 0.2, 50),
        (6, 33, 5, 0.6, 500),
        (8, 64, 16, 0.1, 2000),
    ],
)
def test_every_byte_is_scheduled_exactly_once_in_bounded_chunks_and_batches(
    w: int, max_chunk_bytes: int, max_inflight_ops: int, zero_share: float, biggest: int
) -> None:
    rng = random.Random(w * 1000 + max_chunk_bytes)
    matrix = random_matrix(rng, w, zero_share, biggest)
    schedule = plan_schedule(
        matrix, max_chunk_bytes=max_chunk_bytes, max_inflight_ops=max_inflight_ops
    )
    sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, _, kind, c in all_ops(schedule):
        assert 0 < c.nbytes <= max_chunk_bytes
        key = (rank, c.peer) if kind == "send" else (c.peer, rank)
        (sends if kind == "send" else recvs).setdefault(key, []).append((c.offset, c.nbytes))
    for src in range(w):
        for dst in range(w):
            if src == dst or matrix[src][dst] == 0:
                assert (src, dst) not in sends and (src, dst) not in recvs
                continue
            # Ascending, touching, covering [0, n): each byte exactly once, on both sides.
            pieces = sends[(src, dst)]
            assert pieces == recvs[(src, dst)]
            assert pieces[0][0] == 0
            for (off, n), (next_off, _) in itertools.pairwise(pieces):
                assert off + n == next_off
            assert pieces[-1][0] + pieces[-1][1] == matrix[src][dst]
    for rank in range(w):
        for batch in schedule.batches_for(rank):
            assert len(batch.sends) + len(batch.recvs) <= max_inflight_ops


def test_each_send_meets_its_receive_in_the_same_batch_and_the_same_order() -> None:
    rng = random.Random(7)
    for w in range(2, 8):
        matrix = random_matrix(rng, w, 0.3, 300)
        schedule = plan_schedule(matrix, max_chunk_bytes=16, max_inflight_ops=6)
        by_batch: dict[tuple[int, int, int], list[Chunk]] = {}
        for rank, k, kind, c in all_ops(schedule):
            src, dst = (rank, c.peer) if kind == "send" else (c.peer, rank)
            side = 0 if kind == "send" else 1
            by_batch.setdefault((k, src, dst), [[], []])[side].append((c.offset, c.nbytes))
        for sent, received in by_batch.values():
            assert sent == received


def test_every_rank_derives_the_same_plan_from_the_same_matrix() -> None:
    matrix = [[0, 5, 0, 70], [3, 0, 0, 0], [0, 0, 0, 12], [1, 1, 1, 1]]
    as_lists = plan_schedule(matrix, max_chunk_bytes=8, max_inflight_ops=4)
    as_tuples = plan_schedule(
        tuple(tuple(row) for row in matrix), max_chunk_bytes=8, max_inflight_ops=4
    )
    assert as_lists == as_tuples
    assert [as_lists.batches_for(r) for r in range(4)] == [
        as_tuples.batches_for(r) for r in range(4)
    ]


def test_random_plans_run_to_completion_under_the_executor_protocol() -> None:
    rng = random.Random(11)
    for trial in range(60):
        w = rng.randint(2, 7)
        schedule = plan_schedule(
            random_matrix(rng, w, rng.random() * 0.7, rng.choice([5, 50, 500])),
            max_chunk_bytes=rng.choice([1, 3, 16, 64]),
            max_inflight_ops=rng.randint(2, 9),
        )
        assert simulate(schedule), f"deadlock in trial {trial}"


def test_the_simulator_does_detect_a_deadlocking_plan() -> None:
    # Control for the test above: if rank 1 ran its batches in reverse, the two ranks would
    # each wait on a chunk the other has not posted yet.
    schedule = plan_schedule([[0, 30], [30, 0]], max_chunk_bytes=10, max_inflight_ops=2)
    plans = {0: schedule.batches_for(0), 1: schedule.batches_for(1)[::-1]}
    assert not simulate(schedule, plans)


def test_a_fan_out_sends_to_every_receiver_in_the_first_batch() -> None:
    # One sender, four receivers: chunk-major slots keep all receivers busy at once.
    big = 10 << 20
    matrix = [[0, big, big, big, big]] + [[0] * 5 for _ in range(4)]
    schedule = plan_schedule(matrix, max_chunk_bytes=1 << 20, max_inflight_ops=8)
    first = schedule.batches_for(0)[0]
    assert sorted(c.peer for c in first.sends) == [1, 2, 3, 4]
    assert schedule.sent_by(0) == 4 * big
    assert [schedule.received_by(r) for r in range(1, 5)] == [big] * 4


@pytest.mark.parametrize(
    ("matrix", "kwargs", "error", "words"),
    [
        ([], {}, ExchangeError, "empty"),
        ([[0, 1], [2]], {}, ExchangeError, "row 1"),
        ([[0, -1], [0, 0]], {}, ExchangeError, "rank 0 to rank 1"),
        ([[0, 1.5], [0, 0]], {}, ExchangeError, "rank 0 to rank 1"),
        ([[0, 1], [0, 0]], {"max_chunk_bytes": 0}, ConfigError, "max_chunk_bytes"),
        ([[0, 1], [0, 0]], {"max_inflight_ops": 1}, ConfigError, "max_inflight_ops"),
    ],
)
def test_a_malformed_matrix_or_bound_is_rejected_with_a_message_naming_it(
    matrix: list, kwargs: dict, error: type[Exception], words: str
) -> None:
    bounds = {"max_chunk_bytes": 4, "max_inflight_ops": 2} | kwargs
    with pytest.raises(error, match=words):
        plan_schedule(matrix, **bounds)
