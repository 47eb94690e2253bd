"""The preflight of a version: before any payload moves, every rank shows every other rank what
it was built for and where its tensors stand, in one fixed-size all_gather, and every rank
reaches the same verdict from the same rows.

One int64 row per rank (``ROW_LENGTH`` words whatever the world size, so a rank built for
another world size still takes part and is named instead of hanging the others):

    [0] magic        "dsclpf01"
    [1] status       0 = ready, 1 = failed before sending (its detection or encoding raised,
                     or its process group does not match its role plan)
    [2] role         0 = writer, 1 = receiver
    [3] version      writer: the version it sends; receiver: its committed version
    [4] base         writer: its base (-1 anchor); receiver: the version of an apply that
                     started and was not committed
    [5] window       writer: its attempt-window token; receiver: the window token of that
                     uncommitted apply (0: none)
    [6] applying base  receiver: the base of that uncommitted apply; writer: a fresh random
                     token of this attempt (``Cleared.tag`` names the attempt's exchanges)
    [7] flags        bit 0: this receiver is dirty (its state failed a digest check)
    [8] arrived      when this rank entered the preflight (ms since the epoch, its clock)
    [9] patience     how long this rank waits there (ms): a writer ``exchange.timeout_s``, a
                     receiver ``wait_for_version_s``
    [10 : 10+F]      the fingerprint: one 63-bit hash per part of ``FINGERPRINT_PARTS``
    [10+F]           message length in bytes
    [11+F : ...]     ``status_row.MESSAGE_WORDS`` words of UTF-8: the failure, or, when the
                     rank is ready, its configuration in words (named in a mismatch error)

Every unknown number is ``UNKNOWN``. The verdict (:func:`judge`) refuses, identically on every
rank and before any byte of a payload moves:

- a rank that arrived after another rank's wait had ended (by more than
  ``status_row.CLOCK_SKEW_S``): that rank gave up and raised, so the others must not go on to
  an exchange it is not in (where they would blame it): :class:`ExchangeTimeoutError` naming
  the late rank;
- a failed rank: :class:`PeerFailedError` naming it and its reason;
- any fingerprint part that differs between ranks (model config, engine/TP/EP, role plan,
  writer count, layout table, lineage): :class:`FingerprintMismatchError` naming every rank's
  configuration;
- a delta that some receiver cannot take: it holds no verified version, is dirty, holds
  another base, or applied an attempt that this send does not cover (the writers' combined
  window token differs from the one it recorded, e.g. a writer restarted and lost the union of
  its uncommitted attempts): :class:`SyncAbortedError` with ``anchor_required=True``.

This module knows rows, fingerprints and versions; it knows nothing about payloads or tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from deltasync.cluster.roles import ReceiverRole, RolePlan
from deltasync.errors import (
    ConfigError,
    ExchangeError,
    ExchangeTimeoutError,
    FingerprintMismatchError,
    PeerFailedError,
    SyncAbortedError,
)
from deltasync.exchange import group_device, status_row
from deltasync.exchange.notes import FailureNotes, blame, close_pairs, wait
from deltasync.layout import ReceiverLayout

MAGIC = status_row.magic(b"dsclpf02")
UNKNOWN = -(1 << 62)
FINGERPRINT_PARTS = ("model", "engine", "plan", "writers", "layout", "lineage")
_HEAD = 10
ARRIVED, PATIENCE = 8, 9
_F = len(FINGERPRINT_PARTS)
ROW_LENGTH = _HEAD + _F + 1 + status_row.MESSAGE_WORDS
WRITER, RECEIVER = 0, 1
_DIRTY = 1
_MASK63 = (1 << 63) - 1


def _hash63(text: str) -> int:
    return (
        int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK63
    )


def layout_digest(layout: ReceiverLayout) -> str:
    """BLAKE2b of the layout table (every shard's tensors and every placement block): two
    layouts with the same shapes but other blocks (a vocabulary of 1010 padded like 1000) differ."""
    h = hashlib.blake2b(digest_size=16)
    table = layout.table
    for shard in sorted(table.dst_shapes):
        for local, shape in table.dst_shapes[shard].items():
            h.update(f"T {shard} {local} {list(shape)}\n".encode())
        for alias, target in sorted(table.aliases[shard].items()):
            h.update(f"A {shard} {alias} {target}\n".encode())
    for name in sorted(table.placements):
        h.update(f"S {name} {list(table.src_shapes[name])}\n".encode())
        for p in table.placements[name]:
            b = p.block
            fields = (b.src_cols, b.dst_cols, b.src_row, b.dst_row, b.rows, b.src_col, b.dst_col)
            h.update(f"P {p.shard} {p.local} {fields} {b.cols}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was built for: the canonical text of each part, and a short summary."""

    parts: dict[str, str]
    summary: str

    def words(self) -> list[int]:
        return [_hash63(self.parts[p]) for p in FINGERPRINT_PARTS]


def fingerprint(
    layout: ReceiverLayout, plan: RolePlan, *, lineage: str | None = None, digest_every: int = 1
) -> Fingerprint:
    """The fingerprint of a rank built with ``layout`` and ``plan`` (computed once per rank).

    ``digest_every`` (``ClusterConfig.digest_every``) is the job's verification policy, part
    of its ``plan``: a receiver built to verify every version refuses writers that send no
    digests (one writer with digests off would otherwise turn verification off on every
    receiver), and writers of different policies are refused before any payload moves. In the
    plan's word rather than a word of its own, so that the row keeps its size: a rank of a
    release before it (a rolling upgrade) meets a row of its own size and both are refused by
    name, instead of a collective of two sizes aborting one of them in gloo."""
    spec = layout.spec
    model = {
        k: (str(v) if isinstance(v, torch.dtype) else v)
        for k, v in dataclasses.asdict(spec).items()
    }
    layout_hex = layout_digest(layout)
    digests = f"every {digest_every}" if digest_every else "none"
    parts = {
        "model": json.dumps(model, sort_keys=True, default=list),
        "engine": f"{layout.engine} tp={layout.tp} ep={layout.ep}",
        "plan": f"{plan.describe()}; digests {digests}",
        "writers": str(len(plan.writers)),
        "layout": layout_hex,
        "lineage": lineage or "",
    }
    experts = f" E={spec.num_experts}x{spec.moe_intermediate_size}" if spec.num_experts else ""
    summary = (
        f"{spec.model_type} V={spec.vocab_size} H={spec.hidden_size} L={spec.num_hidden_layers} "
        f"heads={spec.num_attention_heads}/{spec.num_key_value_heads}x{spec.head_dim} "
        f"I={spec.intermediate_size}{experts}{' tied' if spec.tie_word_embeddings else ''}; "
        f"{parts['engine']}; {plan.dp_mode}, {len(plan.writers)} writer(s), "
        f"{len(plan.receivers)} receiver(s), {plan.world_size} ranks; layout {layout_hex[:12]}; "
        f"lineage {lineage or '-'}; digests {digests}"
    )
    return Fingerprint(parts=parts, summary=summary)


@dataclass(frozen=True)
class PreflightRow:
    rank: int
    ok: bool
    role: int
    version: int
    base: int
    window: int
    applying_base: int
    dirty: bool
    fingerprint: tuple[int, ...]
    message: str  # the failure, or this rank's configuration summary
    arrived_ms: int = UNKNOWN
    patience_ms: int = UNKNOWN


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _word(value: int | None) -> int:
    """``value`` as a row word; UNKNOWN for None and for a value no int64 holds (only a rank
    reporting its failure carries one, e.g. the version argument it was refused for: the row
    must still reach every rank, or they would wait for it until their timeout)."""
    return UNKNOWN if value is None or not _INT64_MIN <= value <= _INT64_MAX else value


def encode_preflight_row(
    *,
    role: int,
    fingerprint: Fingerprint,
    who: str,
    version: int | None,
    base: int | None,
    window: int = 0,
    applying_base: int | None = None,
    dirty: bool = False,
    failure: str | None = None,
    attempt: int | None = None,
) -> torch.Tensor:
    """This rank's row; ``who`` names its role (e.g. "writer w00000"). ``attempt``: a
    writer's fresh token for this attempt, in the receivers' ``applying_base`` word."""
    row = np.zeros(ROW_LENGTH, dtype=np.int64)
    text = failure if failure is not None else f"{who}: {fingerprint.summary}"
    length, words = status_row.encode_message(text)
    row[:_HEAD] = [
        MAGIC,
        status_row.status(failure),
        role,
        _word(version),
        _word(base),
        _word(window),
        _word(attempt if attempt is not None else applying_base),
        _DIRTY if dirty else 0,
        UNKNOWN,  # arrived and patience: stamped by preflight()
        UNKNOWN,
    ]
    row[_HEAD : _HEAD + _F] = fingerprint.words()
    row[_HEAD + _F] = length
    row[_HEAD + _F + 1 :] = words
    return torch.from_numpy(row)


def decode_preflight_rows(rows: torch.Tensor) -> list[PreflightRow]:
    data = rows.cpu().numpy().astype("<i8", copy=False)
    if data.ndim != 2 or data.shape[1] != ROW_LENGTH:
        raise ExchangeError(f"preflight: gathered rows have shape {data.shape}")
    out = []
    for rank, row in enumerate(data):
        if int(row[0]) != MAGIC:
            raise ExchangeError(
                f"preflight: rank {rank} sent a row that is not a preflight row (magic "
                f"{int(row[0]):#x}); the ranks are not running the same protocol step or "
                "deltasync version: re-create the group"
            )
        out.append(
            PreflightRow(
                rank=rank,
                ok=int(row[1]) == status_row.OK,
                role=int(row[2]),
                version=int(row[3]),
                base=int(row[4]),
                window=int(row[5]),
                applying_base=int(row[6]),
                dirty=bool(int(row[7]) & _DIRTY),
                fingerprint=tuple(int(x) for x in row[_HEAD : _HEAD + _F]),
                message=status_row.decode_message(row[_HEAD + _F + 1 :], int(row[_HEAD + _F])),
                arrived_ms=int(row[ARRIVED]),
                patience_ms=int(row[PATIENCE]),
            )
        )
    return out


@dataclass(frozen=True)
class Cleared:
    """What every rank agreed to move: ``version`` on ``base`` (-1: anchor), the writers'
    combined window token that receivers record with their apply, and the first writer's
    token of this attempt."""

    version: int
    base: int
    window: int
    attempt: int = 0

    @property
    def tag(self) -> str:
        """The failure-notes tag of this attempt's exchanges and commit (``exchange.notes``):
        the same on every rank and fresh for every attempt. A retry of the same version in
        the same window is another attempt: the arrival marks of an aborted one must not
        hide a rank that never arrived at the retry."""
        return f"{self.window:x}-{self.version}-{self.attempt:x}"


def combined_window(tokens: Sequence[int]) -> int:
    """One token for the writers' windows (in rank order): changes when any writer's does."""
    return _hash63(",".join(str(t) for t in tokens)) or 1


def _show(v: int) -> str:
    return "none" if v == UNKNOWN else str(v)


def _version_text(rows: Sequence[PreflightRow]) -> str:
    """The version the (first) writer's row names, for a refusal every rank raises alike."""
    writers = [r for r in rows if r.role == WRITER]
    return f"version {_show(writers[0].version)}" if writers else "this version"


def judge(rows: Sequence[PreflightRow], plan: RolePlan) -> Cleared:
    """The verdict every rank reaches from the same rows: what moves, or the same error.
    Fingerprints first: a rank built for another plan may also have failed its group check, and
    what the operator needs then is every rank's configuration (after a rank that gave up: it
    judges nothing, so no verdict may let the others go on)."""
    _refuse_if_one_gave_up(rows, plan)
    differ = [
        p for i, p in enumerate(FINGERPRINT_PARTS) if len({r.fingerprint[i] for r in rows}) > 1
    ]
    if differ:
        each = "; ".join(f"rank {r.rank}: {r.message}" for r in rows)
        raise FingerprintMismatchError(
            f"the ranks were built for different models or plans (they differ in "
            f"{', '.join(differ)}); refused on every rank before any payload moved, nothing was "
            f"written. Build every rank from the same model config, engine, TP/EP, role plan "
            f"and digest policy (ClusterConfig.digest_every), and layout. Each rank: {each}"
        )
    failed = [r for r in rows if not r.ok]
    if failed:
        reasons = "; ".join(f"rank {r.rank}: {r.message or '(no message)'}" for r in failed)
        noun = "rank" if len(failed) == 1 else "ranks"
        ranks = ", ".join(str(r.rank) for r in failed)
        raise PeerFailedError(
            f"preflight of {_version_text(rows)}: {noun} {ranks} failed before sending "
            f"({reasons}); no payload was sent, nothing was written, and the group is still "
            "usable"
        )
    writers = [r for r in rows if r.role == WRITER]
    receivers = [r for r in rows if r.role == RECEIVER]
    if [r.rank for r in writers] != [w.rank for w in plan.writers]:
        raise FingerprintMismatchError(
            f"preflight: ranks {[r.rank for r in writers]} act as writers but the role plan "
            f"names {[w.rank for w in plan.writers]}; refused before any payload moved"
        )
    lead = writers[0]
    split = [r for r in writers if (r.version, r.base) != (lead.version, lead.base)]
    if split:
        each = "; ".join(
            f"rank {r.rank}: version {r.version} on base {_show(r.base)}" for r in writers
        )
        held = [r.version for r in receivers if r.version != UNKNOWN]
        common = max([r.version for r in writers if r.version != UNKNOWN] + [h + 1 for h in held])
        raise SyncAbortedError(
            f"preflight: the writers send different versions ({each}); nothing was sent. Call "
            "sync with the same version (and anchor flag) on every writer: a number above "
            f"every version a receiver holds, e.g. sync({common}, anchor=True) on each (a "
            "replaced writer counts from its own checkpoint)",
            failures={r.rank: "sends another version" for r in split},
            anchor_required=False,
        )
    window = combined_window([r.window for r in writers])
    attempt = 0 if lead.applying_base == UNKNOWN else lead.applying_base
    cleared = Cleared(version=lead.version, base=lead.base, window=window, attempt=attempt)
    # A version number names one state: a receiver that committed this number (or a later
    # one) must never be handed another state under it, anchor or delta (a writer restarted
    # from an older checkpoint, a replacement writer counting from 0).
    ahead = {
        r.rank: r.version
        for r in receivers
        if r.version != UNKNOWN and r.version >= cleared.version
    }
    if ahead:
        top = max(ahead.values())
        lines = _each(plan, {rank: f"committed version {v}" for rank, v in ahead.items()})
        raise SyncAbortedError(
            f"preflight: version {cleared.version} refused on every rank before any payload "
            f"moved, nothing was written: {lines}. A version number names one state: send a "
            f"version above {top} (sync({top + 1}, anchor=True) on every writer, unless they "
            f"hold version {top}'s state)",
            failures={rank: f"VersionError: committed version {v}" for rank, v in ahead.items()},
            anchor_required=False,
        )
    if cleared.base == -1:
        return cleared  # an anchor defines the whole state: every receiver can take it
    refused: dict[int, str] = {}
    for r in receivers:
        role = plan.role(r.rank)
        assert isinstance(role, ReceiverRole)
        if r.version == UNKNOWN:
            refused[r.rank] = "holds no verified version"
        elif r.dirty:
            refused[r.rank] = (
                f"is dirty (its state failed a digest check after version {r.version})"
            )
        elif r.version != cleared.base:
            refused[r.rank] = f"holds version {r.version}, not the base {cleared.base}"
        elif r.base != UNKNOWN and r.window != window:
            refused[r.rank] = (
                f"applied an attempt of version {r.base} that this send does not cover (a writer "
                "restarted or lost the record of its uncommitted attempts)"
            )
    if refused:
        lines = _each(plan, refused)
        raise SyncAbortedError(
            f"preflight: delta version {cleared.version} on base {cleared.base} refused on every "
            f"rank before any payload moved, nothing was written: {lines}. Send an anchor "
            "(sync(version, anchor=True) on every writer)",
            failures={rank: f"AnchorRequiredError: {why}" for rank, why in refused.items()},
            anchor_required=True,
        )
    return cleared


def _refuse_if_one_gave_up(rows: Sequence[PreflightRow], plan: RolePlan) -> None:
    """The all_gather completes on the late ranks with the rows that were sent, also the row
    of a rank whose wait had already ended: that rank raised a timeout naming no one, and the
    others would go on to exchange round 1 without it and blame it (a healthy writer named dead
    because a receiver came late). Refused on every rank that has the rows instead, naming the
    late ranks."""
    found = status_row.late_after([(r.rank, r.arrived_ms, r.patience_ms) for r in rows], UNKNOWN)
    if found is None:
        return
    first, waits, late = found
    version = _version_text(rows)
    names = ", ".join(f"{plan.who(r)} ({ms / 1000:.1f} s after it)" for r, ms in late)
    raise ExchangeTimeoutError(
        f"preflight of {version}: {names} arrived after {plan.who(first)} had "
        f"stopped waiting (it waits {waits / 1000:g} s there): rank {first} gave up and "
        "raised; no payload moved, nothing was written. Re-create the process group, and "
        "start every rank's sync within that time (writers wait exchange.timeout_s in the "
        "preflight, receivers wait_for_version_s)"
    )


def _each(plan: RolePlan, whys: dict[int, str]) -> str:
    """``rank R (receiver S replica P) why; ...`` in rank order, for a refusal naming ranks."""
    return "; ".join(f"{plan.who(rank)} {why}" for rank, why in sorted(whys.items()))


# What the preflight's judgement raises, identically on every rank once the gather completed
# (a refusal, a failed rank's report, a mismatched build): the ranks still agree on where the
# protocol is, unlike a gather that failed or was interrupted.
VERDICTS = (PeerFailedError, ConfigError)


def preflight(
    row: torch.Tensor,
    *,
    plan: RolePlan,
    group: dist.ProcessGroup | None,
    timeout_s: float,
    what: str,
    tag: str | None = None,
) -> Cleared:
    """Gather ``row`` from every rank of ``group`` and judge; ``what`` names the wait.
    ``tag`` (the same on every rank, fresh for each preflight; ``NoteLedger.preflight_tag``):
    every rank marks its arrival under it, so that a gather whose connection closed names the
    rank that never came (one that died between versions) instead of "some rank"."""
    world = dist.get_world_size(group)
    notes = None
    if tag is not None:
        notes = FailureNotes(group, tag=tag, rank=dist.get_rank(group), world=world)
        notes.arrive()
    stamped = row.clone()
    stamped[ARRIVED] = status_row.now_ms()
    stamped[PATIENCE] = round(timeout_s * 1000)
    mine = stamped.to(group_device(group))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        wait(
            work,
            timeout_s=timeout_s + status_row.WAIT_BEYOND_S,
            what=f"preflight (all_gather of the fingerprint rows of all {world} ranks; {what})",
            peers="some rank of the group (not started, still busy, or dead)",
        )
    except ExchangeError as exc:
        # A connection that closed: a rank died (gloo tells its peers at once). A timeout
        # names no one here: a rank still training or generating is late, not dead.
        if notes is None or isinstance(exc, ExchangeTimeoutError):
            raise
        # Only the dead rank's ring neighbours see its connection close; the others would wait
        # here for their own timeout (a receiver's is wait_for_version_s): pass it on.
        text = blame(notes, None, str(exc), then=lambda: close_pairs(group))
        raise ExchangeError(text) from exc
    return judge(decode_preflight_rows(torch.stack(gathered)), plan)
