"""The joint-commit row and its verdict: did every rank do its part of a version?

After the payload exchange(s) every rank contributes one fixed-size int64 row to a single
all_gather (``commit.py``), so no rank waits for a message whose size it does not know:

    [0] magic        "dsclack1", so a rank calling some other collective is not misread
    [1] status       0 = ok, 1 = failed
    [2] version      the version this rank sent or applied (UNKNOWN if it failed before knowing)
    [3] base         its base version (-1 for an anchor; UNKNOWN likewise)
    [4] flags        bit 0: a state digest follows; bit 1: this receiver needs an anchor
    [5:7]            16-byte state digest of the receiver's shard after the apply
    [7] length of the message in bytes
    [8:40]           up to 256 bytes of UTF-8: what failed

:func:`judge` is a pure function of the gathered rows and the role plan, so every rank reaches
the same verdict: commit, or abort with the same message naming every failed rank. Beyond the
status flags it cross-checks that every receiver applied exactly the version and base the
writers sent, and that DP replicas of a shard that hashed their state agree.

This module knows the row layout and roles; no process groups, no waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.cluster.roles import ReceiverRole, RolePlan, WriterRole
from deltasync.errors import ExchangeError

MAGIC = int.from_bytes(b"dsclack1", "little")
MESSAGE_BYTES = 256
ROW_LENGTH = 8 + MESSAGE_BYTES // 8
UNKNOWN = -(1 << 62)
_OK, _FAILED = 0, 1
_HAS_DIGEST, _NEEDS_ANCHOR = 1, 2


@dataclass(frozen=True)
class Ack:
    rank: int
    ok: bool
    version: int
    base: int
    state_digest: str | None
    anchor_required: bool
    message: str


def describe(exc: BaseException) -> str:
    """The one-line text a failed rank sends its peers."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def encode_ack(
    *,
    version: int | None,
    base: int | None,
    state_digest: str | None = None,
    failure: str | None = None,
    anchor_required: bool = False,
) -> torch.Tensor:
    row = np.zeros(ROW_LENGTH, dtype=np.int64)
    message = b""
    if failure is not None:
        # Cut at a character boundary so peers never see half a UTF-8 sequence.
        message = failure.encode("utf-8")[:MESSAGE_BYTES].decode("utf-8", "ignore").encode("utf-8")
    flags = (_HAS_DIGEST if state_digest else 0) | (_NEEDS_ANCHOR if anchor_required else 0)
    row[:5] = [
        MAGIC,
        _FAILED if failure is not None else _OK,
        UNKNOWN if version is None else version,
        UNKNOWN if base is None else base,
        flags,
    ]
    if state_digest:
        row[5:7] = np.frombuffer(bytes.fromhex(state_digest), dtype="<i8")
    row[7] = len(message)
    text = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
    text[: len(message)] = np.frombuffer(message, dtype=np.uint8)
    row[8:] = text.view("<i8")
    return torch.from_numpy(row)


def decode_acks(rows: torch.Tensor) -> list[Ack]:
    """Rows gathered from every rank (``(world, ROW_LENGTH)`` int64) -> one Ack per rank."""
    data = rows.cpu().numpy().astype("<i8", copy=False)
    if data.ndim != 2 or data.shape[1] != ROW_LENGTH:
        raise ExchangeError(f"joint commit: gathered rows have shape {data.shape}")
    out = []
    for rank, row in enumerate(data):
        if int(row[0]) != MAGIC:
            raise ExchangeError(
                f"joint commit: rank {rank} sent a row that is not an ack "
                f"(magic {int(row[0]):#x}); "
                "the ranks are not running the same protocol step: re-create the group"
            )
        n = min(max(int(row[7]), 0), MESSAGE_BYTES)
        text = row[8:].view(np.uint8)[:n].tobytes().decode("utf-8", "replace")
        flags = int(row[4])
        out.append(
            Ack(
                rank=rank,
                ok=int(row[1]) == _OK,
                version=int(row[2]),
                base=int(row[3]),
                state_digest=row[5:7].tobytes().hex() if flags & _HAS_DIGEST else None,
                anchor_required=bool(flags & _NEEDS_ANCHOR),
                message=text,
            )
        )
    return out


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str
    failures: dict[int, str]
    anchor_required: bool


def _who(plan: RolePlan, rank: int) -> str:
    role = plan.role(rank)
    if isinstance(role, WriterRole):
        return f"rank {rank} (writer {role.writer_id})"
    return f"rank {rank} (receiver {role.shard} replica {role.replica})"


def _show(v: int) -> str:
    return "?" if v == UNKNOWN else str(v)


def judge(acks: Sequence[Ack], plan: RolePlan) -> Verdict:
    """Commit only if every rank succeeded and all agree on what was committed."""
    failures = {a.rank: a.message for a in acks if not a.ok}
    if not failures:
        failures = _disagreements(acks, plan)
    if not failures:
        return Verdict(ok=True, message="", failures={}, anchor_required=False)
    writer_rows = [a for a in acks if isinstance(plan.role(a.rank), WriterRole)]
    sent = writer_rows[0] if writer_rows else None
    what = f"version {_show(sent.version)}" if sent else "this version"
    lines = "; ".join(f"{_who(plan, r)}: {m}" for r, m in sorted(failures.items()))
    return Verdict(
        ok=False,
        message=f"joint commit of {what} aborted, nothing committed: {lines}",
        failures=failures,
        anchor_required=any(a.anchor_required for a in acks),
    )


def _disagreements(acks: Sequence[Ack], plan: RolePlan) -> dict[int, str]:
    out: dict[int, str] = {}
    writers = [a for a in acks if isinstance(plan.role(a.rank), WriterRole)]
    first = writers[0]
    for a in writers[1:]:
        if (a.version, a.base) != (first.version, first.base):
            out[a.rank] = (
                f"sent version {_show(a.version)} on base {_show(a.base)} while writer rank "
                f"{first.rank} sent version {_show(first.version)} on base {_show(first.base)}"
            )
    digests: dict[str, tuple[int, str]] = {}
    for a in acks:
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
    return out
