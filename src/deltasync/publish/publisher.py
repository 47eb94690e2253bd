"""Publisher: one trainer rank's side of a version on shared storage.

``publish(version, changed, params)``, per writer:

1. if ``version`` is already committed, check that this trainer's state is the committed one
   (a retry or a replay) and return; a different state is a CommitConflictError;
2. bounded staleness: wait while a live receiver is too far behind;
3. decide delta or anchor: an anchor on request, every ``anchor_every`` versions, for the first
   version, whenever the caller's changes are not relative to the newest committed version
   (``since``), because then a delta could miss an element, and whenever this publisher has
   not itself verified that its baseline IS the stored state of that version (its own commit,
   a recognised replay, or :meth:`Publisher.resume` after a restart): a delta on a foreign
   base (a wiped or restored store, a trainer restarted from another checkpoint) would be
   refused by every receiver;
4. stream one blob per receiver shard (:mod:`deltasync.publish.streams`): the changes are
   consumed parameter group by parameter group (:mod:`deltasync.publish.segments` over the
   groups of :mod:`deltasync.layout.groups`; given a tracker's lazy stream, detection of the
   next group runs while the previous one uploads), each group routed
   (:mod:`deltasync.layout.routing`) and appended as one segment to every shard's blob that it
   touches; then store this writer's marker, also when it sent nothing;
5. the committer (rank 0) computes every shard's digest from the full state (or joins the
   writers' part digests from their markers), waits for all markers and commits
   (:mod:`deltasync.commit.committer`); the other writers wait for the manifest and check it
   lists their blobs.

Nothing in the store changes what a receiver sees until step 5 commits the manifest, so a
crash anywhere leaves the previous version in force; a retry overwrites and re-commits.

Lineage: every manifest carries a run id. A delta keeps its base's run id and names the base's
shard digests; an anchor keeps the run id when this publisher verified its baseline on the
newest committed version (a periodic anchor) and starts a new lineage (a fresh random run id)
otherwise. The manifest also records the receiver layout (:class:`LayoutRecord`) and each
blob's element count (density for ``inspect``).

State digests need the full state. A single writer has it. With several writers (each holding
a dim-0 shard) no writer can compute a local tensor's digest alone, since e.g. ``qkv_proj``
rows come from several trainer ranks: given ``full_state`` (the full parameters, or a callable
that gathers them), the committer lists state digests; without it, every writer states its
part digest of every shard in its marker (``layout.part_digests``, from its own rows, no
gather) and the committer lists each shard's parts digest (``layout.digest.parts_digest``).

:class:`PublishReport` (what one ``publish`` did, with its timings) lives here with it. This
class knows the protocol order and who does what; planning, encoding and commit records live in
the modules it calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from deltasync import names
from deltasync.commit import AckRecord, BlobEntry, Manifest, WriterMarker, should_anchor
from deltasync.commit import committer as commit_mod
from deltasync.commit.catalog import Catalog, poll_pause, wait_for_acks, wait_for_staleness
from deltasync.commit.model import LayoutRecord, new_run_id
from deltasync.commit.records import ReceiverRecord
from deltasync.commit.retention import GcPlan, collect_garbage
from deltasync.errors import (
    AckTimeoutError,
    CommitConflictError,
    ConfigError,
    DeltaSyncError,
    KeyNotFoundError,
    LayoutError,
    ManifestError,
    OutcomeUnknownError,
    StoreError,
    VersionError,
)
from deltasync.format import full_updates
from deltasync.interrupts import interrupts_deferred
from deltasync.layout import ReceiverLayout, TrainerLayout, fsdp_dim0_rows
from deltasync.layout.digest import (
    TensorEntries,
    combine_entries,
    parse_parts_digest,
    parts_digest,
    shard_digests,
    state_digests,
    state_tensor_digests,
)
from deltasync.layout.part_digests import parts_param_shapes, writer_part_digests
from deltasync.layout.routing import (
    Change,
    ShardTensors,
    checked_changes,
    every_element_stream,
    full_shard_tensors,
    in_stream_order,
    padding_updates,
)
from deltasync.publish.config import PublisherConfig
from deltasync.publish.segments import GroupRouter, Ready
from deltasync.publish.streams import QUEUED_SEGMENTS, ShardStreams
from deltasync.store import Store
from deltasync.store.base import check_store
from deltasync.trainer.params import local_of
from deltasync.trainer.positions import Positions
from deltasync.validate import check_instance


def _joined(kept: TensorEntries | None, fed: TensorEntries | None) -> TensorEntries | None:
    """The entries the digest pass takes as given: both sets (each vouches for its own)."""
    if not fed:
        return kept
    out = {shard: dict(entries) for shard, entries in (kept or {}).items()}
    for shard, entries in fed.items():
        out.setdefault(shard, {}).update(entries)
    return out


@dataclass(frozen=True, kw_only=True)
class PublishReport:
    version: int
    kind: str  # "delta" | "anchor"
    base_version: int | None
    writer: str
    # True when the version was already committed with this same state (a retry after a lost
    # reply, or a replayed trainer): nothing new was stored, the baseline still advanced.
    already_committed: bool = False
    anchor_reason: str | None = None  # why this version is an anchor
    blobs: tuple[BlobEntry, ...] = ()
    shard_bytes: dict[str, int] = field(default_factory=dict)
    shard_elements: dict[str, int] = field(default_factory=dict)
    build_s: float = 0.0  # gather, cast, route, (anchor: split)
    encode_s: float = 0.0
    upload_s: float = 0.0  # waiting for uploads after the last encode
    digest_s: float = 0.0  # full-state shard digests (committer)
    commit_s: float = 0.0  # markers, manifest, LATEST
    staleness_wait_s: float = 0.0
    total_s: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(self.shard_bytes.values())

    @property
    def elements_sent(self) -> int:
        return sum(self.shard_elements.values())


log = logging.getLogger(__name__)

# Changed elements per segment when consecutive groups are batched (a detected list of
# changes): a few MiB of routed indices and values while a batch is routed and encoded (2^20
# put ~25 MiB of transients beside the 0.6B's ~28 MiB of captured positions; 2^19 -> 2^18 took
# 4-5 MiB off the 0.6B's peak at the same CPU time, publish_probe --threads 1).
SEGMENT_ELEMENTS = 1 << 18

# Fewer changed elements than this in a detected list: a small delta, published on the
# caller's thread with its blobs held whole (a few hundred KiB; see Publisher._publish).
HELD_BELOW = SEGMENT_ELEMENTS


def _small(changes: object) -> bool:
    """Whether ``changes`` is a list of fewer than HELD_BELOW changed elements (anything else,
    a malformed item included, is not: the checks in the stream name it)."""
    if not isinstance(changes, (list, tuple)):
        return False
    total = 0
    for item in changes:
        idx = item[1] if isinstance(item, tuple) and len(item) == 3 else None
        if isinstance(idx, torch.Tensor):
            total += idx.numel()
        elif isinstance(idx, Positions):
            total += len(idx)
        else:
            return False
        if total >= HELD_BELOW:
            return False
    return True


class _Later:
    """A digest job run on the caller's thread when its result is asked for."""

    def __init__(self, fn: Callable[[], TensorEntries]) -> None:
        self._fn = fn

    def result(self) -> TensorEntries:
        return self._fn()

    def cancel(self) -> bool:
        return True


# The most versions a writer that waited in vain adopts at once (see Publisher._adopts).
_ADOPT_MAX = 64
# Publisher._adopted_since of a writer that adopted its first version (its baseline unknown)
_UNKNOWN_BASE = object()

Params = Mapping[str, torch.Tensor]


def _built_for(m: WriterMarker) -> tuple[int | None, int | None, str | None]:
    return m.base_version, m.num_writers, m.layout


def _check_agreement(markers: Iterable[WriterMarker], own: WriterMarker) -> None:
    """Raise VersionError (nothing is committed) unless every writer built its blobs for the
    committer's base, writer count and layout: one writer's anchor beside another's delta,
    shards cut for another world size, or blobs routed for another receiver layout or model
    make a version no receiver can apply."""
    markers = sorted(markers, key=lambda m: m.writer)
    if all(_built_for(m) == _built_for(own) for m in markers):
        return
    layouts = len({m.layout for m in markers}) > 1  # named only where they differ
    each = "; ".join(
        f"{m.writer}: {'anchor' if m.base_version == -1 else f'base {m.base_version}'}, "
        f"num_writers={m.num_writers}" + (f", layout {str(m.layout)[:12]}" if layouts else "")
        for m in markers
    )
    raise VersionError(
        f"version {own.version}: the writers built their parts for different versions, world "
        f"sizes or layouts ({each}); nothing was committed. Give every writer the same "
        "num_writers, receiver layout, trainer layout and model config (and the same deltasync "
        "release: the layout fingerprint's definition may differ between releases), and "
        "publish next_version() on every writer"
    )


FullState = Params | Callable[[], Params]
_OWN = object()  # since= default: the version this publisher last committed or verified


class Publisher:
    def __init__(
        self,
        store: Store,
        *,
        receiver_layout: ReceiverLayout,
        trainer_layout: TrainerLayout | None = None,
        config: PublisherConfig | None = None,
    ) -> None:
        check_instance(
            "Publisher",
            "receiver_layout",
            receiver_layout,
            ReceiverLayout,
            remedy="build it with ReceiverLayout.build(spec, engine, tp) or load the probed one",
        )
        if trainer_layout is not None:
            check_instance("Publisher", "trainer_layout", trainer_layout, TrainerLayout)
        self.store = check_store("Publisher", store)
        self.layout = receiver_layout
        self.trainer_layout = trainer_layout or TrainerLayout(receiver_layout.spec)
        self.config = config or PublisherConfig()
        self.writer = self.config.writer_id()
        self.catalog = Catalog(store, signing_key=self.config.signing_key)
        # The committed version whose stored state this publisher verified its trainer holds
        # (its own commit, a recognised replay, or resume()); None: unknown, so the next
        # version is an anchor. ``run_id`` is that version's lineage.
        self.baseline: int | None = None
        self.run_id: str | None = None
        self._baseline_digests: dict[str, str] | None = None  # its shard digests
        self._stored: Manifest | None = None  # the manifest the commit in progress stored
        self.layout_record = LayoutRecord.of(receiver_layout)
        # what this writer routes for, in its markers: writers that differ never commit
        self._layout_fp = self.layout_record.fingerprint(
            params=sorted([n, list(s)] for n, s in self.trainer_layout.param_shapes().items())
        )
        self._pool: ThreadPoolExecutor | None = None  # uploads; started on first use
        # whether part digests are defined over this trainer layout (None: not checked yet)
        self._parts_layout_ok: bool | None = None
        self._parts_odd: list[str] = []  # the parameters that differ, when it is False
        # Versions whose number this publisher never publishes again: with several writers,
        # every one that failed on this writer; with one, those whose manifest write ended
        # without a verdict (the store may still apply it later)
        self._failed: set[int] = set()
        # Of those, the versions whose manifest write ended without a verdict: their blobs
        # stay (gc keeps them) while the manifest may still land and name them
        self._may_land: set[int] = set()
        # The params each attempt since the last commit sent (names only), and those a delta
        # must send whole after adopting such an attempt (see _adopts)
        self._sent_names: dict[int, set[str]] = {}
        self._resend_whole: set[str] = set()
        # The baseline before an adoption, while nothing this writer committed follows it: a
        # caller whose attempt failed since still gives its changes relative to it
        self._adopted_since: int | object | None = None
        # With several writers: the baseline is a version other writers committed (another
        # session's, taken by resume() or, replayed, by its digests), which a writer without
        # the full state cannot take or adopt and so anchors after: this one anchors too,
        # until a commit
        self._foreign_baseline: int | None = None
        self._digest_pool: ThreadPoolExecutor | None = None  # the committer's digest pass
        self._claim = commit_mod.claim_record()  # this process's, as its writer, per version
        self._claimed: int | None = None  # the version this attempt claimed (several writers)
        self._router = GroupRouter(
            trainer_layout=self.trainer_layout,
            receiver_layout=receiver_layout,
            rank=self.config.writer_rank,
            world_size=self.config.num_writers,
        )
        # (version, its per-tensor digest entries) of the state this publisher last committed
        self._entries: tuple[int, TensorEntries] | None = None
        if self.config.is_committer:
            self.repair_latest()

    # --- store state ------------------------------------------------------------------

    def committed(self) -> int | None:
        """The newest committed version in the store (LATEST, then the manifests after it;
        with a key, only manifests that verify count)."""
        return self.catalog.latest(verified=True)

    def repair_latest(self) -> int | None:
        """Point LATEST at the newest committed manifest, up (a crash can leave it behind) or
        down (it names a version that has no manifest)."""
        return commit_mod.repair_latest(self.store, self.catalog)

    def next_version(self) -> int:
        """The version number to publish next: one above the newest committed (0 on an empty
        store), and above every number this publisher does not reuse (see :meth:`publish`).
        After a restart, publish this, never a number the store already holds. Several writers
        publish one number together: after writers failed different numbers (they were given
        different ones), take the largest of their ``next_version()`` (e.g. an all-reduce MAX
        over the trainer ranks). The store cannot tell another writer's attempt in flight from
        an abandoned one, so this method does not guess from it."""
        committed = self.committed()
        after = 0 if committed is None else committed + 1
        if self.baseline is not None:  # its own commit, which a stale LATEST may not name yet
            after = max(after, self.baseline + 1)
        return max(after, max(self._failed, default=-1) + 1)

    def resume(
        self, version: int | None, params: Params, *, full_state: FullState | None = None
    ) -> bool:
        """After a restart: check that ``params`` (just loaded from the checkpoint of
        ``version``, before any optimizer step) are the stored state of ``version``.

        Args:
            version: the version the checkpoint was taken at (None: unknown).
            params: this rank's parameters as loaded.
            full_state: the full parameters (or a callable gathering them) when this rank
                holds a shard; every writer of a multi-writer publisher needs it here, so that
                all writers reach the same decision.

        Returns:
            True when the store's manifest of ``version`` lists exactly this state: the next
            version may then be a delta on it. False (logged with the reason) when the store
            lost it, holds another lineage or another state, or its manifest is unusable (damaged,
            badly signed, another layout): the next version is an anchor that starts a new
            lineage.
        """
        self._set_baseline(None)
        if version is None:
            return False
        try:
            manifest = self.catalog.manifest(version, fresh=True)
        except KeyNotFoundError:
            log.warning(
                "writer %s: resume from version %d: the store has no manifest of it (wiped, "
                "restored or another store); the next version is an anchor",
                self.writer,
                version,
            )
            return False
        except ManifestError as exc:
            # Damaged, forged or built for another layout: it cannot vouch for this checkpoint.
            log.warning(
                "writer %s: resume from version %d: its manifest is unusable (%s); the next "
                "version is an anchor",
                self.writer,
                version,
                exc,
            )
            return False
        if self.config.num_writers > 1 and full_state is None:
            raise ConfigError(
                "Publisher.resume with num_writers > 1 needs full_state on every writer (each "
                "checks the same digests, so all writers agree on delta or anchor)"
            )
        self._check_shards(params)
        full = (
            params if full_state is None else (full_state() if callable(full_state) else full_state)
        )
        if full_state is not None:
            self._check_full(full)
        if self._digests_like(full, manifest.shard_digests) != dict(manifest.shard_digests):
            log.warning(
                "writer %s: resume from version %d: the stored version %d (run %s) holds another "
                "state than this checkpoint; the next version is an anchor",
                self.writer,
                version,
                version,
                manifest.run_id,
            )
            return False
        beyond = self._run_went_past(manifest)
        if beyond is not None:
            log.warning(
                "writer %s: resume from version %d: %s; the next version is an anchor of a new run",
                self.writer,
                version,
                beyond,
            )
            return False
        self._take_committed(manifest)
        return True

    def _run_went_past(self, manifest: Manifest) -> str | None:
        """What shows that ``manifest``'s run went on past it in a store that no longer holds
        those versions (restored from an older copy), or None. Continuing the run from it
        would publish new states under numbers its receivers and acks already give to others
        (a trainer would count a receiver holding the old version 5 as holding the new 4).
        The evidence: an ack of a later version that has no manifest, and (one writer: what
        several writers read must not differ between them, and registrations move) a
        receiver registered at a later version of the run that has none. Later versions the
        store still holds are the ordinary restart (the trainer went on past its checkpoint)."""
        for key in self.store.list("acks/"):
            try:
                acked, receiver = names.parse_ack_key(key)
            except ManifestError:
                continue
            if acked > manifest.version and not self.catalog.has_manifest(acked):
                return _restored(manifest, f"receiver {receiver!r} acked version {acked}")
        if self.config.num_writers > 1:
            return None
        unreadable: list[str] = []
        registrations = self.catalog.receivers(unreadable=unreadable)
        if unreadable:  # the evidence may be in them: the run is not continued on a guess
            return (
                f"the registrations of receivers {unreadable} could not be read, so whether "
                "the store was restored from an older copy cannot be told"
            )
        for rid, rec in registrations.items():
            if (
                rec.run_id == manifest.run_id
                and rec.version is not None
                and rec.version > manifest.version
                and not self.catalog.has_manifest(rec.version)  # held: the run went on here
            ):
                held = f"receiver {rid!r} holds version {rec.version} of run {manifest.run_id}"
                return _restored(manifest, held)
        return None

    def _take_committed(self, manifest: Manifest) -> None:
        """Take a version committed without this call (``resume``, or a version found
        committed already) as the baseline. With several writers, another session's version
        makes the next one an anchor on every writer that takes one (``_foreign_baseline``),
        so writers that resumed, replayed or could not take it agree."""
        self._set_baseline(manifest)
        if self.config.num_writers > 1 and self.writer not in manifest.writers:
            self._foreign_baseline = manifest.version

    def _set_baseline(self, manifest: Manifest | None) -> None:
        self._adopted_since = None
        self.baseline = None if manifest is None else manifest.version
        self.run_id = None if manifest is None else manifest.run_id
        self._baseline_digests = None if manifest is None else dict(manifest.shard_digests)

    def _on_lineage(self, head: Manifest | None) -> bool:
        """True when the newest committed version is exactly the state this publisher
        verified as its baseline (number, run id and every shard digest)."""
        return (
            head is not None
            and self.baseline == head.version
            and self.run_id == head.run_id
            and self._baseline_digests == dict(head.shard_digests)
        )

    # --- publish ----------------------------------------------------------------------

    def publish(
        self,
        version: int,
        changes: Iterable[Change],
        params: Params,
        *,
        anchor: bool = False,
        since: int | object | None = _OWN,
        full_state: FullState | None = None,
        touched: Collection[str] | Callable[[], Collection[str]] | None = None,
        fed: TensorEntries | Callable[[], TensorEntries] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> PublishReport:
        """Publish ``version`` and return once it is committed.

        Args:
            version: the version number to commit (a retry of a committed one is recognised).
            changes: ``(name, sorted int64 indices, bf16 values)`` per changed parameter, in
                ``params`` order, each parameter at most once: a tracker's ``iter_changes()``
                (then detection runs as this method consumes it, and each group of parameters
                is routed, encoded and uploading while the next is detected), or a list of
                such triples. The indices are this rank's flat indices and list every element
                that differs from version ``since``. An item may also be ``(name,
                Positions, None)`` (an overlapped sender's capture): the values are then read
                from ``params`` as the parameter is routed, a vocab-parallel parameter range
                by range. Ignored for an anchor.
            params: this rank's current (fp32 master or BF16) parameters.
            anchor: publish a full version from ``params`` instead of a delta.
            since: the version ``changes`` are relative to (default: the version this
                publisher last committed); None when unknown, which makes this an anchor.
            full_state: the FULL parameters (or a callable returning them) when this rank
                holds a shard of them: the committer hashes the resulting state from them.
                Without it, several writers list parts digests (each writer hashes its
                own rows; no gather), which receivers check with their layout.
            touched: when known up front, every parameter ``changes`` names (an overlapped
                sender's capture): the receiver tensors no other parameter feeds keep the
                digests this publisher computed when it committed ``since`` (their bytes are
                that state's), so the digest pass reads only the touched ones. A change for
                a parameter outside ``touched`` raises ConfigError. A callable instead gives
                them once ``changes`` has named them all (a stream handed over while its
                detection still runs): the digest pass then starts when it returns.
            fed: receiver tensors' digest entries already computed from ``params`` as they
                are now (a :class:`~deltasync.layout.digest_feed.DigestFeed` the detection
                pass fed): the digest pass takes them as given and reads only the other
                tensors. A callable is called on the digest thread, which starts when it
                returns. Ignored with ``full_state`` (the digests then come from that).
            before_commit: called once every read of ``params`` (and of ``full_state``) has
                ended, before the blobs' last bytes are stored and anything is committed; it
                may raise to refuse the version (nothing is then committed; with several
                writers the claim is stored already, and a notice of the refusal is stored
                for the other writers).

        Returns:
            A :class:`PublishReport` with the version's kind, blobs, sizes and timings.

        Raises:
            VersionError: ``version``'s number is not reused: with several writers, it
                already failed on this writer; with one, its manifest write ended without a
                verdict and the store does not hold that manifest (see :meth:`next_version`).
        """
        names.check_version_arg(
            "Publisher.publish", version, hint="publish publisher.next_version()"
        )
        several = self.config.num_writers > 1
        if version in self._failed and (several or not self._manifest_landed(version)):
            raise VersionError(self._not_reused(version, several))
        self._claimed = None
        try:
            return self._publish(
                version,
                changes,
                params,
                anchor=anchor,
                since=since,
                full_state=full_state,
                touched=touched,
                fed=fed,
                before_commit=before_commit,
            )
        except BaseException as exc:
            if several:
                self._failed.add(version)
                if self._claimed == version:  # wrote for it: the other writers are told
                    self._abandon(version, exc)
            raise

    def _manifest_landed(self, version: int) -> bool:
        """Whether the store now holds ``version``'s manifest (a write that ended without a
        verdict and was applied after all); a store that cannot answer counts as no."""
        try:
            return self.catalog.has_manifest(version)
        except StoreError:
            return False

    def _not_reused(self, version: int, several: bool) -> str:
        if several:
            why = (
                f"version {version} already failed on this writer, and with "
                f"{self.config.num_writers} writers its number is not reused: the committer may "
                "still read this writer's marker of the failed attempt and commit blobs that a "
                "retry overwrites"
            )
        else:
            why = (
                f"version {version}'s manifest write ended without a verdict, so the store may "
                "still apply it: a retry under that number would overwrite the blobs it names "
                "(every receiver would then refuse the version)"
            )
        return (
            f"writer {self.writer}: {why}. Nothing was written; this writer's changes are kept. "
            "Publish next_version() (it skips numbers that are not reused)"
        )

    def _publish(
        self,
        version: int,
        changes: Iterable[Change],
        params: Params,
        *,
        anchor: bool = False,
        since: int | object | None = _OWN,
        full_state: FullState | None = None,
        touched: Collection[str] | Callable[[], Collection[str]] | None = None,
        fed: TensorEntries | Callable[[], TensorEntries] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> PublishReport:
        """:meth:`publish`, once its version is allowed."""
        t0 = time.perf_counter()
        names.check_version(version)
        cfg = self.config
        since = self.baseline if since is _OWN else since
        unreadable = None  # why the newest manifest cannot be a base
        try:
            # from this publisher's own commit where LATEST lags behind it (its LATEST write
            # failed after a skipped number): a delta on it, not an anchor on a new lineage
            head = self.catalog.head(known=self._own_newest(), verified=True)
            committed = None if head is None else head.version
        except ManifestError as exc:
            # The newest manifest is unreadable (torn, tampered): nothing vouches for a base,
            # so this version is an anchor of a new lineage above it.
            unreadable = f"the newest committed manifest is unreadable: {exc}"
            log.warning("writer %s: version %d is an anchor: %s", self.writer, version, exc)
            head, committed, anchor = None, self.catalog.latest(verified=True), True
        if committed is not None and version <= committed:
            return self._already_committed(version, committed, params, full_state, t0)
        if since is not None and since == self._adopted_since:
            since = self.baseline  # its changes since then cover the adopted versions
        elif since is None and self._adopted_since is _UNKNOWN_BASE:
            since = self.baseline  # it adopted its first version: every param goes out whole
        if since == self.baseline and self._adopts(head):  # None: its first version's attempt
            since = self.baseline
        if unreadable is None and self.catalog.has_manifest(version):
            # committed, though the head stops short of it (a LATEST that could not be moved
            # and a gap left by a number never reused): compared, never overwritten
            return self._already_committed(version, version, params, full_state, t0)

        waited = 0.0
        if cfg.max_staleness is not None:
            waited = wait_for_staleness(
                self.catalog,
                committed,
                max_staleness=cfg.max_staleness,
                ttl_s=cfg.receiver_ttl_s,
                timeout_s=cfg.staleness_timeout_s,
                poll_s=cfg.poll_interval_s,
            )
        reason = unreadable or self._anchor_reason(version, head, since, anchor)
        kind = "delta" if reason is None else "anchor"
        if reason is not None:
            log.info("writer %s: version %d is an anchor: %s", self.writer, version, reason)
        base = committed if kind == "delta" else None
        # A lineage continues only on a base this publisher verified; otherwise a new one.
        on_lineage = self._on_lineage(head)
        if on_lineage and head is not None:
            run_id = head.run_id
        else:  # a new lineage, started after the one the store's newest version carries
            run_id = new_run_id(after=None if head is None else head.run_id)
        base_digests = self._baseline_digests if kind == "delta" else None
        self.trainer_layout.check_tied_once(params)
        self._check_shards(params)
        # Several writers without the full state state part digests, where they are defined
        # (the committer needs them: it refuses here, before anything is written; another
        # writer without them may have a committer given full_state, which needs none)
        parts = cfg.num_writers > 1 and full_state is None and self._parts_defined()
        if cfg.num_writers > 1:  # before any blob of this version is written
            try:
                commit_mod.claim_version(
                    self.store, version, self.writer, self._claim, signing_key=cfg.signing_key
                )
            except StoreError:  # not another process's claim: the other writers are told
                self._claimed = version
                raise
            self._claimed = version
        if kind == "anchor":  # a full version from the full state, never from the changes
            source = None if cfg.num_writers == 1 else every_element_stream(params)
            # The caller's touched names the changes of the delta it captured, not every
            # parameter an anchor (this publisher's choice: anchor_every, a new lineage)
            # streams, and an anchor keeps no digest: each is computed afresh.
            touched = None
        else:
            source = checked_changes(changes, lazy=(Positions,))
            if self._resend_whole:
                source = _whole(source, self._resend_whole, params)
                # The caller's touched names its own changes, not the params resent whole, and
                # it keeps no digest here: the adopted base's state was never hashed by this
                # publisher (_kept_entries), so every digest is computed afresh.
                touched = None
        if source is not None:
            source = _names_into(source, self._sent_names.setdefault(version, set()))

        t = time.perf_counter()
        # A small delta detected already: its blobs are held and stored whole, and its digest
        # pass runs after the routing, all on this thread (hand-overs to threads that compete
        # with the trainer for the cores cost more than they overlap).
        held = source is not None and _small(changes)
        digest_job: Future | _Later | None = None
        # Several writers without the full state: each hashes its own parts of every shard
        # (its marker states them; the committer joins them into parts digests), beside the
        # uploads as the committer's full-state pass runs, and no rank gathers the model.
        parts_job: Future | _Later | None = None
        if parts:

            def mine() -> dict[str, str]:
                return self._part_digests(params, cfg.writer_rank)

            if held:
                parts_job = _Later(mine)  # type: ignore[arg-type]
            else:
                if self._digest_pool is None:
                    self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ds-digest")
                parts_job = self._digest_pool.submit(mine)
        elif cfg.is_committer and not (kind == "anchor" and cfg.num_writers == 1):
            # The full-state digest pass only reads the params: run it beside detection,
            # routing and encoding (casts and hashing release the GIL), not after them.
            if self._digest_pool is None and not held:
                self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ds-digest")
            full = self._resolve_full(params, full_state)
            given = None if full_state is not None else fed

            def entries() -> TensorEntries:
                # callables are known once the stream is: the job waits for them
                named = touched() if callable(touched) else touched
                keep = _joined(
                    self._kept_entries(kind, since, committed, named),
                    given() if callable(given) else given,
                )
                return self._tensor_entries(full, keep)

            if held:
                digest_job = _Later(entries)
            else:
                assert self._digest_pool is not None
                digest_job = self._digest_pool.submit(entries)
        shards = len(self.layout.shards())
        threads = cfg.upload_threads or min(32, shards)
        # A list (or a Ready stream) was detected already: a prefetch thread would only add a
        # hop.
        detected = isinstance(changes, (list, tuple, Ready))
        if self._pool is None and not held:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ds-upload")
        streams = ShardStreams(
            self.store,
            None if held else self._pool,
            version=version,
            base_version=-1 if base is None else base,
            writer=self.writer,
            level=cfg.level,
            # every blob uploads on its own thread: a slow link holds back the encoder instead
            # of queueing the blobs in memory
            queued=QUEUED_SEGMENTS if threads >= shards else 0,
        )
        try:
            digests = None
            if source is None:
                state = self._full_state_shards(params)
                streams.add(
                    {
                        s: full_updates(in_stream_order(self.layout, s, tensors))
                        for s, tensors in state.items()
                    }
                )
                if cfg.is_committer:
                    digests = shard_digests(state)
                del state
            else:
                # Detected already, so no upload waits for detection: consecutive small
                # groups go out as one segment (fewer routing calls, zstd frames and writes).
                self._router.stream(
                    streams,
                    source,
                    params,
                    prefetch=0 if detected else cfg.prefetch,
                    batch_elements=SEGMENT_ELEMENTS if detected else 0,
                    touched=None if callable(touched) else touched,
                )
                if kind == "anchor":
                    streams.add(padding_updates(self.layout, [s.id for s in self.layout.shards()]))
            build_s = time.perf_counter() - t - streams.encode_s
            t = time.perf_counter()
            tensor_entries = None
            own_parts: dict[str, str] | None = None
            if digest_job is not None:  # overlaps with the uploads still running
                tensor_entries = digest_job.result()
                digests = combine_entries(tensor_entries)
            if parts_job is not None:
                own_parts = parts_job.result()
            digest_s = time.perf_counter() - t
            if before_commit is not None:  # nothing reads params from here on
                before_commit()
            t = time.perf_counter()
            entries, shard_bytes, shard_elements = streams.finish()
            upload_s = time.perf_counter() - t
        except BaseException as exc:
            streams.abort()  # no partial blob lands under a blob key; nothing is committed
            for job in (digest_job, parts_job):
                if job is not None:
                    job.cancel()
            if isinstance(exc, Exception):  # an interrupt writes nothing more
                self._drop_unnamed(version, streams.stored_keys())
            raise
        encode_s = streams.encode_s

        t = time.perf_counter()
        marker = WriterMarker(
            version=version,
            writer=self.writer,
            blobs=tuple(entries),
            created_at=time.time(),
            base_version=-1 if base is None else base,
            num_writers=cfg.num_writers,
            layout=self._layout_fp,
            part_digests=own_parts,
        )
        data = marker.to_json(cfg.signing_key)  # MAC'd when keyed
        try:
            if cfg.num_writers > 1:  # a number is never retried there: its marker is stored once
                commit_mod.store_marker(self.store, marker, data, signing_key=cfg.signing_key)
            else:  # one writer retries a number that did not commit, rewriting its own marker
                self.store.put(marker.key, data)
        except StoreError as exc:
            # Refused (a full disk): nothing names the blobs. A write that may have landed
            # (no verdict, or a marker there after all) may be joined by the committer.
            if not isinstance(exc, OutcomeUnknownError) and not self._marker_there(marker):
                self._drop_unnamed(version, [e.key for e in entries])
            raise
        self._stored = None
        try:
            manifest, ours = self._commit(
                marker, kind, base, digests, run_id, base_digests, entries
            )
        except BaseException:
            stored = self._stored
            if stored is not None and stored.version == version:
                # Committed: what failed came after (advancing LATEST, which readers skip
                # past and the next commit repairs). The baseline is this version, as the
                # caller sees it in ``baseline``; its per-tensor digests are not kept.
                self._settle(stored)
                self._entries = None
            elif cfg.num_writers > 1:
                self._withdraw(marker)
            raise
        commit_s = time.perf_counter() - t
        self._settle(manifest)
        # this state's per-tensor digests, for the next delta's unchanged tensors
        self._entries = (version, tensor_entries) if tensor_entries is not None and ours else None
        return PublishReport(
            version=version,
            kind=manifest.kind,
            base_version=manifest.base_version,
            writer=self.writer,
            already_committed=not ours,
            anchor_reason=reason,
            blobs=tuple(entries),
            shard_bytes=shard_bytes,
            shard_elements=shard_elements,
            build_s=build_s,
            encode_s=encode_s,
            upload_s=upload_s,
            digest_s=digest_s,
            commit_s=commit_s,
            staleness_wait_s=waited,
            total_s=time.perf_counter() - t0,
        )

    def _settle(self, manifest: Manifest) -> None:
        """``manifest`` is committed: this writer's baseline from now on. With several
        writers it may be another session's: an equal state that won the race for the number
        (``commit_manifest`` found the same digests), taken by its digests as a replayed
        version is, so the next version is an anchor, as on the writers that could not take
        it (see :meth:`_take_committed`)."""
        self._set_baseline(manifest)
        self._sent_names.clear()
        self._resend_whole = set()
        self._foreign_baseline = None
        if self.config.num_writers > 1 and self.writer not in manifest.writers:
            self._foreign_baseline = manifest.version

    def _commit(
        self,
        marker: WriterMarker,
        kind: str,
        base: int | None,
        digests: Mapping[str, str] | None,
        run_id: str,
        base_digests: Mapping[str, str] | None,
        entries: Sequence[BlobEntry],
    ) -> tuple[Manifest, bool]:
        """After this writer's marker is stored: the committer joins every writer's marker into
        the manifest and commits it; another writer waits for it. Returns the manifest and
        whether this attempt's blobs are the committed ones."""
        cfg, version = self.config, marker.version
        if cfg.is_committer:
            # Our own marker from memory: the store's copy may have been rewritten since.
            markers = commit_mod.wait_for_markers(
                self.store,
                version,
                cfg.all_writer_ids(),
                timeout_s=cfg.marker_timeout_s,
                poll_s=cfg.poll_interval_s,
                own=marker,
                signing_key=cfg.signing_key,
            )
            _check_agreement(markers, marker)
            if digests is None:  # several writers without the full state: their parts
                digests = self._joined_parts(markers, version)
            manifest = commit_mod.build_manifest(
                version=version,
                kind=kind,
                base_version=base,
                writers=cfg.all_writer_ids(),
                markers=markers,
                shard_digests=digests,
                created_at=time.time(),
                run_id=run_id,
                base_digests=base_digests,
                layout=self.layout_record,
                signing_key=cfg.signing_key,
            )
            # The commit point and the record of it are one step for an interrupt (held for
            # one small write, bounded by the store's timeouts): else a Ctrl-C as the write
            # returns would leave a committed version reported as not committed.
            with interrupts_deferred():
                try:
                    ours = commit_mod.commit_manifest(self.store, self.catalog, manifest)
                except OutcomeUnknownError:
                    self._failed.add(version)  # no verdict: the store may apply it later
                    self._may_land.add(version)
                    raise
                if not ours:  # an equivalent manifest was committed first: its lineage is ours
                    manifest = self.catalog.manifest(version)
                self._stored = manifest  # committed from here on, whatever follows
            commit_mod.advance_latest(self.store, self.catalog, version, manifest.run_id)
            return manifest, ours
        manifest = commit_mod.wait_for_manifest(
            self.catalog,
            version,
            timeout_s=cfg.marker_timeout_s,
            poll_s=cfg.poll_interval_s,
            committer=cfg.writer_id(0),
            signing_key=cfg.signing_key,
        )
        self._check_listed(manifest, entries)
        return manifest, True

    def _marker_there(self, marker: WriterMarker) -> bool:
        """Whether the store may hold ``marker``'s key after its write failed (one that cannot
        be asked may)."""
        try:
            return self.store.exists(marker.key)
        except StoreError:
            return True

    def _drop_unnamed(self, version: int, keys: Sequence[str]) -> None:
        """Delete the blobs this attempt at ``version`` stored before it failed ahead of its
        marker: no marker lists them, so no manifest can name them, and on a full disk their
        room is what the next attempt needs, and with several writers the notice that tells
        the others to stop waiting (else they wait out ``marker_timeout_s``). Best effort:
        what cannot be deleted is left to gc, and so is the rest after the first delete that
        fails (a store that does not answer, the usual cause of the failure, would hold the
        caller for a retry deadline per blob)."""
        for i, key in enumerate(keys):
            try:
                self.store.delete(key)
            except StoreError as exc:
                log.warning(
                    "writer %s: blob %r of its failed version %d could not be deleted (%s); "
                    "gc removes it, and the %d after it not tried, once a later version is "
                    "committed",
                    self.writer,
                    key,
                    version,
                    exc,
                    len(keys) - i - 1,
                )
                return

    def _withdraw(self, marker: WriterMarker) -> None:
        """After this writer's attempt failed with several writers: remove its marker, so the
        committer cannot join the abandoned attempt's blobs into a version later (best effort:
        if the committer read it first and commits, the next publish adopts that version)."""
        try:
            if not self.catalog.has_manifest(marker.version):
                self.store.delete(marker.key)
        except StoreError as exc:
            log.warning(
                "writer %s: the marker of its failed version %d could not be removed (%s); "
                "that number is never published again by this writer",
                self.writer,
                marker.version,
                exc,
            )

    def _own_newest(self) -> int | None:
        """This publisher's newest version the store holds: its baseline, or a newer attempt
        of its own reported failed whose manifest, listing this writer, landed after all (a
        manifest write without a verdict, applied later; a writer that gave up waiting for a
        slow one). LATEST may lag behind both, below a number never committed, where the probe
        from it stops; with several writers, the others took such a version as their base
        (they saw it while they waited), so this one must find it too."""
        known = self.baseline
        for v in sorted(self._failed, reverse=True):
            if known is not None and v <= known:
                break
            if known is not None and v > known + _ADOPT_MAX:
                continue  # too far to adopt (see _adopts)
            try:
                if self.catalog.has_manifest(v) and self.writer in self.catalog.manifest(v).writers:
                    return v
            except DeltaSyncError:  # unknown now: the probe from the baseline decides
                return known
        return known

    def _abandon(self, version: int, exc: BaseException) -> None:
        """After this writer's attempt at ``version`` failed with several writers: tell the
        others (its notice), so the committer, or the writers waiting on the committer, stop
        waiting for it, unless the version is or may yet be committed (a manifest stored, or
        a manifest write without a verdict), or an interrupt ended it (nothing more is
        written then)."""
        if self.config.num_writers == 1 or not isinstance(exc, Exception):
            return
        if version in self._may_land:
            return
        try:
            if not self.catalog.has_manifest(version):
                commit_mod.abandon_version(
                    self.store,
                    version,
                    self.writer,
                    f"{type(exc).__name__}: {exc}",
                    signing_key=self.config.signing_key,
                )
        except Exception:  # the error that ended the attempt is what the caller must see
            log.exception("writer %s: no notice of its failed version %d", self.writer, version)

    def _check_shards(self, params: Params) -> None:
        """Each of this writer's parameters is its rank's dim-0 shard for ``num_writers``
        writers: a writer configured for another world size would place its rows at the wrong
        offsets (a smaller shard fits inside the range, so the indices alone cannot tell).
        One writer's params are the whole model (the shard digests are computed from them),
        so it holds every parameter, each whole (e.g. not a tensor-parallel trainer's shard).

        Raises:
            ConfigError: naming the parameter, its shape here and the one expected, and the
                remedy; before anything is written."""
        cfg = self.config
        one = cfg.num_writers == 1
        missing = self.trainer_layout.missing(params)
        if missing:
            why = (
                "a one-writer publisher computes the shard digests from params, so pass every "
                "parameter of the model"
                if one
                else "each of several writers sends its rank's dim-0 shard of every parameter "
                "(an anchor without one cannot restore a shard, a delta would never send its "
                "changes), so pass every parameter's local shard"
            )
            raise ConfigError(
                f"writer {self.writer}: params have no {missing[:5]} ({len(missing)} of the "
                f"model's parameters missing); {why} (as model.named_parameters() lists "
                "them; a model whose embeddings are tied needs a layout built from its own "
                "config). Nothing was written"
            )
        wrong = self.trainer_layout.misshapen(
            ((n, tuple(local_of(t).shape)) for n, t in params.items()),
            cfg.writer_rank,
            cfg.num_writers,
        )
        if wrong is not None:
            name, shape, want = wrong
            if one:
                raise ConfigError(
                    f"writer {self.writer}: parameter {name!r} is {shape} here, but "
                    f"the model's is {want}; a one-writer publisher takes every parameter "
                    "whole, as the model's class holds it (not transposed; a tensor-parallel "
                    "trainer's shards gathered first), or give FSDP ranks "
                    "that publish their own dim-0 shards num_writers (the world size) and "
                    "writer_rank. Nothing was written"
                )
            raise ConfigError(
                f"writer {self.writer}: parameter {name!r} is {shape} here, but "
                f"rank {cfg.writer_rank}'s dim-0 shard among num_writers={cfg.num_writers} "
                f"is {want}; give every writer the trainer's world size as num_writers and "
                "its own rank as writer_rank. Nothing was written"
            )

    def _adopts(self, head: Manifest | None) -> bool:
        """Whether every version committed since this writer's baseline names this writer and
        its lineage: attempts of its own that got no verdict and landed after all (a manifest
        write whose reply was lost; with several writers, a non-committer that timed out
        waiting while the committer joined its blobs). It takes the newest as its baseline and
        goes on with deltas (its changes are kept since its baseline, and the params those
        attempts sent go out whole: below), instead of an anchor of a new lineage, or, with
        several writers, an anchor of its own beside the others' deltas. With several writers
        the newest version is adopted also when it is an anchor of this publisher's own
        attempt, whatever came before it (no baseline, or another lineage)."""
        if head is None:
            return False
        if (
            self.config.num_writers > 1
            and head.kind == "anchor"
            and self.writer in head.writers
            and head.version in self._sent_names  # this publisher's own attempt
            and (self.baseline is None or head.version > self.baseline)
        ):
            # An anchor of its own (with several writers, the others take it as their base)
            # whatever came before it: no baseline (a fresh or restarted job) or a new lineage.
            # It sent every param, and they all go out whole next.
            adopted = [head.version]
        else:
            if self.baseline is None:
                return False
            if not self.baseline < head.version <= self.baseline + _ADOPT_MAX:
                return False
            adopted = []
            for v in range(self.baseline + 1, head.version + 1):
                try:
                    m = head if v == head.version else self.catalog.manifest(v)
                except KeyNotFoundError:
                    continue  # a number never committed
                if m.run_id != self.run_id or self.writer not in m.writers:
                    return False
                adopted.append(v)
        # Its changes are what differs from its baseline now: an element an adopted version
        # changed that has gone back to its baseline bits since is not among them (a snapshot
        # tracker's diff), yet the receivers hold the adopted value. The params those
        # attempts sent go out whole with the next delta (all of them where unrecorded).
        sent = [self._sent_names.get(v) for v in adopted]
        self._resend_whole = set().union(*sent) if all(s is not None for s in sent) else {"*"}
        log.info(
            "writer %s: versions %s were committed with its blobs while its attempt failed; "
            "version %d is a delta on %d, with every param those versions sent whole",
            self.writer,
            adopted,
            head.version + 1,
            head.version,
        )
        before = self._adopted_since
        if before is None:
            before = _UNKNOWN_BASE if self.baseline is None else self.baseline
        self._set_baseline(head)
        self._adopted_since = before
        return True

    def _anchor_reason(
        self, version: int, head: Manifest | None, since: object, forced: bool
    ) -> str | None:
        if forced:
            return "requested"
        if head is None:
            return "first committed version"
        committed = head.version
        if since is None:
            return "the changes' baseline is unknown (fresh or restarted publisher)"
        if since != committed:
            return (
                f"the changes are relative to version {since}, but the newest committed version "
                f"is {committed}"
            )
        if self._foreign_baseline == committed:
            return (
                f"version {committed} was taken from other writers (another session's, by "
                "resume() or by its digests): a writer without the full state cannot take it, "
                "and anchors"
            )
        if not self._on_lineage(head):
            return (
                f"this publisher has not verified that its baseline is the stored version "
                f"{committed} (run {head.run_id}): a restarted publisher calls resume() first"
            )
        if should_anchor(version, anchor_every=self.config.anchor_every):
            return f"every {self.config.anchor_every} versions"
        return None

    def _kept_entries(
        self, kind: str, since: object, committed: int | None, touched: Collection[str] | None
    ) -> TensorEntries | None:
        """The per-tensor digest entries the digest pass may reuse: only for a delta on the
        state this publisher itself hashed when it committed ``since`` (the newest version),
        one writer, and ``touched`` known; then every tensor no touched parameter feeds."""
        if (
            kind != "delta"
            or touched is None
            or self.config.num_writers != 1
            or self._entries is None
            or not (self._entries[0] == since == committed == self.baseline)
        ):
            return None
        fed: set[tuple[str, str]] = set()
        for name in touched:
            try:
                canonical = self.trainer_layout.canonical_names(name)
            except LayoutError:
                continue  # not a model parameter: routing refuses it if it carries changes
            for canon in canonical:
                fed.update(self.layout.holders(canon))
        return {
            shard: {local: e for local, e in locals_.items() if (shard, local) not in fed}
            for shard, locals_ in self._entries[1].items()
        }

    def _tensor_entries(self, full: Params, keep: TensorEntries | None) -> TensorEntries:
        return state_tensor_digests(
            full, trainer_layout=self.trainer_layout, receiver_layout=self.layout, keep=keep
        )

    def _digests(self, full: Params) -> dict[str, str]:
        return state_digests(full, trainer_layout=self.trainer_layout, receiver_layout=self.layout)

    def _part_digests(self, params: Params, index: int) -> dict[str, str]:
        """``{shard: part digest}`` of writer ``index`` from its dim-0 shards ``params``."""
        return writer_part_digests(
            params,
            trainer_layout=self.trainer_layout,
            receiver_layout=self.layout,
            index=index,
            count=self.config.num_writers,
        )

    def _parts_defined(self) -> bool:
        """Whether part digests are defined over this trainer's parameters: the transformers
        ones (``hf_model``'s table: receivers derive each writer's rows from it, knowing
        nothing of the trainer's layout). If not, ConfigError on the committer (before anything
        is written); another writer states none (its committer may be given full_state)."""
        if self._parts_layout_ok is None:
            want = parts_param_shapes(self.layout)
            have = {n: tuple(s) for n, s in self.trainer_layout.param_shapes().items()}
            self._parts_layout_ok = have == want
            self._parts_odd = sorted(set(have) ^ set(want)) or sorted(
                n for n in have if have[n] != want[n]
            )
        if not self._parts_layout_ok and self.config.is_committer:
            odd = self._parts_odd
            raise ConfigError(
                f"writer {self.writer}: without full_state, several writers state part digests "
                "over the transformers model's parameters, and this trainer layout's differ "
                f"(e.g. {odd[:3]}); nothing was written. Give the committer full_state"
            )
        return self._parts_layout_ok

    def _digests_like(self, full: Params, listed: Mapping[str, str]) -> dict[str, str]:
        """Every shard's digest of the FULL state ``full`` in the form ``listed`` uses: the
        state digests, or (several writers' parts digests) each writer's parts of ``full``'s
        dim-0 rows joined as the committer joins the writers' markers."""
        count = next((p[0] for d in listed.values() if (p := parse_parts_digest(d))), None)
        if count is None:
            return self._digests(full)
        per_writer = []
        for k in range(count):
            rows = {}
            for name, t in full.items():
                t = local_of(t)
                rows[name] = t[slice(*fsdp_dim0_rows(t.shape[0], k, count))] if t.dim() else t
            per_writer.append(
                writer_part_digests(
                    rows,
                    trainer_layout=self.trainer_layout,
                    receiver_layout=self.layout,
                    index=k,
                    count=count,
                )
            )
        return {s: parts_digest([per_writer[k][s] for k in range(count)]) for s in per_writer[0]}

    def _joined_parts(self, markers: Sequence[WriterMarker], version: int) -> dict[str, str]:
        """Every shard's parts digest from the writers' markers (writer index order). A marker
        without part digests (its writer was given full_state) or with another set of shards
        is refused by name: nothing is committed."""
        cfg = self.config
        by_writer = {m.writer: m for m in markers}
        shards = sorted(s.id for s in self.layout.shards())
        ordered = []
        for k in range(cfg.num_writers):
            m = by_writer[cfg.writer_id(k)]
            if m.part_digests is None:
                raise VersionError(
                    f"version {version}: writer {m.writer}'s marker states no part digests (it "
                    "was given full_state), and the committer, given none, needs every writer's "
                    "to list each shard's digest; nothing was committed. Give full_state to the "
                    "committer (or to no writer)"
                )
            if sorted(m.part_digests) != shards:
                raise VersionError(
                    f"version {version}: writer {m.writer}'s marker states part digests of "
                    f"shards {sorted(m.part_digests)[:8]}, the receiver layout has {shards[:8]}; "
                    "nothing was committed. Give every writer the same receiver layout"
                )
            ordered.append(m.part_digests)
        return {s: parts_digest([p[s] for p in ordered]) for s in shards}

    def _full_state_shards(self, params: Params) -> ShardTensors:
        return full_shard_tensors(
            params, trainer_layout=self.trainer_layout, receiver_layout=self.layout
        )

    def _resolve_full(self, params: Params, full_state: FullState | None) -> Params:
        if self.config.num_writers == 1:
            return params
        if full_state is None:
            raise ConfigError(
                "the committing writer of a multi-writer publisher needs full_state (the full "
                "parameters or a callable gathering them) to compute the shard digests"
            )
        full = full_state() if callable(full_state) else full_state
        self._check_full(full)
        return full

    def _check_full(self, full: Params) -> None:
        """ConfigError unless ``full`` (a ``full_state``) holds every parameter, whole."""
        if not full:
            raise ConfigError(
                f"writer {self.writer}: full_state returned no parameters (as "
                "gather_bf16(keep=False) does: enough for a writer that does not commit to "
                "publish), and this writer hashes the whole state from it (it commits, or "
                "resume() compares the state on every writer). Give it a full_state that keeps "
                "the state here: gather_bf16(..., keep=True)"
            )
        missing = self.trainer_layout.missing(full)
        if missing:
            raise ConfigError(
                f"writer {self.writer}: full_state has no {missing[:5]} ({len(missing)} of the "
                "model's parameters missing); every shard's digest is computed from "
                "it, so it holds every parameter of the model, whole. Nothing was committed"
            )
        wrong = self.trainer_layout.misshapen(
            ((n, tuple(local_of(t).shape)) for n, t in full.items()), 0, 1
        )
        if wrong is not None:
            name, shape, want = wrong
            raise ConfigError(
                f"writer {self.writer}: full_state's {name!r} is {shape}, but the model's is "
                f"{want}; full_state holds every parameter whole (gathered, not a rank's "
                "shard). Nothing was committed"
            )

    def _already_committed(
        self, version: int, committed: int, params: Params, full_state, t0: float
    ) -> PublishReport:
        try:
            manifest = self.catalog.manifest(version)
        except KeyNotFoundError:
            raise VersionError(
                f"version {version} is not newer than the newest committed version {committed}, "
                "and it has no manifest to compare with; publish under a version above "
                f"{committed}"
            ) from None
        if self.config.is_committer:
            empty = full_state is None and self.config.num_writers > 1
        else:  # None given, or a gather that keeps nothing here (gather_bf16(keep=False))
            full_state = full_state() if callable(full_state) else full_state
            empty = not full_state
        if empty:
            # It cannot hash the resulting state, and nothing else proves that its changes
            # since its baseline are in that version (another session's late commit, a stale
            # number, or steps taken since an attempt of its own that landed): taking the
            # version lost them. Its next version adopts the attempts that landed with its
            # blobs and anchors after anyone else's.
            raise CommitConflictError(
                f"version {version} is already committed (writers {list(manifest.writers)}); "
                f"writer {self.writer!r}, one of several, cannot tell without the full "
                f"state whether its changes since version {self.baseline} are in it, and keeps "
                "them. Publish next_version() on every writer, or give every writer full_state "
                "that keeps the state (gather_bf16(..., keep=True)) so that a retried or replayed "
                "version is compared as the committer compares it"
            )
        full = self._resolve_full(params, full_state)
        if self._digests_like(full, manifest.shard_digests) != dict(manifest.shard_digests):
            raise CommitConflictError(
                f"version {version} is already committed (writers {list(manifest.writers)}) "
                "with a different state than this trainer's; this publisher diverged from "
                f"what receivers hold. Publish under a version above {committed} (it will be "
                "an anchor)"
            )
        if self.config.is_committer:
            commit_mod.advance_latest(self.store, self.catalog, version, manifest.run_id)
        self._take_committed(manifest)
        return PublishReport(
            version=version,
            kind=manifest.kind,
            base_version=manifest.base_version,
            writer=self.writer,
            already_committed=True,
            total_s=time.perf_counter() - t0,
        )

    def _check_listed(self, manifest, entries: Iterable[BlobEntry]) -> None:
        listed = {(b.key, b.digest) for b in manifest.blobs}
        lost = [e.key for e in entries if (e.key, e.digest) not in listed]
        if lost or self.writer not in manifest.writers:
            raise CommitConflictError(
                f"version {manifest.version} was committed without this writer's blobs {lost} "
                f"(writers {list(manifest.writers)}): another publisher attempt won the commit. "
                "This writer's changes are kept; resync before publishing again"
            )

    def close(self) -> None:
        """Stop the upload and digest threads (a later publish starts them again)."""
        for attr in ("_pool", "_digest_pool"):
            pool = getattr(self, attr)
            if pool is not None:
                pool.shutdown(wait=True)
                setattr(self, attr, None)

    # --- joint commit, staleness, retention -------------------------------------------

    def wait_for_acks(
        self, version: int, receivers: Iterable[str] | None = None, timeout: float = 60.0
    ) -> dict[str, AckRecord | None]:
        """Block until every receiver in ``receivers`` holds ``version`` or later, verified.

        Args:
            version: the version to wait for.
            receivers: receiver ids (default: every live registered one).
            timeout: seconds; AckTimeoutError then names the receivers still missing (or,
                with the default, those whose registration the store would not return).

        Returns:
            ``{receiver: its ack of exactly version, or None if it registered a later one}``.
        """
        if receivers is None:
            receivers, timeout = self._live_ids(version, timeout)
        return wait_for_acks(
            self.catalog, version, receivers, timeout_s=timeout, poll_s=self.config.poll_interval_s
        )

    def _live_ids(self, version: int, timeout: float) -> tuple[list[str], float]:
        """The live receivers' ids and what is left of ``timeout``. A registration the store
        would not return may be a live receiver's, never left out on a guess: read again until
        every one reads (AckTimeoutError naming them at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            unreadable: list[str] = []
            live = self.catalog.live_receivers(self.config.receiver_ttl_s, unreadable=unreadable)
            if not unreadable:
                return list(live), max(0.0, deadline - time.monotonic())
            if time.monotonic() >= deadline:
                raise AckTimeoutError(
                    f"version {version}: waited {timeout:.1f} s to read the registrations of "
                    f"receivers {unreadable}, which the store would not return, to tell which "
                    "receivers are live. The version stays committed"
                )
            poll_pause(deadline, self.config.poll_interval_s)

    def live_receivers(self, *, unreadable: list[str] | None = None) -> dict[str, ReceiverRecord]:
        """The receivers whose heartbeat is younger than ``receiver_ttl_s``. A registration
        the store would not return (an outage, a throttled prefix) is left out with a warning,
        or, given ``unreadable``, has its receiver id appended there: a caller that acts on
        every live receiver must not take it for none."""
        return self.catalog.live_receivers(self.config.receiver_ttl_s, unreadable=unreadable)

    def gc(self) -> GcPlan:
        """Delete what retention allows (see :mod:`deltasync.commit.retention`)."""
        return collect_garbage(
            self.store,
            self.catalog,
            keep_versions=self.config.keep_versions,
            receiver_ttl_s=self.config.receiver_ttl_s,
            may_land=self._may_land,
            orphan_grace_s=self.config.orphan_grace_s,
        )


def _names_into(changes: Iterable[Change], names: set[str]) -> Iterator[Change]:
    """``changes``, adding each item's param name to ``names`` as it passes."""
    for item in changes:
        names.add(item[0])
        yield item


def _whole(changes: Iterable[Change], whole: set[str], params: Params) -> Iterator[Change]:
    """``changes`` with every element of the params in ``whole`` (``{"*"}``: all of them), each
    in place of its own item, or where it had none at its own place in ``params`` order: the
    router takes a stream in that order only, and a param that must go out whole may have no
    change at all (it went back to its baseline bits, or never moved), before a changed one.
    Each param's indices exist only while its item passes, as in ``changes`` itself."""
    order = {name: i for i, name in enumerate(params)}
    resend = [name for name in params if "*" in whole or name in whole]  # in params order
    due = 0  # resend[:due] have gone out
    for item in changes:
        at = order.get(item[0])
        if at is None:  # not a param: yielded as is, for the router to name it
            yield item
            continue
        while due < len(resend) and order[resend[due]] < at:
            yield from every_element_stream({resend[due]: params[resend[due]]})
            due += 1
        if due < len(resend) and resend[due] == item[0]:
            yield from every_element_stream({item[0]: params[item[0]]})
            due += 1
        else:
            yield item
    for name in resend[due:]:
        yield from every_element_stream({name: params[name]})


def _restored(manifest: Manifest, evidence: str) -> str:
    return (
        f"{evidence}, past the store's newest version of that run: the store was restored from "
        f"an older copy, and the numbers after {manifest.version} already name other states"
    )
