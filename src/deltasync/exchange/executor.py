"""Round 2's executor: carries out one rank's part of a finished Schedule, batch by batch.

For each batch it posts every send and receive at once (``batch_isend_irecv``, which NCCL needs
to pair a send and a receive on one connection without deadlock), then waits on each with the
configured timeout. Receives land directly in slices of the output tensors; sends read
directly from the payload when it already lives on the group's device, and otherwise go
through a staging buffer of at most ``max_chunk_bytes`` (e.g. host bytes on an NCCL group).
Staging buffers are reused from batch to batch, so at most ``max_inflight_ops // 2`` of them
ever exist.

Operations between the same two ranks in the same direction match in posting order, and both
sides post chunks in ascending order, which is what the schedule relies on.

This module does not decide anything: not what to send, not in which order, not what a failure
means for the other ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltasync.exchange.schedule import Batch, Chunk, Schedule
from deltasync.exchange.waits import abandon, wait


@dataclass(frozen=True)
class RoundTwoStats:
    bytes_sent: int
    bytes_received: int
    messages: int  # point-to-point operations this rank posted
    batches: int  # batches this rank took part in
    peak_staging_bytes: int  # most bytes of staging buffers alive at once


class StagingPool:
    """Reusable device buffers for chunks whose source is not on the group's device."""

    def __init__(self, device: torch.device, buffer_bytes: int) -> None:
        self._device = device
        self._buffer_bytes = buffer_bytes
        self._buffers: list[torch.Tensor] = []
        self._used = 0

    @property
    def allocated_bytes(self) -> int:
        return len(self._buffers) * self._buffer_bytes

    def stage(self, piece: torch.Tensor) -> torch.Tensor:
        if self._used == len(self._buffers):
            self._buffers.append(torch.empty(self._buffer_bytes, dtype=torch.uint8, device=self._device))
        buf = self._buffers[self._used][: piece.numel()]
        self._used += 1
        # Synchronous copy: the source may be pageable host memory owned by the caller.
        buf.copy_(piece)
        return buf

    def release_all(self) -> None:
        """Called only after every operation of the batch finished, so reuse is safe."""
        self._used = 0


def run_schedule(
    schedule: Schedule,
    *,
    rank: int,
    sources: Mapping[int, torch.Tensor],
    outputs: Mapping[int, torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout_s: float,
) -> RoundTwoStats:
    """Send ``sources[dst]`` and fill ``outputs[src]`` (preallocated, exact sizes) as planned.

    sources/outputs: flat uint8 tensors keyed by peer rank, sized as ``schedule.matrix`` says.
    Raises ExchangeTimeoutError or ExchangeError naming the round, batch, chunk and peer.
    """
    backend = str(dist.get_backend(group))
    plan = schedule.batches_for(rank)
    # Chunks never exceed max_chunk_bytes, so neither does a staging buffer.
    pool = StagingPool(device, max((c.nbytes for b in plan for c in b.sends), default=0))
    sent = received = messages = 0
    for batch in plan:
        ops: list[dist.P2POp] = []
        labels: list[tuple[str, int]] = []  # (what the operation is, its peer), as posted
        for c in batch.sends:
            piece = sources[c.peer][c.offset : c.offset + c.nbytes]
            if piece.device != device:
                piece = pool.stage(piece)
            ops.append(dist.P2POp(dist.isend, piece, group=group, group_peer=c.peer))
            labels.append((f"send of {_chunk_text(c)} to rank {c.peer}", c.peer))
        for c in batch.recvs:
            target = outputs[c.peer][c.offset : c.offset + c.nbytes]
            ops.append(dist.P2POp(dist.irecv, target, group=group, group_peer=c.peer))
            labels.append((f"receive of {_chunk_text(c)} from rank {c.peer}", c.peer))
        works = dist.batch_isend_irecv(ops)
        _finish(works, labels, batch, schedule.num_batches, timeout_s, backend)
        pool.release_all()
        sent += sum(c.nbytes for c in batch.sends)
        received += sum(c.nbytes for c in batch.recvs)
        messages += len(ops)
    return RoundTwoStats(sent, received, messages, len(plan), pool.allocated_bytes)


def _finish(
    works: list[dist.Work],
    labels: list[tuple[str, int]],
    batch: Batch,
    num_batches: int,
    timeout_s: float,
    backend: str,
) -> None:
    prefix = f"exchange round 2, batch {batch.index + 1} of {num_batches}"
    if len(works) == len(labels):
        named = [(f"{prefix}: {what}", f"rank {peer}") for what, peer in labels]
    else:
        # A coalescing backend (NCCL) returns one work for the whole batch.
        peers = sorted({peer for _, peer in labels})
        everything = "; ".join(what for what, _ in labels)
        named = [(f"{prefix}: {everything}", _ranks_text(peers))] * len(works)
    for i, work in enumerate(works):
        try:
            wait(work, timeout_s=timeout_s, what=named[i][0], peers=named[i][1])
        except BaseException:
            abandon(works[i + 1 :], backend=backend)
            raise


def _chunk_text(c: Chunk) -> str:
    return f"chunk {c.index + 1}/{c.count} ({c.nbytes} bytes)"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
