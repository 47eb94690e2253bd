"""The commit protocol of one version, as the committing writer (rank 0) runs it.

1. wait until every writer of this attempt has stored its marker (each lists its blobs). The
   committer's own marker is taken from memory, never read back from the store; the others'
   must carry a valid MAC when a signing key is set (a marker rewritten or pre-planted by
   anyone without the key is ignored, and named if the wait times out);
2. build the manifest from the markers (pure: :func:`build_manifest`), with the shard digests
   of the full resulting state, signed if a key is configured;
3. ``put_if_absent`` the manifest: this is the commit, and it fences a racing publisher. On a
   conflict the stored manifest is read back: if it describes the same resulting state (a
   retry of our own commit whose reply was lost, or a replayed trainer), the version is
   committed and we go on; otherwise CommitConflictError, and LATEST is not touched;
4. advance ``LATEST`` (never backwards; :func:`repair_latest` is the one move that may lower
   it: to the newest committed manifest when ``LATEST`` names a version without one). It is a
   hint: failing to write it is logged, never raised, since the manifest has committed.

This module knows keys, records and manifests; it knows nothing about tensors or layouts.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence

from deltasync import names
from deltasync.commit.canonical import canonical_json
from deltasync.commit.catalog import Catalog, poll_pause
from deltasync.commit.model import LayoutRecord, Manifest
from deltasync.commit.records import (
    MAX_MARKER_BYTES,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    WriterAbandoned,
    WriterMarker,
    encode_latest,
)
from deltasync.commit.signing import check_record_mac, record_mac, sign
from deltasync.errors import (
    CommitConflictError,
    CommitTimeoutError,
    ConfigError,
    DeltaSyncError,
    KeyNotFoundError,
    ManifestError,
    MissingWritersError,
    ObjectTooLargeError,
    OutcomeUnknownError,
    StoreError,
)
from deltasync.format import FORMAT_VERSION
from deltasync.store import Store

log = logging.getLogger(__name__)

MAX_CLAIM_BYTES = 1024  # a claim's record is read only to name its process
# How often the waits for markers and for the manifest also read the writers' abandoned
# notices: far less often than they poll (a notice saves a timeout of minutes; a request per
# poll per waiting writer would double the store's load while it waits).
NOTICE_POLL_S = 0.5


def build_manifest(
    *,
    version: int,
    kind: str,
    base_version: int | None,
    writers: Sequence[str],
    markers: Sequence[WriterMarker],
    shard_digests: Mapping[str, str],
    created_at: float,
    run_id: str,
    base_digests: Mapping[str, str] | None = None,
    layout: LayoutRecord | None = None,
    signing_key: bytes | None = None,
) -> Manifest:
    """The manifest of ``version`` from exactly one marker per writer (pure). ``run_id`` is
    the lineage, ``base_digests`` (deltas) every shard's state digest of the base version,
    ``layout`` the receiver layout the blobs were built for."""
    by_writer = {}
    for marker in markers:
        if marker.version != version:
            raise ManifestError(
                f"writer marker of {marker.writer!r} is for version {marker.version}, not {version}"
            )
        if marker.writer in by_writer:
            raise ManifestError(f"two markers of writer {marker.writer!r} for version {version}")
        by_writer[marker.writer] = marker
    if set(by_writer) != set(writers):
        raise ManifestError(
            f"version {version}: markers from {sorted(by_writer)} but the writers are "
            f"{sorted(writers)}"
        )
    blobs = tuple(b for w in sorted(by_writer) for b in by_writer[w].blobs)
    unknown = sorted({b.shard for b in blobs} - set(shard_digests))
    if unknown:
        raise ManifestError(
            f"version {version}: writers sent blobs for shards {unknown} that the receiver "
            "layout does not have; writers and committer disagree on the layout"
        )
    manifest = Manifest(
        version=version,
        base_version=base_version,
        kind=kind,
        format_version=FORMAT_VERSION,
        created_at=created_at,
        writers=tuple(writers),
        blobs=blobs,
        shard_digests=dict(shard_digests),
        run_id=run_id,
        base_digests=dict(base_digests or {}),
        layout=layout,
    )
    return sign(manifest, signing_key) if signing_key is not None else manifest


def wait_for_markers(
    store: Store,
    version: int,
    writers: Sequence[str],
    *,
    timeout_s: float,
    poll_s: float,
    own: WriterMarker | None = None,
    signing_key: bytes | None = None,
) -> list[WriterMarker]:
    """Every writer's marker of ``version``; MissingWritersError names those that never came.

    ``own`` is the caller's marker as it wrote it (used as is: what the store holds under its
    key may have been rewritten since). With ``signing_key``, a stored marker counts only once
    its MAC verifies; an unreadable or forged one is skipped until the real writer's replaces
    it, and the timeout error names it."""
    found: dict[str, WriterMarker] = {}
    if own is not None:
        if own.version != version or own.writer not in writers:
            raise ManifestError(
                f"the committer's own marker is for writer {own.writer!r} version "
                f"{own.version}, not one of {list(writers)} at version {version}"
            )
        found[own.writer] = own
    rejected: dict[str, str] = {}
    abandoned: dict[str, str] = {}
    ignored: set[str] = set()
    deadline = time.monotonic() + timeout_s
    notices_at = time.monotonic() + NOTICE_POLL_S
    while True:
        notices = time.monotonic() >= notices_at
        if notices:
            notices_at = time.monotonic() + NOTICE_POLL_S
        for writer in writers:
            if writer in found:
                continue
            key = names.writer_marker_key(version, writer)
            try:
                data = store.get(key, max_bytes=MAX_MARKER_BYTES)
                marker = WriterMarker.from_json(
                    data, signing_key=signing_key, what=f"writer marker {key!r}"
                )
            except KeyNotFoundError:
                if notices:
                    reason = abandoned_reason(
                        store, version, writer, signing_key=signing_key, ignored=ignored
                    )
                    if reason is not None:
                        abandoned[writer] = reason
                continue
            except DeltaSyncError as exc:
                if writer not in rejected:
                    log.warning("version %d: ignoring the marker at %r: %s", version, key, exc)
                rejected[writer] = f"{type(exc).__name__}: {exc}"
                continue
            if marker.version != version or marker.writer != writer:
                rejected[writer] = (
                    f"it describes writer {marker.writer!r} version {marker.version}: misplaced"
                )
                continue
            if signing_key is None and marker.mac is not None:
                # Committed unsigned, the version would be refused by every receiver that
                # holds the writer's key, and so would every version after it.
                rejected[writer] = (
                    "it is signed, and this committer has no signing key: give every writer "
                    "the same PublisherConfig.signing_key"
                )
                continue
            found[writer] = marker
            rejected.pop(writer, None)
        missing = [w for w in writers if w not in found]
        if not missing:
            return [found[w] for w in writers]
        refused = "".join(f" The marker of {w} was refused: {r}." for w, r in rejected.items())
        if abandoned:
            why = "; ".join(f"{w}: {r}" for w, r in abandoned.items())
            raise MissingWritersError(
                f"version {version}: writers {sorted(abandoned)} abandoned their attempt "
                f"({why}).{refused} Nothing was committed; publish next_version() on every "
                "writer"
            )
        if time.monotonic() >= deadline:
            raise MissingWritersError(
                f"version {version}: waited {timeout_s:.1f} s for the markers of writers "
                f"{missing} (have {sorted(found)}); those trainer ranks crashed or are stuck "
                f"before finishing their blobs.{refused} Nothing was committed; publish "
                "next_version() on every writer (their largest, if they differ) once they "
                "run again, or raise PublisherConfig.marker_timeout_s"
            )
        poll_pause(deadline, poll_s)


def abandon_version(
    store: Store, version: int, writer: str, reason: str, *, signing_key: bytes | None = None
) -> None:
    """Store ``writer``'s notice that its attempt at ``version`` failed, so that the committer
    (and the writers waiting for the committer's manifest) stop waiting for it. Best effort: a
    store that refuses it leaves them to their timeout, as before the notice existed. Call it
    only while ``version`` is not committed and cannot be (no manifest write of it without a
    verdict)."""
    notice = WriterAbandoned(
        version=version,
        writer=writer,
        reason=reason[:MAX_REASON_CHARS],
        created_at=time.time(),
    )
    try:
        store.put(notice.key, notice.to_json(signing_key))
    except StoreError as exc:
        log.warning(
            "writer %s: the notice that its attempt at version %d failed could not be stored "
            "(%s); the other writers wait out their timeout",
            writer,
            version,
            exc,
        )


def abandoned_reason(
    store: Store,
    version: int,
    writer: str,
    *,
    signing_key: bytes | None = None,
    ignored: set[str] | None = None,
) -> str | None:
    """Why ``writer`` abandoned its attempt at ``version``, or None when it has not (no notice,
    or one that cannot be read or, with ``signing_key``, does not verify: ignored, so that
    nobody without the key can make a version fail). A wait passes ``ignored``, the keys it
    logged as ignored already, so that a planted notice is logged once, not at every poll."""
    key = names.writer_abandoned_key(version, writer)
    try:
        data = store.get(key, max_bytes=MAX_RECORD_BYTES)
        notice = WriterAbandoned.from_json(data, signing_key=signing_key, what=f"notice {key!r}")
    except KeyNotFoundError:
        return None
    except DeltaSyncError as exc:
        if ignored is None or key not in ignored:
            log.warning("version %d: ignoring the abandoned notice at %r: %s", version, key, exc)
            if ignored is not None:
                ignored.add(key)
        return None
    if notice.version != version or notice.writer != writer:
        return None  # misplaced
    return notice.reason


def claim_version(
    store: Store, version: int, writer: str, claim: bytes, *, signing_key: bytes | None = None
) -> None:
    """Claim ``version`` for this process as ``writer`` (several writers), before its first
    blob: blob keys are named by version, shard and writer, so a second process running as the
    same writer id would overwrite the first one's blobs, and the version those parts commit
    would be refused by every receiver. ``claim`` is this process's own token (the same bytes
    on every call, :func:`claim_record`); a claim already there with other bytes is another
    process's: ConfigError naming the writer and that process, before anything is written.
    With ``signing_key`` only a claim carrying its MAC for this key (its version and writer)
    is another process's: one that does not verify was planted by someone without the key (a
    copy of a genuine claim stored under another key included), and is replaced."""
    key = names.writer_claim_key(version, writer)
    what = f"version {version}: writer {writer!r}'s claim"
    verifies = (lambda held: _claim_verifies(held, key, signing_key)) if signing_key else None
    if signing_key:
        claim = _bound_claim(claim, key, signing_key)
    if _stored_once(store, key, claim, what, verifies=verifies):
        return
    raise ConfigError(
        f"version {version}: writer {writer!r} was claimed by another process "
        f"({_claimant(store, key)}): two trainer processes run as that writer (the same "
        "writer_rank and session). Give each rank its own writer_rank, and a restarted job a "
        "new session; this process wrote nothing for the version"
    )


def _claimant(store: Store, key: str) -> str:
    """Who holds a claim, as its record says (a store's bytes: shown, never trusted)."""
    try:
        record = json.loads(store.get(key, max_bytes=MAX_CLAIM_BYTES))
        host, pid = record["host"], record["pid"]
    except (StoreError, ValueError, TypeError, KeyError):
        return "its claim is unreadable"
    if not isinstance(host, str) or type(pid) is not int:
        return "its claim is unreadable"
    return f"host {host[:64]!r}, pid {pid}"


def claim_record() -> bytes:
    """A new claim token of this process: unique, and naming where it runs (with a signing
    key, :func:`claim_version` MACs it for the key it is stored at)."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": secrets.token_hex(16)}
    return json.dumps(record, sort_keys=True).encode()


_CLAIM = "writer claim"


def _bound_claim(claim: bytes, key: str, signing_key: bytes) -> bytes:
    """``claim`` MAC'd for ``key``, the version and writer it claims: the same bytes on every
    call, and a copy stored under another version's or writer's key does not verify."""
    record = json.loads(claim)
    record["mac"] = record_mac(_CLAIM, canonical_json({**record, "key": key}), signing_key)
    return json.dumps(record, sort_keys=True).encode()


def _claim_verifies(data: bytes, key: str, signing_key: bytes) -> bool:
    """Whether a claim stored at ``key`` carries a valid MAC for that key."""
    try:
        record = json.loads(data)
        mac = record.pop("mac")
        body = canonical_json({**record, "key": key})
        check_record_mac(_CLAIM, body, mac, signing_key, what="claim")
    except (ValueError, TypeError, AttributeError, KeyError, DeltaSyncError):
        return False
    return True


def _marker_verifies(data: bytes, marker: WriterMarker, signing_key: bytes) -> bool:
    """Whether a marker stored at ``marker``'s key verifies and is of its version and writer
    (a copy of a genuine marker of another version or writer is not)."""
    try:
        held = WriterMarker.from_json(data, signing_key=signing_key, what="writer marker")
    except DeltaSyncError:
        return False
    return (held.version, held.writer) == (marker.version, marker.writer)


def store_marker(
    store: Store, marker: WriterMarker, data: bytes, *, signing_key: bytes | None = None
) -> None:
    """Store a writer's marker of a version, once: a marker already there (other bytes) is
    another process's, running as the same writer id (a rank handed out twice, or an old
    incarnation still alive), and is never overwritten. ConfigError then, naming the writer.
    With ``signing_key`` only a marker that verifies, of this version and writer, is another
    process's: one that does not was planted by someone without the key (a copy of another
    version's marker included), and is replaced."""
    verifies = (lambda held: _marker_verifies(held, marker, signing_key)) if signing_key else None
    what = f"version {marker.version}: writer {marker.writer!r}'s marker"
    if _stored_once(store, marker.key, data, what, verifies=verifies):
        return
    raise ConfigError(
        f"version {marker.version}: writer {marker.writer!r} already stored its marker from "
        "another process: two trainer processes run as that writer (the same writer_rank and "
        "session). Give each rank its own writer_rank, and a restarted job a new session; "
        "this attempt is not committed, and receivers refuse a version built from both"
    )


def commit_manifest(store: Store, catalog: Catalog, manifest: Manifest) -> bool:
    """Write the manifest if absent. True: we committed it; False: an equivalent manifest (same
    resulting shard states) was already committed. CommitConflictError otherwise."""
    key = names.manifest_key(manifest.version)
    data = manifest.to_json()
    try:
        store.put_if_absent(key, data)
        catalog.forget(manifest.version)
        return True
    except CommitConflictError:
        pass
    except StoreError as exc:
        # No verdict (a reply lost past the retries), or a failure from a store that applied
        # the write before it failed (the contract says a failure stored nothing; not every
        # store keeps it): read the key back once. Our bytes there mean it landed, committed
        # (receivers may hold it already); none there, a failure stored nothing, and a lost
        # reply may still land (the caller retires the number); another manifest there lost
        # us the race, as a conflict would have said.
        landed = _stored_as(store, key, data)
        if landed is None:
            raise
        catalog.forget(manifest.version)
        if landed:
            verdict = "had no verdict" if isinstance(exc, OutcomeUnknownError) else "failed"
            log.info(
                "version %d: the manifest write %s (%s), but landed",
                manifest.version,
                verdict,
                exc,
            )
            return True
    catalog.forget(manifest.version)
    try:
        existing = catalog.manifest(manifest.version)
    except DeltaSyncError as exc:
        raise CommitConflictError(
            f"version {manifest.version} already has a manifest that this publisher cannot "
            f"read ({type(exc).__name__}: {exc}); another publisher wrote it. This attempt was "
            "not committed and LATEST was not touched"
        ) from exc
    if dict(existing.shard_digests) == dict(manifest.shard_digests):
        return False
    raise CommitConflictError(
        f"version {manifest.version} was committed first by another publisher (writers "
        f"{list(existing.writers)}) with a different resulting state; this attempt "
        f"(writers {list(manifest.writers)}) lost the race: its blobs are orphaned (gc removes "
        "them) and LATEST was not touched. Publish the next version after resyncing, or stop "
        "the second publisher"
    )


def _stored_once(
    store: Store,
    key: str,
    data: bytes,
    what: str,
    *,
    verifies: Callable[[bytes], bool] | None = None,
    planted: int = 3,
) -> bool:
    """``put_if_absent`` of ``data`` at ``key``: True when ``key`` holds our bytes (written
    now, or by an earlier attempt of ours whose reply was lost), False when it holds another
    writer's. A store that cannot say which is a StoreError naming ``what`` (retryable), never
    taken for another writer's. ``verifies(bytes)`` (with a signing key): whether other bytes
    there are a key holder's; those that are not were planted by someone who can write the
    store but has no key (they would fail every writer of the version), and are deleted and
    the write tried again, up to ``planted`` times."""
    for _ in range(planted + 1):
        try:
            store.put_if_absent(key, data)
            return True
        except CommitConflictError:
            pass
        except OutcomeUnknownError:
            if _stored_as(store, key, data) is None:
                raise
        held = _held(store, key, len(data))
        if held is _GONE:
            continue  # deleted meanwhile: try again
        if held is None:
            raise StoreError(
                f"{what} is stored, and reading it back to tell whose it is failed; retry the "
                "publish (a later read answers it)"
            )
        if held == data:
            return True
        if verifies is None or verifies(held):
            return False
        log.warning(
            "%s: %r holds bytes that do not verify under the signing key (planted by someone "
            "who can write the store, not a writer of this run); deleting them and writing "
            "it again",
            what,
            key,
        )
        # Read again right before the delete: another holder of the key (the same writer id
        # twice) may have replaced the planted bytes since; its claim is never deleted. The
        # Store has no compare-and-delete, so this narrows the window, it does not close it.
        if _held(store, key, len(data)) == held:
            store.delete(key)
    return False


_GONE = object()  # _held's answer for a key that holds nothing


def _held(store: Store, key: str, size: int) -> bytes | object | None:
    """What ``key`` holds (``b""``: more than any claim or marker of ours, ``_GONE``: nothing),
    None when it cannot be read now."""
    try:
        return store.get(key, max_bytes=max(size, MAX_CLAIM_BYTES, MAX_MARKER_BYTES))
    except ObjectTooLargeError:
        return b""  # no claim or marker of ours is that large
    except KeyNotFoundError:
        return _GONE
    except StoreError:
        return None


def _stored_as(store: Store, key: str, data: bytes) -> bool | None:
    """Whether ``key`` holds exactly ``data`` (False: other bytes); None when it holds nothing
    or cannot be read now."""
    held = _held(store, key, len(data))
    return None if held is None or held is _GONE else held == data


def advance_latest(store: Store, catalog: Catalog, version: int, run_id: str | None = None) -> bool:
    """Point LATEST at ``version`` unless it already names that or a newer committed
    version (a LATEST naming a version without a manifest, or with a key one whose manifest
    does not verify, does not hold it back)."""
    current = catalog.read_latest()
    if current is not None and current >= version and catalog.is_committed(current):
        return False
    return _put_latest(store, version, run_id)


def _put_latest(store: Store, version: int, run_id: str | None) -> bool:
    """Write LATEST; a failure is logged, never raised: the version is committed by its
    manifest already, and readers probe for the manifests after the LATEST they read."""
    try:
        store.put(names.LATEST, encode_latest(version, run_id))
    except StoreError as exc:
        log.warning(
            "LATEST could not be moved to version %d (%s); the version is committed. Readers "
            "probe for the manifests after the LATEST they read, so they find it unless a "
            "number before it was never committed; then they find it once a later commit "
            "moves LATEST. If the write keeps failing, remove whatever is stored at LATEST "
            "(e.g. a directory someone created there)",
            version,
            exc,
        )
        return False
    return True


def repair_latest(store: Store, catalog: Catalog) -> int | None:
    """Point LATEST at the newest committed manifest, up (a crash after the commit) or down
    (LATEST names a version with no manifest: asked of the store itself, not of its listing);
    returns that version (None: nothing committed, LATEST left alone)."""
    newest = catalog.newest_committed(verified=True)
    try:
        current = catalog.read_latest(strict=True)
    except StoreError as exc:
        # Unknown is not absent: the listing's newest could be below what LATEST says (a
        # listing that lags), and writing it would lower LATEST under a committed version.
        log.warning(
            "LATEST could not be read (%s): not repaired now; the next commit rewrites it", exc
        )
        return newest
    # LATEST naming a version the listing does not show: a listing that lags behind the writes
    # (an eventually consistent store) must not lower it when its manifest is there
    lagging = current is not None and (newest is None or current > newest)
    if lagging and catalog.has_manifest(current) and catalog.verifies(current):
        newest = current
    if newest is None:
        return None
    try:
        run_id = catalog.manifest(newest).run_id
    except DeltaSyncError:
        return newest  # an unreadable newest manifest: readers refuse it; leave LATEST alone
    if current != newest or catalog.read_latest_run() != run_id:
        _put_latest(store, newest, run_id)
    return newest


def wait_for_manifest(
    catalog: Catalog,
    version: int,
    *,
    timeout_s: float,
    poll_s: float,
    committer: str | None = None,
    signing_key: bytes | None = None,
) -> Manifest:
    """A non-committing writer waits for the committer's manifest of ``version``; it stops
    when the ``committer`` writer abandoned its attempt (its notice: the manifest never
    comes)."""
    deadline = time.monotonic() + timeout_s
    notices_at = time.monotonic() + NOTICE_POLL_S
    ignored: set[str] = set()
    while not catalog.has_manifest(version):
        reason = None
        if committer is not None and time.monotonic() >= notices_at:
            notices_at = time.monotonic() + NOTICE_POLL_S
            reason = abandoned_reason(
                catalog.store, version, committer, signing_key=signing_key, ignored=ignored
            )
        if reason is not None and not catalog.has_manifest(version):
            raise CommitTimeoutError(
                f"version {version}: the committing writer {committer} abandoned its attempt "
                f"({reason}); nothing was committed. This writer's changes are kept (its "
                "tracker is not cleared); publish next_version() on every writer"
            )
        if time.monotonic() >= deadline:
            raise CommitTimeoutError(
                f"version {version}: waited {timeout_s:.1f} s for the committing writer (rank 0) "
                "to write the manifest; it crashed or is stuck. This writer's changes are kept "
                "(its tracker is not cleared); publish next_version() on every writer"
            )
        poll_pause(deadline, poll_s)
    return catalog.manifest(version)
