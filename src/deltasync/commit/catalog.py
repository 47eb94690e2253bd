"""Catalog: a read-only view of what is committed on a store (versions, manifests, records).

Publisher, receivers and ``deltasync inspect`` all read the store through this one class, so
they agree on what "committed" means: a version exists only through its manifest, parsed
strictly (``expected_version`` rejects a manifest stored under another version's key), its
signature checked when a key is configured, its format version one this build reads.

``LATEST`` is a hint. A publisher can crash after committing a manifest and before moving
``LATEST``, so :meth:`latest` probes the following versions' manifests, and
:meth:`newest_committed` lists every manifest when ``LATEST`` is missing altogether. A
``LATEST`` that names a version without a manifest (a store restored out of order, a stray
write) is treated as absent, so it never wedges a reader.

Caches follow verification: a manifest is cached only once it parsed and verified, a caller
calls :meth:`forget` for the versions of a chain that failed to stage or verify (a repaired store then
heals on the next read), and :meth:`head` reads the newest manifest from the store every time:
when it differs from what the cache holds for that version (the store was rewritten, another
lineage), the whole cache is dropped before any chain is planned from it.

Waiting on the catalog (what receivers report in the store) lives here too:

- :func:`wait_for_acks` (synchronous RL, the joint commit): returns once every named receiver
  holds ``version`` or later, verified: an ack of exactly ``version`` whose state digest is the
  manifest's digest of the receiver's shard, or a registration record at a later version (a
  receiver that jumped over ``version`` through a chain acknowledges only where it landed);
- :func:`wait_for_staleness` (asynchronous RL): returns once no live registered receiver is
  more than ``max_staleness`` versions behind ``committed`` (counted by version number).

Every wait names what it waits for.

This module knows keys, manifests and records; it knows nothing about tensors or applying.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from deltasync import names
from deltasync.commit.model import Manifest, ManifestLimits
from deltasync.commit.planning import ChainLink, plan_chain, plan_shard_chain, starts_chain
from deltasync.commit.records import (
    MAX_LATEST_BYTES,
    MAX_RECORD_BYTES,
    AckRecord,
    ReceiverRecord,
    decode_latest,
    decode_latest_run,
)
from deltasync.commit.signing import check_signature, check_signature_bytes
from deltasync.errors import (
    AckTimeoutError,
    IntegrityError,
    KeyNotFoundError,
    KeyRequiredError,
    ManifestError,
    ObjectTooLargeError,
    StalenessTimeoutError,
    StoreError,
    VersionError,
)
from deltasync.format import FORMAT_VERSION
from deltasync.store import Store

_PROBE_LIMIT = 10_000  # a runaway forward probe means a hostile or broken store

log = logging.getLogger(__name__)


class Catalog:
    """Committed versions on ``store``; ``signing_key`` (if set) is required on every manifest."""

    def __init__(
        self,
        store: Store,
        *,
        signing_key: bytes | None = None,
        limits: ManifestLimits | None = None,
        signed_needs_key: bool = False,
    ) -> None:
        self.store = store
        self._key = signing_key
        # a reader that applies what it reads (a receiver): without a key it refuses signed
        # manifests, as it could not tell them from unsigned ones anyone with write access plants
        self._signed_needs_key = signed_needs_key
        self._limits = limits or ManifestLimits()
        self._cache: dict[int, Manifest] = {}  # committed manifests never change

    # --- versions ---------------------------------------------------------------------

    def _latest_bytes(self, *, strict: bool = False) -> bytes | None:
        try:
            return self.store.get(names.LATEST, max_bytes=MAX_LATEST_BYTES)
        except KeyNotFoundError:
            return None
        except ObjectTooLargeError:
            log.warning("LATEST is larger than %d bytes: treated as absent", MAX_LATEST_BYTES)
            return None
        except StoreError as exc:
            if strict:
                raise
            # LATEST is a hint: a link or a special file planted there, or a read
            # that failed, must not stop every reader and writer. The manifests are the truth
            # (the newest one is found by listing), and the next commit rewrites LATEST.
            log.warning("LATEST could not be read (%s): treated as absent", exc)
            return None

    def read_latest(self, *, strict: bool = False) -> int | None:
        """What ``LATEST`` says, or None if it does not exist yet. A malformed ``LATEST`` is a
        hint nobody can use: treated as absent (the next commit overwrites it). ``strict``: a
        read that failed (not a missing or oversized LATEST) raises its StoreError instead of
        counting as absent."""
        data = self._latest_bytes(strict=strict)
        try:
            return None if data is None else decode_latest(data)
        except ManifestError as exc:
            log.warning("LATEST is not readable (%s): treated as absent", exc)
            return None

    def read_latest_run(self) -> str | None:
        """The run id ``LATEST`` records (None: absent, malformed or written without one)."""
        data = self._latest_bytes()
        try:
            return None if data is None else decode_latest_run(data)
        except ManifestError:
            return None

    def latest(self, known: int | None = None, *, verified: bool = False) -> int | None:
        """The newest committed version: ``LATEST``, then any manifests right after it.
        A ``LATEST`` naming a version that has no manifest is treated as absent. ``known``: a
        version the caller committed itself; the probe starts there when LATEST is behind it
        and its manifest is stored (a LATEST write that failed after a number that was never
        committed would otherwise stop the probe below it). ``verified`` (a publisher): with a
        key, a manifest that does not verify counts as none, so one planted above the head
        (with LATEST naming it) is never taken for the newest version; a receiver reads the
        newest manifest and refuses it by name instead."""
        exists = self.is_committed if verified else self._stored
        hint = self.read_latest()
        if (
            known is not None
            and (hint is None or known > hint)
            and self.store.exists(names.manifest_key(known))
        ):
            hint = known
        if hint is not None and not exists(hint):
            newest = self.newest_committed(verified=verified)
            log.warning(
                "LATEST names version %d, which has no manifest%s (a store restored out of "
                "order, or a stray write); using the newest committed manifest (%s) instead",
                hint,
                " that verifies" if verified and self._key is not None else "",
                newest,
            )
            hint = newest
        if hint is None:
            return self.newest_committed(verified=verified)
        v = newest = hint
        for _ in range(_PROBE_LIMIT):
            if v >= names.MAX_VERSION or not self._stored(v + 1):
                return newest
            v += 1
            if not verified or self.verifies(v):  # one that does not verify is walked over
                newest = v
        raise ManifestError(
            f"more than {_PROBE_LIMIT} manifests follow LATEST={hint}: the store is broken"
        )

    def _stored(self, version: int) -> bool:
        return self.store.exists(names.manifest_key(version))

    def versions(self) -> list[int]:
        """Every version with a manifest, by listing (cost grows with the stored keys)."""
        out = []
        for key in self.store.list(names.VERSIONS_PREFIX):
            if key.endswith("/" + names.MANIFEST_FILE):
                try:
                    out.append(names.parse_manifest_key(key))
                except ManifestError:
                    continue  # not ours (or hostile); never trusted as a version
        return sorted(out)

    def version_dirs(self) -> dict[int, list[str]]:
        """Every key under each version directory, committed or not (for retention)."""
        out: dict[int, list[str]] = {}
        for key in self.store.list(names.VERSIONS_PREFIX):
            head = key.split("/", 1)[0]
            try:
                v = names.parse_version_dir(head)
            except ManifestError:
                continue
            out.setdefault(v, []).append(key)
        return out

    def newest_committed(self, *, verified: bool = False) -> int | None:
        """The newest listed manifest (``verified``: with a key, the newest that verifies)."""
        for version in reversed(self.versions()):
            if not verified or self.verifies(version):
                return version
        return None

    def has_manifest(self, version: int) -> bool:
        return version in self._cache or self.store.exists(names.manifest_key(version))

    def verifies(self, version: int) -> bool:
        """Without a key True; with a key, whether ``version``'s manifest verifies (read once,
        then cached): a store writer without the key can plant a manifest, never commit a
        version. A read that fails otherwise (an outage) raises."""
        if self._key is None:
            return True
        try:
            self.manifest(version)
        except (KeyNotFoundError, ObjectTooLargeError, ManifestError):
            return False
        return True

    def is_committed(self, version: int) -> bool:
        """Whether the store holds ``version``'s manifest (asked of the store itself) and,
        with a key, it verifies."""
        return self.store.exists(names.manifest_key(version)) and self.verifies(version)

    # --- manifests --------------------------------------------------------------------

    def manifest(self, version: int, *, fresh: bool = False) -> Manifest:
        """The verified manifest of ``version`` (``fresh``: read from the store even if
        cached); KeyNotFoundError if it is not committed, ManifestError (naming the key, the
        version and what to do) if it does not parse or verify."""
        cached = self._cache.get(version)
        if cached is not None and not fresh:
            return cached
        key = names.manifest_key(version)
        data = self.store.get(key, max_bytes=self._limits.max_manifest_bytes)
        try:
            check_signature_bytes(data, self._key, what="the manifest")  # before parsing
            m = Manifest.from_json(data, limits=self._limits, expected_version=version)
            check_signature(m, self._key)
        except ManifestError as exc:
            self._cache.pop(version, None)
            raise type(exc)(
                f"{key} (version {version}): {exc}. Nothing was applied from it; repair or "
                "re-publish that version (receivers re-read it on their next pull)"
            ) from None
        if self._key is None and self._signed_needs_key and m.signature is not None:
            raise KeyRequiredError(
                f"{key} (version {version}) is signed, and this receiver has no signing key: "
                "it could not tell the trainer's manifests from unsigned ones anyone with write "
                "access to the store plants. Pass the trainer's key (ReceiverConfig.signing_key, "
                "--key-file, DeltaSyncInitInfo.signing_key_hex). Nothing was applied from it"
            )
        if m.format_version != FORMAT_VERSION:
            raise ManifestError(
                f"{key} (version {version}) declares wire format {m.format_version}; this "
                f"deltasync reads format {FORMAT_VERSION}: upgrade the receiver or the publisher"
            )
        if cached is not None and cached != m:
            log.warning(
                "manifest %d changed in the store since it was read (the store was rewritten "
                "or holds another lineage); dropping every cached manifest",
                version,
            )
            self._cache.clear()
        self._cache[version] = m
        return m

    def head(self, known: int | None = None, *, verified: bool = False) -> Manifest | None:
        """The newest committed manifest, read from the store (never only from the cache);
        ``known`` and ``verified`` as :meth:`latest` takes them. A manifest deleted between
        the two reads (by retention, once newer versions committed) is followed by the newest
        one."""
        v = self.latest(known, verified=verified)
        if v is None:
            return None
        try:
            return self.manifest(v, fresh=True)
        except KeyNotFoundError:
            newer = self.latest(verified=verified)
            if newer is None or newer <= v:
                raise
            return self.manifest(newer, fresh=True)

    def forget(self, version: int) -> None:
        """Drop ``version`` from the cache (it failed to stage or verify)."""
        self._cache.pop(version, None)

    def forget_all(self) -> None:
        self._cache.clear()

    def shard_chain(
        self, shard: str, held: tuple[int, str] | None, head: Manifest
    ) -> list[Manifest]:
        """Manifests to apply, in order, to take ``shard`` from ``held`` (verified version
        and state digest; None: nothing usable) to ``head`` (:func:`plan_shard_chain`).

        Reads manifests back from ``head`` only as far as the walk needs. A broken link (a
        cached manifest of a lost lineage) drops the cache and plans once more from the store.
        """
        for attempt in (0, 1):
            seen: dict[int, Manifest] = {head.version: head}
            links: dict[int, ChainLink] = {}
            m: Manifest | None = head
            while m is not None:
                if shard not in m.shard_digests:
                    raise ManifestError(
                        f"version {m.version} does not define receiver shard {shard!r} (it has "
                        f"{list(m.shard_digests)[:8]}): this store is published for another "
                        "layout"
                    )
                links[m.version] = link = m.link(shard)
                if starts_chain(link, held) or link.base is None:
                    break
                try:
                    m = seen[link.base] = self.manifest(link.base)
                except KeyNotFoundError:
                    m = None  # plan_shard_chain names the gap
            try:
                plan = plan_shard_chain(held, head.version, links)
            except VersionError:
                if attempt == 0 and len(seen) > 1:
                    self._cache.clear()
                    continue
                raise
            return [seen[v] for v in plan]
        raise AssertionError("unreachable")

    def chain(self, local_version: int | None, latest: int) -> list[Manifest]:
        """Manifests to apply, in order, to go from ``local_version`` (None: nothing) to
        ``latest``: deltas from the local version, or the newest anchor on the way and the
        deltas after it (:func:`plan_chain`). Reads manifests back from ``latest`` only as far
        as the walk needs; raises VersionError if no chain exists."""
        if local_version is not None and local_version >= latest:
            plan_chain(local_version, latest, [])  # [] when equal; VersionError when ahead
            return []
        seen: dict[int, Manifest] = {}
        v: int | None = latest
        while v is not None and v not in seen:
            try:
                m = self.manifest(v)
            except KeyNotFoundError:
                break  # plan_chain names the gap (deleted by retention or never committed)
            seen[v] = m
            if m.kind == "anchor" or m.base_version == local_version:
                break
            v = m.base_version
        plan = plan_chain(local_version, latest, [m.info for m in seen.values()])
        return [seen[v] for v in plan]

    # --- records ----------------------------------------------------------------------

    def acks(self, version: int) -> dict[str, AckRecord]:
        out = {}
        for key in self.store.list(names.acks_prefix(version)):
            try:
                _, receiver = names.parse_ack_key(key)
                data = self.store.get(key, max_bytes=MAX_RECORD_BYTES)
                ack = AckRecord.from_json(data, signing_key=self._key, what=f"ack {key!r}")
            except (ManifestError, KeyNotFoundError, ObjectTooLargeError):
                continue  # malformed or vanished: not an acknowledgement
            except StoreError as exc:
                _unreadable(key, exc)
                continue
            if ack.version == version and ack.receiver == receiver:
                out[receiver] = ack
        return out

    def receivers(self, *, unreadable: list[str] | None = None) -> dict[str, ReceiverRecord]:
        """Every registration that parses, verifies and names its receiver. One the store
        would not return (an outage) counts as absent, or, given ``unreadable``, has its
        receiver id appended there: a reader that acts on every live receiver (retention,
        bounded staleness, the default ack wait) must not take it for none."""
        out = {}
        for key in self.store.list(names.RECEIVERS_PREFIX):
            try:
                receiver = names.parse_receiver_key(key)
            except ManifestError:
                continue
            try:
                rec = self.receiver(receiver, strict=unreadable is not None)
            except StoreError as exc:
                log.warning("record %r could not be read (%s); reported unreadable", key, exc)
                unreadable.append(receiver)
                continue
            if rec is not None:
                out[receiver] = rec
        return out

    def receiver(self, receiver: str, *, strict: bool = False) -> ReceiverRecord | None:
        """``receiver``'s registration, or None when it has none that parses, verifies and
        names it (``strict``: a ``StoreError`` reading it is raised)."""
        key = names.receiver_key(receiver)
        try:
            data = self.store.get(key, max_bytes=MAX_RECORD_BYTES)
            rec = ReceiverRecord.from_json(data, signing_key=self._key, what=f"record {key!r}")
        except (ManifestError, KeyNotFoundError, ObjectTooLargeError):
            return None
        except StoreError as exc:
            if strict:
                raise
            _unreadable(key, exc)
            return None
        return rec if rec.receiver == receiver else None

    def live_receivers(
        self, ttl_s: float, now: float | None = None, *, unreadable: list[str] | None = None
    ) -> dict[str, ReceiverRecord]:
        """:meth:`receivers` whose heartbeat is younger than ``ttl_s``."""
        records = self.receivers(unreadable=unreadable)
        now = time.time() if now is None else now  # after the reads, which take time
        return {r: rec for r, rec in records.items() if rec.is_live(now, ttl_s)}


log = logging.getLogger(__name__)


def _lagging(
    catalog: Catalog, committed: int, max_staleness: int, ttl_s: float
) -> tuple[dict[str, int | None], list[str]]:
    """The live receivers too far behind (receiver: version held), and those whose
    registration the store would not return (a live one far behind, perhaps: waited for)."""
    run_id = catalog.manifest(committed).run_id
    unreadable: list[str] = []
    live = catalog.live_receivers(ttl_s, unreadable=unreadable)
    out: dict[str, int | None] = {}
    for rid, rec in live.items():
        version = rec.version_in(run_id)  # a version of another lineage is nothing of this one
        held = -1 if version is None else version  # nothing yet: behind everything
        if committed - held > max_staleness:
            out[rid] = rec.version
    return out, unreadable


def wait_for_staleness(
    catalog: Catalog,
    committed: int | None,
    *,
    max_staleness: int,
    ttl_s: float,
    timeout_s: float,
    poll_s: float,
) -> float:
    """Block until every live receiver holds >= ``committed - max_staleness``; return seconds
    waited. StalenessTimeoutError names the receivers that stayed behind."""
    if committed is None:
        return 0.0
    t0 = time.monotonic()
    logged = False
    while True:
        behind, unread = _lagging(catalog, committed, max_staleness, ttl_s)
        if not behind and not unread:
            if logged:
                log.info(
                    "bounded staleness: receivers caught up after %.1f s", time.monotonic() - t0
                )
            return time.monotonic() - t0
        if not logged:
            log.info(
                "bounded staleness %d: waiting (up to %.0f s) for receivers %s (receiver: version "
                "held) to come within %d versions of committed version %d, and for the "
                "registrations of %s to read",
                max_staleness,
                timeout_s,
                behind,
                max_staleness,
                committed,
                unread,
            )
            logged = True
        if time.monotonic() - t0 >= timeout_s:
            why = []
            if behind:
                why.append(
                    f"receivers {behind} (receiver: version held) are still more than "
                    f"{max_staleness} versions behind committed version {committed} (waited for "
                    "until they catch up or their heartbeat expires: receiver_ttl_s)"
                )
            if unread:
                why.append(
                    f"the registrations of receivers {unread} could not be read (a live one may "
                    "be behind: waited for until the store returns them)"
                )
            raise StalenessTimeoutError(
                f"bounded staleness {max_staleness}: after {timeout_s:.1f} s "
                f"{'; '.join(why)}; nothing was published. Check those receivers"
            )
        poll_pause(t0 + timeout_s, poll_s)


def poll_pause(deadline: float, poll_s: float) -> None:
    """Sleep between two polls of a wait that ends at ``deadline`` (``time.monotonic()``):
    ``poll_s``, or less so that the last poll runs at the deadline rather than a whole
    interval after it."""
    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def _since_lost(rec: ReceiverRecord | None, ack: AckRecord, run_id: str) -> bool:
    """Whether the receiver's registration, written after ``ack``, says it no longer holds
    that version or a later one of the lineage (it went dirty, or back to an anchor)."""
    if rec is None or rec.updated_at <= ack.created_at:
        return False
    now = rec.version_in(run_id)
    return now is None or now < ack.version


def wait_for_acks(
    catalog: Catalog,
    version: int,
    receivers: Iterable[str],
    *,
    timeout_s: float,
    poll_s: float,
) -> dict[str, AckRecord | None]:
    """``{receiver: ack}`` once each named receiver holds ``version`` or later (ack None when a
    receiver's record shows a later version instead). AckTimeoutError names the missing.

    Only ``version``'s lineage counts: an ack or a registration of another lineage (left by a
    receiver that still holds the old lineage after a store reset) is not one of this
    version's, whatever its number."""
    wanted = list(dict.fromkeys(receivers))
    manifest = catalog.manifest(version)
    done: dict[str, AckRecord | None] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        acks = catalog.acks(version)
        for rid in wanted:
            if rid in done:
                continue
            ack = acks.get(rid)
            if ack is not None and ack.run_id not in (None, manifest.run_id):
                ack = None
            try:
                rec = catalog.receiver(rid, strict=True)
            except StoreError as exc:
                # it may say the receiver lost the version since its ack: asked again
                log.warning("record of receiver %r could not be read (%s); asked again", rid, exc)
                continue
            if ack is not None:
                expected = manifest.shard_digests.get(ack.shard)
                if expected != ack.state_digest:
                    raise IntegrityError(
                        f"receiver {rid!r} acknowledged version {version} for shard {ack.shard!r} "
                        f"with state digest {ack.state_digest}, but the manifest says {expected}: "
                        "that receiver runs a different layout or is broken"
                    )
                if not _since_lost(rec, ack, manifest.run_id):
                    done[rid] = ack
                    continue
            later = None if rec is None else rec.version_in(manifest.run_id)
            if later is not None and later > version:
                done[rid] = None
        missing = [r for r in wanted if r not in done]
        if not missing:
            return done
        if time.monotonic() >= deadline:
            raise AckTimeoutError(
                f"version {version}: waited {timeout_s:.1f} s for acknowledgements from "
                f"receivers {missing} (acknowledged: {sorted(done)}); they are down, slow, or "
                "failing to apply (see their logs). The version stays committed"
            )
        poll_pause(deadline, poll_s)


def _unreadable(key: str, exc: StoreError) -> None:
    """A record that cannot be read (planted with no read permission, an outage) counts as
    absent, as a malformed one does, for a reader that does not ask for it (acks, inspect);
    the readers that act on every live receiver do (:meth:`Catalog.receivers`)."""
    log.warning("record %r could not be read (%s); treated as absent", key, exc)
