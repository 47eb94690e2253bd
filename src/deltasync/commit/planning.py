"""Pure decisions over committed versions: which to apply, which to keep, when to anchor.

Input is what the manifests say (version, kind, base), never the store itself, so every rule
here is a table-tested function:

- :func:`plan_chain` walks back from ``latest`` along base pointers until it reaches the
  receiver's version (apply those deltas in order) or an anchor (restore it, then the deltas
  after it), whichever comes first;
- :func:`plan_shard_chain` is the same walk for one shard with lineage: a delta starts the
  chain only if it names the receiver's version AND its state digest as its base, and every
  step's base digest must be the digest of the step before it (else the store mixes lineages);
- :func:`plan_retention` returns the versions safe to delete: never ``latest`` or anything
  newer (a version may be committed before ``LATEST`` advances), never the newest keep_latest,
  never the chain a fresh receiver needs (newest anchor and the deltas after it), and never
  anything a live receiver still needs: every version above the one it holds (it may be in
  the middle of replaying them) plus its planned chain, and the anchor it is restoring (its
  registration names it: an older one than the newest, when anchors came during a slow
  fetch) with every version after it;
- :func:`should_anchor` is the publisher's every-K rule.

Nothing here does I/O or knows about tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from deltasync.errors import ConfigError, VersionError


class ChainLink(NamedTuple):
    """One version as seen by one receiver shard (what :func:`plan_shard_chain` needs)."""

    version: int
    kind: str  # "delta" | "anchor"
    base: int | None  # the delta's base version
    base_digest: str | None  # the delta's base state digest of this shard
    digest: str  # this version's state digest of this shard
    run_id: str


def starts_chain(link: ChainLink, held: tuple[int, str] | None) -> bool:
    """True when the chain to apply starts at ``link``: an anchor, or a delta whose base is
    exactly the held ``(version, state digest)``."""
    if link.kind == "anchor":
        return True
    return held is not None and link.base == held[0] and link.base_digest == held[1]


def plan_shard_chain(
    held: tuple[int, str] | None, head: int, links: dict[int, ChainLink]
) -> list[int]:
    """Versions to apply, in order, to take a shard from ``held`` (its verified version and
    state digest; None: nothing usable) to ``head``.

    Walks back from ``head`` along base pointers until :func:`starts_chain`. A held state that
    no delta names (another lineage, a store that regressed, a renumbered trainer) is never
    used as a base: the walk goes on to an anchor. VersionError names a gap (a version on the
    way has no manifest and no anchor comes later) or a broken link (a delta whose base digest
    is not its base version's digest: manifests of two lineages mixed).
    """
    chain: list[int] = []
    v: int | None = head
    while True:
        link = links.get(v) if v is not None else None
        if link is None:
            start = "an empty state" if held is None else f"version {held[0]}"
            raise VersionError(
                f"cannot reach version {head} from {start}: version {v} on the way is not "
                "available (deleted by retention or never committed) and no anchor comes later; "
                "publish an anchor (full version) to let this receiver catch up"
            )
        if chain:
            after = links[chain[-1]]
            if after.base_digest != link.digest or after.run_id != link.run_id:
                raise VersionError(
                    f"delta {after.version} (run {after.run_id}) applies on version {v} with "
                    f"state digest {after.base_digest}, but manifest {v} (run {link.run_id}) "
                    f"says {link.digest}: the store mixes manifests of two lineages. Publish an "
                    "anchor, or restore the store consistently"
                )
        chain.append(link.version)
        if starts_chain(link, held):
            break
        v = link.base
    chain.reverse()
    return chain


class VersionInfo(NamedTuple):
    """What the manifest of ``version`` says about its place in the chain."""

    version: int
    kind: str  # "delta" | "anchor"
    base: int | None  # the delta's base version; ignored for anchors


def _index(available: Iterable[VersionInfo | tuple]) -> dict[int, VersionInfo]:
    by_version: dict[int, VersionInfo] = {}
    for item in available:
        info = VersionInfo(*item)
        if info.kind not in ("delta", "anchor"):
            raise VersionError(f"version {info.version} has unknown kind {info.kind!r}")
        if info.kind == "delta" and (
            not isinstance(info.base, int) or not 0 <= info.base < info.version
        ):
            raise VersionError(
                f"delta version {info.version} has base {info.base!r}; a delta's base must be "
                "an earlier version"
            )
        if info.version in by_version:
            raise VersionError(f"version {info.version} is listed twice")
        by_version[info.version] = info
    return by_version


def _walk(local_version: int | None, latest: int, by_version: dict[int, VersionInfo]) -> list[int]:
    if local_version is not None and local_version > latest:
        raise VersionError(
            f"local version {local_version} is newer than the latest committed version {latest}: "
            "the store regressed or belongs to another run; refusing to go backwards"
        )
    if local_version == latest:
        return []
    chain = []
    v = latest
    while True:
        info = by_version.get(v)
        if info is None:
            start = "an empty state" if local_version is None else f"version {local_version}"
            raise VersionError(
                f"cannot reach version {latest} from {start}: version {v} on the way is not "
                "available (deleted by retention or never committed) and no anchor comes later; "
                "publish an anchor (full version) to let this receiver catch up"
            )
        chain.append(v)
        if info.kind == "anchor" or info.base == local_version:
            break
        # A base below local_version means latest's ancestry skips the receiver's version:
        # keep walking, an anchor further back can still restore it.
        v = info.base
    chain.reverse()
    return chain


def plan_chain(
    local_version: int | None, latest: int, available: Iterable[VersionInfo | tuple]
) -> list[int]:
    """Versions to apply, in order, to go from ``local_version`` (None: empty) to ``latest``.

    The first entry is an anchor unless the chain reaches ``local_version`` through deltas
    first. Raises VersionError if no chain exists or ``local_version`` is ahead of ``latest``.
    """
    return _walk(local_version, latest, _index(available))


def plan_retention(
    available: Iterable[VersionInfo | tuple],
    live_receiver_versions: Iterable[int | None],
    *,
    keep_latest: int = 1,
    latest: int | None = None,
    restoring: Iterable[int] = (),
) -> list[int]:
    """Sorted versions that are safe to delete (see the module docstring for what is kept).

    ``latest`` defaults to the newest available version; ``live_receiver_versions`` holds the
    version each live receiver has (None for a receiver that has none yet); ``restoring`` the
    anchors live receivers are restoring (one per such receiver).
    """
    if not isinstance(keep_latest, int) or isinstance(keep_latest, bool) or keep_latest < 1:
        raise ConfigError(f"keep_latest must be an int >= 1, got {keep_latest!r}")
    by_version = _index(available)
    if not by_version:
        return []
    ordered = sorted(by_version)
    if latest is None:
        latest = ordered[-1]
    keep = {v for v in ordered if v >= latest}
    keep.update(ordered[-keep_latest:])
    anchors = [v for v in ordered if v <= latest and by_version[v].kind == "anchor"]
    if anchors:
        keep.add(anchors[-1])
    try:
        keep.update(_walk(None, latest, by_version))
    except VersionError:
        # No chain from an anchor to latest among these versions (a manifest left out: it
        # did not verify): which ones a fresh receiver needs cannot be told, so every version
        # from the newest anchor on stays (every version, without one)
        floor = anchors[-1] if anchors else ordered[0]
        keep.update(v for v in ordered if floor <= v <= latest)
    for held in live_receiver_versions:
        if held is None:
            continue  # needs the fresh-receiver chain, kept above
        keep.update(v for v in ordered if held < v <= latest)
        try:
            keep.update(_walk(held, latest, by_version))
        except VersionError:
            pass  # it cannot reach latest anyway; what it might still read is kept above
    for anchor in restoring:
        # Its fetch of that anchor may be under way, and the versions after it take it to
        # latest; a newer anchor does not help it: it would start over, and a trainer that
        # anchors faster than it fetches would starve it. (A number that is no anchor here
        # keeps no more than a registration holding the version before it would.)
        keep.update(v for v in ordered if anchor <= v <= latest)
    return [v for v in ordered if v not in keep]


def should_anchor(version: int, *, anchor_every: int, forced: bool = False) -> bool:
    """Publish ``version`` as an anchor? Version 0 and every ``anchor_every``-th are anchors."""
    if not isinstance(anchor_every, int) or isinstance(anchor_every, bool) or anchor_every < 1:
        raise ConfigError(f"anchor_every must be an int >= 1, got {anchor_every!r}")
    return forced or version % anchor_every == 0
