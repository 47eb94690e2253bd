"""Retention: which stored keys are safe to delete, and deleting them in a safe order.

:func:`plan_deletions` is pure. It applies :func:`deltasync.commit.plan_retention` (never a
version a live receiver still needs, never the anchor a live receiver is restoring nor any
version after it, never the newest anchor and the chain after it, never the newest committed
version or anything newer) and also removes leftovers that no manifest
vouches for: blobs and markers of losing attempts in committed versions, and everything of
uncommitted versions older than the newest committed one (newer ones may still be in flight).

Only keys that parse as what retention expects under that version are ever deleted (a
manifest, a blob or a writer marker of the version, an ack of the version): anything else
found under a doomed version's prefixes was not written by deltasync and is left alone (with
a warning), so a store shared with others cannot steer the trainer into deleting it.

An attempt that never committed is deleted only once its newest key is older than a grace
period (``orphan_grace_s``): a manifest write whose outcome was unknown (a reply lost past the
retries) may still land and name those blobs. Its age is the store's (``Store.modified``); a
store that cannot tell keeps such attempts. The publisher also passes the numbers it knows had
no verdict (``may_land``), kept whatever their age while they have no manifest.

A receiver's registration (``receivers/{id}.json``) is deleted once its heartbeat is older
than ``forget_receivers_after_s`` (a day by default), and never before it is older than both
the receiver TTL and the orphan grace: such a receiver is long dead (a rollout pod that came
and went), and without this every reader of registrations (bounded staleness, retention,
inspect) would read them all forever. A receiver that comes back writes its registration again
on its next heartbeat (every pull). Each planned registration is read again right before its
deletion and kept if its heartbeat is fresh again (it came back while the versions were being
deleted), so only a heartbeat landing between that read and the delete is lost, costing one
heartbeat's absence. A registration that does not parse or verify is left alone; one the
store would not return (an outage) stops the pass before anything is deleted: taken for
absent, a live receiver's versions would be deleted on a guess.

The conditional-write probes an S3 client writes and deletes before its first commit
(``probes/``) are deleted once older than the orphan grace (and never younger than
``PROBE_MIN_AGE_S``): only a client killed mid-probe leaves one, and a younger one may be a
probe in flight, which would pass its second write if its key were gone.

A store that has ``abort_uploads`` (S3) is asked, after the deletions, to abort the multipart
uploads still open under each version deleted whole: nothing will complete them.

Deletion order: a version's manifest goes first, so the version disappears atomically for
readers, then its blobs and markers, then its acks; registrations of dead receivers last. A
failed deletion does not stop the pass (under steady transient errors it would fall behind for
good): the rest goes on, except the keys of a version whose manifest could not be deleted,
which stays committed whole, and the pass then raises a ``StoreError`` counting the failures.
:func:`collect_garbage` reads what the plan needs from a store and deletes it
(``Publisher.gc`` and ``deltasync gc`` both run it). This module knows keys and manifests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from deltasync import names
from deltasync.commit.model import Manifest
from deltasync.commit.planning import plan_retention
from deltasync.errors import KeyNotFoundError, ManifestError, StoreError
from deltasync.store.base import written_at

if TYPE_CHECKING:
    from deltasync.commit.catalog import Catalog
    from deltasync.commit.records import ReceiverRecord
    from deltasync.store import Store

log = logging.getLogger(__name__)

# PublisherConfig's keep_versions, receiver_ttl_s and orphan_grace_s, which ``deltasync gc``
# defaults to as well. The grace outlasts any one S3 request (connect and read timeouts of a
# minute at most, a few attempts): a manifest PUT still in flight after it is not credible.
KEEP_VERSIONS = 2
RECEIVER_TTL_S = 120.0
ORPHAN_GRACE_S = 600.0
# ``deltasync gc --forget-receivers-after``'s default: a registration whose heartbeat is a day
# old belongs to a receiver that is gone (a live one heartbeats on every pull).
FORGET_RECEIVERS_AFTER_S = 86400.0
# The youngest leftover probe gc deletes, whatever the orphan grace: a probe takes a client's
# first seconds (two writes and a delete).
PROBE_MIN_AGE_S = 60.0


def _version_of(key: str) -> int | None:
    """The version a deltasync version-directory key belongs to, or None for any other key."""
    parsers = (
        names.parse_manifest_key,
        names.parse_writer_marker_key,
        names.parse_writer_claim_key,
        names.parse_writer_abandoned_key,
        names.parse_blob_key,
    )
    for parse in parsers:
        try:
            parsed = parse(key)
        except ManifestError:
            continue
        return parsed if isinstance(parsed, int) else parsed[0]
    return None


def _ack_version(key: str) -> int | None:
    try:
        return names.parse_ack_key(key)[0]
    except ManifestError:
        return None


def _ours(keys: Iterable[str], version: int, parse) -> list[str]:
    out, foreign = [], []
    for key in keys:
        (out if parse(key) == version else foreign).append(key)
    if foreign:
        log.warning(
            "retention: %d key(s) under version %d are not deltasync's and are left alone "
            "(e.g. %r); someone else writes into this store",
            len(foreign),
            version,
            foreign[0],
        )
    return sorted(out)


@dataclass(frozen=True)
class GcPlan:
    versions: tuple[int, ...]  # committed versions removed entirely
    keys: tuple[str, ...]  # every key to delete, in order (manifests first)
    # attempts that never committed, kept for now: their manifest may still land
    deferred: tuple[int, ...] = ()
    # receivers whose registrations are deleted (their keys end ``keys``): dead for long enough
    receivers: tuple[str, ...] = ()
    # the newest committed version whose manifest verifies, which the plan starts from (None:
    # none does, and no version is deleted)
    committed: int | None = None


def plan_forgotten_receivers(
    records: Mapping[str, ReceiverRecord], *, now: float, after_s: float
) -> tuple[str, ...]:
    """The receivers (sorted) whose last heartbeat is more than ``after_s`` seconds before
    ``now``. Pure; the caller makes ``after_s`` at least the receiver TTL, so a live receiver
    is never among them (a heartbeat from the future is not old either)."""
    return tuple(sorted(r for r, rec in records.items() if now - rec.updated_at > after_s))


def plan_deletions(
    *,
    version_keys: Mapping[int, Iterable[str]],
    manifests: Mapping[int, Manifest],
    ack_keys: Mapping[int, Iterable[str]],
    committed: int | None,
    live_versions: Iterable[int | None],
    keep_versions: int,
    restoring: Iterable[int] = (),
) -> GcPlan:
    """The plan for what the store holds: ``live_versions`` (each live receiver's version of
    the committed lineage, None: none) and ``restoring`` (the anchors of that lineage live
    receivers are restoring) go to :func:`plan_retention`."""
    if committed is None or not manifests:
        return GcPlan((), ())
    doomed = plan_retention(
        [m.info for m in manifests.values()],
        list(live_versions),
        keep_latest=keep_versions,
        latest=committed,
        restoring=list(restoring),
    )
    first: list[str] = []
    rest: list[str] = []
    own = {v: _ours(keys, v, _version_of) for v, keys in version_keys.items()}
    for v in doomed:
        first.append(names.manifest_key(v))
        rest.extend(k for k in own.get(v, ()) if k != names.manifest_key(v))
        rest.extend(_ours(ack_keys.get(v, ()), v, _ack_version))
    gone = set(doomed)
    for v, keys in sorted(own.items()):
        if v in gone:
            continue
        m = manifests.get(v)
        if m is None:
            if v < committed:  # never committed, and never will be: publish only goes forward
                rest.extend(keys)
            continue  # newer: an attempt may still be in flight
        keep = {names.manifest_key(v), *(b.key for b in m.blobs)}
        keep.update(names.writer_marker_key(v, w) for w in m.writers)
        # the writers' claims too: one deleted would let a second process running as that
        # writer claim the version and overwrite its committed blobs
        keep.update(names.writer_claim_key(v, w) for w in m.writers)
        rest.extend(k for k in keys if k not in keep)  # a losing attempt's leftovers
    return GcPlan(tuple(doomed), tuple(first + rest))


def collect_garbage(
    store: Store,
    catalog: Catalog,
    *,
    keep_versions: int,
    receiver_ttl_s: float,
    dry_run: bool = False,
    may_land: Collection[int] = (),
    orphan_grace_s: float = ORPHAN_GRACE_S,
    forget_receivers_after_s: float = FORGET_RECEIVERS_AFTER_S,
) -> GcPlan:
    """Plan retention from what ``store`` holds now and delete it in order (``dry_run``: plan
    only). Live receivers are the records younger than ``receiver_ttl_s``. An attempt that
    never committed stays while its newest key is younger than ``orphan_grace_s`` (or its age
    is unknown), and so do the versions in ``may_land`` (manifest writes that ended without a
    verdict, which the caller's publisher knows) while they have no manifest: it may still
    land and name their keys. A registration whose heartbeat is older than
    ``max(forget_receivers_after_s, receiver_ttl_s, orphan_grace_s)`` is deleted too
    (``math.inf``: never)."""
    latest = catalog.latest()
    version_keys = catalog.version_dirs()
    listed = set(version_keys)  # every version directory, verified or not
    manifests: dict[int, Manifest] = {}

    def load(v: int) -> None:
        # A manifest that does not verify (foreign, hostile) is never touched; one that could
        # not be read (an outage) stops the plan: without it the chain to the newest version
        # cannot be walked, and nothing is deleted on a guess.
        try:
            manifests[v] = catalog.manifest(v)
        except (ManifestError, KeyNotFoundError):
            version_keys.pop(v, None)

    # Plan from verified manifests only: the newest committed version is the newest whose
    # manifest verifies (a planted LATEST and a junk manifest above the real head must not
    # make the real chain look old enough to delete).
    if latest is not None:
        load(latest)  # even where the listing lags behind it
    for v, keys in list(version_keys.items()):
        if names.manifest_key(v) in keys and v not in manifests:
            load(v)
    committed = max((v for v in manifests if latest is None or v <= latest), default=None)
    if latest is not None and committed != latest:
        log.warning(
            "retention: LATEST leads to version %d, whose manifest does not verify; planning "
            "from the newest verified one (%s)",
            latest,
            committed,
        )
    deferred = []
    now = time.time()
    for v, keys in list(version_keys.items()):
        if names.manifest_key(v) in keys:
            continue
        # Deleted in full as never committed, unless the store says otherwise: a listing can
        # lag behind the newest writes (an eventually consistent store), and it must not
        # delete the blobs of a version committed meanwhile.
        if committed is None or v >= committed:
            continue
        if v in may_land:
            del version_keys[v]
            deferred.append(v)
            continue
        if not store.exists(names.manifest_key(v)):
            if _may_still_commit(store, keys, orphan_grace_s, now):
                del version_keys[v]
                deferred.append(v)
            continue
        keys.append(names.manifest_key(v))
        load(v)
    # Every ack in one listing. An ack may land after its version was collected (a receiver
    # writes it beside its registration, which a gc may read first): with no version
    # directory left and a newer version committed, nothing will read it again.
    ack_keys: dict[int, list[str]] = {}
    for key in store.list("acks/"):
        v = _ack_version(key)
        if v is not None:
            ack_keys.setdefault(v, []).append(key)
    orphaned = [
        key
        for v, keys in sorted(ack_keys.items())
        if v not in listed and committed is not None and v < committed
        for key in keys
    ]
    probes = _left_probes(store, max(orphan_grace_s, PROBE_MIN_AGE_S), time.time())
    run_id = manifests[committed].run_id if committed in manifests else None
    # Every registration that parses and verifies; one the store would not return stops the
    # plan (as an unreadable manifest does): counted as absent, a live receiver's versions
    # would be deleted on a guess.
    unreadable: list[str] = []
    records = catalog.receivers(unreadable=unreadable)
    if unreadable:
        raise StoreError(
            f"retention: the registrations of receivers {unreadable} could not be read; a live "
            "one would lose the versions it needs, so nothing was deleted. Run gc again once "
            "the store answers"
        )
    now = time.time()  # again: the reads above take time, and heartbeats are judged by it
    live_records = [r for r in records.values() if r.is_live(now, receiver_ttl_s)]
    live = [r.version if run_id is None else r.version_in(run_id) for r in live_records]
    # The anchors live receivers are fetching (of this lineage: an older lineage's anchor is
    # nothing a receiver can reach the head from). Without a verified head nothing is deleted.
    restoring = [
        a
        for a in (r.restoring_in(run_id) for r in live_records if run_id is not None)
        if a is not None
    ]
    # Never a live receiver (TTL), nor one paused for less than an attempt's grace.
    forget_after_s = max(forget_receivers_after_s, receiver_ttl_s, orphan_grace_s)
    forgotten = plan_forgotten_receivers(records, now=now, after_s=forget_after_s)
    plan = plan_deletions(
        version_keys=version_keys,
        manifests=manifests,
        ack_keys=ack_keys,
        committed=committed,
        live_versions=live,
        keep_versions=keep_versions,
        restoring=restoring,
    )
    plan = replace(plan, committed=committed)
    if deferred:
        log.info(
            "retention: attempt(s) at version(s) %s never committed and are kept for now: a "
            "manifest write may still land (grace %gs)",
            deferred,
            orphan_grace_s,
        )
        plan = replace(plan, deferred=tuple(sorted(deferred)))
    if orphaned or probes:
        plan = replace(plan, keys=plan.keys + tuple(orphaned) + tuple(probes))
    if forgotten:
        log.info(
            "retention: forgetting %d receiver registration(s) without a heartbeat for over "
            "%gs (e.g. %r); a receiver that comes back registers again on its next pull",
            len(forgotten),
            forget_after_s,
            forgotten[0],
        )
        plan = replace(
            plan,
            keys=plan.keys + tuple(names.receiver_key(r) for r in forgotten),
            receivers=forgotten,
        )
    if not dry_run:
        forgotten_at = {names.receiver_key(r): r for r in plan.receivers}
        kept: set[str] = set()
        failed: list[tuple[str, StoreError]] = []
        standing: set[int] = set()  # doomed versions whose manifest could not be deleted
        for key in plan.keys:
            receiver = forgotten_at.get(key)
            if receiver is not None and _came_back(catalog, receiver, forget_after_s):
                kept.add(receiver)
                continue
            if standing and (_version_of(key) in standing or _ack_version(key) in standing):
                continue  # still committed: its manifest vouches for these keys
            try:
                store.delete(key)
            except StoreError as exc:
                # One failed deletion does not stop the pass: under steady transient errors a
                # pass that stopped at the first one would fall behind for good.
                failed.append((key, exc))
                if _is_manifest(key):
                    standing.add(_version_of(key))
        for v in plan.versions:
            if v not in standing:
                catalog.forget(v)
        # Versions now gone whole (retired, or attempts that never committed): a multipart
        # upload still open under one (S3: a create applied after its call ended) is
        # nobody's, and would stay open for good. Only S3 has such uploads.
        abort_uploads = getattr(store, "abort_uploads", None)
        if abort_uploads is not None:
            gone = {_version_of(k) for k in plan.keys} - standing - set(manifests)
            for v in sorted((gone | set(plan.versions)) - standing - {None}):
                abort_uploads(names.version_dir(v) + "/")
        if failed:
            key, exc = failed[0]
            raise StoreError(
                f"retention: {len(failed)} of {len(plan.keys)} deletions failed (first: {key!r}: "
                f"{exc}); every other planned key was deleted, and versions {sorted(standing)} "
                "keep every key their manifest names (the older versions of their chains may "
                "be gone). Run gc again once the store answers"
            ) from exc
        if kept:  # what was done, not what was planned
            plan = replace(
                plan,
                keys=tuple(k for k in plan.keys if forgotten_at.get(k) not in kept),
                receivers=tuple(r for r in plan.receivers if r not in kept),
            )
    return plan


def _is_manifest(key: str) -> bool:
    try:
        names.parse_manifest_key(key)
    except ManifestError:
        return False
    return True


def _came_back(catalog, receiver: str, after_s: float) -> bool:
    """Whether ``receiver``, planned to be forgotten, registered again since the plan read its
    record (the versions' deletions before take time): its registration is then kept, as is
    one the store would not return now."""
    try:
        rec = catalog.receiver(receiver, strict=True)
    except StoreError as exc:
        log.warning(
            "retention: the registration of receiver %r could not be read again (%s); kept",
            receiver,
            exc,
        )
        return True
    if rec is None or time.time() - rec.updated_at > after_s:
        return False
    log.info(
        "retention: receiver %r registered again meanwhile; its registration is kept", receiver
    )
    return True


def _left_probes(store: Store, min_age_s: float, now: float) -> list[str]:
    """The conditional-write probes (``probes/{token}``) written at least ``min_age_s`` before
    ``now``. A key there that is not a probe's name, or whose age the store cannot tell, is
    left alone."""
    left = []
    for key in store.list(names.PROBES_PREFIX):
        try:
            names.probe_key(key[len(names.PROBES_PREFIX) :])  # a probe's name, or ManifestError
            at = written_at(store, key)
        except (ManifestError, KeyNotFoundError):  # not a probe's name; deleted meanwhile
            continue
        if at is not None and now - at >= min_age_s:
            left.append(key)
    return left


def _may_still_commit(store: Store, keys: Iterable[str], grace_s: float, now: float) -> bool:
    """Whether an uncommitted attempt is too young to delete: one of its keys was written
    less than ``grace_s`` ago, or the store cannot say when."""
    if grace_s <= 0:
        return False
    for key in keys:
        try:
            at = written_at(store, key)
        except KeyNotFoundError:  # deleted meanwhile (another gc)
            continue
        if at is None or now - at < grace_s:
            return True
    return False
