"""Retention: which stored keys are safe to delete, and deleting them in a safe order.

:func:`plan_deletions` is pure. It applies :func:`deltasync.manifest.plan_retention` (never a
version a live receiver still needs, never the newest anchor and the chain after it, never the
newest committed version or anything newer) and also removes leftovers that no manifest
vouches for: blobs and markers of crashed or losing attempts in versions older than the newest
committed one (newer ones may still be in flight).

Deletion order: a version's manifest goes first, so the version disappears atomically for
readers, then its blobs and markers, then its acks. This module knows keys and manifests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from deltasync import names
from deltasync.manifest import Manifest, plan_retention


@dataclass(frozen=True)
class GcPlan:
    versions: tuple[int, ...]  # committed versions removed entirely
    keys: tuple[str, ...]  # every key to delete, in order (manifests first)


def plan_deletions(
    *,
    version_keys: Mapping[int, Iterable[str]],
    manifests: Mapping[int, Manifest],
    ack_keys: Mapping[int, Iterable[str]],
    committed: int | None,
    live_versions: Iterable[int | None],
    keep_versions: int,
) -> GcPlan:
    if committed is None or not manifests:
        return GcPlan((), ())
    doomed = plan_retention(
        [m.info for m in manifests.values()],
        list(live_versions),
        keep_latest=keep_versions,
        latest=committed,
    )
    first: list[str] = []
    rest: list[str] = []
    for v in doomed:
        first.append(names.manifest_key(v))
        rest.extend(k for k in sorted(version_keys.get(v, ())) if k != names.manifest_key(v))
        rest.extend(sorted(ack_keys.get(v, ())))
    gone = set(doomed)
    for v, keys in sorted(version_keys.items()):
        if v in gone or v >= committed:
            continue
        m = manifests.get(v)
        listed = set() if m is None else {b.key for b in m.blobs}
        if m is not None:
            listed.add(names.manifest_key(v))
        for key in sorted(keys):
            if key in listed:
                continue
            if m is not None and key.startswith(names.writers_prefix(v)):
                continue  # markers of the committed attempt: small, and they document it
            rest.append(key)
    return GcPlan(tuple(doomed), tuple(first + rest))
