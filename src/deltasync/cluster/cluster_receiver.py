"""ClusterReceiver: a rollout rank's side of the in-cluster sync of one version.

``sync()`` runs, on one receiver rank:

1. receive (``receive``): the first exchange (this rank sends nothing), waiting up to
   ``config.wait_for_version_s`` for the trainer; in ``forward`` mode replica 0 of a shard then
   forwards what it got, unopened, to the shard's other replicas in a second exchange;
2. stage (``staging.stage_payloads``): verify and decode everything, refuse a wrong base,
   merge the writers' updates. The engine keeps serving; nothing has been written;
3. apply: journal the apply (``applying = (version, base)``), then scatter in place inside
   the engine's ``pause`` context: the only moment the engine must not read weights;
4. verify: when the trainer sent the shard's expected state digest, hash the live tensors
   and compare; a mismatch marks the journal dirty (only an anchor is accepted from then on);
5. acknowledge in the joint commit; advance ``version`` only when every rank succeeded.

A failure in 2-4 is raised on this rank as the storage path raises it (DigestMismatchError,
BlobBaseMismatchError, IntegrityError, ...) after this rank has told every other rank in the
joint commit, where they raise SyncAbortedError; so nobody commits, and a failure in 2 leaves
the tensors bitwise untouched. If another rank failed, this one raises SyncAbortedError; its
tensors may already hold the failed attempt's values, which the journal records and the retry
of the same version overwrites (see ``journal``).

``apply_payload`` is 2-4 with no collective (benchmarks and tests drive it directly). After an
ExchangeError that is not a PeerFailedError the group is broken: re-create it and call
:meth:`use_group`.

This class knows the order of those steps; it holds no copy of the model, only the staged
updates of one version.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.cluster.envelope import as_view, pack_envelope
from deltasync.cluster.joint_commit import encode_commit_row, joint_commit
from deltasync.cluster.reports import ApplyReport, ReceiveReport
from deltasync.cluster.roles import ClusterConfig, RolePlan, check_group, resolve_rank
from deltasync.cluster.staging import as_cpu_bytes, stage_payloads
from deltasync.errors import AnchorRequiredError, IntegrityError, SyncAbortedError
from deltasync.exchange import exchange
from deltasync.exchange.status_row import describe
from deltasync.format import apply_updates, check_tensors_match
from deltasync.layout import ReceiverLayout
from deltasync.layout.digest import state_digest

PauseContext = Callable[[], contextlib.AbstractContextManager]

log = logging.getLogger(__name__)


class Incoming(dict[int, torch.Tensor]):
    """``{source rank: payload}`` of one version, with how long receiving took."""

    def __init__(
        self, items: Mapping[int, torch.Tensor], *, wait_s: float, forward_s: float
    ) -> None:
        super().__init__(items)
        self.wait_s = wait_s  # the first exchange: waiting for the trainer, then its transfer
        self.forward_s = forward_s  # the second exchange (forward mode)


class ClusterReceiver:
    """One receiver rank of a :class:`RolePlan`, holding shard ``plan.receiver(rank).shard``.

    tensors: the live local tensors (storage names as ``layout.local_specs``, BF16), written in
        place.
    version: the version they hold when no journal file says otherwise (None: nothing
        verified; the first sync must be an anchor).
    journal_path: a file for the durable journal; None keeps it in memory.
    pause: the engine's "stop reading weights" context, entered only around the scatter.
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
    ) -> None:
        self.rank = resolve_rank(rank, group)
        self.role = plan.receiver(self.rank)
        plan.check_shards(s.id for s in layout.shards())
        self.plan = plan
        self.shard = self.role.shard
        self.specs = layout.local_specs(self.shard)
        self.tensors = dict(tensors)
        self._check_tensors()
        self.config = config or ClusterConfig()
        self.journal = ClusterJournal(version=version, path=journal_path)
        self._pause = pause or contextlib.nullcontext
        self.use_group(group)

    def _check_tensors(self) -> None:
        check_tensors_match(
            self.tensors, self.specs, what=f"receiver shard {self.shard!r}",
            hint="pass storage names only; tied aliases share storage and need no entry",
        )  # fmt: skip

    def use_group(self, group: dist.ProcessGroup | None) -> None:
        """Sync over ``group`` from now on (e.g. a new group after a round-2 failure)."""
        self.group = group

    def _check_group(self) -> None:
        check_group(self.group, self.plan, self.rank)

    @property
    def version(self) -> int | None:
        """The jointly committed version the tensors hold (see ``journal.state``)."""
        return self.journal.state.committed

    # ------------------------------------------------------------------ step 1

    def receive(self) -> Incoming:
        """The exchange(s) of one version: ``{source rank: payload}`` for this rank (CPU)."""
        self._check_group()
        t = time.perf_counter()
        first = replace(self.config.exchange, timeout_s=self.config.wait_for_version_s)
        got = as_cpu_bytes(exchange({}, group=self.group, config=first))
        wait_s = time.perf_counter() - t
        if self.plan.exchanges == 1:
            return Incoming(got, wait_s=wait_s, forward_s=0.0)
        t = time.perf_counter()
        targets = self.plan.forward_targets(self.rank)
        bundle = (
            pack_envelope([as_view(got[s]) for s in sorted(got)], nested=True) if targets else b""
        )
        forwarded = exchange(
            {t: bundle for t in targets}, group=self.group, config=self.config.exchange
        )
        mine = got if self.role.replica == 0 else as_cpu_bytes(forwarded)
        return Incoming(mine, wait_s=wait_s, forward_s=time.perf_counter() - t)

    # ------------------------------------------------------------------ steps 2-4

    def apply_payload(self, received: Mapping[int, object]) -> ApplyReport:
        """Stage, journal, apply and verify one version's payloads; no collective. Raises a
        typed error; before the journal entry nothing has been written."""
        t = time.perf_counter()
        staged = stage_payloads(
            received, plan=self.plan, rank=self.rank, specs=self.specs, journal=self.journal,
            max_decompressed_bytes=self.config.max_decompressed_bytes,
        )  # fmt: skip
        stage_s = time.perf_counter() - t

        self.journal.begin(staged.version, staged.base)  # before the first write
        t = time.perf_counter()
        with self._pause():
            apply_updates(staged.updates, self.tensors)
        pause_s = time.perf_counter() - t

        digest, verify_s = None, 0.0
        if staged.state_digest is not None:
            t = time.perf_counter()
            digest = state_digest(self.tensors)
            verify_s = time.perf_counter() - t
            if digest != staged.state_digest:
                log.error(
                    "receiver %s replica %s (rank %d): state digest after version %d does not "
                    "match the trainer's; marked dirty, only an anchor is accepted from now on",
                    self.shard, self.role.replica, self.rank, staged.version,
                )  # fmt: skip
                self.journal.mark_dirty()
                raise IntegrityError(
                    f"receiver {self.shard} replica {self.role.replica} (rank {self.rank}): after "
                    f"applying version {staged.version} the state digest is {digest}, the trainer "
                    f"says {staged.state_digest}. The tensors no longer hold version "
                    f"{self.version}; only an anchor is accepted from now on. Check that trainer "
                    "and receiver use the same layout"
                )
        return ApplyReport(
            version=staged.version, base=staged.base, payload_bytes=staged.payload_bytes,
            elements=staged.elements, stage_s=stage_s, pause_s=pause_s, verify_s=verify_s,
            state_digest=digest,
        )  # fmt: skip

    # ------------------------------------------------------------------ the whole version

    def sync(self) -> ReceiveReport:
        """Receive, apply and jointly commit the version the writers send.

        Returns:
            A :class:`ReceiveReport`: the version now held, the previous one and timings
            (wait, stage, pause, verify, commit).
        """
        t0 = time.perf_counter()
        previous = self.version
        received = self.receive()

        report, failure = None, None
        try:
            report = self.apply_payload(received)
        except Exception as exc:  # noqa: BLE001 -- told to every rank in the commit, then raised
            failure = exc
        timings = received.wait_s, received.forward_s
        del received  # the payload bytes are dead weight from here on
        if failure is None:
            assert report is not None
            row = encode_commit_row(
                version=report.version, base=report.base, state_digest=report.state_digest
            )
        else:
            state = self.journal.state
            row = encode_commit_row(
                version=None, base=None, failure=describe(failure),
                anchor_required=isinstance(failure, (AnchorRequiredError, IntegrityError))
                or state.dirty or state.committed is None,
            )  # fmt: skip
        t = time.perf_counter()
        verdict = joint_commit(
            row, plan=self.plan, group=self.group, timeout_s=self.config.commit_timeout_s
        )
        commit_s = time.perf_counter() - t
        if failure is not None:
            raise failure
        if not verdict.ok:
            raise SyncAbortedError(
                verdict.message, failures=verdict.failures, anchor_required=verdict.anchor_required
            )
        assert report is not None
        self.journal.commit(report.version)
        return ReceiveReport(
            version=report.version, base=report.base, previous_version=previous,
            payload_bytes=report.payload_bytes, elements=report.elements,
            wait_s=timings[0], forward_s=timings[1], stage_s=report.stage_s, pause_s=report.pause_s,
            verify_s=report.verify_s, commit_s=commit_s, total_s=time.perf_counter() - t0,
        )  # fmt: skip
