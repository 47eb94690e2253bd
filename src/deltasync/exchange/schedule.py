"""Round 2's plan: which bytes each rank sends and receives, in which batch, in what order.

Pure: a function of the byte-count matrix and two numbers of :class:`ExchangeConfig` (defined
here with the timeout of every wait), so every rank derives the same plan from the same round-1
result without talking, and the plan is tested as a table.

The pairing is the classic shifted ring: at step ``s`` (1 .. W-1) rank ``r`` sends to
``(r + s) % W`` and receives from ``(r - s) % W``. The bytes of each ordered pair are cut into
chunks of at most ``max_chunk_bytes``. A *slot* is one (step, chunk index); slots are ordered
chunk-major (chunk 0 of every step, then chunk 1 of every step, ...) so a rank that feeds many
peers keeps all of them busy instead of serving them one after another. Consecutive slots are
grouped into batches of ``max_inflight_ops // 2`` slots; in one slot a rank has at most one send
and one receive, so a batch never holds more than ``max_inflight_ops`` operations.

Why this cannot deadlock: both ends of a pair place chunk ``j`` of step ``s`` in the same slot,
hence in the same batch. A rank posts every operation of its batch ``k`` before waiting on any
of them, and moves to ``k + 1`` only when all of ``k`` finished. By induction over ``k``: once
every rank has finished its batches before ``k``, every operation of batch ``k`` has its
counterpart posted, so all of them complete. Ranks with nothing in a batch simply skip it.
Pairs with zero bytes produce no operation on either side. Self-sends are not scheduled here;
the executor copies them locally.

This module knows nothing about torch, process groups or timeouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from deltasync.errors import ConfigError, ExchangeError
from deltasync.validate import check_int, check_seconds

_OWNER = "ExchangeConfig"

# A chunk size must fit the int64 fields of round 1 and gloo's int sizes comfortably.
_MAX_CHUNK_LIMIT = 1 << 40


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """How the two-round exchange chunks, pipelines and waits.

    max_chunk_bytes: no staging buffer and no single point-to-point message exceeds this.
    max_inflight_ops: at most this many sends and receives are posted and unfinished on a rank
        at once. At least 2, because one step may pair a send and a receive that only complete
        together.
    timeout_s: the longest any single wait (round 1 or one round-2 message) may take before the
        exchange raises ExchangeTimeoutError naming the peer and the round.
    """

    max_chunk_bytes: int = 64 << 20
    max_inflight_ops: int = 8
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_int(_OWNER, "max_chunk_bytes", self.max_chunk_bytes, lo=1, hi=_MAX_CHUNK_LIMIT)
        check_int(_OWNER, "max_inflight_ops", self.max_inflight_ops, lo=2, hi=1 << 16)
        check_seconds(_OWNER, "timeout_s", self.timeout_s)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One point-to-point message: bytes ``[offset, offset + nbytes)`` of the pair's payload."""

    peer: int  # the other side, as a rank of the group
    offset: int
    nbytes: int
    index: int  # 0-based chunk number within this ordered pair
    count: int  # chunks in this ordered pair


@dataclass(frozen=True, slots=True)
class Batch:
    """The operations one rank posts together. The peer of every chunk has the matching
    operation in its batch with the same ``index``, in the same order."""

    index: int
    sends: tuple[Chunk, ...]
    recvs: tuple[Chunk, ...]


@dataclass(frozen=True)
class Schedule:
    """The whole round-2 plan of a group; ``batches_for(rank)`` is one rank's part of it."""

    matrix: tuple[tuple[int, ...], ...]  # matrix[src][dst] = bytes src sends to dst
    max_chunk_bytes: int
    slots_per_batch: int
    chunks_per_step: tuple[int, ...]  # entry s-1: the most chunks any pair has at step s

    @property
    def world_size(self) -> int:
        return len(self.matrix)

    @property
    def num_slots(self) -> int:
        return sum(self.chunks_per_step)

    @property
    def num_batches(self) -> int:
        return -(-self.num_slots // self.slots_per_batch)

    def slots(self) -> Iterator[tuple[int, int]]:
        """(step, chunk index) in execution order: chunk-major over the steps."""
        for j in range(max(self.chunks_per_step, default=0)):
            for s, count in enumerate(self.chunks_per_step, start=1):
                if j < count:
                    yield s, j

    def chunks(self, src: int, dst: int) -> int:
        return _num_chunks(self.matrix[src][dst], self.max_chunk_bytes)

    def batches_for(self, rank: int) -> tuple[Batch, ...]:
        """This rank's non-empty batches, in the order it must run them."""
        w, size, per_batch = self.world_size, self.max_chunk_bytes, self.slots_per_batch
        if not 0 <= rank < w:
            raise ExchangeError(f"rank {rank} is outside a schedule for {w} ranks")
        # Per step s (index s-1): the peer and byte count of this rank's send and receive.
        send = [((rank + s) % w, self.matrix[rank][(rank + s) % w]) for s in range(1, w)]
        recv = [((rank - s) % w, self.matrix[(rank - s) % w][rank]) for s in range(1, w)]
        send_chunks = [_num_chunks(n, size) for _, n in send]
        recv_chunks = [_num_chunks(n, size) for _, n in recv]
        levels = max(send_chunks + recv_chunks, default=0)  # chunk indices this rank takes part in
        out: list[Batch] = []
        sends: list[Chunk] = []
        recvs: list[Chunk] = []
        current = slot = 0
        # Walk the global slot order (see slots()) only as far as this rank has work.
        for j in range(levels):
            for i, step_chunks in enumerate(self.chunks_per_step):
                if j >= step_chunks:
                    continue
                k, slot = slot // per_batch, slot + 1
                if j >= send_chunks[i] and j >= recv_chunks[i]:
                    continue
                if k != current and (sends or recvs):
                    out.append(Batch(current, tuple(sends), tuple(recvs)))
                    sends, recvs = [], []
                current = k
                offset = j * size
                if j < send_chunks[i]:
                    peer, n = send[i]
                    sends.append(Chunk(peer, offset, min(size, n - offset), j, send_chunks[i]))
                if j < recv_chunks[i]:
                    peer, n = recv[i]
                    recvs.append(Chunk(peer, offset, min(size, n - offset), j, recv_chunks[i]))
        if sends or recvs:
            out.append(Batch(current, tuple(sends), tuple(recvs)))
        return tuple(out)

    def sent_by(self, rank: int) -> int:
        """Bytes this rank sends to other ranks (self-sends excluded)."""
        return sum(n for dst, n in enumerate(self.matrix[rank]) if dst != rank)

    def received_by(self, rank: int) -> int:
        """Bytes this rank receives from other ranks (self-sends excluded)."""
        return sum(row[rank] for src, row in enumerate(self.matrix) if src != rank)


def plan_schedule(
    matrix: Sequence[Sequence[int]], *, max_chunk_bytes: int, max_inflight_ops: int
) -> Schedule:
    """Plan round 2 from the byte-count matrix (``matrix[src][dst]``), identically on all ranks."""
    if (
        isinstance(max_chunk_bytes, bool)
        or not isinstance(max_chunk_bytes, int)
        or max_chunk_bytes < 1
    ):
        raise ConfigError(f"max_chunk_bytes must be an int >= 1, got {max_chunk_bytes!r}")
    if (
        isinstance(max_inflight_ops, bool)
        or not isinstance(max_inflight_ops, int)
        or max_inflight_ops < 2
    ):
        raise ConfigError(f"max_inflight_ops must be an int >= 2, got {max_inflight_ops!r}")
    rows = _checked_matrix(matrix)
    w = len(rows)
    per_step = tuple(
        max(_num_chunks(rows[r][(r + s) % w], max_chunk_bytes) for r in range(w))
        for s in range(1, w)
    )
    return Schedule(
        matrix=rows,
        max_chunk_bytes=max_chunk_bytes,
        slots_per_batch=max_inflight_ops // 2,
        chunks_per_step=per_step,
    )


def _num_chunks(nbytes: int, max_chunk_bytes: int) -> int:
    return -(-nbytes // max_chunk_bytes)


def _checked_matrix(matrix: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    rows = tuple(tuple(row) for row in matrix)
    w = len(rows)
    if w == 0:
        raise ExchangeError("the byte-count matrix is empty; a group has at least one rank")
    for src, row in enumerate(rows):
        if len(row) != w:
            raise ExchangeError(f"byte-count matrix row {src} has {len(row)} entries, expected {w}")
        for dst, n in enumerate(row):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ExchangeError(
                    f"byte count from rank {src} to rank {dst} must be an int >= 0, got {n!r}"
                )
    return rows
