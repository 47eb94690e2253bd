"""Worker functions for the exchange's multi-process tests (run in spawned processes).

Each worker calls ``init_from_env()`` like a torchrun program would, runs its scenarios, checks
what it received bit for bit against what the sender must have sent (every rank can regenerate
any payload from the case number, source and destination), and returns plain Python summaries
that the test process asserts on.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltasync.errors import ExchangeError
from deltasync.exchange import ExchangeConfig, exchange, init_from_env, plan_schedule, run_schedule


@dataclass(frozen=True)
class Case:
    name: str
    matrix: tuple[tuple[int, ...], ...]  # matrix[src][dst] bytes
    max_chunk_bytes: int = 64 << 20
    max_inflight_ops: int = 8


def payload_bytes(case_index: int, src: int, dst: int, n: int) -> torch.Tensor:
    """The bytes ``src`` sends to ``dst`` in a case: reproducible on any rank."""
    gen = torch.Generator().manual_seed(case_index * 1_000_003 + src * 1009 + dst * 17 + 1)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def as_input(t: torch.Tensor, kind: int) -> object:
    """Rotate through every accepted payload type."""
    return [
        lambda: bytes(t.numpy()),
        lambda: bytearray(t.numpy()),
        lambda: memoryview(bytes(t.numpy())),
        lambda: t,
    ][kind % 4]()


def run_cases(rank: int, cases: list[Case]) -> list[dict]:
    """Exchange every case on the world group and check the results bit for bit."""
    init_from_env(timeout_s=30)
    w = dist.get_world_size()
    summaries = []
    for i, case in enumerate(cases):
        row = case.matrix[rank]
        payloads = {
            dst: as_input(payload_bytes(i, rank, dst, n), kind=i + rank + dst)
            for dst, n in enumerate(row)
        }
        config = ExchangeConfig(
            max_chunk_bytes=case.max_chunk_bytes,
            max_inflight_ops=case.max_inflight_ops,
            timeout_s=10,
        )
        got = exchange(payloads, config=config)
        expected_sources = {src for src in range(w) if case.matrix[src][rank] > 0}
        mismatched = [
            src
            for src in expected_sources & set(got)
            if not torch.equal(got[src], payload_bytes(i, src, rank, case.matrix[src][rank]))
        ]
        summaries.append(
            {
                "case": case.name,
                "sources": sorted(got),
                "expected_sources": sorted(expected_sources),
                "mismatched": mismatched,
                "dtypes": sorted({str(t.dtype) for t in got.values()}),
                "peak_staging_bytes": got.stats.peak_staging_bytes,
                "messages": got.stats.messages,
                "bytes_received": got.stats.bytes_received,
            }
        )
    return summaries


def fail_before_round_one(rank: int) -> list[dict]:
    """Three failed exchanges that all end in round 1, then one that must still work."""
    init_from_env(timeout_s=30)
    w = dist.get_world_size()
    config = ExchangeConfig(max_chunk_bytes=1024, timeout_s=10)
    outcomes = []

    status = RuntimeError("change detection blew up") if rank == 2 else None
    outcomes.append(_outcome(lambda: exchange({0: b"x"}, config=config, status=status)))

    bad = torch.zeros(4, dtype=torch.float32) if rank == 1 else b"abcd"
    outcomes.append(_outcome(lambda: exchange({(rank + 1) % w: bad}, config=config)))

    mine = ExchangeConfig(max_chunk_bytes=512 if rank == 3 else 1024, timeout_s=10)
    outcomes.append(_outcome(lambda: exchange({(rank + 1) % w: b"abcd"}, config=mine)))

    # The group must still work: none of the above moved a payload byte.
    got = exchange({(rank + 1) % w: bytes([rank]) * 3000}, config=config)
    outcomes.append({"received": {s: bytes(t.numpy()) for s, t in got.items()}})
    return outcomes


def die_in_round_two(rank: int, dying_rank: int, death_after_s: float, timeout_s: float) -> dict:
    """All pairs exchange enough small chunks to take seconds; ``dying_rank`` exits mid-way."""
    init_from_env(timeout_s=30)
    w = dist.get_world_size()
    config = ExchangeConfig(max_chunk_bytes=4096, max_inflight_ops=2, timeout_s=timeout_s)
    # 12 MiB per pair in 4 KiB chunks: 4 MiB took under 1 s on a quiet machine, so a death
    # 1.5 s in could come after the end
    payloads = {dst: bytes(12 << 20) for dst in range(w) if dst != rank}
    dist.barrier()
    if rank == dying_rank:
        threading.Timer(death_after_s, lambda: os._exit(17)).start()
    start = time.monotonic()
    result = _outcome(lambda: exchange(payloads, config=config))
    result["elapsed_s"] = time.monotonic() - start
    return result


def die_inside_round_one(rank: int, dying_rank: int, timeout_s: float) -> dict:
    """Every rank arrives at round 1 (its mark in the store); ``dying_rank`` is SIGKILLed
    before its row goes out. Its two ring neighbours see the closed connection at once, while
    the other ranks still wait inside the all_gather."""
    import signal

    from deltasync.exchange import rounds

    init_from_env(timeout_s=30)
    if rank == dying_rank:
        real = rounds._round_one

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)  # not reached

        rounds._round_one = die
    dist.barrier()
    start = time.monotonic()
    w = dist.get_world_size()
    config = ExchangeConfig(timeout_s=timeout_s)
    result = _outcome(lambda: exchange({(rank + 1) % w: b"abcd"}, config=config, tag="t1"))
    result["elapsed_s"] = time.monotonic() - start
    return result


def never_call_round_one(rank: int, timeout_s: float) -> dict:
    """Rank 1 never calls exchange(); the others must time out in round 1."""
    init_from_env(timeout_s=30)
    if rank == 1:
        time.sleep(timeout_s + 2)
        return {"skipped": True}
    start = time.monotonic()
    result = _outcome(lambda: exchange({1: b"abc"}, config=ExchangeConfig(timeout_s=timeout_s)))
    result["elapsed_s"] = time.monotonic() - start
    return result


def unmatched_messages(rank: int, timeout_s: float) -> list[dict]:
    """Rank 0 runs a plan rank 1 never runs: first a send, then a receive, each on its own
    group (a timed-out gloo wait closes that group's connection)."""
    init_from_env(timeout_s=30)
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    outcomes = []
    for group, matrix in zip(groups, ([[0, 100], [0, 0]], [[0, 0], [100, 0]]), strict=True):
        if rank == 1:
            time.sleep(timeout_s + 1)
            continue
        schedule = plan_schedule(matrix, max_chunk_bytes=64, max_inflight_ops=2)
        sources = {1: torch.zeros(100, dtype=torch.uint8)} if matrix[0][1] else {}
        outputs = {1: torch.empty(100, dtype=torch.uint8)} if matrix[1][0] else {}
        start = time.monotonic()
        result = _outcome(
            lambda schedule=schedule, sources=sources, outputs=outputs, group=group: run_schedule(
                schedule,
                rank=0,
                sources=sources,
                outputs=outputs,
                group=group,
                device=torch.device("cpu"),
                timeout_s=timeout_s,
            )
        )
        result["elapsed_s"] = time.monotonic() - start
        outcomes.append(result)
    return outcomes


def _outcome(call) -> dict:
    try:
        call()
    except ExchangeError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "cause": repr(exc.__cause__)}
    return {"error": None}


def report_environment(rank: int, tag: str) -> dict:
    return {
        "rank": rank,
        "tag": tag,
        **{k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
    }


def sleep_forever(rank: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def raise_on_rank_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def exit_on_rank_one(rank: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def stream_in_parts(rank: int, parts_per_rank: list[int]) -> dict:
    """Rank r streams ``parts_per_rank[r]`` parts to every other rank (then empty exchanges
    while any rank still has more); every rank keeps calling while ``Received.more`` and
    joins what each source sent, which must be every part of it in order."""
    init_from_env(timeout_s=30)
    w = dist.get_world_size()
    config = ExchangeConfig(max_chunk_bytes=100, max_inflight_ops=4, timeout_s=10)
    mine = parts_per_rank[rank]
    joined: dict[int, bytearray] = {}
    rounds, more_seen = 0, []
    while True:
        index = rounds
        payloads = {}
        if index < mine:
            payloads = {dst: payload_bytes(index, rank, dst, 37 * (index + 1)) for dst in range(w)}
        got = exchange(payloads, config=config, more=index + 1 < mine)
        for src, part in got.items():
            joined.setdefault(src, bytearray()).extend(part.numpy().tobytes())
        rounds += 1
        more_seen.append(got.more)
        if not got.more:
            break
    expected = {
        src: b"".join(
            payload_bytes(i, src, rank, 37 * (i + 1)).numpy().tobytes()
            for i in range(parts_per_rank[src])
        )
        for src in range(w)
        if parts_per_rank[src]
    }
    return {
        "rounds": rounds,
        "more_seen": more_seen,
        "exact": {src: bytes(joined.get(src, b"")) == want for src, want in expected.items()},
    }
