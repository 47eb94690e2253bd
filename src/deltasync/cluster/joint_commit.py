"""The in-cluster joint commit: every rank's status row, one gather, the same verdict everywhere.

After the payload exchange(s) every rank contributes one fixed-size int64 row to a single
all_gather (:func:`joint_commit`), so no rank waits for a message whose size it does not know:

    [0] magic        "dsclack2", so a rank calling some other collective is not misread
    [1] status       0 = ok, 1 = failed
    [2] version      the version this rank sent or applied (UNKNOWN if it failed before knowing)
    [3] base         its base version (-1 for an anchor; UNKNOWN likewise)
    [4] flags        bit 0: a state digest follows; bit 1: this receiver needs an anchor
    [5:7]            16-byte state digest of the receiver's shard after the apply; in a
                     writer's row, :func:`shards_digest` of the shard digests it sent
    [7] length of the message in bytes
    [8] arrived      when this rank entered the commit (ms since the epoch, its clock)
    [9] patience     how long it waits there (ms): ``commit_timeout_s``
    [10:138]         up to 1024 bytes of UTF-8: what failed (``status_row``)

Magic, status and message are the status part every gathered row shares
(:mod:`deltasync.exchange.status_row`). A :class:`CommitRow` is one rank's vote in this
collective; it is not the storage path's ``AckRecord`` (a receiver's record in the store).
A rank that arrives after another rank stopped waiting (a receiver whose verify and apply took
longer than ``commit_timeout_s``) completes the gather with the row that rank sent, but that
rank raised and commits nothing: the verdict is then an abort on every rank that has the rows,
so the late rank does not commit alone (its journal keeps the attempt, which the retry covers).
Such a verdict is ``unsettled``: a writer that raised there retires the version's number, so
every writer holding the verdict retires it too, and all of them number the retry alike.

:func:`judge` is a pure function of the gathered rows and the role plan, so every rank reaches
the same verdict: commit, or abort with the same message naming every failed rank. Beyond the
status flags it cross-checks that every receiver applied exactly the version and base the
writers sent, that DP replicas of a shard that hashed their state agree, and, when a writer
sent whole-state digests, that the receivers' digests are exactly those: the receivers verified
against the digests their payloads carried, so a payload that is not this attempt's (stale,
misrouted) would verify against its own; the commit row is another channel.

A rank commits (the trainer clears its tracker, a receiver advances its version) only after
:func:`joint_commit` returns a positive verdict, so either every rank commits the version or
none does, except when a rank dies inside this very collective, which no protocol over a dying
group can exclude; the receivers' journal and the overwrite semantics make a retry of the same
version converge in that case too.

This module knows the row layout, roles and the one collective; nothing about tensors' data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from deltasync.cluster.roles import ReceiverRole, RolePlan, WriterRole
from deltasync.errors import ExchangeError
from deltasync.exchange import group_device, status_row
from deltasync.exchange.notes import FailureNotes, NoteLedger, blame, wait

MAGIC = status_row.magic(b"dsclack2")
ARRIVED, PATIENCE, _TEXT = 8, 9, 10
ROW_LENGTH = _TEXT + status_row.MESSAGE_WORDS
UNKNOWN = -(1 << 62)
_HAS_DIGEST, _NEEDS_ANCHOR = 1, 2


def shards_digest(digests: Mapping[str, str]) -> str:
    """One 16-byte digest (hex) of ``{shard: state digest}``, as a writer's commit row carries
    it and :func:`judge` recomputes it from the receivers' rows."""
    h = xxhash.xxh3_128()
    for shard in sorted(digests):
        h.update(f"{shard}={digests[shard]}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CommitRow:
    """One rank's row in the joint commit, decoded."""

    rank: int
    ok: bool
    version: int
    base: int
    state_digest: str | None
    anchor_required: bool
    message: str
    arrived_ms: int = UNKNOWN
    patience_ms: int = UNKNOWN


def encode_commit_row(
    *,
    version: int | None,
    base: int | None,
    state_digest: str | None = None,
    failure: str | None = None,
    anchor_required: bool = False,
) -> torch.Tensor:
    row = np.zeros(ROW_LENGTH, dtype=np.int64)
    length, words = status_row.encode_message(failure)
    flags = (_HAS_DIGEST if state_digest else 0) | (_NEEDS_ANCHOR if anchor_required else 0)
    row[:5] = [
        MAGIC,
        status_row.status(failure),
        UNKNOWN if version is None else version,
        UNKNOWN if base is None else base,
        flags,
    ]
    if state_digest:
        row[5:7] = np.frombuffer(bytes.fromhex(state_digest), dtype="<i8")
    row[7] = length
    row[ARRIVED] = row[PATIENCE] = UNKNOWN  # stamped by joint_commit()
    row[_TEXT:] = words
    return torch.from_numpy(row)


def decode_commit_rows(rows: torch.Tensor) -> list[CommitRow]:
    """Rows gathered from every rank (``(world, ROW_LENGTH)`` int64) -> one CommitRow per rank."""
    data = rows.cpu().numpy().astype("<i8", copy=False)
    if data.ndim != 2 or data.shape[1] != ROW_LENGTH:
        raise ExchangeError(f"joint commit: gathered rows have shape {data.shape}")
    out = []
    for rank, row in enumerate(data):
        if int(row[0]) != MAGIC:
            raise ExchangeError(
                f"joint commit: rank {rank} sent a row that is not a commit row "
                f"(magic {int(row[0]):#x}); "
                "the ranks are not running the same protocol step: re-create the group"
            )
        text = status_row.decode_message(row[_TEXT:], int(row[7]))
        flags = int(row[4])
        out.append(
            CommitRow(
                rank=rank,
                ok=int(row[1]) == status_row.OK,
                version=int(row[2]),
                base=int(row[3]),
                state_digest=row[5:7].tobytes().hex() if flags & _HAS_DIGEST else None,
                anchor_required=bool(flags & _NEEDS_ANCHOR),
                message=text,
                arrived_ms=int(row[ARRIVED]),
                patience_ms=int(row[PATIENCE]),
            )
        )
    return out


@dataclass(frozen=True)
class Verdict:
    """What every rank that gathered the rows decides.

    unsettled: the abort is for lateness (some rank had stopped waiting before the last one
    arrived). That rank raised without a verdict, and a writer that does so never sends the
    version's number again; a writer holding this verdict must retire it too, or the writers
    pick different numbers for the retry and every preflight refuses it."""

    ok: bool
    message: str
    failures: dict[int, str]
    anchor_required: bool
    unsettled: bool = False


def _show(v: int) -> str:
    return "?" if v == UNKNOWN else str(v)


def judge(votes: Sequence[CommitRow], plan: RolePlan) -> Verdict:
    """Commit only if every rank succeeded, all agree on what was committed, and no rank had
    stopped waiting before the last one arrived."""
    failures = {a.rank: a.message for a in votes if not a.ok}
    gone = status_row.late_after([(a.rank, a.arrived_ms, a.patience_ms) for a in votes], UNKNOWN)
    if gone is not None:
        first, waits, late = gone
        failures[first] = (
            f"stopped waiting after {waits / 1000:g} s, before "
            + ", ".join(f"rank {r} arrived ({ms / 1000:.1f} s after it)" for r, ms in late)
            + "; a rank whose wait has ended commits nothing, so no rank may"
        )
    if not failures:
        failures = _disagreements(votes, plan)
    if not failures:
        return Verdict(ok=True, message="", failures={}, anchor_required=False)
    writer_rows = [a for a in votes if isinstance(plan.role(a.rank), WriterRole)]
    sent = writer_rows[0] if writer_rows else None
    what = f"version {_show(sent.version)}" if sent else "this version"
    lines = "; ".join(f"{plan.who(r)}: {m}" for r, m in sorted(failures.items()))
    return Verdict(
        ok=False,
        message=f"joint commit of {what} aborted, nothing committed: {lines}",
        failures=failures,
        anchor_required=any(a.anchor_required for a in votes),
        unsettled=gone is not None,
    )


def _disagreements(votes: Sequence[CommitRow], plan: RolePlan) -> dict[int, str]:
    out: dict[int, str] = {}
    writers = [a for a in votes if isinstance(plan.role(a.rank), WriterRole)]
    first = writers[0]
    for a in writers[1:]:
        if (a.version, a.base) != (first.version, first.base):
            out[a.rank] = (
                f"sent version {_show(a.version)} on base {_show(a.base)} while writer rank "
                f"{first.rank} sent version {_show(first.version)} on base {_show(first.base)}"
            )
    digests: dict[str, tuple[int, str]] = {}
    for a in votes:
        role = plan.role(a.rank)
        if not isinstance(role, ReceiverRole):
            continue
        if (a.version, a.base) != (first.version, first.base):
            out[a.rank] = (
                f"applied version {_show(a.version)} on base {_show(a.base)}, the writers sent "
                f"version {_show(first.version)} on base {_show(first.base)}"
            )
        if a.state_digest is not None:
            seen = digests.setdefault(role.shard, (a.rank, a.state_digest))
            if seen[1] != a.state_digest:
                out[a.rank] = (
                    f"state digest {a.state_digest} differs from replica rank {seen[0]}'s "
                    f"{seen[1]} of the same shard"
                )
    for a in writers:
        if a.state_digest is None or out:
            continue
        held = {shard: d for shard, (_, d) in digests.items()}
        missing = sorted(set(plan.shards()) - set(held))
        if missing or shards_digest(held) != a.state_digest:
            what = f"no state digest for shards {missing}" if missing else f"{held}"
            out[a.rank] = (
                f"sent state digests that combine to {a.state_digest}, but the receivers hold "
                f"{what}: a receiver applied a payload other than this attempt's"
            )
    return out


def joint_commit(
    row: torch.Tensor,
    *,
    plan: RolePlan,
    group: dist.ProcessGroup | None,
    timeout_s: float,
    tag: str | None = None,
    earlier: Iterable[str] = (),
    ledger: NoteLedger | None = None,
) -> Verdict:
    """Gather ``row`` from every rank and judge. Raises ExchangeTimeoutError / ExchangeError
    (naming the joint commit, and with ``tag`` the rank that never arrived: see
    ``exchange.notes``) when a rank does not arrive in time or is dead. ``ledger``: this
    rank's marks of earlier version attempts are deleted once every row is in."""
    world = dist.get_world_size(group)
    earlier = list(earlier)
    notes = None
    if tag is not None:
        notes = FailureNotes(
            group, tag=tag, rank=dist.get_rank(group), world=world, earlier=earlier
        )
        notes.arrive()
    device = group_device(group)
    stamped = row.clone()
    stamped[ARRIVED] = status_row.now_ms()
    stamped[PATIENCE] = round(timeout_s * 1000)
    mine = stamped.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    try:
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        wait(
            work,
            timeout_s=timeout_s + status_row.WAIT_BEYOND_S,
            what=f"joint commit (all_gather of the commit rows of all {world} ranks)",
            peers="some rank of the group (a receiver still applying, or a dead rank)",
        )
    except ExchangeError as err:
        raise (err if notes is None else type(err)(blame(notes, None, str(err)))) from err
    except RuntimeError as exc:  # posting fails when a peer is already gone
        err = ExchangeError(f"joint commit could not start: {exc}")
        raise (err if notes is None else ExchangeError(blame(notes, None, str(err)))) from exc
    if ledger is not None:
        ledger.settle(group, dist.get_rank(group))
    return judge(decode_commit_rows(torch.stack(gathered)), plan)
