"""ClusterSender: a trainer rank's side of the in-cluster sync of one version.

``sync()`` runs, on one writer rank:

1. detection: the tracker's changed elements and their BF16 values since its baseline
   (``tracker.iter_changes()``), united with every element an uncommitted attempt since the
   baseline sent (see "Retries" below); every element for an anchor;
2. routing: current BF16 values -> canonical -> every receiver shard
   (``layout.routing.shard_updates``, the storage path's own planning);
3. encoding: one blob per receiver shard (the storage path's wire format and header: version,
   base version, shard, writer ``w{index:05d}``), framed in an envelope per destination, with
   the expected digests (``config.digest_every``: each shard's state digest from a single
   writer, or each writer's digest of the part of each shard it owns, see
   :mod:`deltasync.layout.part_digests`);
4. the preflight (:mod:`deltasync.cluster.preflight`): every rank's fingerprint, versions and
   status in one all_gather. If 1-3 raised here, or any rank was built for another model, plan
   or layout, or some receiver cannot take this delta, every rank raises the same error before
   a payload byte moves, and nothing is applied anywhere;
5. the exchange (in ``forward`` mode then the, for a writer empty, second exchange);
6. the joint commit: only when every receiver reports its apply ok does the tracker's
   baseline advance (``clear()``) and ``version`` move on. Otherwise every rank raises, the
   tracker keeps its bits, and calling ``sync`` again retries.

Retries are supersets by construction. A tracker reports what differs from its baseline *now*
(``SnapshotTracker``), or what changed since it (``AdamWTracker``); neither remembers what an
aborted attempt sent, and an element that changed in the attempt and went back to its baseline
bits by the retry would be missed by the first kind, leaving a receiver that applied the attempt
with the attempt's value. So the sender keeps the union of the indices of every attempt that
passed the preflight since the last commit (the *carry*: per parameter its
:class:`~deltasync.trainer.positions.Positions`, about 1 byte per changed element, dropped at
the commit; see :mod:`deltasync.cluster.capture`) and every retry sends the union of that and the tracker's current changes, with current
values. A pending anchor attempt makes the retry an anchor. The union belongs to an attempt
window with a random token; receivers record the token with their apply, and the preflight
refuses a delta whose writers' tokens no longer match (a writer restarted and lost its union):
only an anchor repairs that.

Overlap (``overlap=True, optimizer=opt``): ``sync`` blocks only for step 1, capturing every
parameter's changed positions, joined with the carry, as ``Positions`` (no values: the tracker
is asked for positions only), then clears the tracker and returns a
:class:`~deltasync.cluster.background.PendingSend`; steps 2-6 run on one background thread
while the trainer's next forward/backward runs. The background starts with the capture and
routes and encodes each parameter as it is captured (the tracker must report in ``params``
order); if detection fails midway, that failure is this rank's status in the preflight, as
it would have been before the background started. With a tracker that holds the optimizer's
steps (``hold_steps``: the barrier runs first in its own pre-step hook) the capture itself runs
on a thread of its own and ``sync`` returns at once. Routing (which reads the BF16 values at the
captured positions) and the digests (steps 2-3) are the last reads of the parameters; the
optimizer's pre-step hook waits for them, and the next ``sync`` for the whole version. Until
the version commits its captured positions are the carry: a version that fails is never lost,
its positions go out with the next one with values re-read then, and the failure is raised at
the next call (``sync``, ``wait``, ``close``) as :class:`~deltasync.errors.SendFailedError` naming
the version. After a delta of fewer than ``inline_below`` changed elements (a small model;
RL deltas keep their size from step to step) the next version runs whole on the caller's
thread before ``sync`` returns, as without overlap (the values detection read, the digest pass
beside detection, one exchange, then, sending nothing, any parts other writers still stream,
so writers that decide differently still meet; the tracker cleared at the commit); nothing
of the trainer's competes with it for the cores, and its failure is still raised at the next
call. A delta's blobs go out in parts
while they are routed (``config.part_bytes``, :mod:`deltasync.cluster.streaming`): the
preflight and each part's exchange run on a stream thread of the version's, so the writer
holds a part or two instead of every shard's whole blob; a failure after the preflight is the
next part's status, and every rank raises as from the preflight. The collectives of an
overlapped version run off the caller's thread, one thread at a time (the stream thread's,
then the background's): the exchange's group must be one the
trainer's own collectives (FSDP) do not use. A ``full_state`` callable is called by ``sync`` on
every writer, on the caller's thread, before anything of the version is built (for the
versions that send digests): one that gathers over the trainer's ranks is a collective every
writer must join, though only writer 0 reads its result; a failure of it is this rank's
status in the preflight.

``payloads_for_version`` is steps 1-3 alone, with no collective (benchmarks time it). After an
ExchangeError that is not a PeerFailedError the group is broken: re-create it and pass the new
one to :meth:`use_group` (see ``docs/cluster.md``, "Recovery").

This class knows the order of those steps; it holds no copy of the model.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed as dist

from deltasync.cluster.background import Background, PendingSend, current_cuda_device
from deltasync.cluster.capture import (
    BATCH_ELEMENTS,
    Capture,
    Carry,
    capture_with_values,
    carry_bytes,
    carry_of,
    iter_handed,
    streamed_blobs,
)
from deltasync.cluster.envelope import (
    envelope_header,
    header_size,
    pack_envelope,
    seal_envelope,
)
from deltasync.cluster.joint_commit import encode_commit_row, joint_commit, shards_digest
from deltasync.cluster.preflight import (
    VERDICTS,
    WRITER,
    encode_preflight_row,
    fingerprint,
    preflight,
)
from deltasync.cluster.reports import Outgoing, SendReport
from deltasync.cluster.roles import ClusterConfig, GroupHealth, RolePlan, check_group, resolve_rank
from deltasync.cluster.streaming import PartStream
from deltasync.errors import (
    AnchorRequiredError,
    ConfigError,
    DeltaSyncError,
    ExchangeError,
    SendFailedError,
    SyncAbortedError,
    VersionError,
)
from deltasync.exchange import exchange
from deltasync.exchange.notes import NoteLedger, naming, part_tag
from deltasync.exchange.status_row import describe
from deltasync.exclusive import one_call_at_a_time
from deltasync.format import encode_blobs
from deltasync.interrupts import interrupts_deferred
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.digest import TensorEntries, combine_entries, state_tensor_digests
from deltasync.layout.digest_feed import DigestFeed
from deltasync.layout.part_digests import writer_part_digests
from deltasync.layout.routing import every_element, padding_updates, shard_updates
from deltasync.names import MAX_VERSION, check_version_arg
from deltasync.trainer import Tracker
from deltasync.trainer.handoff import INLINE_BELOW, VALUES_IN_FLIGHT, Handoff, hand_over
from deltasync.trainer.params import ReadWindow, local_of
from deltasync.trainer.positions import Handed, Positions
from deltasync.trainer.protocol import takes_sink
from deltasync.trainer.step_barrier import optimizers_of

Params = Mapping[str, torch.Tensor]

log = logging.getLogger(__name__)


def _new_window() -> int:
    return secrets.randbits(62) | 1  # never 0 ("no window")


_one_at_a_time = one_call_at_a_time(
    "a writer rank", "sync, wait, use_group or close", "Nothing was sent"
)


class ClusterSender:
    """One writer rank of a :class:`RolePlan`.

    tracker: a :class:`~deltasync.trainer.Tracker` (``iter_changes()``, ``clear()``) watching
        ``params``, cleared at ``version``.
    params: this rank's named parameters (full names as ``model.named_parameters()`` gives
        them; under FSDP2 the local dim-0 shards, ``p.to_local()``), or a callable returning
        them.
    version: the version every receiver holds and the tracker's baseline; None when receivers
        hold nothing yet (the first sync must be an anchor).
    full_state: the FULL parameters (or a callable gathering them). Optional: with several
        writers each writer digests the part of each shard it owns; given, writer 0 sends each
        shard's whole state digest instead.
    lineage: the run id of the model's lineage, if the job has one; part of the fingerprint
        every rank must agree on.
    overlap: return from ``sync`` once the changes are captured and send in the background
        (see the module docstring); needs ``optimizer``, whose next step is the barrier (a
        sequence: every optimizer that steps the parameters, e.g. Muon and AdamW).
    detect_in_background: with a tracker that holds the optimizer's steps, capture on a
        thread of its own and return at once (default); False captures before the return
        (lower latency where the forward/backward runs on the same CPU cores).
    inline_below: with overlap, after a delta of fewer changed elements (this writer's) the
        next version runs whole before ``sync`` returns (the returned ``PendingSend`` is done;
        its report says ``inline``): a background competing with the forward/backward only
        delays a small model's version; an anchor in between changes nothing (it says nothing
        of the deltas' size). 0: always in the background. With or without
        overlap, the version after such a delta (sent whole, as without overlap) has its
        digests hashed by a pass beside detection on another core rather than by detection
        (``ClusterConfig.digests_in_detection``): at that size the pass costs less wall time
        than it saves CPU time (small preset: ~2 ms less blocked, ~4 ms more CPU).
    expect_small: with overlap, treat the first delta as following a small one (as if this
        writer's last committed delta had fewer than ``inline_below`` changed elements), for
        a caller that knows the size already, e.g. from a ``TrainerSync`` on the same tracker
        that this sender takes over from. Without it the first delta goes to the background,
        where a small model's version competes with the forward/backward for the cores (the
        small preset's first in-cluster version: about 1.6-2x the next one's latency). Only
        a scheduling hint between two exact paths: a first delta that turns out large is
        sent whole once, before ``sync`` returns, and later versions follow the size of the
        one before, as without it. Ignored with ``inline_below=0`` (always in the
        background).
    """

    def __init__(
        self,
        tracker: Tracker,
        params: Params | Callable[[], Params],
        *,
        plan: RolePlan,
        trainer_layout: TrainerLayout,
        receiver_layout: ReceiverLayout,
        version: int | None,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        config: ClusterConfig | None = None,
        full_state: Params | Callable[[], Params] | None = None,
        lineage: str | None = None,
        overlap: bool = False,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        detect_in_background: bool = True,
        inline_below: int = INLINE_BELOW,
        expect_small: bool = False,
    ) -> None:
        for name, flag in (
            ("overlap", overlap),
            ("detect_in_background", detect_in_background),
            ("expect_small", expect_small),
        ):
            if not isinstance(flag, bool):
                raise ConfigError(f"ClusterSender.{name} must be a bool, got {flag!r}")
        if isinstance(inline_below, bool) or not isinstance(inline_below, int) or inline_below < 0:
            raise ConfigError(
                f"ClusterSender.inline_below must be a non-negative int, got {inline_below!r}"
            )
        optimizers = optimizers_of(optimizer, "ClusterSender")
        if overlap and not optimizers:
            raise ConfigError(
                "ClusterSender.optimizer is required with overlap=True: its next step must wait "
                "until the version sent in the background no longer reads the parameters (pass "
                "the optimizer the tracker watches, and every other optimizer that steps params)"
            )
        self.rank = resolve_rank(rank, group)
        self.role = plan.writer(self.rank)
        self._health = GroupHealth(f"writer {self.role.writer_id}")
        self._who = f"writer {self.role.writer_id} (rank {self.rank})"
        # one call at a time: two threads' collectives on one rank are paired with other
        # rounds of the other ranks, and gloo aborts their processes
        self._busy = threading.RLock()
        self._closed = False  # close() ends the overlap only: sync goes on blocking after it
        plan.check_shards(s.id for s in receiver_layout.shards())
        if trainer_layout.spec != receiver_layout.spec:
            raise ConfigError(
                "ClusterSender: trainer_layout and receiver_layout were built from different "
                f"model configs ({trainer_layout.spec} vs {receiver_layout.spec})"
            )
        self.plan = plan
        self.tracker = tracker
        self.trainer_layout = trainer_layout
        self.receiver_layout = receiver_layout
        self.config = config or ClusterConfig()
        self.lineage = lineage
        self.fingerprint = fingerprint(
            receiver_layout, plan, lineage=lineage, digest_every=self.config.digest_every
        )
        self._params = params
        if not callable(params):
            self._check_params(params)
        self._full_state = full_state
        # a full_state callable's result for the version being sent (see _gather_full)
        self._full_now: Params | None = None
        if version is not None and (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version <= MAX_VERSION
        ):
            raise ConfigError(
                f"ClusterSender version must be None or an int in 0..{MAX_VERSION} (the "
                f"version the receivers hold), got {version!r}"
            )
        self.version = version
        # The union of what uncommitted attempts since the baseline sent (see the docstring).
        self._window = _new_window()
        self._pending: Carry = {}
        self._pending_anchor = False
        # The newest version whose joint commit ended here without a verdict: other ranks may
        # have completed it from the rows already sent and committed it, so its number is
        # never sent again (another state under it would be two states under one number).
        # Also one aborted for lateness (``Verdict.unsettled``): a rank that gave up on it
        # retired the number, so every writer does, and all number the retry alike.
        self._unsettled: int | None = None
        self._notes = NoteLedger()  # this rank's arrival marks in the group's store
        self.last_report: SendReport | None = None  # of the newest version settled by wait()
        self._digest_pool: ThreadPoolExecutor | None = None  # overlap: digests beside routing
        self._feeds: DigestFeed | None = None  # the digest feed's plan (overlapped deltas)
        self._background = (
            Background(
                optimizers,
                thread_name=f"ds-send-{self.role.writer_id}",
                hold=getattr(tracker, "hold_steps", None) if detect_in_background else None,
                settle=self._settle_edits,
            )
            if overlap
            else None
        )
        self._detector: ThreadPoolExecutor | None = None  # detection after sync returns
        self.inline_below = inline_below
        # this writer's last committed delta was below inline_below (or, before the first,
        # the caller said the first will be: expect_small); anchors leave it as it is
        self._expect_small = expect_small and inline_below > 0
        self.group = group  # a group in use: the first preflight takes this rank's record

    @_one_at_a_time
    def use_group(self, group: dist.ProcessGroup | None) -> None:
        """Sync over ``group`` from now on (e.g. a new group after a round-2 failure). With
        overlap, only when nothing is in flight (after :meth:`wait` raised); a version in
        flight is a ConfigError, and the group is not changed."""
        background = self._background
        if background is not None and background.in_flight is not None:
            raise ConfigError(
                f"writer {self.role.writer_id}: version {background.in_flight.version} is in "
                "flight on the current group; call wait() (it raises if the version failed), "
                "then use_group()"
            )
        self.group = group
        self._health.reset()
        self._notes.new_group(group, self.rank)

    @property
    def overlap(self) -> bool:
        return self._background is not None

    @property
    def pending_elements(self) -> int:
        """Elements the next retry resends beyond the tracker's own changes (at most)."""
        return sum(len(p) for p in self._pending.values())

    @property
    def carry_bytes(self) -> int:
        """Bytes held for those elements' positions (about 1 per element at RL densities)."""
        return carry_bytes(self._pending)

    # ------------------------------------------------------------------ steps 1-3

    def payloads_for_version(self, version: int, *, anchor: bool = False) -> Outgoing:
        """Detect, route and encode ``version`` (on the committed version, or as an anchor)
        into ``{receiver rank: envelope}``. No collective; the tracker is not cleared and the
        union of uncommitted attempts is not extended (``sync`` does that). A delta's digest
        pass (it reads only the params) runs beside detection and routing."""
        base = self._base(version, anchor)
        params = self._current_params()
        if anchor:
            return self._build(version, base, Capture(), params)
        # The detection pass hashes the receivers' tensors where it can (the digest pass then
        # starts after it and reads only the rest); else, and after a small delta, the pass
        # runs beside detection (see inline_below).
        feed = None if self._expect_small else self._digest_feed(version, params, "iter_changes")
        job = None
        if (
            feed is None
            and self.config.sends_digest(version, anchor=False)
            and not callable(self._full_state)
        ):
            # (a full_state callable may gather over the group: only this thread may)
            job = self._digest_job(self._digests, params)
        try:
            caps = capture_with_values(self.tracker, self._pending, sink=feed)
        except BaseException:
            if job is not None:  # it reads the params: done before the caller goes on
                job.exception()
            raise
        if feed is not None:
            job = self._digest_job(self._digests, params, feed.entries())
        return self._build(version, base, caps, params, digests=job)

    def _current_params(self) -> Params:
        if not callable(self._params):
            return self._params
        params = self._params()
        self._check_params(params)
        return params

    def _check_params(self, params: Params) -> None:
        """ConfigError before anything is sent: a tied tensor named twice, a parameter of the
        model missing (an anchor without it cannot restore a shard, a delta would never send
        its changes), or a parameter that is not this writer's dim-0 shard of the model's (a
        matrix stored transposed has the same size, and its digests would be computed from the
        same misread rows)."""
        self.trainer_layout.check_tied_once(params)
        missing = self.trainer_layout.missing(params)
        if missing:
            raise ConfigError(
                f"{self._who}: params have no {missing[:5]} ({len(missing)} of the model's "
                "parameters missing); every writer passes every parameter (under FSDP this "
                "rank's dim-0 shard of each, as model.named_parameters() lists them; a model "
                "whose embeddings are tied needs a layout built from its own config). Nothing "
                "was sent"
            )
        wrong = self.trainer_layout.misshapen(
            ((n, tuple(local_of(t).shape)) for n, t in params.items()),
            self.role.index,
            self.role.count,
        )
        if wrong is not None:
            name, shape, want = wrong
            raise ConfigError(
                f"{self._who}: parameter {name!r} is {shape} here, but writer "
                f"{self.role.index}'s dim-0 shard among the plan's {self.role.count} writer(s) is "
                f"{want}; pass each parameter as the model's class holds it (not transposed; "
                "under FSDP this rank's dim-0 shard). Nothing was sent"
            )

    def _build(
        self,
        version: int,
        base: int,
        caps: Capture,
        params: Params,
        stream: Handoff[Handed] | None = None,
        parts: PartStream | None = None,
        digests: Future | None = None,
        feed: DigestFeed | None = None,
    ) -> Outgoing:
        """Steps 2-3: route (reading the values of captured positions), digest and encode
        captured changes (the last reads of ``params``); with ``stream``, the captured
        positions as the caller's detection hands them over (``caps`` then only marks a
        delta), and the digest pass runs beside the routing from the end of the capture.
        ``digests``: that pass, started by the caller already. ``feed``: the receivers'
        tensors the capture's detection hashed, taken as given by that pass.
        With ``parts`` (a delta), the blobs go out in parts as they are written and the last
        part is sealed there, not returned (``payloads`` is empty)."""
        job = digests
        want = self.config.sends_digest(version, anchor=caps.anchor)
        if want and job is None and stream is not None and not callable(self._full_state):
            # (a full_state callable may gather over the group: only this thread may)
            job = self._digest_job(self._digests_after, stream, params, feed)
        try:
            return self._build_payloads(version, base, caps, params, stream, want, job, parts)
        except BaseException:
            if job is not None:  # it reads the params: done before the optimizer may step
                job.exception()
            raise

    def _digest_feed(
        self, version: int, params: Params, method: str = "iter_capture"
    ) -> DigestFeed | None:
        """A fresh feed for this delta's detection pass, when it sends whole-state digests
        computed from ``params`` alone (one writer, no ``full_state``) and the tracker can feed
        it (its ``method``, the detection the caller runs, takes a ``sink``)."""
        if (
            not self.config.digests_in_detection
            or not self.config.sends_digest(version, anchor=False)
            or self.role.count != 1
            or self._full_state is not None
            or not takes_sink(self.tracker, method)
        ):
            return None
        if self._feeds is None:
            self._feeds = DigestFeed(
                self.trainer_layout, self.receiver_layout, params=frozenset(params)
            )
        return self._feeds.fresh()

    def _digest_job(self, fn: Callable, *args: object) -> Future:
        """``fn(*args)`` on the digest thread (started on first use)."""
        if self._digest_pool is None:
            self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ds-cluster-digest")
        return self._digest_pool.submit(fn, *args)

    def _digests_after(
        self, handoff: Handoff[Handed], params: Params, feed: DigestFeed | None
    ) -> tuple[dict[str, str], bool]:
        handoff.names()  # the capture has ended (or failed: then this raises)
        return self._digests(params, None if feed is None else feed.entries())

    def _build_payloads(
        self,
        version: int,
        base: int,
        caps: Capture,
        params: Params,
        stream: Handoff[Handed] | None,
        want: bool,
        job: Future | None,
        parts: PartStream | None = None,
    ) -> Outgoing:
        t = time.perf_counter()
        where = {"rank": self.role.index, "world_size": self.role.count}
        layouts = {"trainer_layout": self.trainer_layout, "receiver_layout": self.receiver_layout}
        head = {"version": version, "base_version": base, "writer": self.role.writer_id}
        shards = self.plan.shards()
        if caps.positions is not None:
            # Batch by batch: only the blobs and the positions are O(changed) at once.
            # Each blob written after room for its envelope's framing, sealed in place below.
            handed: dict[str, torch.Tensor] = {}
            blobs, shard_elements = streamed_blobs(
                caps.positions if stream is None else _unpacked(stream, handed),
                params,
                shards=shards,
                **layouts,
                **head,
                **where,
                level=self.config.level,
                reserve=0 if parts is not None else header_size(1),
                on_batch=None if parts is None else parts.offer,
                # a batch holds at most part_bytes changed elements (each takes about a
                # compressed byte or more), so a part is at most one batch behind the routing
                batch_elements=BATCH_ELEMENTS
                if parts is None
                else max(1, min(BATCH_ELEMENTS, parts.part_bytes)),
                values=handed,
            )
            build_s, encode_s = time.perf_counter() - t, 0.0
        else:
            changed = every_element(params) if caps.changed is None else caps.changed
            updates = shard_updates(changed, params, **layouts, **where, values=caps.values)
            del changed
            if caps.changed is None:  # an anchor: the tensors nothing routes to are zeros
                for shard, ups in padding_updates(self.receiver_layout, shards).items():
                    updates.setdefault(shard, []).extend(ups)
            build_s = time.perf_counter() - t
            t = time.perf_counter()
            shard_elements = {s: sum(u.nnz for u in updates[s]) for s in shards}
            blobs = dict(
                encode_blobs(
                    {shard: updates[shard] for shard in shards},
                    **head,
                    level=self.config.level,
                    threads=self.config.encode_threads,
                )
            )
            del updates
            encode_s = time.perf_counter() - t

        t = time.perf_counter()  # the wait for the digests where they ran beside the routing
        digests, part = {}, False
        if job is not None:
            digests, part = job.result()
        elif want:
            digests, part = self._digests(params)
        digest_s = time.perf_counter() - t

        t = time.perf_counter()
        if parts is not None:  # framing last, after the rest of each blob

            def framing(shard: str, length: int) -> bytes:
                return envelope_header([length], state_digest=digests.get(shard), part_digest=part)

            shard_bytes = parts.seal(blobs, framing)
            envelopes: dict = {}  # the last part went to the stream
        elif caps.positions is not None:
            shard_bytes = {shard: len(blob) - header_size(1) for shard, blob in blobs.items()}
            envelopes = {
                shard: seal_envelope(blob, state_digest=digests.get(shard), part_digest=part)
                for shard, blob in blobs.items()
            }
        else:
            shard_bytes = {shard: len(blob) for shard, blob in blobs.items()}
            envelopes = {
                shard: pack_envelope([blob], state_digest=digests.get(shard), part_digest=part)
                for shard, blob in blobs.items()
            }
        del blobs
        # DP replicas of a shard share one envelope object: no copy per replica.
        payloads = (
            {dst: envelopes[shard] for dst, shard in self.plan.first_hop().items()}
            if parts is None
            else {}
        )
        encode_s += time.perf_counter() - t
        return Outgoing(
            version=version,
            base=base,
            payloads=payloads,
            shard_bytes=shard_bytes,
            shard_elements=shard_elements,
            detect_s=caps.detect_s,
            build_s=build_s,
            encode_s=encode_s,
            digest_s=digest_s,
            sent_indices=caps.sent,
            shard_digests={} if part else dict(digests),
        )

    def mark_sent(self, out: Outgoing) -> None:
        """Record that ``out``'s payloads may reach receivers: until the next commit every
        delta also resends what it sent (``sync`` calls this after the preflight; call it when
        driving ``payloads_for_version`` by hand)."""
        if out.sent_indices is None:
            self._pending_anchor = True
        else:
            # Kept until the commit, compactly (about 1 byte per element, not routing's 8).
            self._pending = carry_of(out.sent_indices)

    def _base(self, version: int, anchor: bool) -> int:
        check_version_arg(
            "ClusterSender.sync", version, hint="sync() without a version picks the next"
        )
        if self._unsettled is not None and version <= self._unsettled:
            raise VersionError(
                f"version {version} cannot be sent: the joint commit of version "
                f"{self._unsettled} did not settle on this writer (a rank died or timed out in "
                "it), and the ranks that completed it may have committed it; send "
                f"version {self._unsettled + 1} or later (sync() without a version picks it)"
            )
        if anchor:
            return -1
        if self.version is None:
            raise AnchorRequiredError(
                "the receivers hold no committed version yet: the first sync must be an anchor "
                "(sync(anchor=True))"
            )
        if version <= self.version:
            raise VersionError(
                f"version {version} is not after the committed version {self.version}"
            )
        return self.version

    def _digests(
        self, params: Params, fed: TensorEntries | None = None
    ) -> tuple[dict[str, str], bool]:
        """``({shard: digest}, whether they are this writer's part digests)``; ``fed``: the
        entries of tensors already hashed from ``params`` (a :class:`DigestFeed`'s: only one
        writer without ``full_state`` builds one, see :meth:`_digest_feed`)."""
        if self.role.count == 1 or self._full_state is not None:
            if self.role.index != 0:
                return {}, False  # writer 0 sends the whole-state digests
            if self.role.count == 1:
                full = params
            else:
                full = self._full_state if self._full_now is None else self._full_now
            full = full() if callable(full) else full
            entries = state_tensor_digests(
                full,
                trainer_layout=self.trainer_layout,
                receiver_layout=self.receiver_layout,
                keep=fed,
            )
            return combine_entries(entries), False
        return writer_part_digests(
            params,
            trainer_layout=self.trainer_layout,
            receiver_layout=self.receiver_layout,
            index=self.role.index,
            count=self.role.count,
        ), True

    def _gather_full(
        self, version: int, anchor: bool, failure: Exception | None
    ) -> Exception | None:
        """Call a ``full_state`` callable on every writer, on the caller's thread, when this
        version sends digests that need it: it may gather over the trainer's ranks (a
        collective), so writer 0 alone, or the background thread, must not run it. A writer
        whose own checks refused the version (``failure``) joins it all the same, or the other
        writers would wait in the gather instead of hearing of the refusal in the preflight;
        it keeps nothing. Returns the version's failure: ``failure``, else the call's error."""
        self._full_now = None
        if not (
            callable(self._full_state)
            and self.role.count > 1
            and self.config.sends_digest(version, anchor=anchor)
        ):
            return failure
        try:
            full = self._full_state()
        except Exception as exc:
            return failure or exc
        if failure is None:
            self._full_now = full
        return failure

    # ------------------------------------------------------------------ the whole version

    @_one_at_a_time
    def sync(self, version: int | None = None, *, anchor: bool = False) -> SendReport | PendingSend:
        """Send ``version`` to every receiver and commit it jointly.

        Every rank of the group calls its ``sync`` for the same version; see the module
        docstring and ``docs/cluster.md`` for what each failure leaves behind. With
        ``overlap=True`` it first waits for the version in flight (raising its error, see
        below), captures this version's changes and returns while the rest runs in the
        background; the optimizer's next step waits until the background no longer reads the
        parameters.

        Args:
            version: the version to send (default: the committed version + 1, or 0).
            anchor: send every element (restores receivers that hold no verified version).
                An uncommitted anchor attempt makes every retry an anchor too.

        Returns:
            A :class:`SendReport` with the version, base, bytes per receiver and timings; with
            overlap, the :class:`PendingSend` whose ``result()`` gives it.

        Raises:
            PeerFailedError: some rank failed before sending (this one included); nothing moved.
            FingerprintMismatchError: the ranks were built for different models or plans.
            SyncAbortedError: a receiver failed or cannot take this delta; nothing committed.
            ExchangeError: a rank died or hung; the group must be re-created.
            SendFailedError: (overlap) the version in flight failed with one of the above;
                nothing of this version was captured, its changes are kept: call again.
        """
        if self._background is not None:
            return self._sync_overlapped(version, anchor)
        self._health.check()
        version, anchor = self._next(version, anchor)
        t0 = time.perf_counter()
        _require_initialized()
        out, failure = None, None
        try:
            check_group(self.group, self.plan, self.rank)
        except Exception as exc:
            failure = exc
        failure = self._gather_full(version, anchor, failure)
        if failure is None:
            try:
                out = self.payloads_for_version(version, anchor=anchor)
            except Exception as exc:
                failure = exc
        try:
            with naming(f"version {version}"):
                report = self._send(version, anchor, out, failure, t0=t0, captured_s=None)
        except Exception as exc:
            self._health.note(exc, f"version {version}")
            raise
        finally:
            self._full_now = None  # a model-sized gather: not kept past the version
        self._learn_size(report)
        return report

    def _learn_size(self, report: SendReport) -> None:
        """What the next version expects of its delta's size, from ``report``'s committed
        delta: RL deltas keep their size from step to step. An anchor (every element) says
        nothing of it, so the expectation from before it stands."""
        if not report.anchor:
            self._expect_small = report.elements < self.inline_below

    def _next(self, version: int | None, anchor: bool) -> tuple[int, bool]:
        if version is None:
            newest = max(v for v in (self.version, self._unsettled, -1) if v is not None)
            version = newest + 1
        if self._pending_anchor and not anchor:
            log.warning(
                "writer %s: an anchor attempt since version %s was not committed; version %d "
                "is sent as an anchor too, so receivers that applied it converge",
                self.role.writer_id,
                self.version,
                version,
            )
            anchor = True
        return version, anchor

    def _retire(self, version: int) -> None:
        """Never send ``version``'s number again: its joint commit did not settle here."""
        self._unsettled = max(version, -1 if self._unsettled is None else self._unsettled)

    def _send(
        self,
        version: int,
        anchor: bool,
        out: Outgoing | None,
        failure: Exception | None,
        *,
        t0: float,
        captured_s: float | None,
    ) -> SendReport:
        """Steps 4-6: the preflight (where ``failure`` is this rank's status), the exchange and
        the joint commit. ``captured_s`` is None when the caller waits for all of it (the
        tracker is cleared here on commit), else the capture time of an overlapped version (the
        tracker was cleared at the capture and the carry recorded)."""
        with self._health.collectives(f"version {version}"):
            tag = self._preflight(version, None if out is None else out.base, failure)
            assert out is not None  # a failure raised PeerFailedError in the preflight
            if captured_s is None:
                self.mark_sent(out)
            t = time.perf_counter()
            got = exchange(
                out.payloads, group=self.group, config=self.config.exchange, tag=part_tag(tag, 0)
            )
            sent, exchanges = got.stats.bytes_sent, 1
            while got.more:  # other writers still stream their parts: take part, send nothing
                got = exchange(
                    {}, group=self.group, config=self.config.exchange, tag=part_tag(tag, exchanges)
                )
                sent, exchanges = sent + got.stats.bytes_sent, exchanges + 1
            self._forward(tag, exchanges)
            return self._commit(
                version,
                anchor,
                out,
                sent,
                time.perf_counter() - t,
                tag,
                t0=t0,
                captured_s=captured_s,
                exchanges=exchanges,
            )

    def _preflight(self, version: int, base: int | None, failure: BaseException | None) -> str:
        """Step 4; returns the version's exchange tag. Raises what every rank agreed on."""
        row = encode_preflight_row(
            role=WRITER,
            fingerprint=self.fingerprint,
            who=f"writer {self.role.writer_id}",
            version=version,
            base=base,
            window=self._window,
            failure=None if failure is None else describe(failure),
            attempt=_new_window(),
        )
        try:
            cleared = preflight(
                row,
                plan=self.plan,
                group=self.group,
                timeout_s=self.config.exchange.timeout_s,
                what="waiting for every rank to arrive",
                tag=self._notes.preflight_tag(self.group, self.rank),
            )
        except BaseException as exc:
            if not isinstance(exc, VERDICTS):  # a verdict every rank holds keeps the tags
                self._notes.new_group(self.group, self.rank)
            if failure is not None and isinstance(exc, DeltaSyncError):
                raise exc from failure
            raise
        self._notes.begin(cleared.tag, self.group, self.rank)
        return cleared.tag

    def _forward(self, tag: str, exchanges: int) -> None:
        if self.plan.exchanges == 2:  # the replicas forward; a writer sends nothing
            # ranks that failed alive in the version's first exchanges are passed over there
            exchange(
                {},
                group=self.group,
                config=self.config.exchange,
                tag=f"{tag}-x2",
                earlier=[part_tag(tag, k) for k in range(exchanges)],
            )

    def _commit(
        self,
        version: int,
        anchor: bool,
        out: Outgoing,
        sent: int,
        transfer_s: float,
        tag: str,
        *,
        t0: float,
        captured_s: float | None,
        exchanges: int = 1,
    ) -> SendReport:
        """Step 6: the joint commit, then the baseline moves."""
        t = time.perf_counter()
        # The shard digests this writer sent, combined: the commit checks them against what
        # the receivers hashed, over another channel than the payloads that carried them.
        combined = shards_digest(out.shard_digests) if out.shard_digests else None
        try:
            verdict = joint_commit(
                encode_commit_row(version=out.version, base=out.base, state_digest=combined),
                plan=self.plan,
                group=self.group,
                timeout_s=self.config.commit_timeout_s,
                tag=f"{tag}-commit",
                earlier=[part_tag(tag, k) for k in range(exchanges)]
                + ([f"{tag}-x2"] if self.plan.exchanges == 2 else []),
                ledger=self._notes,
            )
        except BaseException:  # an ExchangeError, or an interrupt while it waits
            # No verdict here; a late rank may still complete the all_gather from the rows
            # already sent and commit (a stalled receiver does).
            self._retire(version)
            raise
        commit_s = time.perf_counter() - t
        if not verdict.ok:
            message = verdict.message
            if verdict.unsettled:
                # A rank stopped waiting before this one arrived: if it is a writer, it retired
                # the number above. Every writer holding this verdict retires it as well, so
                # the writers' next sync() numbers the retry alike.
                self._retire(version)
                message += f"; version {version} is not sent again (sync() picks {version + 1})"
            raise SyncAbortedError(
                message, failures=verdict.failures, anchor_required=verdict.anchor_required
            )
        # Every receiver holds the version: only now may the baseline move (an overlapped
        # version's tracker moved at its capture; its carry is dropped here).
        if captured_s is None:
            self.tracker.clear()
        self.version = version
        self._pending, self._pending_anchor, self._window = {}, False, _new_window()
        return SendReport(
            version=version,
            base=out.base,
            anchor=anchor,
            bytes_sent=sent,
            shard_bytes=out.shard_bytes,
            shard_elements=out.shard_elements,
            elements=sum(out.shard_elements.values()),
            detect_s=out.detect_s,
            build_s=out.build_s,
            encode_s=out.encode_s,
            digest_s=out.digest_s,
            transfer_s=transfer_s,
            commit_s=commit_s,
            total_s=time.perf_counter() - t0,
            overlapped=captured_s is not None,
            captured_s=captured_s or 0.0,
            exchanges=exchanges,
        )

    def _send_in_parts(
        self,
        version: int,
        base: int,
        handoff: Handoff[Handed],
        pending: PendingSend,
        *,
        t0: float,
        feed: DigestFeed | None = None,
    ) -> SendReport:
        """An overlapped delta streamed (``config.part_bytes``): steps 2-5 at once, the
        preflight and each part's exchange on the stream's thread as the blobs grow, then the
        joint commit (``cluster.streaming``)."""
        parts = PartStream(
            shards=self.plan.shards(),
            first_hop=self.plan.first_hop(),
            start=lambda failure: self._preflight(version, base, failure),
            group=self.group,
            config=self.config.exchange,
            part_bytes=self.config.part_bytes,
            name=f"ds-parts-{self.role.writer_id}",
        )
        try:
            read = self._current_params()
            out = self._build(version, base, Capture(positions={}), read, handoff, parts, feed=feed)
            self._refuse_if_edited(pending, read)
        except Exception as exc:  # the capture's own error where it failed
            pending.release()
            parts.fail(exc if handoff.error is None else handoff.error)  # raises
            raise
        pending.release()  # the parameters are read no more: the optimizer may step
        t = time.perf_counter()
        parts.finish()
        assert parts.tag is not None  # finish raised if the preflight did not pass
        self._forward(parts.tag, parts.exchanges)
        return self._commit(
            version,
            anchor=False,
            out=out,
            sent=parts.bytes_sent,
            transfer_s=time.perf_counter() - t,
            tag=parts.tag,
            t0=t0,
            captured_s=pending.captured_s,
            exchanges=parts.exchanges,
        )

    # ------------------------------------------------------------------ overlap

    def _sync_overlapped(self, version: int | None, anchor: bool) -> PendingSend:
        background = self._background
        assert background is not None
        self.wait()  # one version at a time; raises the failed version's error
        self._health.check()
        version, anchor = self._next(version, anchor)
        _require_initialized()
        t0 = time.perf_counter()
        base, failure = -1, None
        try:
            check_group(self.group, self.plan, self.rank)
            base = self._base(version, anchor)
        except Exception as exc:
            failure = exc
        failure = self._gather_full(version, anchor, failure)  # read by this version's build
        pending = PendingSend(version, 0.0)
        if failure is None and not anchor and self._expect_small:
            # RL deltas keep their size from step to step: after a small one, this version
            # runs here, whole (a thread competing with the forward/backward only delays it)
            background.run_here(pending, lambda p: self._send_inline(version, p, t0=t0))
            return pending
        params = self._current_params()
        pending.reads = ReadWindow(  # the version reads params from here on
            params,
            version,
            window="after sync returned, before the next optimizer step or wait()",
            tracker=self.tracker,
        )
        # A delta's positions go to the background as each parameter is captured: routing and
        # encoding overlap the rest of detection (joined with the carry; the values detection
        # read go along while the handoff has room for them, the background reads the rest).
        handoff: Handoff[Handed] | None = None
        feed = None
        if failure is None and not anchor:
            handoff = Handoff(VALUES_IN_FLIGHT)
            feed = self._digest_feed(version, params)

        def work(p: PendingSend) -> SendReport:
            try:
                return send(p)
            finally:
                self._full_now = None  # a model-sized gather: not kept past the version

        def send(p: PendingSend) -> SendReport:
            if failure is None and handoff is not None and self.config.part_bytes:
                return self._send_in_parts(version, base, handoff, p, t0=t0, feed=feed)
            out, err = None, failure
            if err is None:
                caps = Capture() if handoff is None else Capture(positions={})
                try:
                    read = self._current_params()
                    out = self._build(version, base, caps, read, handoff, feed=feed)
                    self._refuse_if_edited(p, read)
                except Exception as exc:  # the capture's own error where it failed
                    err = exc if handoff is None or handoff.error is None else handoff.error
            p.release()  # the parameters are read no more: the optimizer may step
            return self._send(version, anchor, out, err, t0=t0, captured_s=p.captured_s)

        if handoff is None:
            if failure is None:  # an anchor: every element, nothing to capture
                # the anchor pending first: an interrupt before the clear() ends costs a
                # repeated anchor, never the step's changes
                self._pending_anchor = True
                self.tracker.clear()
            pending.end_detection()
            pending.captured_s = time.perf_counter() - t0
            background.submit(pending, work)
            return pending
        detecting_elsewhere = False
        try:
            background.submit(pending, work)
            if background.held:
                # The tracker holds the optimizer's steps behind the barrier: detection goes on
                # on a thread of its own and sync returns now.
                if self._detector is None:
                    self._detector = ThreadPoolExecutor(1, thread_name_prefix="ds-detect")
                device = current_cuda_device()
                with interrupts_deferred():  # a capture started is one that settles itself
                    self._detector.submit(self._capture, handoff, params, pending, device, feed)
                    detecting_elsewhere = True
                return pending
            self._capture(handoff, params, pending, feed=feed)
        except BaseException as exc:
            # An interrupt before the capture settled the handoff: the background stops at it
            # (every rank then raises) instead of waiting for parameters that never come. A
            # capture running on the detection thread settles it itself.
            if not detecting_elsewhere:
                handoff.fail(exc)
                pending.end_detection()
            raise
        finally:
            pending.captured_s = time.perf_counter() - t0
        return pending

    def _refuse_if_edited(self, pending: PendingSend, params: Params) -> None:
        """This rank's last read of ``pending`` has ended: a write since its reads began
        refuses it (every rank then raises, nothing is committed)."""
        if pending.reads is not None:
            pending.reads.refuse_if_written(params)

    def _settle_edits(self, pending: PendingSend) -> None:
        """Once ``pending`` reads nothing more and its detection has ended, before the next
        optimizer step (:class:`~deltasync.trainer.params.ReadWindow`); once per version."""
        reads, pending.reads = pending.reads, None
        if reads is not None:
            reads.settle(self._current_params(), self.tracker)

    def _send_inline(self, version: int, pending: PendingSend, *, t0: float) -> SendReport:
        """A version after a small delta, whole on the caller's thread, as without overlap
        (``payloads_for_version``: the values detection read, nothing decoded or read twice;
        then one exchange, taking part, sending nothing, in the parts other writers still
        stream, and the joint commit): the tracker is cleared at the commit and what passed
        the preflight is the carry until then."""
        out, failure = None, None
        try:
            out = self.payloads_for_version(version)
        except Exception as exc:
            failure = exc
        finally:
            self._full_now = None  # read by the build only: not kept past it
            pending.end_detection()
            pending.release()  # the parameters are read no more
        pending.captured_s = time.perf_counter() - t0 if out is None else out.detect_s
        report = self._send(version, False, out, failure, t0=t0, captured_s=None)
        return replace(report, overlapped=True, inline=True, captured_s=pending.captured_s)

    def _capture(
        self,
        handoff: Handoff[Handed],
        params: Params,
        pending: PendingSend,
        device: int | None = None,
        feed: DigestFeed | None = None,
    ) -> None:
        """Step 1 of an overlapped delta: each parameter's changed positions, joined with the
        carry, handed to the background as they are detected; then the tracker is cleared
        and the capture is the carry. A failure is this rank's status in the preflight (or
        the next part's): every rank raises it, nothing is applied, the tracker and the carry
        are kept. On the caller's thread, an interrupt is raised there too."""
        if device is not None:
            torch.cuda.set_device(device)
        captured: Carry = {}
        try:
            handed = iter_handed(
                self.tracker, self._pending, params, values_max=VALUES_IN_FLIGHT, sink=feed
            )
            for name, pos, vals in handed:
                captured[name] = pos
                hand_over(handoff, name, pos, vals)
            # The tracker's baseline moves now (only the capture touches the tracker); until
            # the version commits, what it reported is the carry, sent again by every retry.
            # The carry first: an interrupt from here on costs extra elements, never lost ones.
            self._pending = captured  # the one copy: routed, and carried
            self.tracker.clear()
            pending.end_detection()
            handoff.close()
        except BaseException as exc:
            handoff.fail(exc)  # nothing once closed: the version then goes on to its commit
            pending.end_detection()
            if not isinstance(exc, Exception):  # an interrupt: the caller sees it now too
                raise

    @property
    def in_flight(self) -> PendingSend | None:
        """The version captured and not yet settled by :meth:`wait` (overlap mode)."""
        return None if self._background is None else self._background.in_flight

    @property
    def barrier_wait_s(self) -> float:
        """How long the optimizer's last step waited for the background (overlap mode)."""
        return 0.0 if self._background is None else self._background.barrier_wait_s

    @_one_at_a_time
    def wait(self) -> SendReport | None:
        """Wait for the version in flight (overlap mode) and settle it.

        Returns:
            Its report, or None when nothing was in flight.

        Raises:
            SendFailedError: it did not commit; its changed positions are kept and go out with
                the next version (``anchor_required`` / ``group_broken`` say what the retry
                needs first).
        """
        # In flight until settled: an interrupt while this waits leaves it for the next call
        # (and the optimizer's barrier) to wait for again.
        background = self._background
        pending = None if background is None else background.in_flight
        if pending is None:
            return None
        try:
            report = pending.result()
        except Exception as exc:
            # detection may outlive a send that failed early: the carry is its capture
            pending.wait_detected()
            self._settle_edits(pending)
            background.settled(pending)
            self._health.note(exc, f"version {pending.version}")
            broken = self._health.broken is not None  # an interrupt inside too (collectives)
            needs_anchor = self._pending_anchor or bool(getattr(exc, "anchor_required", False))
            log.warning(
                "writer %s: version %d did not commit (%s: %s); its changes (%d element(s)) go "
                "out with the next version",
                self.role.writer_id,
                pending.version,
                type(exc).__name__,
                exc,
                self.pending_elements,
            )
            remedy = "call sync again on every rank"
            if broken:
                remedy = "re-create the group (use_group) and " + remedy
            if needs_anchor:
                remedy += " with anchor=True"
            raise SendFailedError(
                f"writer {self.role.writer_id}: version {pending.version} did not commit; its "
                f"changes are kept and go out with the next version: {remedy} "
                f"({type(exc).__name__}: {exc})",
                version=pending.version,
                anchor_required=needs_anchor,
                group_broken=broken,
            ) from exc
        pending.wait_detected()  # a send that read none of it (an anchor) may end first
        self._settle_edits(pending)
        background.settled(pending)
        self.last_report = report
        self._learn_size(report)
        return report

    @_one_at_a_time
    def close(self) -> None:
        """Wait for the version in flight, remove the optimizer hook, stop the threads (the
        background's in overlap mode; the digest pass's in either). Later ``sync`` calls
        block, as without overlap.

        Raises:
            SendFailedError: the version in flight did not commit.
        """
        try:
            if self._background is not None:
                self.wait()
        finally:
            if self._background is not None:
                self._background.close()
                self._background = None
            if self._detector is not None:
                self._detector.shutdown(wait=True)
                self._detector = None
            if self._digest_pool is not None:
                self._digest_pool.shutdown(wait=True)
                self._digest_pool = None


def _unpacked(
    stream: Iterable[tuple[str, Handed]], values: dict[str, torch.Tensor]
) -> Iterator[tuple[str, Positions]]:
    """``(name, positions)`` of a handoff's items, each one's handed values put in ``values``
    first (where :func:`~deltasync.cluster.capture.streamed_blobs` takes them)."""
    for name, (pos, vals) in stream:
        if vals is not None:
            values[name] = vals
        yield name, pos


def _require_initialized() -> None:
    if not dist.is_initialized():
        raise ExchangeError("torch.distributed is not initialized; call init_from_env() first")
