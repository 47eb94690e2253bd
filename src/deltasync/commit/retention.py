"""Retention: which stored keys are safe to delete, and deleting them in a safe order.

:func:`plan_deletions` is pure. It applies :func:`deltasync.commit.plan_retention` (never a
version a live receiver still needs, never the newest anchor and the chain after it, never the
newest committed version or anything newer) and also removes leftovers that no manifest
vouches for: blobs and markers of losing attempts in committed versions, and everything of
uncommitted versions older than the newest committed one (newer ones may still be in flight).

Deletion order: a version's manifest goes first, so the version disappears atomically for
readers, then its blobs and markers, then its acks. This module knows keys and manifests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from deltasync import names
from deltasync.commit.model import Manifest
from deltasync.commit.planning import plan_retention


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
        if v in gone:
            continue
        m = manifests.get(v)
        if m is None:
            if v < committed:  # never committed, and never will be: publish only goes forward
                rest.extend(sorted(keys))
            continue  # newer: an attempt may still be in flight
        keep = {names.manifest_key(v), *(b.key for b in m.blobs)}
        keep.update(names.writer_marker_key(v, w) for w in m.writers)
        rest.extend(k for k in sorted(keys) if k not in keep)  # a losing attempt's leftovers
    return GcPlan(tuple(doomed), tuple(first + rest))
