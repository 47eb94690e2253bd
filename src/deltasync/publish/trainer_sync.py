"""TrainerSync: detection -> publish -> clear, in the order that keeps every delta exact.

The tracker's baseline may advance only after the version is committed on every publisher
(several publishers serve several receiver layouts, e.g. a vLLM TP=2 fleet and an HF
evaluator, each on its own store prefix). Values are absolute overwrites, so elements sent
twice are harmless: a retry may always resend more than needed, never less.

Two modes:

- ``overlap=False`` (default): ``step_published`` runs the whole publish (detection, routing,
  encoding, upload, digests, commit) and clears the tracker only after the commit; on a
  failure the tracker keeps its bits.
- ``overlap=True``: ``step_published`` blocks only while the tracker's detection captures
  every parameter's changed positions (held as 8-bit gaps, :mod:`.positions`: about 1 byte
  per changed element), clears the tracker and returns a :class:`PendingVersion`; value
  reads, routing, encoding, upload, digest assembly and the commit run on a background thread
  while the caller's next forward/backward runs. The background starts as soon as the delta
  holds ``inline_below`` changed elements and takes each further parameter as it is captured,
  so routing and encoding also overlap the rest of detection (0.6B on one detection thread:
  capture to commit 1.83-2.16 s -> 1.44-1.52 s, the capture ~0.1 s longer for the GIL). If
  detection fails meanwhile, that publish stops before its commit and the error propagates
  as without overlap. With a tracker that holds the optimizer's steps for the sync
  (``AdamWTracker.hold_steps``: its own pre-step hook waits for the sync before it touches
  its state), the rest of a large delta's detection goes on on a thread of its own and
  ``step_published`` returns once the background has started: the caller is blocked for
  the first ``inline_below`` changed elements' worth of detection, and after a large delta
  for none of the next one's.
  Detection reads only θ, m and v, which nothing changes until the next optimizer step, and
  that step waits for it; a failure there stops the publish before its commit, leaves the
  tracker and the carry as they were, and is raised at the next call, naming the version.
  ``PendingVersion.detected()`` says when the pass has ended. The values at the captured
  positions come with them where the detection kernel wrote them (a large parameter's, while
  they fit the handoff's budget of :data:`~deltasync.trainer.handoff.VALUES_IN_FLIGHT`
  values the background has not taken yet); the background reads the others from
  ``params``. The shard digests are hashed by the detection pass itself where it can
  (``digests_in_detection``: the kernel casts every element of each chunk it tests, and a
  :class:`~deltasync.layout.digest_feed.DigestFeed` hashes the receivers' tensors from the
  casts in order); the background's digest pass reads ``params`` for the rest. Nothing
  changes ``params`` until the next optimizer step, so that step is the barrier: a pre-step
  hook on ``optimizer`` waits
  for the version in flight (as does the next ``step_published``). Until a version commits,
  its changed positions stay here (the *carry*); a version that fails is never lost: its
  positions join the next version's, values read from ``params`` then, and the error is
  raised at the next call (``step_published``, ``wait``, ``close``) as
  :class:`PublishFailedError` naming it.
  A delta with fewer than ``inline_below`` changed elements (2^18 by default: a small model)
  is published on the caller's thread instead, before ``step_published`` returns, with the
  same contract (errors at the next call, the carry until settled): on a two-core trainer a
  background thread competing with the forward/backward made such a version's latency about
  twice the inline publish (the small preset: 0.53 s, inline 0.26 s). Such a delta goes out
  with the values its detection read (``AdamWTracker.iter_capture``: a budget of
  ``inline_below`` elements), so nothing is decoded or read twice.
  Between ``step_published`` and the next optimizer step (or ``wait()``) nothing else may write
  the params (``load_state_dict``, a clamp): the version still reads them. Such a write is
  seen by the params' version counters: taken when the version's reads begin, compared by
  each publisher once they have ended (a write by then refuses the version before anything
  is stored: :class:`~deltasync.errors.ParamsEditedError`, the ``__cause__`` of the next
  call's ``PublishFailedError``) and again when the version is settled, before the next
  optimizer step, where every param written meanwhile is marked changed in the tracker
  (``mark_changed``) so the next version sends it in full; a tracker cleared after the write
  could not see it by itself. A write still running while a publisher compares cannot be
  seen there: that version may commit bits the receivers' verify refuses, and the next one
  repairs it. The barrier also waits for detection to end, not only for the background: a
  publish that failed early does not stop a detection still reading θ, m and v.

A ``full_state`` callable is called once per ``step_published``, first, on the caller's thread
and on every writer (not only by the committer, the one publisher that reads it): a callable
that gathers over the trainer's ranks (an FSDP ``full_tensor()`` or full-state-dict gather) is
a collective every rank must join, and one issued by the committer alone, or from the
background thread beside FSDP's own collectives, would hang the ranks.

``synchronous=True`` also waits for the acknowledgements of the given receivers after each
commit (synchronous RL); the version stays committed if that wait times out.

This class knows the tracker protocol (:class:`deltasync.trainer.Tracker`: ``iter_changes()``
and ``clear()``), an optimizer's step pre-hook and Publisher; nothing else.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deltasync.errors import (
    CaptureAbandonedError,
    ConfigError,
    OutcomeUnknownError,
    PublishFailedError,
    SendInterruptedError,
)
from deltasync.interrupts import interrupts_deferred
from deltasync.layout.digest import TensorEntries
from deltasync.layout.digest_feed import DigestFeed
from deltasync.names import check_version_arg
from deltasync.native.loader import release_free_heap
from deltasync.native.ops import bf16_at
from deltasync.publish.publisher import Publisher, PublishReport
from deltasync.publish.segments import Ready
from deltasync.trainer import Tracker
from deltasync.trainer.carry import Change, merge_captured
from deltasync.trainer.handoff import (
    INLINE_BELOW,
    VALUES_IN_FLIGHT,
    Handoff,
    hand_over,
    run_into,
)
from deltasync.trainer.params import ReadWindow, Version
from deltasync.trainer.positions import Handed, Positions
from deltasync.trainer.protocol import sink_kwargs, takes_sink
from deltasync.trainer.step_barrier import StepBarrier, optimizers_of
from deltasync.validate import check_bool

log = logging.getLogger(__name__)

Params = Mapping[str, torch.Tensor]
Captured = dict[str, Positions]


class PendingVersion:
    """A version captured by ``TrainerSync(overlap=True)`` and publishing in the background.

    ``captured_s`` is how long the caller was blocked (detection and capture, or its start
    when detection goes on in the background: ``detect_s`` is then the whole pass, known
    once ``detected()``); ``done()`` says whether the background has finished; ``result()``
    waits and returns the reports (or raises the publish error; the TrainerSync still raises
    it at its next call)."""

    def __init__(self, version: int, future: Future, captured_s: float) -> None:
        self.version = version
        self.captured_s = captured_s
        self._future = future
        self.finished_at: float | None = None  # time.time() when the commit (or failure) ended
        self.detect_s: float | None = None  # from the call to the end of detection
        # the full parameters the publishers digest (a full_state callable's result, taken
        # on the caller's thread); dropped once the version is settled
        self.full_state: Params | Callable[[], Params] | None = None
        self.feed: DigestFeed | None = None  # the receivers' tensors hashed by detection
        # the writes to params it can see while it reads them; None once settled
        self.reads: ReadWindow | None = None
        # every param's version counters when its reads began (the state it publishes)
        self.counters: dict[str, Version] | None = None
        self.committed = False  # committed on every publisher (then only the ack wait failed)
        self._detected = threading.Event()

    def detected(self) -> bool:
        """Whether detection has ended (it may go on after ``step_published`` returned, see
        the module docstring); the carry holds the version's positions from then on."""
        return self._detected.is_set()

    def wait_detected(self, timeout: float | None = None) -> bool:
        return self._detected.wait(timeout)

    def _end_detection(self, started: float) -> None:
        self.detect_s = time.perf_counter() - started
        self._detected.set()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[PublishReport]:
        return self._future.result(timeout)


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard


def _positions_stream(tracker: Tracker) -> Iterator[tuple[str, torch.Tensor | Positions]]:
    """The tracker's changed positions; without values where the tracker can (the background
    reads the values from the params, which nothing changes until the next optimizer step),
    already encoded where it can (``iter_positions``: chunk by chunk as detection runs)."""
    encoded = getattr(tracker, "iter_positions", None)
    if callable(encoded):
        yield from encoded()
        return
    positions_only = getattr(tracker, "iter_changed", None)
    if callable(positions_only):
        yield from positions_only()
        return
    for name, idx, _ in tracker.iter_changes():
        yield name, idx


def _until_ended(
    changes: Iterable[tuple[str, torch.Tensor, torch.Tensor]], ended: threading.Event
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``changes``, then ``ended`` set (also when the consumer stops early and closes it)."""
    try:
        yield from changes
    finally:
        ended.set()


def _entries_once_ended(feed: DigestFeed, ended: threading.Event) -> TensorEntries:
    """The feed's entries once its detection stream has ended (called on the digest thread)."""
    ended.wait()
    return feed.entries()


def _capture_stream(
    tracker: Tracker, values_below: int, values_max: int, feed: DigestFeed | None = None
) -> Iterator[tuple[str, torch.Tensor | Positions, torch.Tensor | None]]:
    """``_positions_stream`` as triples; with a tracker that offers ``iter_capture`` and a
    budget, the small parameters of a small delta come with the values detection read, and
    with ``values_max`` the large parameters with at most that many changes too; ``feed``
    (given only for a tracker whose ``iter_capture`` takes a ``sink``) hashes the receivers'
    tensors from the detection pass's casts."""
    capture = getattr(tracker, "iter_capture", None)
    if (values_below or values_max) and callable(capture):
        yield from capture(values_below, values_max=values_max, **sink_kwargs(feed))
        return
    for name, pos in _positions_stream(tracker):
        yield name, pos, None


def _hand_over(handoff: Handoff[Handed], name: str, pos: Positions, change: Change | None) -> None:
    hand_over(handoff, name, pos, None if change is None else change[2])


def with_values(item: tuple[str, Positions], params: Params) -> Change:
    """``(name, sorted int64 indices, BF16 values)`` of one captured parameter, its values
    read from ``params`` now (the bits the receivers must end with)."""
    name, positions = item
    local = _local(params[name])
    idx = positions.indices().to(local.device)
    return name, idx, bf16_at(local, idx, trusted=True)


def _no_verdict(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a write that got no verdict."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OutcomeUnknownError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class TrainerSync:
    """One tracker feeding one or more publishers.

    ``params`` are the named parameters the tracker watches (or a callable returning them);
    ``baseline`` is the committed version they equal when the tracker was created or last
    cleared, if the caller knows it; a publisher still publishes an anchor until it verified
    that state against its store (after a restart: :meth:`resume`). None makes the first
    publish an anchor (a version already committed with the same state is recognised instead,
    see :meth:`Publisher.publish`). ``overlap=True`` publishes in the background (see the
    module docstring) and needs the ``optimizer`` whose next step is the barrier (a sequence:
    every optimizer that steps ``params``, e.g. Muon and AdamW; one left out steps while the
    version reads, which is then refused and sent again); a delta with
    fewer than ``inline_below`` changed elements (a small model) is published on the caller's
    thread before ``step_published`` returns, because a background thread competing with the
    forward/backward would only delay it (0: always in the background).
    ``detect_in_background`` (default True): with a tracker that holds the optimizer's steps,
    a large delta's detection goes on after ``step_published`` returns (module docstring); on
    a trainer whose forward/backward runs on the same CPU cores that trades latency for
    overhead (0.6B on two cores: overhead 1.63 -> 0.81 s, latency 2.75 -> 3.03 s, trainer
    memory +0.5%), so False detects before the return as without such a tracker.
    ``digests_in_detection`` (default True): the first publisher's shard digests are hashed
    by the detection pass from its own BF16 casts (module docstring; without overlap the
    tracker's ``iter_changes(sink=)`` stream the publisher routes as it is detected) instead
    of by a second read of ``params``: ~0.2 CPU-s less per 0.6B version, detection ~15%
    longer (where detection blocks ``step_published``, so does that); False keeps the
    separate pass beside detection. Without overlap, a version after a delta that sent fewer
    than ``inline_below`` elements (the first publisher's) keeps that pass too: on a small
    model it runs on a core detection leaves idle (small preset: about even in wall time,
    ~3 ms more CPU with the detection hashing).

    Restart recipe: checkpoint the model, the optimizer and the committed version the params
    equal; on restart load them, build the tracker and this TrainerSync, call
    ``resume(version)``, then publish ``next_version()`` after the next optimizer step."""

    def __init__(
        self,
        tracker: Tracker,
        publishers: Publisher | Sequence[Publisher],
        params: Params | Callable[[], Params],
        *,
        baseline: int | None = None,
        full_state: Params | Callable[[], Params] | None = None,
        synchronous: bool = False,
        ack_receivers: Sequence[str] | None = None,
        ack_timeout_s: float = 60.0,
        overlap: bool = False,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        inline_below: int = INLINE_BELOW,
        detect_in_background: bool = True,
        digests_in_detection: bool = True,
    ) -> None:
        pubs = [publishers] if isinstance(publishers, Publisher) else list(publishers)
        if not pubs:
            raise ConfigError("TrainerSync needs at least one publisher")
        optimizers = optimizers_of(optimizer, "TrainerSync")
        if overlap and not optimizers:
            raise ConfigError(
                "TrainerSync.optimizer is required with overlap=True: its next step must wait "
                "for the version publishing in the background (pass the optimizer the tracker "
                "hooks, and every other optimizer that steps params)"
            )
        self.tracker = tracker
        self.publishers = pubs
        self._params = params
        self._full_state = full_state
        self.baseline = baseline
        self.synchronous = synchronous
        self.ack_receivers = ack_receivers
        self.ack_timeout_s = ack_timeout_s
        self.overlap = overlap
        if not isinstance(inline_below, int) or inline_below < 0:
            raise ConfigError(
                f"TrainerSync.inline_below must be a non-negative int, got {inline_below!r}"
            )
        self.inline_below = inline_below
        # overlap mode: positions captured since the last commit, per param
        self._carry: Captured = {}
        self._closed = False  # close(): later calls block, as without overlap
        # every param's version counters when the baseline version's reads began
        self._baseline_counters: dict[str, Version] | None = None
        self._inflight: PendingVersion | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._detector: ThreadPoolExecutor | None = None  # detection after the return
        self._feeds: DigestFeed | None = None  # the digest feed's plan (first publisher)
        self._expect_large = False  # the last delta held at least inline_below elements
        # without overlap: the last committed delta sent fewer than inline_below elements
        self._small_delta = False
        self.last_reports: list[PublishReport] = []  # of the newest committed version
        self.barrier_wait_s = 0.0  # how long the last barrier waited for the background
        self._waited: PendingVersion | None = None  # the version the barrier last waited for
        # A tracker that holds the optimizer's steps for us (its own pre-step hook calls the
        # barrier first) lets a large delta's detection go on after step_published returns.
        check_bool("TrainerSync", "detect_in_background", detect_in_background)
        self.digests_in_detection = check_bool(
            "TrainerSync", "digests_in_detection", digests_in_detection
        )
        hold = getattr(tracker, "hold_steps", None) if detect_in_background else None
        self._steps = StepBarrier(
            optimizers if overlap else (), self._barrier, hold if callable(hold) else None
        )

    # --- the synchronous path -----------------------------------------------------------

    def resume(self, version: int | None) -> bool:
        """After a restart: the params were just loaded from the checkpoint taken at committed
        ``version`` and the tracker was built on them (before any optimizer step). Check, on
        every publisher, that the store still holds exactly this state as ``version``.

        Args:
            version: the version recorded in the checkpoint (None: unknown).

        Returns:
            True when every publisher verified it: the next version is a delta on it while
            it is the newest committed version (the run continues its lineage), an anchor of a
            new lineage when later versions were committed after the checkpoint. False when
            a store lost it or holds another state: the next version is an anchor (a new
            lineage), so no receiver ever applies a delta on a foreign base.
        """
        params = self._params() if callable(self._params) else self._params
        verified = [
            pub.resume(version, params, full_state=self._full_state) for pub in self.publishers
        ]
        self.baseline = version if version is not None and all(verified) else None
        return self.baseline is not None

    def next_version(self) -> int:
        """The version to publish next: one above the newest committed on every publisher
        (never a number some store already holds) and above the version in flight, which
        may still commit (``step_published(sync.next_version())`` evaluates it before that
        call waits for the version in flight)."""
        newest = max(pub.next_version() for pub in self.publishers)
        pending = self._inflight
        return newest if pending is None else max(newest, pending.version + 1)

    def step_published(
        self, version: int, *, anchor: bool = False
    ) -> list[PublishReport] | PendingVersion:
        """Publish the changes since the baseline as ``version`` on every publisher.

        Without overlap: returns once committed everywhere, then clears the tracker; on any
        failure the tracker keeps its bits and the exception propagates: call again (same or
        a later version) to retry. With overlap: waits for the version in flight (raising
        :class:`PublishFailedError` if it failed; its changes are kept for the next call),
        captures this version's changes and returns while it publishes in the background.

        Args:
            version: the version to commit on every publisher.
            anchor: publish a full version instead of the tracker's changes.

        Returns:
            One :class:`PublishReport` per publisher, in order; with overlap, the
            :class:`PendingVersion` whose ``result()`` gives them.
        """
        check_version_arg("TrainerSync.step_published", version, hint="publish sync.next_version()")
        full = self._gather_full_state()
        if self.overlap and not self._closed:
            return self._step_overlapped(version, anchor, full)
        if self._carry:
            # After close(), a version that failed in flight left its capture: it goes out
            # with this one, through the same path, and this call waits for the commit.
            self._step_overlapped(version, anchor, full)
            try:
                reports = self.wait()
            finally:
                self._stop_threads()
            assert reports is not None
            return reports
        params = self._params() if callable(self._params) else self._params
        # The first publisher's digests hashed by the detection pass where it can: its digest
        # pass then waits for the end of the stream and reads only the tensors not fed. After
        # a small delta the pass runs beside detection instead, on another core: at that size
        # it costs less wall time than it saves CPU time (see ``inline_below``).
        feed = None if anchor or self._small_delta else self._digest_feed(params, "iter_changes")
        ended = threading.Event()
        changes: Iterable = self.tracker.iter_changes(**sink_kwargs(feed))
        if feed is not None:
            changes = _until_ended(changes, ended)
        if len(self.publishers) > 1:  # every publisher needs the same changes: detect once
            changes = list(changes)
        # With one publisher the stream is lazy: each group is detected while the previous
        # one is encoded and uploading.
        fed = None if feed is None else functools.partial(_entries_once_ended, feed, ended)
        try:
            reports = self._publish_all(version, changes, params, anchor, full, fed)
        finally:
            ended.set()  # a publish that stopped early leaves no digest pass waiting
        # Committed everywhere: the new baseline is this version's state.
        self.tracker.clear()
        self.baseline = version
        self.last_reports = reports
        self._small_delta = not anchor and reports[0].elements_sent < self.inline_below
        self._wait_acks(version)
        return reports

    def _gather_full_state(self) -> Params | Callable[[], Params] | None:
        """A ``full_state`` callable's result, taken first, on every writer, before anything
        that could raise on one rank only: it may be a collective (see the module docstring).
        Its failure is raised where the publisher reads the state, after the version's
        claim, so that the committer's failure is told to the other writers (its notice).
        One writer reads its own parameters, never the callable: not called then."""
        gather = self._full_state
        if not callable(gather) or all(p.config.num_writers == 1 for p in self.publishers):
            return gather
        try:
            return gather()
        except Exception as exc:
            error = exc  # ``exc`` is unbound once the except clause ends
            if not any(p.config.is_committer for p in self.publishers):
                # only a committer reads the state: said here, as nothing raises it later
                log.warning(
                    "writer %s: full_state raised %s: %s (only the committer reads it; this "
                    "writer publishes on, and a gather that failed here may fail or hang there)",
                    self.publishers[0].writer,
                    type(exc).__name__,
                    exc,
                )

            def failed() -> Params:
                raise error

            return failed

    def _publish_all(
        self,
        version: int,
        changes,
        params: Params,
        anchor: bool,
        full: Params | Callable[[], Params] | None,
        fed: Callable[[], TensorEntries] | None = None,
    ):
        """Every publisher's publish of ``changes``; ``full``: the full state, resolved;
        ``fed``: the first publisher's entries hashed by the detection pass
        (``_digest_feed`` plans it for that one)."""
        return [
            pub.publish(
                version,
                changes,
                params,
                anchor=anchor,
                since=self.baseline,
                full_state=full,
                fed=fed if i == 0 else None,
            )
            for i, pub in enumerate(self.publishers)
        ]

    def _wait_acks(self, version: int) -> None:
        if self.synchronous:
            for pub in self.publishers:
                pub.wait_for_acks(version, self.ack_receivers, timeout=self.ack_timeout_s)

    # --- the overlapped path ------------------------------------------------------------

    def _step_overlapped(
        self, version: int, anchor: bool, full: Params | Callable[[], Params] | None = None
    ) -> PendingVersion:
        self.wait()  # the barrier; raises the failed version's error (its carry is kept)
        t = time.perf_counter()
        params = self._params() if callable(self._params) else self._params
        # Detection on the caller's thread (it reads θ, m, v; the tracker is cleared right
        # after, so no other thread ever touches the tracker): each parameter's positions
        # are held compactly (about 1 byte per changed element, positions.py) as soon as it
        # is detected. They are both what the background routes and, until this version
        # commits, the carry. A large parameter's values come along for the background
        # while the handoff has room for them (_hand_over); it reads the rest from params.
        # While the delta is still small the tracker hands over the values it read with the
        # positions (a bounded budget, iter_capture): an inline publish then reads nothing
        # twice. Once it holds ``inline_below`` changed elements it is a large delta: the
        # background starts publishing what is captured so far and takes each further
        # parameter as it is detected (routing, encoding and upload overlap the rest of
        # detection; the detection kernels and the routing's heavy parts release the GIL).
        # With a tracker that holds the optimizer's steps (``hold_steps``), a large delta's
        # detection goes on on a thread of its own once the background has started, and this
        # call returns: the next optimizer step waits for it (and for the publish) before the
        # tracker's own hook runs, so nothing the detection reads changes under it.
        # When the previous delta was large, this one is expected large too (RL deltas keep
        # their size from step to step): with such a tracker the whole pass goes to that
        # thread at once (a small delta that comes anyway publishes in the background).
        captured: Captured = {}
        detected: dict[str, Change] = {}
        count = 0
        handoff: Handoff[Handed] | None = None
        unsubmitted: Future = Future()  # the version's future until a thread takes it
        pending = PendingVersion(version, unsubmitted, 0.0)
        pending.full_state = full
        pending.reads = ReadWindow(  # the version reads params from here on
            params,
            version,
            window="after step_published returned, before the next optimizer step or wait()",
            tracker=self.tracker,
        )
        pending.counters = pending.reads.counters
        at_once = not anchor and self._steps.held and self._expect_large
        budget = 0 if anchor or at_once else self.inline_below
        values_max = 0 if anchor else VALUES_IN_FLIGHT
        pending.feed = None if anchor else self._digest_feed(params)
        # A small delta's positions are held as the tracker gave them (it publishes here and
        # drops them at its commit); a large delta's are compacted as they are handed over.
        items = merge_captured(
            _capture_stream(self.tracker, budget, values_max, pending.feed),
            self._carry,
            params,
            encode=False,
        )
        try:
            if at_once:
                handoff = Handoff(VALUES_IN_FLIGHT)
                return self._detect_in_background(items, captured, handoff, pending, params, t)
            for name, pos, change in items:
                captured[name] = pos
                count += len(pos)
                if handoff is not None:
                    captured[name] = pos = pos.compact()
                    _hand_over(handoff, name, pos, change)
                elif not anchor and count >= self.inline_below:
                    # a large delta: the background takes the values detection read while
                    # they fit the handoff's budget, and reads the others as it routes
                    if change is not None:
                        detected[name] = change
                    handoff = Handoff(VALUES_IN_FLIGHT)
                    for n, p in captured.items():
                        captured[n] = p = p.compact()  # kept until the commit
                        _hand_over(handoff, n, p, detected.pop(n, None))
                    if self._steps.held:
                        return self._detect_in_background(
                            items, captured, handoff, pending, params, t
                        )
                    with interrupts_deferred():  # what runs is what fails or is waited for
                        pending._future = self._submit(pending, captured, params, anchor, handoff)
                elif change is not None:
                    detected[name] = change
            # The carry first: an interrupt from here on costs extra elements, never lost ones
            self._carry = captured
            self.tracker.clear()
            self._expect_large = not anchor and count >= self.inline_below
            pending.captured_s = time.perf_counter() - t
            pending._end_detection(t)
            self._inflight = pending
            if handoff is not None:
                handoff.close()
                return pending
            if not anchor and count < self.inline_below:
                # A version this small publishes in a few tens of milliseconds: handing it to
                # a thread that then competes with the forward/backward for the cores costs
                # more latency than the caller waiting for it here. Same contract: errors
                # surface at the next call, the carry stays until it is settled.
                changes = [
                    detected.get(name) or with_values((name, pos), params)
                    for name, pos in captured.items()
                ]
                try:
                    run_into(
                        pending._future,
                        lambda: self._background(pending, captured, params, anchor, None, changes),
                        f"the publish of version {version}",
                    )
                finally:
                    pending.reads = None  # nothing of it reads params after the return
                return pending
            del detected
            for n, p in captured.items():  # kept until the commit, beside the background
                captured[n] = p.compact()
            with interrupts_deferred():
                pending._future = self._submit(pending, captured, params, anchor, None)
        except BaseException as exc:
            # Nothing of this version commits unless its handoff was closed before the
            # interrupt: the background stops at its next item. Before the tracker's clear()
            # the tracker and the carry stay as they were (the next call detects again); after
            # it the carry holds the whole capture. A version no thread took yet fails here,
            # so that wait() reports it instead of waiting for it.
            if handoff is not None:
                handoff.fail(exc)
            if pending._future is not unsubmitted:
                try:
                    pending.result()
                except Exception:
                    pass
            elif not unsubmitted.done():
                unsubmitted.set_exception(
                    SendInterruptedError.of(exc, f"the capture of version {version}")
                )
            raise
        return pending

    def _detect_in_background(
        self,
        items: Iterator[tuple[str, Positions, Change | None]],
        captured: Captured,
        handoff: Handoff[Handed],
        pending: PendingVersion,
        params: Params,
        started: float,
    ) -> PendingVersion:
        """Start the publish on what ``handoff`` holds and the rest of detection on the
        detection thread; return the pending version."""
        # One step for an interrupt: a version in flight is one whose detection runs
        with interrupts_deferred():
            pending._future = self._submit(pending, captured, params, False, handoff)
            self._inflight = pending
            if self._detector is None:
                self._detector = ThreadPoolExecutor(1, thread_name_prefix="ds-detect")
            self._detector.submit(self._detect_rest, items, captured, handoff, pending, started)
        pending.captured_s = time.perf_counter() - started
        return pending

    def _detect_rest(
        self,
        items: Iterator[tuple[str, Positions, Change | None]],
        captured: Captured,
        handoff: Handoff[Handed],
        pending: PendingVersion,
        started: float,
    ) -> None:
        """The rest of a large delta's detection, after ``step_published`` returned: each
        parameter handed to the background as it is captured, then the tracker cleared and
        the capture made the carry. A failure stops the publish before its commit (raised at
        the next call, naming the version) and leaves the tracker and the carry as they were,
        as a failure before the return does."""
        try:
            for name, pos, change in items:
                captured[name] = pos = pos.compact()
                _hand_over(handoff, name, pos, change)
        except BaseException as exc:
            handoff.fail(exc)
            pending._end_detection(started)
            return
        finally:
            items.close()  # the tracker's pass ends here, on this thread
        self._carry = captured  # before clear(), as on the caller's thread
        self.tracker.clear()
        self._expect_large = sum(len(p) for p in captured.values()) >= self.inline_below
        pending._end_detection(started)
        handoff.close()

    def _digest_feed(self, params: Params, method: str = "iter_capture") -> DigestFeed | None:
        """A fresh feed for this version's detection pass, when the first publisher hashes
        the state from ``params`` alone (one writer, no ``full_state``) and the tracker can
        feed it (its ``method``, the detection this sync runs, takes a ``sink``)."""
        pub = self.publishers[0]
        if (
            not self.digests_in_detection
            or self._full_state is not None
            or pub.config.num_writers != 1
            or not takes_sink(self.tracker, method)
        ):
            return None
        if self._feeds is None:
            self._feeds = DigestFeed(pub.trainer_layout, pub.layout, params=frozenset(params))
        return self._feeds.fresh()

    def _submit(self, *args: object) -> Future:
        """:meth:`_background` with ``args`` on the publish thread (started on first use)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ds-publish")
        return self._worker.submit(self._background, *args)

    def _background(
        self,
        pending: PendingVersion,
        captured: Captured,
        params: Params,
        anchor: bool,
        handoff: Handoff[Handed] | None,
        changes: list[Change] | None = None,
    ) -> list[PublishReport]:
        # The capture's transients (each parameter's int64 positions) leave holes between the
        # captured positions it keeps: give the free pages back before the publish allocates
        # (the capture may still be running: this only returns pages no object uses). Not for
        # an inline version: its holes are small and the call (~1 ms) would be in its latency.
        if changes is None:
            release_free_heap()
        # the receiver tensors only untouched params feed keep their digests, when the
        # tracker watches every param (else nothing proves the rest)
        touched: Collection[str] | Callable[[], Collection[str]] | None = None
        if self._watches_all(params):
            # A param whose counters moved since the baseline was read is touched whatever
            # detection says: its old digest proves nothing about it (a whole parameter the
            # tracker missed would otherwise keep a digest that hides the miss from every
            # receiver's verify). Stepped params are fed by detection anyway.
            moved = self._moved_since_baseline(pending, params)
            if handoff is not None:
                names = handoff.names

                def touched_names() -> frozenset[str]:
                    return names() | moved

                touched = touched_names
            else:
                touched = frozenset(captured) | moved
        feed = pending.feed
        fed: TensorEntries | Callable[[], TensorEntries] | None = None
        if feed is not None and handoff is not None:

            def fed_entries() -> TensorEntries:
                handoff.names()  # the feed is complete once detection has ended
                return feed.entries()

            fed = fed_entries
        elif feed is not None:
            fed = feed.entries()
        before = [pub.baseline for pub in self.publishers]
        try:
            reports = []
            for i, pub in enumerate(self.publishers):
                if changes is not None:
                    source = changes
                elif i == 0 and handoff is not None:  # taken as the caller captures it
                    source = Ready((name, pos, vals) for name, (pos, vals) in handoff)
                else:  # positions only: the publisher reads each parameter's values as it
                    # routes it (the embedding piece by piece), never all at once; a later
                    # publisher starts once the capture is complete, which the first one's
                    # draining of the handoff does not prove (an anchor, or a version found
                    # committed already, reads no change)
                    if handoff is not None:
                        handoff.names()
                    source = Ready((name, pos, None) for name, pos in captured.items())
                reports.append(
                    pub.publish(
                        pending.version,
                        source,
                        params,
                        anchor=anchor,
                        since=self.baseline,
                        full_state=pending.full_state,
                        touched=touched,
                        fed=fed if i == 0 else None,
                        before_commit=functools.partial(self._refuse_if_edited, pending, params),
                    )
                )
            # Committed everywhere: the baseline moves now (wait() reads it after result());
            # the carry is dropped when the caller's thread settles the version.
            self.baseline = pending.version
            pending.committed = True  # whatever the ack wait below does
            self._wait_acks(pending.version)
            return reports
        except BaseException:
            # Committed by every publisher before the failure (an interrupt while LATEST was
            # advanced): reported as committed, as the version is.
            if not pending.committed and all(
                pub.baseline == pending.version != was
                for pub, was in zip(self.publishers, before, strict=True)
            ):
                self.baseline = pending.version
                pending.committed = True
            raise
        finally:
            pending.finished_at = time.time()
            pending.full_state = None  # a model-sized gather: not kept past the publish

    def _moved_since_baseline(self, pending: PendingVersion, params: Params) -> frozenset[str]:
        """The params written in place (by anything: the optimizer included) between the
        reads of the baseline version and of ``pending``; all of them when either is unknown."""
        before, now = self._baseline_counters, pending.counters
        if before is None or now is None:
            return frozenset(params)
        return frozenset(n for n in params if before.get(n) != now.get(n))

    def _watches_all(self, params: Params) -> bool:
        """Whether the tracker watches every one of ``params`` (an AdamWTracker's ``shards``
        names them): only then does its silence about a param prove it unchanged."""
        watched = getattr(self.tracker, "shards", None)
        return isinstance(watched, Mapping) and all(n in watched for n in params)

    @property
    def in_flight(self) -> PendingVersion | None:
        """The version captured and not yet settled by :meth:`wait` (overlap mode)."""
        return self._inflight

    def _refuse_if_edited(self, pending: PendingVersion, params: Params) -> None:
        """A publisher's last step before it stores and commits ``pending``."""
        if pending.reads is not None:
            pending.reads.refuse_if_written(params)

    def _settle_edits(self, pending: PendingVersion) -> None:
        """Once ``pending`` is done and its detection has ended, before the next optimizer
        step (:class:`~deltasync.trainer.params.ReadWindow`); once per version."""
        reads, pending.reads = pending.reads, None
        if reads is not None:
            reads.settle(self._params() if callable(self._params) else self._params, self.tracker)

    def _barrier(self) -> None:
        """The optimizer's pre-step hook: the version in flight must be done, and its
        detection ended, before the step changes ``params``, m and v (detection and the
        digests read them). A background that failed early does not stop a detection still
        running. Errors wait for the next call."""
        pending = self._inflight
        if pending is None or pending is self._waited:  # waited for by another optimizer
            return
        t = time.perf_counter()
        try:
            pending.result()
        except Exception:  # raised at the next call, naming the version
            pass
        pending.wait_detected()
        self.barrier_wait_s = time.perf_counter() - t
        self._waited = pending
        self._settle_edits(pending)

    def wait(self) -> list[PublishReport] | None:
        """Wait for the version in flight (overlap mode) and settle it.

        Returns:
            Its reports, or None when nothing was in flight.

        Raises:
            PublishFailedError: it did not commit (or its acknowledgement wait failed); its
                changed positions are kept and go out with the next version.
        """
        # In flight until settled: an interrupt while this waits leaves it for the next call
        # (and the optimizer's barrier) to wait for again.
        pending = self._inflight
        if pending is None:
            return None
        try:
            reports = pending.result()
        except Exception as failure:
            # detection may outlive a background that failed early: the carry is its capture
            pending.wait_detected()
            self._settle_edits(pending)
            self._inflight = None
            # detection that went on after the return failed: that error is the one to name
            exc = failure
            if isinstance(failure, CaptureAbandonedError) and failure.__cause__ is not None:
                # an interrupt is named as one, the SendInterruptedError the docs promise
                exc = SendInterruptedError.of(
                    failure.__cause__, f"the capture of version {pending.version}"
                )
            # Only the ack wait failed? Not "the baseline is this version": it already was
            # when a version committed earlier is published again, and refused.
            committed = pending.committed
            if committed:
                self._carry = {}
                self._baseline_counters = pending.counters
            else:
                log.warning(
                    "version %d did not commit (%s: %s); its changes go out with the next "
                    "version (%d parameter(s) carried, the rest still in the tracker)",
                    pending.version,
                    type(exc).__name__,
                    exc,
                    len(self._carry),
                )
            unknown = not committed and _no_verdict(exc)
            raise PublishFailedError(
                f"version {pending.version} "
                + (
                    "committed, but what follows a commit failed (advancing LATEST, or the wait "
                    "for acknowledgements); the baseline is this version"
                    if committed
                    else "got no verdict on its manifest write, which may still land (its "
                    "number is not published again: call step_published with next_version()); "
                    "its changes are kept and go out with the next version"
                    if unknown
                    else "did not commit; its changes are kept and go out with the next version: "
                    "call step_published again"
                )
                + f" ({type(exc).__name__}: {exc})",
                version=pending.version,
                committed=None if unknown else committed,
            ) from exc
        # Detection may outlive a publish that read none of it (an anchor, a version found
        # committed already): it clears the tracker and sets the carry when it ends, so it
        # must end before the caller edits params or steps.
        pending.wait_detected()
        self._settle_edits(pending)
        self._inflight = None
        self._carry = {}  # committed everywhere: the baseline is this version's state
        self._baseline_counters = pending.counters
        self.last_reports = reports
        return reports

    def close(self) -> None:
        """Wait for the version in flight, remove the optimizer hook, stop the thread. Later
        ``step_published`` calls block, as without overlap: nothing holds the optimizer's
        next step behind a version any more.

        Raises:
            PublishFailedError: the version in flight did not commit.
        """
        try:
            self.wait()
        finally:
            self._closed = True
            self._steps.remove()
            self._stop_threads()

    def _stop_threads(self) -> None:
        for pool in (self._detector, self._worker):
            if pool is not None:
                pool.shutdown(wait=True)
        self._detector = self._worker = None
