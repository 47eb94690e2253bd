"""The two-round exchange: every rank hands over ``{dst: bytes}`` and gets back ``{src: bytes}``.

Round 1 is one fixed-size all_gather of each rank's byte counts, status and settings (see
``status_row``). If any rank failed before it could send (the caller passed ``status=exc``, or
its payloads were unusable), every rank raises the same PeerFailedError there, before a single
payload byte moves, and the group stays usable. Round 2 plans from the gathered matrix
(``plan_schedule``, identical on every rank) and carries the plan out (``run_schedule``). The
caller's payloads become flat uint8 tensors without a copy (``as_byte_tensors``). No
rank waits for a message whose size it does not know, and every wait is bounded by
``config.timeout_s``. A failure in round 2 leaves the group unusable: re-create it.

Tensors live on the group's device (CUDA for NCCL, CPU otherwise) and only tensor collectives
and point-to-point operations are used, so the same code runs on gloo and NCCL.

Round 2's executor (:func:`run_schedule`) carries out one rank's part of the schedule, batch by
batch. For each batch it posts every send and receive before waiting on any (as one
``batch_isend_irecv`` group on NCCL, which needs that to pair a send and a receive on one
connection without deadlock), then waits on each with the configured timeout. Receives land
directly in slices of the output tensors; sends read directly from the payload when it already
lives on the group's device, and otherwise go through a staging buffer of at most
``max_chunk_bytes`` (e.g. host bytes on an NCCL group), reused from batch to batch, so at most
``max_inflight_ops // 2`` of them ever exist. Operations between the same two ranks in the
same direction match in posting order, and both sides post chunks in ascending order, which is
what the schedule relies on. On a failure the executor calls ``on_failure(peer, error)`` (the
peer of the failed message, or None) *before* it abandons its other messages, which closes
their connections: that is when a caller leaves its failure note (``exchange.notes``) so that
peers reading it find the culprit.

This module knows nothing about what the bytes mean (blobs, versions, shards).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltasync.errors import ExchangeError, PeerFailedError
from deltasync.exchange.notes import FailureNotes, abandon, blame, failure, wait
from deltasync.exchange.schedule import Chunk, ExchangeConfig, Schedule, plan_schedule
from deltasync.exchange.status_row import decode_rows, describe, encode_row

DEFAULT_CONFIG = ExchangeConfig()

Payload = bytes | bytearray | memoryview | torch.Tensor


@dataclass(frozen=True)
class ExchangeStats:
    """What one rank did in one exchange."""

    bytes_sent: int  # to other ranks
    bytes_received: int  # from other ranks
    bytes_local: int  # copied from this rank to itself
    messages: int  # point-to-point operations posted in round 2
    batches: int  # round-2 batches this rank took part in
    peak_staging_bytes: int  # staging buffers alive at once (0 when payloads are on-device)
    round1_s: float
    round2_s: float


class Received(dict[int, torch.Tensor]):
    """``{src: flat uint8 tensor}`` for every rank that sent this rank a non-empty payload,
    on the group's device; ``stats`` says what the exchange did. A rank that sent nothing has
    no entry. ``more``: some rank said it has more to send (another exchange follows)."""

    def __init__(
        self, items: Mapping[int, torch.Tensor], stats: ExchangeStats, *, more: bool = False
    ) -> None:
        super().__init__(items)
        self.stats = stats
        self.more = more


def exchange(
    payloads: Mapping[int, Payload],
    *,
    group: dist.ProcessGroup | None = None,
    config: ExchangeConfig = DEFAULT_CONFIG,
    status: BaseException | None = None,
    tag: str | None = None,
    more: bool = False,
    earlier: Iterable[str] = (),
) -> Received:
    """Send ``payloads[dst]`` to each rank ``dst`` of ``group``; return what the others sent.

    Every rank of the group must call this together with the same ``config``. Pass
    ``status=exc`` when this rank failed to produce its payloads: it still takes part in round
    1, so all ranks raise the same PeerFailedError naming it instead of waiting for it.

    Pass ``more=True`` when this rank streams a payload over several exchanges and has more
    after this one: round 1 carries it, and every rank's ``Received.more`` says whether any
    rank does, so all ranks agree on whether another exchange follows (a failure status
    ends the sequence: every rank raises).

    Pass ``tag`` (the same on every rank, fresh for every exchange) to have a failing rank
    leave a note in the group's store and follow the others', so that every survivor names the
    rank that died or hung (``notes``), not just the peer it was waiting on. ``earlier``: the
    tags of the exchanges of the same version before this one (a streamed version's parts): a
    rank missing here that left a note there failed there, alive, and is passed over.

    Raises PeerFailedError (some rank failed before sending; the group is still usable),
    ExchangeTimeoutError (a wait exceeded ``config.timeout_s``; names the round and peer) or
    ExchangeError (a peer died, or ranks disagree on the config).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ExchangeError(
            "torch.distributed is not initialized; call deltasync.exchange.init_from_env() "
            "or torch.distributed.init_process_group() first"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ExchangeError("this process is not a member of the given process group")
    device = group_device(group)

    cause = status
    sources: dict[int, torch.Tensor] = {}
    if cause is None:
        try:
            sources = as_byte_tensors(payloads, world)
        except Exception as exc:
            cause = exc
    counts = [int(sources[d].numel()) if d in sources else 0 for d in range(world)]
    notes = (
        None
        if tag is None
        else FailureNotes(group, tag=tag, rank=rank, world=world, earlier=earlier)
    )
    if notes is not None:
        notes.arrive()

    def on_failure(peer: int | None, err: ExchangeError) -> ExchangeError:
        return err if notes is None else type(err)(blame(notes, peer, str(err)))

    start = time.perf_counter()
    try:
        matrix, any_more = _round_one(
            counts, cause, config, group, device, world, on_failure, more=more
        )
    except PeerFailedError as err:
        raise err from cause
    round1_s = time.perf_counter() - start

    schedule = plan_schedule(
        matrix, max_chunk_bytes=config.max_chunk_bytes, max_inflight_ops=config.max_inflight_ops
    )
    outputs = {
        src: torch.empty(row[rank], dtype=torch.uint8, device=device)
        for src, row in enumerate(matrix)
        if src != rank and row[rank] > 0
    }
    if rank in sources:  # a self-send is a local copy, never a message
        outputs[rank] = torch.empty(counts[rank], dtype=torch.uint8, device=device)
        outputs[rank].copy_(sources[rank])
    start = time.perf_counter()
    done = run_schedule(
        schedule,
        rank=rank,
        sources=sources,
        outputs=outputs,
        group=group,
        device=device,
        timeout_s=config.timeout_s,
        on_failure=on_failure,
    )
    stats = ExchangeStats(
        bytes_sent=done.bytes_sent,
        bytes_received=done.bytes_received,
        bytes_local=counts[rank],
        messages=done.messages,
        batches=done.batches,
        peak_staging_bytes=done.peak_staging_bytes,
        round1_s=round1_s,
        round2_s=time.perf_counter() - start,
    )
    return Received(outputs, stats, more=any_more)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the exchange keeps its tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _round_one(
    counts: list[int],
    cause: BaseException | None,
    config: ExchangeConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world: int,
    on_failure,
    *,
    more: bool,
) -> tuple[tuple[tuple[int, ...], ...], bool]:
    row = encode_row(
        counts,
        failure=None if cause is None else describe(cause),
        max_chunk_bytes=config.max_chunk_bytes,
        max_inflight_ops=config.max_inflight_ops,
        more=more,
    ).to(device)
    gathered = [torch.empty_like(row) for _ in range(world)]
    try:
        work = dist.all_gather(gathered, row, group=group, async_op=True)
        wait(
            work,
            timeout_s=config.timeout_s,
            what=f"exchange round 1 (all_gather of the status rows of all {world} ranks)",
            peers="some rank of the group",
        )
    except ExchangeError as err:
        raise on_failure(None, err) from err
    except RuntimeError as exc:  # posting the collective fails when a peer is already gone
        raise on_failure(None, ExchangeError(f"exchange round 1 could not start: {exc}")) from exc
    return decode_rows(torch.stack(gathered).cpu())


# Caller payloads as flat uint8 tensors, without copying them: ``bytes``, ``bytearray`` and
# ``memoryview`` become CPU tensors sharing the caller's memory (``torch.frombuffer`` keeps the
# buffer alive); contiguous uint8 tensors become flat views. Whether a chunk must be staged onto
# the group's device is the executor's business, chunk by chunk, so no copy ever exceeds
# ``max_chunk_bytes``. Errors raised here happen before round 1, which reports them to every peer.


def as_byte_tensors(payloads: Mapping[int, Payload], world_size: int) -> dict[int, torch.Tensor]:
    """``{dst: flat uint8 tensor}`` for every non-empty payload; raises ExchangeError naming
    the destination whose payload is unusable."""
    if not isinstance(payloads, Mapping):
        raise ExchangeError(
            f"payloads must be a mapping of destination rank to bytes, got {type(payloads).__name__}"
        )
    out: dict[int, torch.Tensor] = {}
    for dst, payload in payloads.items():
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world_size:
            raise ExchangeError(
                f"payload key {dst!r} is not a rank of this group (ints 0..{world_size - 1})"
            )
        flat = _flat_bytes(dst, payload)
        if flat.numel() > 0:
            out[dst] = flat
    return out


def _flat_bytes(dst: int, payload: object) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise ExchangeError(
                f"payload for rank {dst} is a {payload.dtype} tensor; pass bytes as uint8 "
                "(for other dtypes use tensor.view(torch.uint8))"
            )
        if not payload.is_contiguous():
            # A flat view of a strided tensor would be a full copy; refuse instead of hiding it.
            raise ExchangeError(
                f"payload tensor for rank {dst} is not contiguous; call .contiguous()"
            )
        return payload.reshape(-1)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        view = memoryview(payload)
        if not view.c_contiguous:
            raise ExchangeError(f"payload memoryview for rank {dst} is not C-contiguous")
        if view.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        with warnings.catch_warnings():
            # Read-only buffers (bytes) are only ever read by the exchange: sends and copies.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=torch.uint8)
    raise ExchangeError(
        f"payload for rank {dst} is a {type(payload).__name__}; expected bytes, bytearray, "
        "memoryview or a uint8 tensor"
    )


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
