"""Receiver: keeps one inference shard's live tensors at the newest committed version.

``pull()``:

1. read the newest committed manifest from the store (``LATEST`` plus any manifest right after
   it; a ``LATEST`` naming no manifest is ignored) and plan the chain for this shard
   (:meth:`Catalog.shard_chain`): the local state is a base only when a delta names its
   version AND its state digest; otherwise (nothing verified, dirty, another lineage, a store
   that regressed or was renumbered) the newest anchor of the current lineage is restored;
2. check the layout the manifests were built for against this receiver's tensors, before
   anything is fetched;
3. stage (the engine keeps serving): a chain that starts at an anchor is registered first
   (``ReceiverRecord.restoring``, refreshed by the fetch's heartbeats, gone once the version
   it leads to is recorded), so that retention keeps that anchor and the versions after it
   even when newer anchors commit during a slow fetch; verify each manifest (signature when
   a key is set) and the chain's bases, fetch every blob and verify its size, digest, header
   and trailer (:mod:`deltasync.receiver.staging`); decode it here only when the decoded
   chain is small (``max_staged_bytes``);
4. verify before write: read the chain one tensor at a time (:func:`deltasync.format.iter_chain`:
   every record checked, writers disjoint, an anchor complete) and hash each tensor as it
   WILL be after its pieces, chunk by chunk (:mod:`deltasync.layout.verify`); compare with the
   manifest's shard digest (a parts digest, from several writers without the full state: the
   shard's part digests as they will be, :mod:`deltasync.layout.part_digests`, which needs the
   receiver's layout). A mismatch refuses the pull with every live element untouched.
   The journal is written durably meanwhile, on a thread, and waited for before step 5;
5. scatter into the live tensors: the pause, and only that (the records read again and
   decoded version by version, one tensor at a time, unless the chain is held);
6. record the new verified version, true from the end of the scatter, three ways at once: the
   state file, the ack and the registration (independent durable writes); clear the journal
   once the state file is durable. A failed ack or heartbeat is logged and retried on the
   next pull; it never turns a verified apply into an error. A failed state file write
   raises with the journal kept: the receiver reports no version (dirty) until the next pull
   replays it.

A crash during step 5 leaves the journal, and the next Receiver on the same state dir repairs
before anything else (see :mod:`.journal` for why replaying the whole journaled chain is always
correct); if the journaled blobs are gone, it restores the newest anchor instead. A dirty
receiver reports no version (:attr:`PullReport.version` is None, :attr:`PullReport.dirty`).

:class:`ReceiverConfig` (its settings) and :class:`PullReport` (what one pull did) live here
with the receiver. This class knows the order of those steps; fetching, decoding, verifying and
files live in the modules it calls. It holds no copy of the model: the fetched blobs of one
pull and one or two tensors' decoded changes at a time (or, within ``max_staged_bytes``, the
whole decoded chain).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from deltasync import names
from deltasync.atomic import InBackground
from deltasync.commit import AckRecord, Manifest, ManifestLimits, ReceiverRecord
from deltasync.commit.catalog import Catalog
from deltasync.commit.model import LayoutRecord, run_started_ms, specs_fingerprint
from deltasync.commit.signing import MIN_KEY_BYTES
from deltasync.errors import (
    FULL_ERRNOS,
    ApplyError,
    ConfigError,
    DeltaSyncError,
    DriftError,
    FormatError,
    IntegrityError,
    KeyNotFoundError,
    LayoutMismatchError,
    LocalStateError,
    ManifestError,
    ObjectTooLargeError,
    ReceiverLayoutRequiredError,
    StoreError,
    VersionError,
)
from deltasync.exclusive import one_call_at_a_time
from deltasync.format import (
    BlobRecords,
    NamedOnce,
    PauseContext,
    Records,
    TensorPieces,
    TensorSpec,
    apply_pieces,
    check_tensors_match,
    check_tensors_still_match,
    inside_pause,
    iter_chain,
)
from deltasync.format.stash import Stash
from deltasync.interrupts import interrupts_deferred
from deltasync.layout import ReceiverLayout
from deltasync.layout.digest import parse_parts_digest, parts_digest, state_digest
from deltasync.layout.part_digests import chain_part_digests, receiver_part_digests
from deltasync.layout.verify import CHUNK_ELEMENTS, chain_state_digest
from deltasync.receiver.journal import Journal, JournalStep, LocalState, StateDir
from deltasync.receiver.staging import check_chain, open_version, spill_plan
from deltasync.store import Store
from deltasync.store.base import check_store
from deltasync.validate import (
    check_bool,
    check_instance,
    check_int,
    check_number,
    check_signing_key,
)

_OWNER = "ReceiverConfig"


_UNWRITTEN = object()  # no registration written by this process yet


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """- ``receiver_id``: this receiver's name in acks and registrations (data-parallel
      replicas of one shard need distinct ids);
    - ``signing_key``: when set, every manifest must carry a valid HMAC-SHA256 signature;
      without it a signed manifest is refused (``KeyRequiredError``, a ``SignatureError``
      and a ``ConfigError``: the trainer signs, so this receiver needs its key);
    - ``verify_on_open``: hash the live tensors at construction and compare with the digest
      of the version the state file records; a mismatch marks the state dirty (the next pull
      restores the newest anchor);
    - ``verify_after_write``: also hash the live tensors after the scatter (a second full read
      per pull; the state is already verified before the write, so this only guards against
      something else writing the tensors during the pause);
    - ``limits``: bounds on manifests; ``max_decompressed_bytes``: bound per blob;
    - ``durable``: fsync the journal and state file (False only for tests on scratch disks:
      a power loss could then lose the journal and hide a torn apply). The records, not the
      tensors: live tensors never outlive a power loss intact (process memory and /dev/shm
      are gone, a mapped file on disk is not msynced), so a receiver started on tensors that
      may have lived through one must keep ``verify_on_open``, which alone tells whether
      they hold the recorded version;
    - ``max_staged_bytes``: a pull whose decoded chain is estimated at most this size decodes
      it once and holds it from verify to scatter; a larger one decodes it twice, one tensor
      at a time (verify, then the scatter), so the pull holds the compressed blobs plus one
      tensor's changes instead of the whole decoded chain. None: 1/16 of the shard's bytes,
      at least 4 MiB (a small model's pull then decodes once: a second decode would cost more
      time in the pause than the few MiB it saves);
    - ``scrub_every``: every Nth pull that finds nothing new first runs :meth:`Receiver.scrub`
      (a full read of the shard); a drift it finds is repaired by that same pull from the
      newest anchor. 0 (the default): never. A pull that applies a version verifies the whole
      resulting state from the live tensors anyway, so this matters while the head does not
      move (training paused or over, the engine serving on).
    - ``restore_drift``: a pull whose verify finds that the live tensors no longer hold the
      recorded version (something else wrote them: an engine's own weight reload) restores
      the newest anchor and the chain in that same pull, logged and reported as
      ``PullReport.drifted``, instead of raising :class:`IntegrityError` and leaving the
      restore to the next pull. Off by default: outside an engine that reloads its own
      weights, such a write is a fault to see. The engine hooks turn it on.
    - ``fetch_heartbeat_s``: while a pull fetches more than ``FETCH_HEARTBEAT_MIN_BYTES``
      (a large anchor, a slow link) the registration is refreshed this often, so that the
      receiver stays live to retention (``receiver_ttl_s``, 120 s by default, must exceed
      it) and the chain it fetches is kept; the tensors hold the version before all along
      the fetch. 0: refreshed only as the pull ends.
    """

    receiver_id: str
    signing_key: bytes | None = field(default=None, repr=False)
    verify_on_open: bool = True
    verify_after_write: bool = False
    limits: ManifestLimits = field(default_factory=ManifestLimits)
    max_decompressed_bytes: int = 1 << 36
    durable: bool = True
    max_staged_bytes: int | None = None
    scrub_every: int = 0
    restore_drift: bool = False
    fetch_heartbeat_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            names.check_token("receiver", self.receiver_id)
        except ManifestError as exc:
            raise ConfigError(f"ReceiverConfig.receiver_id: {exc}") from None
        check_signing_key(_OWNER, self.signing_key, min_bytes=MIN_KEY_BYTES)
        for name in ("verify_on_open", "verify_after_write", "durable", "restore_drift"):
            check_bool(_OWNER, name, getattr(self, name))
        check_instance(_OWNER, "limits", self.limits, ManifestLimits)
        check_int(_OWNER, "max_decompressed_bytes", self.max_decompressed_bytes, lo=1)
        if self.max_staged_bytes is not None:
            check_int(_OWNER, "max_staged_bytes", self.max_staged_bytes, lo=0)
        check_int(_OWNER, "scrub_every", self.scrub_every, lo=0)
        check_number(_OWNER, "fetch_heartbeat_s", self.fetch_heartbeat_s, positive=False, unit="s")


@dataclass(frozen=True, kw_only=True)
class PullReport:
    """What one pull did. ``version`` is the verified version the tensors hold now, and None
    while ``dirty`` (the tensors are known not to hold any verified version)."""

    version: int | None
    previous_version: int | None  # what they held before (None: nothing verified)
    chain: tuple[int, ...] = ()  # versions applied, in order (first may be an anchor)
    from_anchor: bool = False
    repaired: bool = False  # this finished an apply a crash interrupted
    dirty: bool = False
    run_id: str | None = None  # the lineage of ``version``
    records_pending: bool = False  # the ack or heartbeat failed; retried on the next pull
    bytes_fetched: int = 0
    elements_written: int = 0
    stage_s: float = 0.0  # fetch, verify, decode, fold: the engine keeps serving
    verify_s: float = 0.0  # digest of the resulting state, before the write (still serving)
    pause_s: float = 0.0  # scatter into the live tensors: the engine must not read them
    total_s: float = 0.0
    scrubbed: bool = False  # the live tensors were hashed first (ReceiverConfig.scrub_every)
    # the live tensors no longer held the version (found by the scrub, or with restore_drift
    # by the verify of a delta): this pull restored an anchor
    drifted: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.chain)


log = logging.getLogger(__name__)


class _Outage:
    """How one record's failed writes are logged: the first as a warning, the repeats of an
    outage at debug level with one warning a :data:`REMIND_S` (a store that stays full or
    down fails every pull, and a line a pull buried what an operator needs to see), and the
    first write after it at info level with the count."""

    REMIND_S = 60.0

    def __init__(self, what: str) -> None:
        self.what = what
        self.failed = 0
        self.last: BaseException | None = None  # the newest failure, for errors that follow
        self._warned_at = 0.0

    def failure(self, who: str, exc: BaseException) -> None:
        self.failed += 1
        self.last = exc
        now = time.monotonic()
        if self.failed == 1 or now - self._warned_at >= self.REMIND_S:
            self._warned_at = now
            again = "" if self.failed == 1 else f" ({self.failed} failed writes so far)"
            log.warning(
                "%s: %s not written (%s)%s; retried on the next pull", who, self.what, exc, again
            )
        else:
            log.debug("%s: %s not written again (%s)", who, self.what, exc)

    def success(self, who: str) -> None:
        if self.failed:
            log.info("%s: %s written again after %d failed writes", who, self.what, self.failed)
            self.failed = 0


MIN_STAGED_BYTES = 4 << 20  # the default max_staged_bytes of a small shard
# A fetch of more than this (for one shard) refreshes the registration while it runs
# (ReceiverConfig.fetch_heartbeat_s); a smaller one is over long before a heartbeat is due.
FETCH_HEARTBEAT_MIN_BYTES = 64 << 20
# Decoded bytes per decompressed section byte, at most: int32 indices from 1-byte gaps plus
# BF16 values (4 + 2 for 1 + 2 bytes) is 2x; int64 indices (tensors above 2^31 elements) 3.3x.
_DECODED_PER_RAW = 2
# Decoded bytes per listed element a verify of a parts digest holds: an int32 index and a
# BF16 value (int64 indices, above 2^31 elements, hold 10; the budget is a bound, not a count)
_HELD_BYTES_PER_ELEMENT = 6
# Errors that mean "the journaled chain cannot be replayed from the store any more".
_UNREPLAYABLE = (KeyNotFoundError, FormatError, ManifestError, VersionError)


_one_at_a_time = one_call_at_a_time("a receiver", "pull, scrub, invalidate, deregister or close")


class Receiver:
    """One receiver shard. ``tensors`` are the live local tensors (storage names, BF16), written
    in place; ``state_dir`` is this receiver's own durable directory.

    ``pause`` is the engine's "stop reading weights" context, entered only around the scatter;
    ``on_tensor_written(name)`` is called once per tensor a pull writes, once it holds its new
    values (progress, tests; a chain of several versions is written version by version: the
    tensors its last version lists as they are written, the others after that).

    ``persist(tensors, state)``, when given, is called once the tensors hold a newly verified
    version, before anything records it (state file, ack, registration): a sidecar writes the
    copy its engine reads there (``deltasync pull``). The version a receiver reports is then
    the one persisted: while ``persist`` fails, the pull raises its error (an
    :class:`~deltasync.errors.ApplyError` unless it raised a deltasync error), every record
    keeps the version before, and the next pull calls it again before anything else. The
    journal stays until it succeeds, so a receiver restarted meanwhile replays the version
    into what it loads and persists it then."""

    def __init__(
        self,
        store: Store,
        *,
        shard: str,
        tensors: Mapping[str, torch.Tensor],
        state_dir: str,
        config: ReceiverConfig,
        specs: Mapping[str, TensorSpec] | None = None,
        pause: PauseContext | None = None,
        on_tensor_written: Callable[[str], None] | None = None,
        layout: ReceiverLayout | None = None,
        register: bool = True,
        persist: Callable[[Mapping[str, torch.Tensor], LocalState], None] | None = None,
    ) -> None:
        check_store("Receiver", store)
        check_instance("Receiver", "tensors", tensors, Mapping)
        check_instance("Receiver", "state_dir", state_dir, (str, os.PathLike))
        check_instance(
            "Receiver",
            "config",
            config,
            ReceiverConfig,
            remedy="pass ReceiverConfig(receiver_id=...)",
        )
        if layout is not None:
            check_instance("Receiver", "layout", layout, ReceiverLayout)
        try:
            self.shard = names.check_token("shard", shard)
        except ManifestError as exc:
            raise ConfigError(f"Receiver shard: {exc}") from None
        self.store = store
        self.config = config
        self.tensors = dict(tensors)
        self.specs = (
            dict(specs)
            if specs is not None
            else {
                n: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in self.tensors.items()
            }
        )
        self._check_tensors()
        self._specs_fp = specs_fingerprint(self.specs)
        self._shard_bytes = sum(_numel(sp.shape) * sp.dtype.itemsize for sp in self.specs.values())
        self._layout = layout  # what a parts digest (several writers' parts) is checked with
        record = LayoutRecord.of(layout) if layout is not None else None
        self._layout_desc = record.describe() if record is not None else "the tensors it was given"
        # where this shard's elements come from (None: built from tensors alone, not checked)
        shard_record = record.shards.get(self.shard) if record is not None else None
        self._placements_fp = shard_record.placements if shard_record is not None else None
        self._pause = pause or contextlib.nullcontext
        self._on_tensor = on_tensor_written
        self._persist = persist
        # a version the tensors hold that persist has not taken yet: its state and its ack
        self._unpersisted: tuple[LocalState, AckRecord] | None = None
        self.catalog = Catalog(
            store, signing_key=config.signing_key, limits=config.limits, signed_needs_key=True
        )
        self.dir = StateDir(state_dir, durable=config.durable)
        self._pending_ack: AckRecord | None = None
        self._heartbeat_owed = False
        self._registration_outage = _Outage("registration")
        self._ack_outage = _Outage("ack")
        self._idle_pulls = 0  # pulls that found nothing new, toward scrub_every
        # Restarted while the store could not say whether the held version is committed as
        # held: whether its ack is owed is decided on the next flush of the records.
        self._ack_undecided = False
        # register=False: no registration until the store confirms a version this receiver
        # holds (a pull verified it against the head, or the store commits the version it
        # opened with as held): a sidecar must not stall a bounded-staleness trainer before
        # its first pull, nor name a version its file's metadata merely claims. Only while
        # it restores an anchor is it registered (the anchor, no version), so that gc keeps
        # the anchor under its fetch; a restore that fails withdraws it.
        self._confirmed = register
        # The version the registration this process last wrote names (None: none, withdrawn
        # or removed; _UNWRITTEN: none written yet, so whatever the store holds is not this
        # process's to vouch for). A write begins only once a registration of ours naming a
        # version is withdrawn.
        self._registered: int | object | None = _UNWRITTEN
        # one call at a time: a second thread's pull would replay this one's journal as a
        # crash's and record whichever version finished last over the other's writes
        self._busy = threading.RLock()
        # Registration writes one at a time (re-entrant: a signal handler's heartbeat on a
        # thread already writing one does not deadlock). While a pull or a record of a new
        # version runs (``_quiet``), the state in memory is not what the tensors hold at
        # every moment (withdrawn before the first write, the version before until the state
        # file of the new one is written): heartbeats write nothing then, and the call
        # registers what the tensors hold as it ends.
        self._records = threading.RLock()
        self._quiet = 0
        self._request: str | None = None  # the engine request handed over last (answering)
        # The anchor (version, run id) a restore under way fetches: its registrations name it
        # (ReceiverRecord.restoring) so that retention keeps it, and the versions after it,
        # until the receiver holds what it leads to; None outside such a restore.
        self._restoring: tuple[int, str] | None = None
        # The version held was verified (applied by a pull, or hashed by a scrub) since that
        # request came: only then does a registration naming a version name the request too.
        self._vouched = False
        self._closed = False
        self._who = f"receiver {config.receiver_id!r} shard {self.shard!r}"
        self.last_repair: PullReport | None = None
        self.dir.lock(self._who)
        try:
            self._open()
        except BaseException:  # never constructed: the state dir is not held by it
            self.dir.unlock()
            raise

    def _open(self) -> None:
        """The state dir's records and the tensors, as the constructor finds them: a journal
        replayed, else the held version verified (and its ack owed once the store commits it)."""
        state = self.dir.read_state()
        mine = (self.config.receiver_id, self.shard)
        if state is not None and (state.receiver, state.shard) != mine:
            raise LocalStateError(
                f"state dir {str(self.dir.path)!r} belongs to receiver {state.receiver!r} shard "
                f"{state.shard!r}, not {self.config.receiver_id!r} shard {self.shard!r}"
            )
        self._state = state or LocalState(
            receiver=self.config.receiver_id, shard=self.shard, version=None, state_digest=None
        )
        journal = self.dir.read_journal()
        if journal is not None:
            # Killed mid-scatter: the tensors hold no version until the repair has replayed
            # the journal, so the registration says so (a trainer waiting for acks or for
            # staleness must not count a torn receiver; retention keeps the fresh-receiver
            # chain for it, and a journaled chain it deleted meanwhile means the repair
            # restores the newest anchor instead). In memory too (the journal says so on
            # disk): a heartbeat during the replay's fetch (the keepalive of a large one)
            # registers what self._state says, which must not be the version before the crash.
            self._state = self._state_with(dirty=True)
            self._register_as(self._state)
            try:
                self.last_repair = self._repair(journal)
            except StoreError as exc:
                if isinstance(exc, KeyNotFoundError):
                    raise
                # The store is unreachable (an outage): the engine may still start. The
                # tensors hold no version meanwhile, and the next pull repairs first.
                log.warning(
                    "receiver %r shard %r: the journal of an interrupted apply could not be "
                    "replayed now (%s); it holds no version until a pull replays it",
                    self.config.receiver_id,
                    self.shard,
                    exc,
                )
                self._state = self._state_with(dirty=True)
        else:
            if (
                self.config.verify_on_open
                and self._state.version is not None
                and not self._state.dirty
                and self._live_digest(self._state.state_digest, self._state.version)
                != self._state.state_digest
            ):
                log.warning(
                    "receiver %r shard %r: the tensors do not hash to version %d as recorded; "
                    "marked dirty, the next pull restores the newest anchor",
                    self.config.receiver_id,
                    self.shard,
                    self._state.version,
                )
                self._set_state(dirty=True)
            elif self.config.verify_on_open and self._held() is not None:
                # Verified what it holds: owe the ack of it once the store shows that version
                # committed as held (a process killed between its scatter and its ack comes
                # back here, and the trainer's wait completes, also after an outage).
                self._ack_undecided = True
            self._flush_records()

    def _decide_owed_ack(self) -> None:
        """After a restart: owe the ack of the held version if the store commits it as held;
        while the store cannot be read (an outage, credentials refused) decide later."""
        if self._held() is None:
            self._ack_undecided = False
            return
        committed = self._still_committed()
        if committed is None:
            return
        self._ack_undecided = False
        if committed:
            self._pending_ack = self._ack_of_held()
            self._confirmed = True

    def _ack_of_held(self) -> AckRecord:
        """An ack of the version the local state records, written now."""
        return AckRecord(
            version=self._state.version,
            receiver=self.config.receiver_id,
            shard=self.shard,
            state_digest=self._state.state_digest,
            created_at=time.time(),
            run_id=self._state.run_id,
        )

    def _still_committed(self) -> bool | None:
        """Is the held version committed in the store as this receiver holds it: a manifest
        of that number, with this shard's state digest and (where recorded) lineage? After a
        store reset the same number names another state, whose ack this receiver must not
        write. False when it is not (or its manifest is unusable: the ack is an
        optimisation, never a reason to fail); None when the store could not be read."""
        version, digest = self._state.version, self._state.state_digest
        try:
            manifest = self.catalog.manifest(version)
        except StoreError as exc:
            if isinstance(exc, (KeyNotFoundError, ObjectTooLargeError)):
                return False  # not committed, or not a manifest this receiver reads
            return None
        except DeltaSyncError:  # unusable (unreadable, badly signed)
            return False
        return manifest.shard_digests.get(self.shard) == digest and (
            self._state.run_id in (None, manifest.run_id)
        )

    @classmethod
    def for_layout(
        cls,
        store: Store,
        layout: ReceiverLayout,
        shard: str,
        tensors: Mapping[str, torch.Tensor],
        state_dir: str,
        config: ReceiverConfig,
        **kwargs,
    ) -> Receiver:
        """A receiver whose expected tensors are ``layout``'s local specs of ``shard``."""
        check_instance(
            "Receiver.for_layout",
            "layout",
            layout,
            ReceiverLayout,
            remedy="build it with ReceiverLayout.build(spec, engine, tp) or load the probed one",
        )
        return cls(
            store,
            shard=shard,
            tensors=tensors,
            state_dir=state_dir,
            config=config,
            specs=layout.local_specs(shard),
            layout=layout,
            **kwargs,
        )

    def _check_tensors(self) -> None:
        check_tensors_match(
            self.tensors,
            self.specs,
            what=f"receiver shard {self.shard!r}",
            hint="pass storage names only; tied aliases share storage and need no entry",
        )

    # --- state ------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The version the tensors hold, verified: None before the first, and while
        :attr:`dirty` (the tensors are known not to hold the last verified one, which
        :attr:`verified_version` still names)."""
        return None if self._state.dirty else self._state.version

    @property
    def verified_version(self) -> int | None:
        """The last version verified and recorded, whether or not the tensors still hold it
        (they do not while :attr:`dirty`)."""
        return self._state.version

    @property
    def state_digest(self) -> str | None:
        """The digest of :attr:`version`'s state, as verified (None when it is None)."""
        return None if self._state.dirty else self._state.state_digest

    @property
    def run_id(self) -> str | None:
        """The lineage of :attr:`version` (None when it is None)."""
        return None if self._state.dirty else self._state.run_id

    @property
    def dirty(self) -> bool:
        """True when the tensors are known not to hold :attr:`version`."""
        return self._state.dirty

    def _refuse_regression(self, held: int, head: Manifest) -> None:
        """With a key, the store's newest version below the held one is never followed down
        when it is of the held version's own run (its manifests above were deleted), nor of a
        run that started before it (the held run's manifests were deleted, down to an older
        lineage the same key signed): deleting objects needs no key, so that would let anyone
        who can delete roll the engine back to any older signed version. A run that started
        later (a store reset, a new lineage), or whose start is not known (a run id of the
        releases before), is followed as without a key."""
        mine = self._state.run_id
        if head.run_id is None or mine is None:
            return
        if head.run_id != mine:
            started, held_started = run_started_ms(head.run_id), run_started_ms(mine)
            if started is None or held_started is None or started > held_started:
                return
            raise VersionError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r} holds version "
                f"{held} of run {mine!r}, and the store's newest version is now "
                f"{head.version} of run {head.run_id!r}, which started before it: the newer "
                "run's manifests were removed (by someone who can delete but needs no key, or "
                f"an operator), or a trainer whose clock is behind started it after a store "
                f"reset. It keeps version {held}: nothing was fetched or written. A version "
                f"above {held} is taken as usual; to follow the store back, call invalidate() "
                "and pull"
            )
        raise VersionError(
            f"receiver {self.config.receiver_id!r} shard {self.shard!r} holds version {held} "
            f"of run {head.run_id!r}, and the store's newest version of that run is now "
            f"{head.version}: the manifests above it were removed (by someone who can delete "
            "but needs no key, or an operator). It keeps version "
            f"{held}: nothing was fetched or written. The trainer's next version is taken as "
            "usual; to follow the store back, call invalidate() and pull"
        )

    def _held_manifest(self, held: tuple[int, str]) -> Manifest | None:
        """The manifest of the held version when the store still holds it, with this shard's
        digest: a head older than the held version is then a view that lags (an unreadable
        LATEST and a listing behind the writes), not a store that went back, and the receiver
        stays where it is instead of restoring an older anchor."""
        try:
            manifest = self.catalog.manifest(held[0], fresh=True)
        except DeltaSyncError:
            return None
        return manifest if manifest.shard_digests.get(self.shard) == held[1] else None

    def _held(self) -> tuple[int, str] | None:
        """The verified (version, state digest) usable as a base, or None."""
        if self.dirty or self.version is None or self.state_digest is None:
            return None
        return self.version, self.state_digest

    def _set_state(self, **changes) -> None:
        """Record ``changes`` durably, then hold them. Marking the state dirty goes the other
        way round: in memory first, then the registration withdrawn, then the state file
        (whether or not it can say so: a full disk), so that a receiver never goes on
        reporting a version its tensors are known not to hold, killed in between too."""
        new = self._state_with(**changes)
        if not new.dirty or self._state.dirty:
            self.dir.write_state(new)
            self._state = new
            return
        held, self._state = self._state.version, new
        # Withdrawn before the state file says so: a process killed between the two leaves a
        # registration naming no version (it claims less, never more); the other way round it
        # left one naming the version the tensors were found not to hold, heartbeat fresh.
        self._pending_ack, self._ack_undecided = None, False
        self._register_as(new)  # best effort (a store error is logged)
        try:
            self.dir.write_state(new)
        except LocalStateError as exc:
            remedy = self._room_remedy(exc, "pull, which restores the newest anchor")
            raise LocalStateError(
                f"{self._who}: its tensors no longer hold version {held}. It reports no "
                f"version now and its registration is withdrawn, but its state file could not "
                f"say so ({exc}): {remedy}. A process restarted before then trusts the file "
                "only with verify_on_open"
            ) from exc

    def _room_remedy(self, error: BaseException, then: str) -> str:
        """The remedy that ends a message about a record the state dir did not take, ending
        with ``then`` (the pull to run): ``error`` (a record write's) already names a full
        disk's remedy, where that was its cause, and it is not told twice."""
        if getattr(error.__cause__, "errno", None) in FULL_ERRNOS:
            return f"once there is room, {then}"
        return (
            f"free space in the state dir {str(self.dir.path)!r} (or let this process write "
            f"there) and {then}"
        )

    def _state_with(self, **changes) -> LocalState:
        """The local state with ``changes`` (not written)."""
        fields = {
            "receiver": self._state.receiver,
            "shard": self._state.shard,
            "version": self._state.version,
            "state_digest": self._state.state_digest,
            "dirty": self._state.dirty,
            "run_id": self._state.run_id,
        }
        fields.update(changes)
        return LocalState(**fields)

    # --- records in the store (after the local state, never instead of it) -------------

    @_one_at_a_time
    def close(self) -> None:
        """Let go of the state dir (another process may open it from now on: a restarted
        engine's receiver). Nothing else changes; every later call but ``close`` is refused
        (ConfigError): its records would go into a directory another process may hold."""
        with self._records:  # no heartbeat lands after this returns
            self._closed = True
        self.dir.unlock()

    @_one_at_a_time
    def scrub(self) -> bool:
        """Hash the live tensors (a full read of the shard) and compare with the digest of the
        version held: True when they hold it.

        On a mismatch, something other than this receiver wrote them (a stray write in the
        engine, a bad copy, failing memory): the state is marked dirty and the registration
        says no version, so no trainer counts this receiver as holding one, a warning names
        the receiver, shard and version, and the next pull restores the newest anchor.
        Nothing verified held (fresh, or already dirty): False, nothing is hashed. Not to be
        called while a pull runs."""
        held = self._held()
        if held is None:
            return False
        if self._live_digest(held[1], held[0]) == held[1]:
            self._vouch()
            return True
        self.invalidate(
            f"the live tensors no longer hash to version {held[0]} (written by something else "
            "since it was verified)"
        )
        return False

    @_one_at_a_time
    def invalidate(self, why: str) -> None:
        """Stop holding the verified version: the caller knows the weights the engine computes
        with are no longer it (``why``: a reload by the engine's own loader, kernels rebuilt
        from other weights), though the tensors this receiver writes may still hash to it.

        The state is marked dirty (durably: a receiver restarted on this state dir holds
        nothing either), the registration says no version, an ack still owed is dropped, a
        warning names the receiver, shard, version and ``why``, and the next pull restores
        the newest anchor. A version the tensors hold that ``persist`` has not taken yet is
        dropped too (the next pull replays its journal instead). Nothing verified held:
        nothing else changes. Not to be called while a pull runs."""
        self._unpersisted = None  # not held either: never recorded by a later pull
        held = self._held()
        if held is None:
            return
        log.warning(
            "receiver %r shard %r: %s; version %d marked dirty, the next pull restores the "
            "newest anchor",
            self.config.receiver_id,
            self.shard,
            why,
            held[0],
        )
        self._pending_ack = None
        self._set_state(dirty=True)
        self._register_as(self._state)

    def _scrub_due(self) -> bool:
        """Count a pull that found nothing new; True on every ``scrub_every``-th."""
        every = self.config.scrub_every
        if not every:
            return False
        self._idle_pulls += 1
        if self._idle_pulls < every:
            return False
        self._idle_pulls = 0
        return True

    def heartbeat(self) -> bool:
        """Register (or refresh) this receiver and the version it verifiably holds. A store
        failure is logged and retried on the next pull; returns whether it was written. Any
        thread may call it, beside a pull too: while a pull applies or records a version
        (from the withdrawal of the registration before its first live write until its
        records are written) it writes nothing and returns False, and the pull registers what
        the tensors hold as it ends. ConfigError after close()."""
        with self._records:
            if self._closed:
                raise ConfigError(
                    f"{self._who}: heartbeat() after close(): what it holds was let go "
                    "(another process may have it now). Build a new one. Nothing was written"
                )
            if self._quiet:
                return False
            return self._register_now(self._state)

    @contextlib.contextmanager
    def _heartbeats_held(self) -> Iterator[None]:
        """Heartbeats write nothing inside (a pull, a record of a new version): see
        ``_records`` in the constructor."""
        with self._records:
            self._quiet += 1
        try:
            yield
        finally:
            with self._records:
                self._quiet -= 1

    @property
    def unpersisted_version(self) -> int | None:
        """A version the tensors hold that ``persist`` has not taken yet (its failure raised
        from the pull; the next pull calls it again first), else None. The receiver reports
        the version before it until then."""
        return None if self._unpersisted is None else self._unpersisted[0].version

    def _register_as(self, state: LocalState) -> bool:
        """:meth:`heartbeat` with the version ``state`` records (the one a pull is recording
        while its state file is being written)."""
        with self._records:
            return self._register_now(state)

    def _register_now(self, state: LocalState) -> bool:
        if not self._confirmed and self._restoring is None:
            return True
        # Unconfirmed, it registers only while it restores an anchor, naming the anchor and
        # no version (its file's metadata merely claims one): gc keeps what it fetches.
        held = self._confirmed and not state.dirty and state.version is not None
        rec = ReceiverRecord(
            receiver=self.config.receiver_id,
            shard=self.shard,
            version=state.version if held else None,
            updated_at=time.time(),
            run_id=state.run_id if held else None,
            # a version named for a request only once verified since it came; naming none
            # claims nothing, whenever it is written
            request=self._request if self._vouched or not held else None,
            restoring=None if self._restoring is None else self._restoring[0],
            restoring_run_id=None if self._restoring is None else self._restoring[1],
        )
        try:
            self.store.put(rec.key, rec.to_json(self.config.signing_key))
            self._registered = rec.version
        except StoreError as exc:
            if rec.version is not None:  # its reply may be what was lost: it may stand
                self._registered = rec.version
            self._heartbeat_owed = True
            self._registration_outage.failure(self._who, exc)
            return False
        self._heartbeat_owed = False
        self._registration_outage.success(self._who)
        return True

    def answering(self, request: str | None) -> None:
        """Name the engine request this receiver is being handed (None: none), so that its
        sender can tell a registration that answers it from one an earlier request left,
        which may name the version asked for while the tensors were reloaded by other means
        since (SGLang's ``check_taken``).

        From now on a registration names the request (``ReceiverRecord.request``) when it
        names no version, or once the version it names has been verified since this call: a
        pull applied it, or :meth:`scrub` hashed the tensors to it. Until then a registration
        naming a version names no request (a refusal before any such check vouches for
        nothing). Every call starts over, the same name again too: a request resent after a
        reload is answered only by a new check. Writes nothing itself; the call that takes the
        request (``pull``, ``scrub`` then ``flush_records``) registers."""
        if request is not None:
            try:
                names.check_token("engine request", request)
            except ManifestError as exc:
                raise ConfigError(f"{self._who}: answering(): {exc}. Nothing was written") from None
        with self._records:  # after a registration write in flight, never during it
            self._request, self._vouched = request, False

    def _vouch(self) -> None:
        """The version held was verified just now (applied, or hashed to its digest)."""
        with self._records:
            self._vouched = True

    @_one_at_a_time
    def deregister(self) -> None:
        """Remove this receiver's registration (best effort): e.g. a sidecar whose first pull
        failed, so that no trainer waits on a receiver that holds nothing."""
        self._remove_registration("registration")

    def _remove_registration(self, what: str) -> None:
        """Delete this receiver's registration, best effort (a failure is logged as ``what``
        not removed)."""
        try:
            with self._records:  # after a heartbeat in flight, never before it
                self.store.delete(names.receiver_key(self.config.receiver_id))
                self._registered = None
        except StoreError as exc:
            log.warning("receiver %r: %s not removed (%s)", self.config.receiver_id, what, exc)

    def _flush_records(self, holding: LocalState | None = None, *, inline: bool = False) -> bool:
        """Write the owed ack (if any) and the registration (of ``holding``, the state a
        pull is recording meanwhile, else the recorded one); True when nothing is owed.

        The two are independent records (a trainer waiting for acks counts either), so the
        registration is written on a thread while the ack is written here: their durable
        writes overlap (two store round trips, four fsyncs on a local store: ~1.7 -> ~0.9 ms
        of every pull here). ``inline``: both on the caller's thread, one after the other."""
        state = self._state if holding is None else holding
        if state.dirty:  # it holds no version now: an ack still owed would say otherwise
            self._pending_ack, self._ack_undecided = None, False
        if self._ack_undecided and holding is None:
            self._decide_owed_ack()
        ack = self._pending_ack
        if ack is None:
            return self._register_as(state)
        beat = (
            None
            if inline
            else InBackground(self._register_as, state, name="deltasync-receiver-heartbeat")
        )
        try:
            self.store.put(ack.key, ack.to_json(self.config.signing_key))
            self._pending_ack = None
            self._ack_outage.success(self._who)
        except StoreError as exc:
            self._ack_outage.failure(f"{self._who}, version {ack.version}", exc)
        finally:
            if beat is None:
                self._register_as(state)
                error = None
            else:
                error = beat.wait()
        if error is not None:
            raise error
        return not self._heartbeat_owed and self._pending_ack is None and not self._ack_undecided

    def _report(self, t0: float, **fields) -> PullReport:
        dirty = self.dirty
        return PullReport(
            version=None if dirty else self.version,
            dirty=dirty,
            run_id=None if dirty else self.run_id,
            records_pending=self._pending_ack is not None
            or self._heartbeat_owed
            or self._ack_undecided,
            total_s=time.perf_counter() - t0,
            **fields,
        )

    # --- pull -------------------------------------------------------------------------

    @_one_at_a_time
    def flush_records(self) -> bool:
        """Write what a store failure left owed (the ack of the version held, the
        registration), as every pull does first; True when nothing is owed any more. For a
        caller that holds the version it was asked for and must not pull (an engine's retried
        request). Inside a pull (its own callbacks, from the withdrawal before its first
        write until its records are written) it writes nothing and returns False, as
        :meth:`heartbeat` does; its writes run on the caller's thread (a signal handler's
        call beside a registration write in flight does not wait on itself)."""
        with self._records:
            if self._quiet:
                return False
        return self._flush_records(inline=True)

    @_one_at_a_time
    def replay_journal(self) -> PullReport | None:
        """Replay the journal an interrupted pull left (what the next pull does first), and
        return its report; None when there is none. For a caller that must agree with others
        on the first write of the version it asks for (an engine's TP ranks): the replay is
        this receiver's own repair, done before that agreement."""
        if self._unpersisted is not None:
            self._settle()  # raises while persist still fails; records the version once not
        journal = self.dir.read_journal()
        return None if journal is None else self._repair(journal)

    @_one_at_a_time
    def pull(self, version: int | None = None) -> PullReport:
        """Bring the tensors to the newest committed version (or to exactly ``version``, e.g.
        the one an engine was told to take, even if a newer one commits meanwhile); see the
        module docstring.

        Repairs an interrupted apply first (its journal), then applies the chain from the
        local state, or from the newest anchor when the local state cannot be a base.

        Returns:
            A :class:`PullReport`: the version now held (None while dirty), the chain applied,
            bytes fetched, elements written and the stage / verify / pause times.

        Raises:
            VersionError: before anything is written, when ``version`` is not committed in the
                store, or is older than the version held while the store still holds that one.
        """
        if version is not None:
            names.check_version(version)
        # before anything is fetched, journaled or written: a tensor freed or resized since
        # construction is refused here, every tensor untouched, not midway through a scatter
        check_tensors_still_match(self.tensors, self.specs, what=f"receiver shard {self.shard!r}")
        t0 = time.perf_counter()
        self.dir.ensure()  # removed behind it: made again, and held again by this process
        # An earlier pull's journal (it failed after writing it) is replayed first, then on
        # to the newest version like any pull: a caller asking for the head must get it, not
        # the version the failed pull was going to.
        repair = self.replay_journal()
        if repair is None:
            return self._pull(t0, version)
        if repair.version is None:
            return repair
        return _then(repair, self._pull(time.perf_counter(), version))

    def _target(self, version: int) -> Manifest:
        """The committed manifest of ``version``, read afresh (VersionError if none)."""
        try:
            return self.catalog.manifest(version, fresh=True)
        except KeyNotFoundError:
            raise VersionError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: version {version} "
                f"is not committed in the store (newest: {self.catalog.latest()}). Nothing was "
                "fetched or written"
            ) from None

    def _pull(self, t0: float, target: int | None = None) -> PullReport:
        head = self.catalog.head() if target is None else self._target(target)
        held = self._held()
        previous = None if held is None else held[0]
        if head is not None and held is not None and head.version < held[0]:
            kept = self._held_manifest(held)
            if kept is not None and target is not None:
                raise VersionError(
                    f"receiver {self.config.receiver_id!r} shard {self.shard!r} holds version "
                    f"{held[0]}, newer than the version {target} asked for, and a receiver never "
                    "goes back: take the newest. Nothing was fetched or written"
                )
            if kept is None and self.config.signing_key is not None:
                self._refuse_regression(held[0], head)
            head = kept or head
        idle = head is None or (
            held is not None
            and head.version == held[0]
            and head.shard_digests.get(self.shard) == held[1]
        )
        if idle and held is not None and self._scrub_due():
            if self.scrub():
                self._confirmed = True
                self._flush_records()
                return self._report(t0, previous_version=previous, scrubbed=True)
            if head is None:  # nothing committed to restore from
                return self._report(t0, previous_version=previous, scrubbed=True, drifted=True)
            report = self._pull(t0, target)  # dirty now: restores the newest anchor
            return replace(report, previous_version=previous, scrubbed=True, drifted=True)
        if idle:
            if head is not None and head.run_id != self._state.run_id:
                self._relabel(head)
            self._confirmed = self._confirmed or (held is not None and head is not None)
            self._flush_records()
            return self._report(t0, previous_version=previous)
        self._check_layout(head)
        try:
            manifests = self.catalog.shard_chain(self.shard, held, head)
        except VersionError:
            # a gap on the way: retention deleted it once a newer version (and the anchor it
            # keeps) committed after the head was read; that version is the one to take
            newer = None if target is not None else self.catalog.head()
            if newer is None or newer.version <= head.version:
                raise
            return self._pull(t0)
        if manifests[0].kind == "anchor":
            why = (
                "it holds no verified version"
                if self.verified_version is None
                else "its state is dirty"
                if self.dirty
                else f"the store regressed below its version {held[0]}"
                if held is not None and head.version < held[0]
                else f"no delta builds on its version {self.version} and state digest (another "
                "lineage, or the chain starts over)"
            )
            log.info(
                "receiver %r shard %r: restoring anchor %d of run %s (%s), then %d version(s) "
                "to %d",
                self.config.receiver_id,
                self.shard,
                manifests[0].version,
                manifests[0].run_id,
                why,
                len(manifests) - 1,
                head.version,
            )
            start = None
        else:
            start = previous
        try:
            return self._run(manifests, start, t0, repaired=False)
        except DriftError:
            if not self.config.restore_drift or start is None:
                raise
        log.warning(
            "receiver %r shard %r: the live tensors no longer hold version %s (written by "
            "something else); restoring the newest anchor in this pull (restore_drift)",
            self.config.receiver_id,
            self.shard,
            previous,
        )
        report = self._pull(t0, target)  # dirty now: restores the newest anchor
        return replace(report, previous_version=previous, drifted=True)

    def _relabel(self, head: Manifest) -> None:
        """The head is the held version's number and this shard's state digest under another
        lineage (a store reset, then a deterministic re-run): the tensors hold that version as
        it is, so the receiver records it under the head's run id and owes its ack. Kept
        under the old run id, its registration would count as nothing of the head's lineage,
        and a bounded-staleness trainer would wait for it for good."""
        log.info(
            "receiver %r shard %r: version %d of run %s is the state it holds (run %s): "
            "recorded under that run",
            self.config.receiver_id,
            self.shard,
            head.version,
            head.run_id,
            self._state.run_id,
        )
        self._set_state(run_id=head.run_id)
        self._ack_undecided = False
        self._pending_ack = self._ack_of_held()

    def _check_layout(self, manifest: Manifest) -> None:
        """Refuse, before any fetch, a version built for another layout than this shard's."""
        _refuse_another_layout(
            manifest,
            self.shard,
            self.specs,
            self._specs_fp,
            self._placements_fp,
            self._layout_desc,
        )

    def _stage(
        self, manifests: list[Manifest], from_version: int | None, files: contextlib.ExitStack
    ):
        """Fetch and check the chain's blobs; decode them now when small (``staged``), else
        leave them to be read one tensor at a time by verify and again by the scatter. Blobs
        above the staged budget together: the largest are spilled to private files in the
        state dir (:func:`spill_plan`), which ``files`` closes when the pull ends."""
        check_chain(manifests, from_version, self.shard)
        for m in manifests:
            self._check_layout(m)
        steps, fetched, raw = [], 0, 0
        entries = [b for m in manifests for b in m.blobs_for(self.shard)]
        size = sum(b.size for b in entries)
        spill = spill_plan(entries, self._staged_budget())
        with self._heartbeats_while_fetching(size):
            for m in manifests:
                blobs, n = open_version(
                    self.store,
                    m,
                    self.shard,
                    self.specs,
                    max_decompressed_bytes=self.config.max_decompressed_bytes,
                    narrow_indices=True,  # 6 bytes per decoded element instead of 10
                    spill=spill,
                    spill_dir=str(self.dir.path),
                    files=files,
                )
                steps.append((m.version, m.kind, blobs))
                fetched += n
                raw += sum(b.raw_len for b in blobs)
        if raw * _DECODED_PER_RAW <= self._staged_budget():
            steps = [(v, kind, [Records(list(b)) for b in blobs]) for v, kind, blobs in steps]
        return steps, fetched

    def _staged_budget(self) -> int:
        """Decoded bytes a pull may hold beside the live tensors (``max_staged_bytes``)."""
        budget = self.config.max_staged_bytes
        if budget is None:
            budget = max(self._shard_bytes // 16, MIN_STAGED_BYTES)
        return budget

    @contextlib.contextmanager
    def _heartbeats_while_fetching(self, size: int) -> Iterator[None]:
        """A fetch of ``size`` bytes, with the registration refreshed every
        ``fetch_heartbeat_s`` on a thread of its own when it is large (a store failure is
        logged by the heartbeat and tried again at the next beat)."""
        every = self.config.fetch_heartbeat_s
        if not every or size <= FETCH_HEARTBEAT_MIN_BYTES:
            yield
            return
        done = threading.Event()

        def beat() -> None:
            while not done.wait(every):
                try:
                    self.heartbeat()
                except Exception:  # the pull goes on; it registers as it ends
                    log.exception("receiver %r: a heartbeat during a fetch failed", self._who)

        thread = threading.Thread(target=beat, name="deltasync-receiver-fetch-heartbeat")
        thread.daemon = True  # never keeps the process alive; joined below
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()  # at most one registration write in flight

    def _run(
        self, manifests: list[Manifest], from_version: int | None, t0: float, *, repaired: bool
    ) -> PullReport:
        # the spill files of large blobs: closed (and so gone, being unlinked) however the
        # pull ends
        with contextlib.ExitStack() as files:
            return self._run_staged(manifests, from_version, t0, files, repaired=repaired)

    def _run_staged(
        self,
        manifests: list[Manifest],
        from_version: int | None,
        t0: float,
        files: contextlib.ExitStack,
        *,
        repaired: bool,
    ) -> PullReport:
        try:
            if manifests[0].kind == "anchor":
                # inside: an interrupt during its registration write must not leave the
                # anchor named by every later heartbeat (the finally below forgets it)
                self._restore_starts(manifests[0])
            try:
                t = time.perf_counter()
                staged = self._stage(manifests, from_version, files)
                stage_s = time.perf_counter() - t
            except DeltaSyncError:
                for m in manifests:  # a repaired store heals on the next pull
                    self.catalog.forget(m.version)
                raise
            # Heartbeats are held from the end of the fetch (before the journal's thread may
            # withdraw the registration) to the end of the record, not during the fetch: the
            # tensors hold the version before all along it, and a heartbeat (a keepalive
            # beside a long fetch) keeps this receiver live, so retention keeps the chain it
            # is fetching.
            with self._heartbeats_held():
                return self._apply(manifests, from_version, t0, staged, stage_s, repaired=repaired)
        except Exception:
            # The restore failed (its fetch, or the refused withdrawal before its first
            # write): the registration this pull wrote last names the anchor, heartbeat
            # fresh, and would keep it and every version after it until that heartbeat
            # expires. Registered again without it (best effort: a store error is logged).
            self._restore_ends()
            raise
        finally:
            # Recorded, the new version's registration named no anchor already (_record);
            # failed, _restore_ends registered again without it. An interrupt skips that
            # write: the registration names the anchor until the next one (a pull or a
            # heartbeat) or until it expires.
            with self._records:
                self._restoring = None

    def _restore_starts(self, anchor: Manifest) -> None:
        """Register, before the fetch, the anchor about to be restored: retention keeps, for
        a receiver that holds nothing usable, only the newest anchor's chain otherwise, and a
        trainer anchoring faster than this receiver fetches would delete every anchor under
        it in turn. The fetch's heartbeats keep the registration fresh. A store failure is
        logged and the fetch goes on (unprotected, as before this record field)."""
        with self._records:
            self._restoring = (anchor.version, anchor.run_id)
            if not self._quiet:
                self._register_now(self._state)

    def _restore_ends(self) -> None:
        """A restore under way stopped without recording its version: register what
        ``self._state`` says, naming no anchor. A torn scatter (its journal on disk) is
        not over: the next pull replays it, naming the anchor again."""
        with self._records:
            if self._restoring is None:
                return
            self._restoring = None
            if self._quiet:
                return
            try:
                torn = self.dir.read_journal() is not None
            except Exception:  # unreadable: the next pull deals with it
                torn = True
            if torn:
                return
            if self._confirmed:
                self._register_now(self._state)
                return
            # unconfirmed: registered for the restore alone, so it is withdrawn with it
            self._remove_registration("registration of a failed restore")

    def _apply(
        self,
        manifests: list[Manifest],
        from_version: int | None,
        t0: float,
        staged: tuple[list, int],
        stage_s: float,
        *,
        repaired: bool,
    ) -> PullReport:
        previous = None if self.dirty else self.version
        target = manifests[-1]
        versions = [m.version for m in manifests]
        expected = target.shard_digests[self.shard]
        steps, fetched = staged
        # The journal's fsyncs overlap the verify pass (they release the GIL): it only has to
        # be durable before the first live write, and a refused or failed verify removes it.
        # (Killed in between, the next start replays a chain that writes what verify checked,
        # or, for a chain verify would have refused, fails its replay and restores an anchor.)
        # A repair replays the journal it found: that one stays until the replay has ended.
        journaled = threading.Event()  # the journal file's write has ended (or none is due)
        record = Journal(
            receiver=self.config.receiver_id,
            shard=self.shard,
            from_version=from_version,
            steps=tuple(JournalStep.of(m, self.shard) for m in manifests),
        )
        journal: InBackground | None = None
        try:
            with interrupts_deferred():  # handed off and named together: never one alone
                journal = InBackground(
                    self._withdraw if repaired else self._journal_then_withdraw,
                    record,
                    journaled,
                    name="deltasync-receiver-record",
                )
            # Verify before write: one full read of the chain's records (every record's
            # structure and every writer/anchor check) and of the resulting state, tensor by
            # tensor; nothing is written until it has finished.
            t = time.perf_counter()
            digest = self._chain_digest(steps, expected, target.version)
            verify_s = time.perf_counter() - t
        except BaseException as exc:
            if journal is not None:
                self._drop_journal(journal, journaled, repaired)
            if isinstance(exc, DeltaSyncError):
                for m in manifests:
                    self.catalog.forget(m.version)
            raise
        if digest != expected:
            self._drop_journal(journal, journaled, repaired)
            for m in manifests:
                self.catalog.forget(m.version)
            self._refused(versions, digest, expected, from_version)
        try:
            error = journal.wait()  # durable before the first live write
        except BaseException:  # an interrupt: nothing was written
            self._drop_journal(journal, journaled, repaired)
            raise
        if error is not None:  # nothing was written: no journal left, the registration again
            self._drop_journal(journal, journaled, repaired)
        if isinstance(error, LocalStateError):
            raise LocalStateError(
                f"version {target.version} not taken by receiver shard {self.shard!r}: "
                f"{error}. Nothing was written (the tensors hold what they held); "
                f"{self._room_remedy(error, 'pull again')}"
            ) from error
        if error is not None:
            raise error
        # The same records again (the blobs' bytes are immutable and fully checked above),
        # one tensor at a time, in chain order. Decoded on this thread: a decode thread would
        # shorten the pause, but its malloc arena kept ~30 MiB resident after an anchor pull
        # of a 61 MiB shard (memory that malloc_trim did not return), more than it saves.
        t = time.perf_counter()
        written = 0
        writing = False
        before = self._state
        # The first step's dense records (an anchor's every tensor) are decoded straight into
        # their live tensors by the chain read itself, not into a new array copied after: a
        # live write inside the iterator, before apply_pieces sees the tensor. Only the first
        # step's: its piece comes first in chain order, so whenever the read (read ahead in
        # lockstep, too) decodes it, no piece of that tensor was written before it, and the
        # later steps' pieces overwrite it in apply_pieces (their dense records stay arrays
        # of their own: a read ahead of one must not write the tensor before its turn).
        first_version, first_kind, first_streams = steps[0]
        direct = bool(first_streams) and all(isinstance(b, BlobRecords) for b in first_streams)
        if direct:
            into = [b.writing_into(self.tensors) for b in first_streams]
            steps = [(first_version, first_kind, into), *steps[1:]]
        try:
            # (a pause that suppressed an error midway raises: torn, as after any error here)
            with inside_pause(self._pause, f"versions {versions} on shard {self.shard!r}"):
                if direct:
                    # torn from before the iteration: its reads write the live tensors
                    writing = True
                    self._state = self._state_with(dirty=True)
                # Tensors written by a step before the last (or by one of the last step's
                # several writers): each may be written again by a later one, so each is
                # reported once the last step's writes end.
                earlier: dict[str, None] = {}
                for final, item in _step_by_step(steps, self.specs):
                    if not writing:
                        # Torn from the first write until the last: no version, in memory
                        # (the journal says so on disk), for whatever asks meanwhile (a
                        # progress callback, the engine's pause, a heartbeat).
                        writing = True
                        self._state = self._state_with(dirty=True)
                    written += apply_pieces(item, self.tensors, ordered=True)  # decoder-proven
                    if not final:
                        earlier[item.name] = None
                    elif self._on_tensor is not None:
                        earlier.pop(item.name, None)
                        self._on_tensor(item.name)
                    del item  # a record is freed before the next one is decoded
                if self._on_tensor is not None:
                    for name in earlier:
                        self._on_tensor(name)
        except BaseException as exc:
            self._interrupted(exc, writing, repaired, versions)
            raise
        if self._persist is not None:
            # The version a receiver with a persist reports is the one persisted: the one
            # before, until persist takes the new one (below). Without one the state stays
            # dirty in memory until the record below names the new version, so that an
            # interrupt in between leaves no version claimed (the journal on disk says so).
            self._state = before
        pause_s = time.perf_counter() - t
        del steps

        if (
            self.config.verify_after_write
            and self._live_digest(expected, target.version) != expected
        ):
            log.error(
                "receiver %r shard %r: the tensors changed during the scatter of version %d; "
                "marked dirty, the next pull restores the newest anchor",
                self.config.receiver_id,
                self.shard,
                target.version,
            )
            self._set_state(dirty=True)
            self.dir.clear_journal()
            self._flush_records()
            raise IntegrityError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: the state verified "
                f"before the write of versions {versions} did not survive it (something else "
                "wrote the live tensors during the pause); marked dirty, the next pull restores "
                "the newest anchor"
            )
        # From here the tensors hold the target version: persisted (when the receiver has a
        # persist), then recorded.
        held = self._state_with(
            version=target.version, state_digest=expected, dirty=False, run_id=target.run_id
        )
        ack = AckRecord(
            version=target.version,
            receiver=self.config.receiver_id,
            shard=self.shard,
            state_digest=expected,
            created_at=time.time(),
            run_id=target.run_id,
            pause_s=pause_s,
            total_s=time.perf_counter() - t0,
        )
        if self._persist is None:
            self._record(held, ack)
        else:
            self._unpersisted = (held, ack)
            self._settle()
        return self._report(
            t0,
            previous_version=previous,
            chain=tuple(versions),
            from_anchor=manifests[0].kind == "anchor",
            repaired=repaired,
            bytes_fetched=fetched,
            elements_written=written,
            stage_s=stage_s,
            verify_s=verify_s,
            pause_s=pause_s,
        )

    def _settle(self) -> None:
        """Persist the version the tensors hold, then record it; while persist raises, raise
        (every record keeps the version before, the journal stays)."""
        with self._heartbeats_held():
            self._persist_and_record()

    def _persist_and_record(self) -> None:
        held, ack = self._unpersisted
        try:
            self._persist(self.tensors, held)
        except Exception as exc:
            # what the persisted copy holds, the version before, is what the records name
            self._register_as(self._state)
            if isinstance(exc, DeltaSyncError):
                raise
            raise ApplyError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: persisting "
                f"version {held.version} failed ({type(exc).__name__}: {exc}); it reports "
                f"version {self.version} until the next pull persists it"
            ) from exc
        self._unpersisted = None
        self._record(held, ack)

    def _record(self, held: LocalState, ack: AckRecord) -> None:
        """Record the version the tensors hold. The state file, the ack and the registration
        are three independent durable records of that one fact, written at once (their
        fsyncs overlap: ~0.7 ms of every pull). The journal goes once the state file is
        durable; killed before that, the next start replays the journaled chain, which writes
        what the tensors already hold. A failed state file write raises with the journal kept
        (the next pull replays it); an ack that went out meanwhile states what the tensors
        hold."""
        self._ack_undecided = False  # a later version's ack and registration supersede it
        self._pending_ack = ack
        with self._records:  # it holds what the anchor led to: nothing left to keep for it
            self._restoring = None
        self._confirmed = True
        self._vouch()  # verified before its first write, written whole
        local = InBackground(self._record_state, held, name="deltasync-receiver-state")
        try:
            self._flush_records(holding=held)
        finally:
            error = local.wait()
        if error is not None:
            if self._state is not held:
                # The state file still records the version before this pull, which the
                # tensors no longer hold: no version until the journal is replayed (in memory:
                # the journal on disk says the same to a restart).
                self._state = self._state_with(dirty=True)
                if isinstance(error, LocalStateError):
                    raise LocalStateError(
                        f"version {held.version} was written to receiver shard {self.shard!r} "
                        f"but not recorded: {error}. It reports no version until a pull "
                        f"replays the journal: {self._room_remedy(error, 'pull again')}"
                    ) from error
            raise error

    def _interrupted(
        self, exc: BaseException, writing: bool, repaired: bool, versions: list[int]
    ) -> None:
        """The scatter raised (the engine's pause refused, an error or an interrupt midway).
        Before its first write nothing changed: the journal goes (a repair's stays: it is the
        crash's). After it the tensors are torn until the journal is replayed (the next pull
        does that first, as a restart would), so this receiver holds no version meanwhile, and
        its registration says so."""
        if not writing:
            if not repaired:
                self.dir.clear_journal()
                if isinstance(exc, Exception):
                    self._register_as(self._state)  # withdrawn for the write that never came
            return
        log.error(
            "receiver %r shard %r: the scatter of versions %s stopped midway (%s); the "
            "tensors hold no version until the next pull replays the journal",
            self.config.receiver_id,
            self.shard,
            versions,
            type(exc).__name__,
        )
        self._state = self._state_with(dirty=True)  # in memory: the journal is on disk
        if isinstance(exc, Exception):
            self._register_as(self._state)  # best effort (a store error is logged)

    def _record_state(self, state: LocalState) -> None:
        """Write ``state`` durably (this receiver's recorded state from then on, whatever
        follows), then drop the journal it makes redundant."""
        self.dir.write_state(state)
        self._state = state
        self.dir.clear_journal()

    def _journal_then_withdraw(self, journal: Journal, journaled: threading.Event) -> None:
        """What must be on record before the first live write: the journal (durable), then a
        registration naming no version, since the tensors hold none from the first write to
        the last (a process killed in the scatter leaves tensors that outlive it holding
        neither version, and its registration, heartbeat fresh, must not name one). On its
        thread, beside the verify pass; :meth:`_withdraw` says when a refused withdrawal
        stops the write."""
        try:
            self.dir.write_journal(journal)
        finally:
            journaled.set()
        self._withdraw(journal, journaled)

    def _withdraw(self, _journal: Journal, journaled: threading.Event) -> None:
        """A registration naming no version, before the first live write (a replay's too:
        its journal may be this process's own, left by a failed record, not a crash's). One
        the store refused, over a registration this process wrote naming a version that the
        store may still hold, is a StoreError: the write does not begin, since that
        registration would go on naming the version before over tensors that hold neither. (A
        registration this process never wrote, e.g. an earlier process's when every write of
        this one failed, does not stop the pull: it ages out with that process's heartbeat.)"""
        journaled.set()  # a replay writes no journal: its crash's is on disk
        withdrawn = self._register_as(self._state_with(dirty=True))
        if not withdrawn and self._registered not in (None, _UNWRITTEN) and self._named():
            raise StoreError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: its registration "
                f"could not be withdrawn before the first write (the store refused the write: "
                f"{self._registration_outage.last}); nothing was written. Pull again once the "
                "store takes writes"
            )

    def _named(self) -> bool:
        """Whether the store may hold a registration of this receiver naming a version (one
        that does not parse or verify names nothing to its readers, nor does a key no reader
        can see: something planted in its place). One the store holds but would not return
        now (an outage) may: its readers read it again once the outage is over, and a crash
        in the scatter would leave it naming the version before, heartbeat fresh, over
        tensors that hold neither."""
        try:
            rec = self.catalog.receiver(self.config.receiver_id, strict=True)
        except StoreError as exc:
            log.warning(
                "receiver %r shard %r: its registration could not be read (%s)",
                self.config.receiver_id,
                self.shard,
                exc,
            )
            try:
                return self.store.exists(names.receiver_key(self.config.receiver_id))
            except StoreError:
                return True
        return rec is not None and rec.version is not None

    def _drop_journal(
        self, journal: InBackground, journaled: threading.Event, repaired: bool
    ) -> None:
        """Nothing was written: remove the journal the background write left (if it wrote),
        and register again the version the tensors still hold. A repair's journal is the
        crash's and stays (the repair decides what follows).

        The journal file's write (milliseconds of fsyncs) and its removal run with interrupts
        held, whatever stopped the pull, so that the file never lands after the removal or
        beside this receiver's next call, nor stays for a second Ctrl-C; the withdrawal's
        store write after it stays interruptible (a withdrawal that lands late names no
        version: it claims less, never more)."""
        with interrupts_deferred():
            journaled.wait()
            if not repaired:
                self.dir.clear_journal()
        if not repaired:
            journal.wait()  # the withdrawal first, then the version the tensors still hold
            self._register_as(self._state)

    # --- digests ----------------------------------------------------------------------

    def _live_digest(self, listed: str, version: int) -> str:
        """The live tensors' digest in the form of ``listed`` (a manifest's digest of this
        shard, of ``version``): the state digest, or the parts digest of several writers."""
        parsed = parse_parts_digest(listed)
        if parsed is None:
            return state_digest(self.tensors)
        count = parsed[0]
        parts = receiver_part_digests(
            self.tensors, layout=self._parts_layout(version), shard=self.shard, count=count
        )
        return parts_digest([parts[k] for k in range(count)])

    def _chain_digest(self, steps: list, listed: str, version: int) -> str:
        """The digest the tensors will have after the chain ``steps`` (to ``version``), in
        the form of ``listed``, read one tensor at a time; the tensors are not written."""
        parsed = parse_parts_digest(listed)
        if parsed is None:
            # A blob spilled to a file (a first pull's anchor) has its large dense records
            # hashed a chunk at a time, never held whole; blobs held in memory (the small
            # pulls) are read as they are. (The parts digest below reads records whole.)
            lazy = [
                (v, kind, [s.lazily() if _in_file(s) else s for s in streams])
                for v, kind, streams in steps
            ]
            if len(steps) < 2 or not any(_in_file(s) for _, _, ss in steps for s in ss):
                return chain_state_digest(self.tensors, iter_chain(lazy, self.specs))
            # A spilled chain of several versions (a catch-up) parks each large sparse
            # piece, as it is read, in an unlinked file beside the spills: a large tensor's
            # pieces of every version are hashed together, a chunk at a time, never all
            # held decoded at once (see deltasync.format.stash).
            with Stash(str(self.dir.path), chunk=CHUNK_ELEMENTS) as stash:
                chain = iter_chain(lazy, self.specs, keep=stash.keep)
                return chain_state_digest(self.tensors, chain)
        count = parsed[0]
        layout = self._parts_layout(version)
        spilled = any(_in_file(s) for _, _, streams in steps for s in streams)
        # the record headers are read once here, for the chain's reading order too
        steps = [(v, kind, [NamedOnce(s) for s in streams]) for v, kind, streams in steps]
        names_listed = {n for _, _, streams in steps for stream in streams for n in stream.names()}
        with contextlib.ExitStack() as scope:
            keep = None
            if spilled:
                # A spilled pull from several writers parks each writer's large sparse piece
                # as it is read (as a catch-up does): a tensor's pieces are hashed a row
                # chunk's share at a time, never held decoded together.
                keep = scope.enter_context(Stash(str(self.dir.path), chunk=CHUNK_ELEMENTS)).keep
            parts = chain_part_digests(
                self.tensors,
                iter_chain(steps, self.specs, keep=keep),
                listed=names_listed,
                layout=layout,
                shard=self.shard,
                count=count,
                # tensors listed ahead of their turn are held up to the staging budget (at
                # least the shard's largest tensor, as a chain read holds about one tensor's
                # pieces), the rest read again (checked already by the first read)
                again=lambda: iter_chain(steps, self.specs, check=False, keep=keep),
                max_held=max(
                    self._staged_budget() // _HELD_BYTES_PER_ELEMENT,
                    max((_numel(sp.shape) for sp in self.specs.values()), default=0),
                ),
            )
        return parts_digest([parts[k] for k in range(count)])

    def _parts_layout(self, version: int) -> ReceiverLayout:
        """The layout a parts digest is checked with; ConfigError (nothing written) without."""
        if self._layout is None:
            raise ReceiverLayoutRequiredError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: version {version} "
                "lists a parts digest of this shard (several writers published it without the "
                "full state), which is checked with the receiver layout, and this Receiver was "
                "built without one. Nothing was written: build it with Receiver.for_layout(store, "
                "layout, shard, ...) (or pass layout=)"
            )
        return self._layout

    def _refused(
        self, versions: list[int], digest: str, expected: str, from_version: int | None
    ) -> None:
        """The chain does not lead to the manifest's state: refuse it, nothing written. If
        the live tensors no longer hash to the recorded version either, they are dirty."""
        held = self._held()
        still = held is None or self._live_digest(held[1], held[0]) == held[1]
        if not still:
            self._set_state(dirty=True)
            self._flush_records()
        log.error(
            "receiver %r shard %r: versions %s would lead to state digest %s, the manifest "
            "says %s; refused before any write%s",
            self.config.receiver_id,
            self.shard,
            versions,
            digest,
            expected,
            ""
            if still
            else " (and the live tensors no longer hash to the recorded version: marked dirty)",
        )
        where = (
            f"version {self.version}"
            if still and held is not None
            else "no verified version (the next pull restores the newest anchor)"
        )
        raise (IntegrityError if still else DriftError)(
            f"receiver {self.config.receiver_id!r} shard {self.shard!r}: applying versions "
            f"{versions} (from {from_version}) would give state digest {digest}, but manifest "
            f"{versions[-1]} says {expected}. Refused before any write: the tensors still hold "
            f"{where}. Check that publisher and receiver use the same layout and model config, "
            "or repair the manifest"
        )

    # --- repair -----------------------------------------------------------------------

    def _repair(self, journal: Journal) -> PullReport:
        """Finish an apply a crash interrupted: replay the journaled chain (see journal.py),
        or, if the store no longer has it, restore the newest anchor."""
        t0 = time.perf_counter()
        if journal.shard != self.shard or journal.receiver != self.config.receiver_id:
            raise LocalStateError(
                f"journal in {str(self.dir.path)!r} is for receiver {journal.receiver!r} shard "
                f"{journal.shard!r}, not this one"
            )
        journaled = [s.version for s in journal.steps]
        try:
            manifests = [self.catalog.manifest(s.version, fresh=True) for s in journal.steps]
            for m, step in zip(manifests, journal.steps, strict=True):
                if JournalStep.of(m, self.shard) != step:
                    raise ManifestError(
                        f"manifest {m.version} no longer matches the journal (the store was "
                        "rewritten under this receiver)"
                    )
            log.warning(
                "receiver %r shard %r: found the journal of an interrupted apply (versions %s "
                "from %s); replaying it",
                self.config.receiver_id,
                self.shard,
                journaled,
                journal.from_version,
            )
            return self._run(manifests, journal.from_version, t0, repaired=True)
        except LocalStateError:
            raise
        except (*_UNREPLAYABLE, IntegrityError) as exc:
            log.warning(
                "receiver %r shard %r: the journaled chain %s cannot be replayed (%s: %s); "
                "marking the state dirty and restoring the newest anchor",
                self.config.receiver_id,
                self.shard,
                journaled,
                type(exc).__name__,
                exc,
            )
        # The tensors are a mix of journaled steps that can no longer be fetched: only a full
        # anchor can restore them. Record that durably before dropping the journal.
        self._set_state(dirty=True)
        self.dir.clear_journal()
        self._flush_records()
        head = self.catalog.head()
        if head is None:
            raise VersionError(
                f"the journaled versions {journaled} (from {journal.from_version}) are gone "
                "and the store has no committed version: this receiver cannot be repaired "
                "until an anchor is published"
            )
        self._check_layout(head)
        manifests = self.catalog.shard_chain(self.shard, None, head)
        log.info(
            "receiver %r shard %r: restoring anchor %d (its state is dirty: the journal of "
            "versions %s could not be replayed), then %d version(s) to %d",
            self.config.receiver_id,
            self.shard,
            manifests[0].version,
            journaled,
            len(manifests) - 1,
            head.version,
        )
        return self._run(manifests, None, t0, repaired=True)


def _then(first: PullReport, then: PullReport) -> PullReport:
    """One report of a repair followed by a pull on from where it left the tensors."""
    return replace(
        then,
        previous_version=first.previous_version,
        chain=first.chain + then.chain,
        from_anchor=first.from_anchor if first.chain else then.from_anchor,
        repaired=True,
        bytes_fetched=first.bytes_fetched + then.bytes_fetched,
        elements_written=first.elements_written + then.elements_written,
        stage_s=first.stage_s + then.stage_s,
        verify_s=first.verify_s + then.verify_s,
        pause_s=first.pause_s + then.pause_s,
        total_s=first.total_s + then.total_s,
    )


def _step_by_step(
    steps: list, specs: Mapping[str, TensorSpec]
) -> Iterator[tuple[bool, TensorPieces]]:
    """The write pass's reading of a verified chain: each step's records in turn, each
    tensor's pieces of that step alone, in chain order, with whether the tensor holds its
    final values once the item is written. Written in this order the tensors end as
    :func:`iter_chain` over the whole chain leaves them (each element holds the last step's
    value that lists it: later steps are written later), while only one step's records of a
    tensor are held at a time: grouped over the whole chain, a catch-up held every version's
    piece of a large tensor (the embedding) together, each beside the section it was
    decoded from. The first step is the anchor, if any (``from_zero``: its tensors start
    from zeros); the verify pass proved every step before this one reads it.

    A step of several writers is read one writer's blob at a time: the verify proved their
    elements disjoint, so in any order they leave the same tensor, and one writer's piece
    of a tensor is held, not every writer's (an anchor's embedding from two FSDP writers:
    two pieces of 6 bytes an element of half the rows each). An anchor's tensor starts from
    zeros at its first writer's piece only. Such a step's tensors are final only once every
    writer's blob is written: none of its items is final (the caller reports them after)."""
    for i, (version, kind, streams) in enumerate(steps):
        last = i == len(steps) - 1
        if len(streams) < 2:
            for item in iter_chain([(version, kind, streams)], specs, check=False):
                yield last, item
                del item
            continue
        begun: set[str] = set()
        for stream in streams:
            for item in iter_chain([(version, kind, [stream])], specs, check=False):
                if item.from_zero and item.name in begun:
                    item = replace(item, from_zero=False)  # zeroed by an earlier writer's piece
                begun.add(item.name)
                yield False, item
                del item


def _in_file(stream: object) -> bool:
    return isinstance(stream, BlobRecords) and stream.in_file


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _refuse_another_layout(
    manifest: Manifest,
    shard: str,
    specs: Mapping[str, TensorSpec],
    specs_fp: str,
    placements_fp: str | None,
    layout_desc: str,
) -> None:
    rec = manifest.layout
    if rec is None:
        return
    mine = rec.shards.get(shard)
    if mine is None:
        raise LayoutMismatchError(
            f"version {manifest.version} was published for {rec.describe()}, shards "
            f"{list(rec.shards)[:8]}; this receiver holds shard {shard!r} of "
            f"{layout_desc}. Nothing was fetched or written: build the receiver for "
            "the publisher's layout (or publish for this one)"
        )
    if mine.specs != specs_fp:
        numel = sum(_numel(s.shape) for s in specs.values())
        raise LayoutMismatchError(
            f"version {manifest.version} was published for {rec.describe()}: shard "
            f"{shard!r} has {mine.numel} elements (specs {mine.specs}); this receiver "
            f"holds {layout_desc}: {len(specs)} tensors, {numel} elements "
            f"(specs {specs_fp}). Nothing was fetched or written: the publisher and "
            "this receiver use different model configs, engines or TP/EP"
        )
    if None not in (mine.placements, placements_fp) and (mine.placements != placements_fp):
        raise LayoutMismatchError(
            f"version {manifest.version} was published for {rec.describe()}: shard "
            f"{shard!r} holds the same tensors but places canonical elements "
            f"differently (placements {mine.placements}; this receiver's "
            f"{placements_fp}). Nothing was fetched or written: give the publisher "
            "and this receiver the same layout (e.g. the same probed layout file)"
        )


def check_published_for(
    manifest: Manifest,
    shard: str,
    specs: Mapping[str, TensorSpec],
    layout: ReceiverLayout | None = None,
) -> None:
    """Refuse (:class:`~deltasync.errors.LayoutMismatchError`) ``manifest`` when it was
    published for another layout than ``shard`` with ``specs`` (and ``layout``'s placements):
    the check a :class:`Receiver` makes before any fetch, for a caller that must make it before
    it writes anything of its own (the ``pull`` sidecar)."""
    record = LayoutRecord.of(layout) if layout is not None else None
    shard_record = record.shards.get(shard) if record is not None else None
    _refuse_another_layout(
        manifest,
        shard,
        specs,
        specs_fingerprint(specs),
        shard_record.placements if shard_record is not None else None,
        record.describe() if record is not None else "the tensors it was given",
    )
