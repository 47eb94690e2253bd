"""ClusterReceiver: a rollout rank's side of the in-cluster sync of one version.

``sync()`` runs, on one receiver rank:

1. preflight (:mod:`deltasync.cluster.preflight`): this rank's fingerprint (model config,
   engine, TP/EP, role plan, writer count, layout table, lineage) and journal state go to every
   rank in one all_gather, waiting up to ``config.wait_for_version_s`` for the trainer to
   arrive. A mismatch anywhere, or a delta this receiver cannot take, is refused on every rank
   before any payload moves;
2. receive (``receive``): the first exchange (this rank sends nothing; while the writers
   stream a delta in parts, one exchange per part, joined, see ``cluster.streaming``); in
   ``forward`` mode replica 0 of a shard then forwards what it got, unopened, to the shard's
   other replicas in a second exchange. Every wait from here on is bounded by
   ``config.exchange.timeout_s``;
3. stage (``staging.stage_payloads``): unwrap the envelopes, verify every blob's digest,
   header and trailer in the received bytes, refuse a wrong base. The engine keeps serving;
   nothing has been written or decoded (a small version, within ``max_staged_bytes``, is
   decoded here and held);
4. verify before write (still serving): read the writers' blobs in lockstep one tensor at a
   time (every record checked, writers disjoint, an anchor complete) and hash the state the
   shard WILL have (one writer, :mod:`deltasync.layout.verify`) or every writer's part digest
   of it (several, :mod:`deltasync.layout.part_digests`), against what the writers sent,
   chunk by chunk with the tensor's pieces patched into a small scratch copy; a mismatch
   refuses the version with nothing written and marks the journal dirty (the base has drifted
   from the trainer's: only an anchor is accepted from then on);
5. apply: journal the apply (``applying = (version, base)`` and the writers' attempt window),
   then, inside the engine's ``pause`` context, read the same records again one tensor at a
   time and scatter each in place (``format.apply_pieces``);
6. acknowledge in the joint commit; the journal commits the version only when every rank
   succeeded, with the digests verified in 4 (``journal.verified``), so that the recorded
   digests always describe the committed version (None after a version sent without them).

:attr:`version` is the version the tensors hold: the committed one, or None while they hold
an uncommitted attempt's values (after a failed sync) or are dirty, so a caller never serves
weights under a version they no longer are. The retry of the same base converges from an
attempt because the writers resend the union of every uncommitted attempt
(:mod:`deltasync.cluster.cluster_sender`); the preflight checks the writers' window token
against the one recorded with the apply, so a retry that cannot prove it covers the attempt is
refused (anchor).

A receiver whose ``journal_path`` names an existing file takes the file's state over
``version``, but the file describes the tensors of the process that wrote it: a replacement
process is usually handed freshly loaded ones. So the constructor hashes the live tensors
(one read of the shard) against the digests recorded with ``committed`` (the state digest, as
the verify computes it, or every writer's part digest) and marks the journal dirty, durably,
when they do not match, and also when the journal has no digest for ``committed`` (that version
was sent without digests, or the file predates them): tensors that cannot be checked cannot be
vouched for. Then :attr:`version` is None and only an anchor is accepted. A journal that was
mid-apply (``applying``) keeps its retry only when the tensors still hash to ``committed``
(the apply never wrote): tensors holding part or all of the attempt cannot be told from
tensors that never held the base, so they need the anchor too.

A failure in 3-5 is raised on this rank as the storage path raises it (DigestMismatchError,
BlobBaseMismatchError, IntegrityError, ...) after this rank has told every other rank in the
joint commit, where they raise SyncAbortedError; a failure in 3-4 leaves the tensors bitwise
untouched. After an ExchangeError that is not a PeerFailedError the group is broken: re-create
it and call :meth:`use_group` (``docs/cluster.md``, "Recovery").

``apply_payload`` is 3-5 with no collective (benchmarks and tests drive it directly).

This class knows the order of those steps; it holds no copy of the model: the received
payload bytes of one version and one tensor's decoded records at a time (or, within
``max_staged_bytes``, the version's decoded records).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from deltasync import names
from deltasync.atomic import InBackground
from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.cluster.envelope import as_view, pack_envelope
from deltasync.cluster.joint_commit import encode_commit_row, joint_commit
from deltasync.cluster.preflight import (
    RECEIVER,
    VERDICTS,
    Cleared,
    encode_preflight_row,
    fingerprint,
    preflight,
)
from deltasync.cluster.reports import ApplyReport, ReceiveReport
from deltasync.cluster.roles import (
    ClusterConfig,
    GroupHealth,
    RolePlan,
    check_group,
    resolve_rank,
)
from deltasync.cluster.staging import (
    Staged,
    as_cpu_bytes,
    check_staged,
    default_staged_bytes,
    part_digests_after,
    stage_payloads,
    state_digest_after,
)
from deltasync.cluster.streaming import join_payloads, receive_parts
from deltasync.errors import (
    AnchorRequiredError,
    DeltaSyncError,
    ExchangeError,
    IntegrityError,
    LocalStateError,
    SyncAbortedError,
)
from deltasync.exchange import exchange
from deltasync.exchange.notes import NoteLedger, naming
from deltasync.exchange.status_row import describe
from deltasync.exclusive import one_call_at_a_time
from deltasync.format import (
    PauseContext,
    apply_pieces,
    check_tensors_match,
    check_tensors_still_match,
    inside_pause,
)
from deltasync.layout import ReceiverLayout
from deltasync.layout.digest import state_digest
from deltasync.layout.part_digests import receiver_part_digests
from deltasync.validate import check_instance, check_int

log = logging.getLogger(__name__)


class Incoming(dict[int, torch.Tensor]):
    """``{source rank: payload}`` of one version, with how long receiving took."""

    def __init__(
        self,
        items: Mapping[int, torch.Tensor],
        *,
        wait_s: float,
        forward_s: float,
        cleared: Cleared | None = None,
        tags: tuple[str, ...] = (),
        error: Exception | None = None,
    ) -> None:
        super().__init__(items)
        self.wait_s = wait_s  # the preflight (waiting for the trainer) and the first exchange
        self.forward_s = forward_s  # the second exchange (forward mode)
        self.cleared = cleared  # what the preflight agreed on
        self.tags = tags  # the failure-notes tag of each exchange, in order
        self.error = error  # a payload that could not be read: raised by apply_payload


class _Diverged(Exception):
    """The state a payload leads to is not the writers' (``why``); nothing written yet."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


_one_at_a_time = one_call_at_a_time(
    "a receiver rank", "sync, receive, apply_payload, use_group or close"
)


class ClusterReceiver:
    """One receiver rank of a :class:`RolePlan`, holding shard ``plan.receiver(rank).shard``.

    tensors: the live local tensors (storage names as ``layout.local_specs``, BF16), written in
        place.
    version: the version they hold when no journal file says otherwise (None: nothing
        verified; the first sync must be an anchor).
    journal_path: a file for the durable journal; None keeps it in memory. An existing file
        wins over ``version`` only when ``tensors`` hash to the digest it recorded for its
        committed version; otherwise (another state, or a version recorded without a digest)
        it is marked dirty and the next sync must be an anchor. Pass it to a replacement only
        with tensors that survived the process that wrote it (e.g. a mapped file).
    pause: the engine's "stop reading weights" context, entered only around the scatter.
    lineage: the run id of the model's lineage, if the job has one (part of the fingerprint).
    max_staged_bytes: a version whose decoded records are estimated at most this size is
        decoded once and held from verify to the scatter; a larger one is decoded twice, one
        tensor at a time (verify, then the scatter inside the pause), so the receiver holds the
        received bytes plus one tensor's changes instead of the version's whole decoded change
        set. None: 1/16 of the shard's bytes, at least 4 MiB (the storage path's default).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        plan: RolePlan,
        layout: ReceiverLayout,
        version: int | None,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        config: ClusterConfig | None = None,
        journal_path: str | None = None,
        pause: PauseContext | None = None,
        lineage: str | None = None,
        max_staged_bytes: int | None = None,
    ) -> None:
        self.rank = resolve_rank(rank, group)
        self.role = plan.receiver(self.rank)
        plan.check_shards(s.id for s in layout.shards())
        self.plan = plan
        self.layout = layout
        self.shard = self.role.shard
        self._health = GroupHealth(f"receiver of shard {self.shard} (rank {self.rank})")
        self.specs = layout.local_specs(self.shard)
        self.tensors = dict(check_instance("ClusterReceiver", "tensors", tensors, Mapping))
        self._check_tensors()
        self.config = config or ClusterConfig()
        if max_staged_bytes is None:
            shard_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
            max_staged_bytes = default_staged_bytes(shard_bytes)
        self.max_staged_bytes = check_int(
            "ClusterReceiver", "max_staged_bytes", max_staged_bytes, lo=0
        )
        self._notes = NoteLedger()  # this rank's arrival marks in the group's store
        # A joint commit gathered every row since the marks of the attempts before it were
        # last deleted: the next sync deletes them before its preflight (_settle_marks).
        self._settle_due = False
        self.fingerprint = fingerprint(
            layout, plan, lineage=lineage, digest_every=self.config.digest_every
        )
        self._who = f"receiver {self.shard} replica {self.role.replica}"
        self._pause = pause or contextlib.nullcontext
        self.group = group  # a group in use: the first preflight takes this rank's record
        # one call at a time: two threads' collectives on one rank are paired with other
        # rounds of the other ranks, and gloo aborts their processes
        self._busy = threading.RLock()
        self._closed = False
        self.journal = ClusterJournal(
            version=version, path=journal_path, owner=f"{self._who} (rank {self.rank})"
        )
        try:
            if self.journal.reopened:
                self._check_reopened()
        except BaseException:  # never constructed: the journal is not held by it
            self.journal.close()
            raise

    @_one_at_a_time
    def close(self) -> None:
        """Release the journal file for another process (a replacement of this one); also
        done when the receiver is collected or the process ends. Every later call but
        ``close`` is refused (ConfigError): its journal writes would land in a file another
        process may hold."""
        self._closed = True
        self._settle_marks()  # the last commit's leftovers, while the group's store is there
        self.journal.close()

    def _check_reopened(self) -> None:
        """Mark the reopened journal dirty unless the tensors provably hold its committed
        version: a journal file outlives the process, its tensors may not (a replacement loads
        fresh ones), and a receiver never reports a version it does not hold."""
        s = self.journal.state
        if s.dirty or s.committed is None:
            return  # already anchor-only
        why = self._unlike_committed()
        if why is None:
            return  # untouched since the commit (mid-apply: the retry converges from the base)
        attempt = "" if s.applying is None else f" (mid-apply of version {s.applying[0]})"
        log.warning(
            "receiver %s replica %s (rank %d): journal %s names version %d%s, but %s; marked "
            "dirty, only an anchor is accepted",
            self.shard,
            self.role.replica,
            self.rank,
            self.journal.path,
            s.committed,
            attempt,
            why,
        )
        self.journal.mark_dirty()

    def _unlike_committed(self) -> str | None:
        """Why the live tensors are not shown to hold the journal's committed version, or
        None when they hash to the digests it recorded with it."""
        s = self.journal.state
        if not s.checkable:
            return (
                "it holds no digest of that version (sent without digests, or a journal older "
                "than its digests), so the tensors cannot be checked"
            )
        if s.digest is not None and state_digest(self.tensors) != s.digest:
            return f"the tensors do not hash to its state digest {s.digest}"
        if s.part_digests is not None:
            count = len(self.plan.writers)
            if len(s.part_digests) != count:
                return (
                    f"it holds {len(s.part_digests)} part digests and the plan has {count} "
                    "writers, so the tensors cannot be checked"
                )
            mine = receiver_part_digests(
                self.tensors, layout=self.layout, shard=self.shard, count=count
            )
            if tuple(mine[k] for k in range(count)) != s.part_digests:
                return "the tensors do not hash to its writers' part digests"
        return None

    def _check_tensors(self) -> None:
        check_tensors_match(
            self.tensors,
            self.specs,
            what=f"receiver shard {self.shard!r}",
            hint="pass storage names only; tied aliases share storage and need no entry",
        )

    @_one_at_a_time
    def use_group(self, group: dist.ProcessGroup | None) -> None:
        """Sync over ``group`` from now on (e.g. a new group after a round-2 failure)."""
        # The old group's store is not written again (it may be the broken one): the marks
        # a settle was due to delete there stay, as those of an attempt that failed on it do.
        self._settle_due = False
        self.group = group
        self._health.reset()
        self._notes.new_group(group, self.rank)

    def _check_group(self) -> None:
        check_group(self.group, self.plan, self.rank)

    @property
    def version(self) -> int | None:
        """The version the tensors hold: the committed one, or None while they hold an
        uncommitted attempt (``journal.state.applying``) or are dirty."""
        s = self.journal.state
        return None if s.applying is not None or s.dirty else s.committed

    @property
    def committed_version(self) -> int | None:
        """The last jointly committed version (the base a retry applies on)."""
        return self.journal.state.committed

    # ------------------------------------------------------------------ step 1

    def _preflight(self) -> Cleared:
        """Show every rank this receiver's fingerprint and state; wait for the trainer (up to
        ``config.wait_for_version_s``) and for the verdict."""
        if not dist.is_initialized():
            raise ExchangeError("torch.distributed is not initialized; call init_from_env() first")
        failure = None
        try:
            self._check_group()
        except Exception as exc:
            failure = f"{self._who}: {self.fingerprint.summary}; {describe(exc)}"
        s = self.journal.state
        held = "no committed version" if s.committed is None else f"version {s.committed}"
        if s.applying is not None:
            held += f" and an uncommitted apply of version {s.applying[0]}"
        row = encode_preflight_row(
            role=RECEIVER,
            fingerprint=self.fingerprint,
            who=self._who,
            version=s.committed,
            base=None if s.applying is None else s.applying[0],
            window=s.window,
            applying_base=None if s.applying is None else s.applying[1],
            dirty=s.dirty,
            failure=failure,
        )
        try:
            return preflight(
                row,
                plan=self.plan,
                group=self.group,
                timeout_s=self.config.wait_for_version_s,
                what=f"{self._who} holds {held}: waiting for the trainer's next version "
                "(wait_for_version_s)",
                tag=self._notes.preflight_tag(self.group, self.rank),
            )
        except BaseException as exc:
            if not isinstance(exc, VERDICTS):  # a verdict every rank holds keeps the tags
                self._notes.new_group(self.group, self.rank)
            raise

    @_one_at_a_time
    def receive(self, cleared: Cleared | None = None) -> Incoming:
        """The preflight (unless ``cleared`` is given) and the exchange(s) of one version:
        ``{source rank: payload}`` for this rank (CPU). Only the preflight waits up to
        ``wait_for_version_s``; every exchange wait is bounded by ``exchange.timeout_s``."""
        t = time.perf_counter()
        if cleared is None:
            cleared = self._preflight()
        tag = cleared.tag
        self._notes.begin(tag, self.group, self.rank)
        # one exchange, or one per part while the writers stream (cluster.streaming)
        tags: list[str] = []
        with naming(f"version {cleared.version}"):
            parts = receive_parts(group=self.group, config=self.config.exchange, tag=tag, tags=tags)
        wait_s = time.perf_counter() - t
        # From here every failure is this version's, voted in the joint commit with the
        # others: a rank that raised now would skip the collectives they wait in.
        error: Exception | None = None
        got: dict[int, torch.Tensor] = {}
        try:
            got = join_payloads(
                parts, where=f"{self._who} (rank {self.rank}): version {cleared.version}"
            )
        except Exception as exc:
            error = exc
        del parts
        if self.plan.exchanges == 1:
            return Incoming(
                got, wait_s=wait_s, forward_s=0.0, cleared=cleared, tags=tuple(tags), error=error
            )
        t = time.perf_counter()
        targets = self.plan.forward_targets(self.rank)
        bundle = b""  # nothing to forward (then each replica votes its payload missing)
        if targets and error is None:
            try:
                bundle = pack_envelope([as_view(got[s]) for s in sorted(got)], nested=True)
            except Exception as exc:
                error = exc
        with naming(f"version {cleared.version} (forwarding to the shard's replicas)"):
            # a rank missing here that left a note in the version's first exchange(s) failed
            # there, alive (the writer, replica 0): passed over, as in the joint commit
            forwarded = exchange(
                {t: bundle for t in targets},
                group=self.group,
                config=self.config.exchange,
                tag=f"{tag}-x2",
                earlier=tags,
            )
        mine = got if self.role.replica == 0 else as_cpu_bytes(forwarded)
        return Incoming(
            mine,
            wait_s=wait_s,
            forward_s=time.perf_counter() - t,
            cleared=cleared,
            tags=(*tags, f"{tag}-x2"),
            error=error,
        )

    # ------------------------------------------------------------------ steps 3-5

    @_one_at_a_time
    def apply_payload(
        self, received: Mapping[int, object], *, window: int | None = None
    ) -> ApplyReport:
        """Stage, journal, apply and verify one version's payloads; no collective. Raises a
        typed error; before the journal entry nothing has been written. ``window``: the
        writers' attempt window the preflight agreed on (recorded with the apply)."""
        error = getattr(received, "error", None)
        if error is not None:
            raise error
        if window is None:
            cleared = getattr(received, "cleared", None)
            window = 0 if cleared is None else cleared.window
        # before anything is journaled or written: a tensor freed or resized since
        # construction is refused here, every tensor untouched, not midway through a scatter
        check_tensors_still_match(self.tensors, self.specs, what=f"receiver shard {self.shard!r}")
        t = time.perf_counter()
        staged = stage_payloads(
            received,
            plan=self.plan,
            rank=self.rank,
            specs=self.specs,
            journal=self.journal,
            max_decompressed_bytes=self.config.max_decompressed_bytes,
            max_staged_bytes=self.max_staged_bytes,
        )
        stage_s = time.perf_counter() - t

        # Verify before write: one full read of every record (and every writer and anchor
        # check), hashing the tensors as they WILL be (the engine still serves); a refusal or a
        # mismatch leaves everything unwritten. The journal's record of the apply is written
        # meanwhile (its fsyncs release the GIL): it only has to be durable before the first
        # write, and a refusal puts the record before it back.
        prior = self.journal.state
        recording = InBackground(
            lambda: self.journal.begin(staged.version, staged.base, window=window),
            name="deltasync-cluster-journal",
        )
        t = time.perf_counter()
        try:
            digest, parts, elements = self._verify(staged)
        except _Diverged as exc:
            recording.wait()  # marked dirty after the apply's record, never under it
            self._diverged(staged.version, exc.why)
        except BaseException:
            if recording.wait() is None:
                self.journal.restore(prior)
            raise
        verify_s = time.perf_counter() - t
        error = recording.wait()  # durable before the first write
        if error is not None:
            raise error
        # what the tensors will hash to, recorded with this version's commit (after the begin,
        # which forgets what an earlier apply noted)
        self.journal.verified(staged.version, digest=digest, part_digests=parts)
        # The same records again (the received bytes are immutable and were fully checked
        # above), one tensor at a time: the decoder proved every index sorted and in range.
        t = time.perf_counter()
        # (a pause that suppressed an error midway raises: the journal's apply stays)
        with inside_pause(self._pause, f"version {staged.version} on rank {self.rank}"):
            for item in staged.chain(self.specs, check=False):
                apply_pieces(item, self.tensors, ordered=True)
        pause_s = time.perf_counter() - t
        return ApplyReport(
            version=staged.version,
            base=staged.base,
            payload_bytes=staged.payload_bytes,
            elements=elements,
            stage_s=stage_s,
            pause_s=pause_s,
            verify_s=verify_s,
            state_digest=digest,
        )

    def _verify(self, staged: Staged) -> tuple[str | None, tuple[str, ...] | None, int]:
        """Read ``staged`` to the end once; the digests the tensors will have after it against
        what the writers sent. Returns the resulting state digest (one writer; None without
        one), every writer's part digest when the writers sent theirs and they all matched
        (else None), and the elements the scatter will write; raises ``_Diverged`` on a
        mismatch, or the records' own typed errors."""
        if staged.state_digest is not None:
            digest, elements = state_digest_after(staged, self.tensors, self.specs)
            if digest != staged.state_digest:
                raise _Diverged(
                    f"would give state digest {digest}, the trainer says {staged.state_digest}"
                )
            return digest, None, elements
        if staged.part_digests:
            count = len(self.plan.writers)
            mine, elements = part_digests_after(
                staged, self.tensors, layout=self.layout, shard=self.shard, count=count
            )
            bad = [
                names.writer_id(k)
                for k in range(count)
                if staged.part_digests[names.writer_id(k)] != mine[k]
            ]
            if bad:
                raise _Diverged(
                    f"would not match the part digests of writers {bad} in the parts they own"
                )
            # staging refused a version where only some writers sent theirs
            return None, tuple(mine[k] for k in range(count)), elements
        return None, None, check_staged(staged, self.specs)

    def _diverged(self, version: int, why: str) -> NoReturn:
        log.error(
            "receiver %s replica %s (rank %d): version %d %s; refused before any write and "
            "marked dirty (its base no longer matches the trainer's), only an anchor is "
            "accepted from now on",
            self.shard,
            self.role.replica,
            self.rank,
            version,
            why,
        )
        self.journal.mark_dirty()
        raise IntegrityError(
            f"receiver {self.shard} replica {self.role.replica} (rank {self.rank}): applying "
            f"version {version} {why}. Refused before any write, but the tensors no longer "
            "match the trainer's base (drift), so only an anchor is accepted from now on. Check "
            "that trainer and receiver use the same layout and that nothing else writes the "
            "receiver's tensors"
        )

    # ------------------------------------------------------------------ the whole version

    @_one_at_a_time
    def sync(self) -> ReceiveReport:
        """Receive, apply and jointly commit the version the writers send.

        Returns:
            A :class:`ReceiveReport`: the version now held, the previous one and timings
            (wait, stage, pause, verify, commit).

        Raises:
            PeerFailedError: some rank failed before sending; nothing moved or was written.
            FingerprintMismatchError: the ranks were built for different models or plans.
            SyncAbortedError: this version cannot be taken here (``anchor_required``) or another
                rank failed; nothing committed.
            ExchangeError: a rank died or hung (named); re-create the group.
            the storage path's errors (DigestMismatchError, IntegrityError, ...) for a failure
                on this rank, after telling every other rank.
        """
        self._health.check()
        try:
            with self._health.collectives("the last sync"):
                return self._sync()
        except Exception as exc:
            self._health.note(exc, "the last sync")
            raise

    def _settle_marks(self) -> None:
        """Delete this rank's marks of the attempts before the last one whose joint commit
        gathered every row (``NoteLedger.settle``), if not done since. A store that cannot
        be reached or cannot delete keeps them."""
        if self._settle_due:
            self._settle_due = False
            self._notes.settle(self.group, self.rank)

    def _sync(self) -> ReceiveReport:
        t0 = time.perf_counter()
        # Here, not in the joint commit: the deletes (a store round trip each, ~2 ms a
        # version on the small preset) come before the preflight, where this rank waits for
        # the trainer's next version anyway, and not between the commit and the return, where
        # they delayed every version's end. No rank reads those marks once every rank's commit
        # row is in, so deleting them one version later changes nothing else.
        self._settle_marks()
        previous = self.version
        received = self.receive()

        report, failure = None, None
        try:
            report = self.apply_payload(received)
        except Exception as exc:
            failure = exc
        timings = received.wait_s, received.forward_s
        cleared, tags = received.cleared, received.tags
        assert cleared is not None
        del received  # the payload bytes are dead weight from here on
        if failure is None:
            assert report is not None
            row = encode_commit_row(
                version=report.version, base=report.base, state_digest=report.state_digest
            )
        else:
            state = self.journal.state
            row = encode_commit_row(
                version=None,
                base=None,
                failure=describe(failure),
                # a drift marked the journal dirty; a torn write a pause hid (IntegrityError
                # too) left it applying: the retry's union repairs that, no anchor needed
                anchor_required=isinstance(failure, (AnchorRequiredError, LocalStateError))
                or state.dirty
                or state.committed is None,
            )
        t = time.perf_counter()
        with naming(f"version {cleared.version}"):
            verdict = joint_commit(
                row,
                plan=self.plan,
                group=self.group,
                timeout_s=self.config.commit_timeout_s,
                tag=f"{cleared.tag}-commit",
                earlier=tags,
            )
        self._settle_due = True  # every row is in: see _settle_marks
        commit_s = time.perf_counter() - t
        if isinstance(failure, DeltaSyncError):
            raise failure
        if failure is not None:
            # Not deltasync's own (an engine's pause hook, a MemoryError in the scatter): it was
            # voted above, so the group still carries the protocol; raised as the verdict every
            # rank holds, not as a backend's error that would break the group (sync's health).
            raise SyncAbortedError(
                verdict.message, failures=verdict.failures, anchor_required=verdict.anchor_required
            ) from failure
        if not verdict.ok:
            raise SyncAbortedError(
                verdict.message, failures=verdict.failures, anchor_required=verdict.anchor_required
            )
        assert report is not None
        self.journal.commit(report.version)
        return ReceiveReport(
            version=report.version,
            base=report.base,
            previous_version=previous,
            payload_bytes=report.payload_bytes,
            elements=report.elements,
            wait_s=timings[0],
            forward_s=timings[1],
            stage_s=report.stage_s,
            pause_s=report.pause_s,
            verify_s=report.verify_s,
            commit_s=commit_s,
            total_s=time.perf_counter() - t0,
        )
