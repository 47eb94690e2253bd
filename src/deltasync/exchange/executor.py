"""Round 2's executor: carries out one rank's part of a finished Schedule, batch by batch.

For each batch it posts every send and receive before waiting on any (as one
``batch_isend_irecv`` group on NCCL, which needs that to pair a send and a receive on one
connection without deadlock), then waits on each with the configured timeout. Receives land
directly in slices of the output tensors; sends read directly from the payload when it already
lives on the group's device, and otherwise go through a staging buffer of at most
``max_chunk_bytes`` (e.g. host bytes on an NCCL group).
Staging buffers are reused from batch to batch, so at most ``max_inflight_ops // 2`` of them
ever exist.

Operations between the same two ranks in the same direction match in posting order, and both
sides post chunks in ascending order, which is what the schedule relies on.

On a failure the executor calls ``on_failure(peer, error)`` (the peer of the failed message, or
None) *before* it abandons its other messages, which closes their connections: that is when a
caller leaves its failure note (``exchange.notes``) so that peers reading it find the culprit.

This module does not decide anything: not what to send, not in which order, not what a failure
means for the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltasync.errors import ExchangeError
from deltasync.exchange.notes import abandon, failure, wait
from deltasync.exchange.schedule import Chunk, Schedule


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
            self._buffers.append(
                torch.empty(self._buffer_bytes, dtype=torch.uint8, device=self._device)
            )
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
    on_failure: Callable[[int | None, ExchangeError], ExchangeError] | None = None,
) -> RoundTwoStats:
    """Send ``sources[dst]`` and fill ``outputs[src]`` (preallocated, exact sizes) as planned.

    sources/outputs: flat uint8 tensors keyed by peer rank, sized as ``schedule.matrix`` says.
    Raises ExchangeTimeoutError or ExchangeError naming the round, batch, chunk and peer (or
    what ``on_failure`` makes of it).
    """
    hook = on_failure or (lambda _peer, err: err)
    backend = str(dist.get_backend(group))
    plan = schedule.batches_for(rank)
    # Chunks never exceed max_chunk_bytes, so neither does a staging buffer.
    pool = StagingPool(device, max((c.nbytes for b in plan for c in b.sends), default=0))
    sent = received = messages = 0
    for batch in plan:
        prefix = f"exchange round 2, batch {batch.index + 1} of {schedule.num_batches}"
        ops: list[_Op] = []
        for c in batch.sends:
            piece = sources[c.peer][c.offset : c.offset + c.nbytes]
            if piece.device != device:
                piece = pool.stage(piece)
            what = f"{prefix}: send of {_chunk_text(c)} to rank {c.peer}"
            ops.append(_Op(True, piece, c.peer, what))
        for c in batch.recvs:
            target = outputs[c.peer][c.offset : c.offset + c.nbytes]
            what = f"{prefix}: receive of {_chunk_text(c)} from rank {c.peer}"
            ops.append(_Op(False, target, c.peer, what))
        posted = _post(ops, group=group, backend=backend, timeout_s=timeout_s, hook=hook)
        for i, (work, what, peers, peer) in enumerate(posted):
            try:
                wait(work, timeout_s=timeout_s, what=what, peers=peers)
            except ExchangeError as exc:
                err = hook(peer, exc)  # before closing anything: see the module docstring
                abandon([w for w, _, _, _ in posted[i + 1 :]], backend=backend)
                raise err from exc
            except BaseException:
                abandon([w for w, _, _, _ in posted[i + 1 :]], backend=backend)
                raise
        pool.release_all()
        sent += sum(c.nbytes for c in batch.sends)
        received += sum(c.nbytes for c in batch.recvs)
        messages += len(ops)
    return RoundTwoStats(sent, received, messages, len(plan), pool.allocated_bytes)


@dataclass(frozen=True)
class _Op:
    is_send: bool
    tensor: torch.Tensor  # a slice of a payload, a staging buffer, or a slice of an output
    peer: int
    what: str  # names the round, batch, chunk and peer in every error


Posted = tuple[dist.Work, str, str, int | None]  # work, what, who could be at fault, that peer


def _post(
    ops: list[_Op],
    *,
    group: dist.ProcessGroup | None,
    backend: str,
    timeout_s: float,
    hook: Callable[[int | None, ExchangeError], ExchangeError],
) -> list[Posted]:
    """Post every operation of a batch; return (work, what it is, who could be at fault, and
    that peer when it is one rank)."""
    if "nccl" in backend:
        # NCCL must see a batch's sends and receives in one group call, or a send and a receive
        # on the same connection deadlock; it returns one work for the whole batch.
        what = "; ".join(op.what for op in ops)
        peers = _ranks_text(sorted({op.peer for op in ops}))
        p2p = [
            dist.P2POp(
                dist.isend if op.is_send else dist.irecv, op.tensor, group=group, group_peer=op.peer
            )
            for op in ops
        ]
        single = ops[0].peer if len({op.peer for op in ops}) == 1 else None
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as exc:
            err = failure(exc, what=what, peers=peers, timeout_s=timeout_s)
            raise hook(single, err) from exc
        return [(work, what, peers, single) for work in works]
    # Elsewhere (gloo) each operation is posted on its own, so an error names its message, and
    # the ones already posted can be abandoned. Posting fails when a peer is already gone.
    posted: list[Posted] = []
    for op in ops:
        try:
            if op.is_send:
                work = dist.isend(op.tensor, group=group, group_dst=op.peer)
            else:
                work = dist.irecv(op.tensor, group=group, group_src=op.peer)
        except RuntimeError as exc:
            err = hook(
                op.peer, failure(exc, what=op.what, peers=f"rank {op.peer}", timeout_s=timeout_s)
            )
            abandon([w for w, _, _, _ in posted], backend=backend)
            raise err from exc
        posted.append((work, op.what, f"rank {op.peer}", op.peer))
    return posted


def _chunk_text(c: Chunk) -> str:
    return f"chunk {c.index + 1}/{c.count} ({c.nbytes} bytes)"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
