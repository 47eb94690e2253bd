"""Catalog: a read-only view of what is committed on a store (versions, manifests, records).

Publisher, receivers and ``deltasync inspect`` all read the store through this one class, so
they agree on what "committed" means: a version exists only through its manifest, parsed
strictly (``expected_version`` rejects a manifest stored under another version's key), its
signature checked when a key is configured, its format version one this build reads.

``LATEST`` is a hint. A publisher can crash after committing a manifest and before moving
``LATEST``, so :meth:`latest` probes the following versions' manifests, and
:meth:`newest_committed` lists every manifest when ``LATEST`` is missing altogether.

This module knows keys, manifests and records; it knows nothing about tensors or applying.
"""

from __future__ import annotations

import time

from deltasync import names
from deltasync.commit.model import Manifest, ManifestLimits
from deltasync.commit.planning import plan_chain
from deltasync.commit.records import AckRecord, ReceiverRecord, decode_latest
from deltasync.commit.signing import check_signature
from deltasync.errors import KeyNotFoundError, ManifestError
from deltasync.format import FORMAT_VERSION
from deltasync.store import Store

_PROBE_LIMIT = 10_000  # a runaway forward probe means a hostile or broken store


class Catalog:
    """Committed versions on ``store``; ``signing_key`` (if set) is required on every manifest."""

    def __init__(
        self,
        store: Store,
        *,
        signing_key: bytes | None = None,
        limits: ManifestLimits | None = None,
    ) -> None:
        self.store = store
        self._key = signing_key
        self._limits = limits or ManifestLimits()
        self._cache: dict[int, Manifest] = {}  # committed manifests never change

    # --- versions ---------------------------------------------------------------------

    def read_latest(self) -> int | None:
        """What ``LATEST`` says, or None if it does not exist yet."""
        try:
            return decode_latest(self.store.get(names.LATEST))
        except KeyNotFoundError:
            return None

    def latest(self) -> int | None:
        """The newest committed version: ``LATEST``, then any manifests right after it."""
        hint = self.read_latest()
        if hint is None:
            return self.newest_committed()
        v = hint
        for _ in range(_PROBE_LIMIT):
            if not self.store.exists(names.manifest_key(v + 1)):
                return v
            v += 1
        raise ManifestError(
            f"more than {_PROBE_LIMIT} manifests follow LATEST={hint}: the store is broken"
        )

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

    def newest_committed(self) -> int | None:
        found = self.versions()
        return found[-1] if found else None

    def has_manifest(self, version: int) -> bool:
        return version in self._cache or self.store.exists(names.manifest_key(version))

    # --- manifests --------------------------------------------------------------------

    def manifest(self, version: int) -> Manifest:
        """The verified manifest of ``version``; KeyNotFoundError if it is not committed."""
        cached = self._cache.get(version)
        if cached is not None:
            return cached
        data = self.store.get(names.manifest_key(version))
        m = Manifest.from_json(data, limits=self._limits, expected_version=version)
        check_signature(m, self._key)
        if m.format_version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest {version} declares wire format {m.format_version}; this deltasync "
                f"reads format {FORMAT_VERSION}: upgrade the receiver or the publisher"
            )
        self._cache[version] = m
        return m

    def forget(self, version: int) -> None:
        self._cache.pop(version, None)

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
                ack = AckRecord.from_json(self.store.get(key))
            except (ManifestError, KeyNotFoundError):
                continue  # malformed or vanished: not an acknowledgement
            if ack.version == version and ack.receiver == receiver:
                out[receiver] = ack
        return out

    def receivers(self) -> dict[str, ReceiverRecord]:
        out = {}
        for key in self.store.list(names.RECEIVERS_PREFIX):
            try:
                receiver = names.parse_receiver_key(key)
                rec = ReceiverRecord.from_json(self.store.get(key))
            except (ManifestError, KeyNotFoundError):
                continue
            if rec.receiver == receiver:
                out[receiver] = rec
        return out

    def live_receivers(self, ttl_s: float, now: float | None = None) -> dict[str, ReceiverRecord]:
        now = time.time() if now is None else now
        return {r: rec for r, rec in self.receivers().items() if rec.is_live(now, ttl_s)}

