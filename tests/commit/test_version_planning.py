"""Chain and retention planning: pure functions, checked against tables."""

from __future__ import annotations

import pytest

from deltasync import names
from deltasync.commit import plan_chain, plan_retention, should_anchor
from deltasync.errors import ConfigError, ManifestError, VersionError


def history(last: int, anchors: set[int], missing: set[int] = frozenset(), bases=None):
    """Versions 0..last, each a delta on the previous one except the anchors (version 0
    exists only if it is an anchor)."""
    bases = bases or {}
    out = []
    for v in range(last + 1):
        if v in missing or (v == 0 and v not in anchors):
            continue
        if v in anchors:
            out.append((v, "anchor", None))
        else:
            out.append((v, "delta", bases.get(v, v - 1)))
    return out


CHAIN_CASES = [
    # (name, local, latest, available, expected)
    ("up to date", 10, 10, history(10, {0}), []),
    ("one behind", 9, 10, history(10, {0}), [10]),
    ("seven behind through deltas", 3, 10, history(10, {0}), [4, 5, 6, 7, 8, 9, 10]),
    ("fresh receiver restores the newest anchor", None, 10, history(10, {0, 4, 8}), [8, 9, 10]),
    ("behind an anchor: restore it", 5, 10, history(10, {0, 8}), [8, 9, 10]),
    ("deltas reach local before the anchor", 9, 10, history(10, {0, 8}), [10]),
    ("latest is an anchor", 9, 10, history(10, {0, 10}), [10]),
    (
        "a deleted delta is bridged by a later anchor",
        2,
        10,
        history(10, {0, 6}, missing={4}),
        [6, 7, 8, 9, 10],
    ),
    (
        "old history deleted, recent chain intact",
        7,
        10,
        history(10, {0}, missing={0, 1, 2, 3}),
        [8, 9, 10],
    ),
    (
        "ancestry skipping the local version restores an anchor",
        5,
        7,
        history(7, {2}, missing={5, 6}, bases={7: 4}),
        [2, 3, 4, 7],
    ),
    ("tuples in any order", 8, 10, list(reversed(history(10, {0}))), [9, 10]),
]


@pytest.mark.parametrize(
    "name, local, latest, available, expected", CHAIN_CASES, ids=[c[0] for c in CHAIN_CASES]
)
def test_plan_chain_table(name, local, latest, available, expected) -> None:
    assert plan_chain(local, latest, available) == expected


CHAIN_ERRORS = [
    (
        "a deleted delta with no later anchor",
        2,
        10,
        history(10, {0}, missing={5}),
        "version 5 on the way",
    ),
    ("fresh receiver without any anchor", None, 10, history(10, set()), "version 0 on the way"),
    ("latest not committed", 3, 11, history(10, {0}), "version 11 on the way"),
    ("local ahead of latest", 12, 10, history(10, {0}), "newer than the latest"),
    ("duplicate version", 3, 5, [*history(5, {0}), (5, "delta", 4)], "listed twice"),
    ("delta based on itself", 3, 5, [*history(4, {0}), (5, "delta", 5)], "earlier version"),
    ("unknown kind", 3, 5, [*history(4, {0}), (5, "patch", 4)], "unknown kind"),
]


@pytest.mark.parametrize(
    "name, local, latest, available, match", CHAIN_ERRORS, ids=[c[0] for c in CHAIN_ERRORS]
)
def test_plan_chain_raises_version_error_when_no_chain_exists(
    name, local, latest, available, match
) -> None:
    with pytest.raises(VersionError, match=match):
        plan_chain(local, latest, available)


RETENTION_CASES = [
    # (name, available, live, kwargs, expected deletions)
    (
        "no receivers: keep newest anchor and what follows",
        history(10, {0, 4, 8}),
        [],
        {},
        [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    ("receiver at 5 pins everything above it", history(10, {0, 4, 8}), [5], {}, [0, 1, 2, 3, 4, 5]),
    (
        "receiver without a version needs only the anchor chain",
        history(10, {0, 4, 8}),
        [None],
        {},
        [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    (
        "up-to-date receiver pins nothing extra",
        history(10, {0, 4, 8}),
        [10],
        {},
        [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    ("keep_latest keeps the newest few", history(10, {0}), [], {"keep_latest": 3}, []),
    (
        # which versions a fresh receiver needs cannot be told (the anchor's manifest left
        # out: it did not verify): nothing is deleted on a guess
        "no anchor chain and no receivers: keep everything",
        history(10, {0}, missing={0}),
        [],
        {"keep_latest": 2},
        [],
    ),
    (
        "versions above LATEST are in flight and kept",
        history(10, {0, 4, 8}),
        [],
        {"latest": 9},
        [0, 1, 2, 3, 4, 5, 6, 7],
    ),
    (
        "newest anchor and every version after it kept when the chain from it is broken",
        history(10, {0, 4}, missing={6}),
        [],
        {},
        [0, 1, 2, 3],
    ),
    (
        "a receiver behind an anchor keeps the versions it may be replaying",
        history(10, {0, 8}),
        [3],
        {},
        [0, 1, 2, 3],
    ),
    (
        "a receiver whose old base was deleted still pins versions above it",
        history(10, {0, 8}, missing={5}),
        [2],
        {},
        [0, 1, 2],
    ),
    ("empty store", [], [4], {}, []),
]


@pytest.mark.parametrize(
    "name, available, live, kwargs, expected", RETENTION_CASES, ids=[c[0] for c in RETENTION_CASES]
)
def test_plan_retention_table(name, available, live, kwargs, expected) -> None:
    deleted = plan_retention(available, live, **kwargs)
    assert deleted == expected
    # Whatever is deleted, every live receiver can still reach latest if it could before.
    remaining = [a for a in available if a[0] not in set(deleted)]
    if not available:
        return
    latest = kwargs.get("latest", max(a[0] for a in available))
    for held in live:
        try:
            before = plan_chain(held, latest, available)
        except VersionError:
            continue
        assert plan_chain(held, latest, remaining) == before


def test_plan_retention_keeps_the_anchor_a_live_receiver_restores_and_every_version_after_it() -> (
    None
):
    # Anchors at 0, 4, 8; a receiver without a version began restoring anchor 4 before 8
    # committed. Keeping only the newest anchor's chain deleted 4 under its fetch, and a
    # trainer anchoring faster than it fetched starved it.
    available = history(10, {0, 4, 8})
    assert plan_retention(available, [None], restoring=[4]) == [0, 1, 2, 3]
    # restoring 4 while holding 1 of another lineage (version_in: None) is the same case
    assert plan_retention(available, [None, None], restoring=[4, 4]) == [0, 1, 2, 3]
    # what it planned when 7 was the head is still there, and it goes on from 7 by deltas
    kept = [a for a in available if a[0] >= 4]
    assert plan_chain(None, 7, [a for a in kept if a[0] <= 7]) == [4, 5, 6, 7]
    assert plan_chain(7, 10, kept) == [8, 9, 10]
    # its registration expired (or it holds a version now): only the newest anchor's chain
    assert plan_retention(available, [None]) == [0, 1, 2, 3, 4, 5, 6, 7]
    # beside keep_latest, LATEST and the other receivers' needs
    assert plan_retention(available, [2], restoring=[8], latest=9) == [0, 1, 2]
    assert plan_retention(available, [], restoring=[0]) == []


def test_plan_retention_rejects_keeping_nothing() -> None:
    with pytest.raises(ConfigError, match="keep_latest"):
        plan_retention(history(3, {0}), [], keep_latest=0)


@pytest.mark.parametrize(
    "version, every, forced, expected",
    [
        (0, 4, False, True),
        (3, 4, False, False),
        (8, 4, False, True),
        (9, 4, True, True),
        (5, 1, False, True),
    ],
)
def test_should_anchor_table(version, every, forced, expected) -> None:
    assert should_anchor(version, anchor_every=every, forced=forced) is expected


def test_should_anchor_rejects_a_zero_period() -> None:
    with pytest.raises(ConfigError, match="anchor_every"):
        should_anchor(3, anchor_every=0)


# --- names: parsers are exact inverses of the builders -----------------------------------


def test_key_parsers_invert_the_builders() -> None:
    assert names.parse_manifest_key(names.manifest_key(12)) == 12
    assert names.parse_blob_key(names.blob_key(12, "tp1-ep0", "w00003")) == (
        12,
        "tp1-ep0",
        "w00003",
    )
    assert names.parse_writer_marker_key(names.writer_marker_key(12, "w00003")) == (12, "w00003")
    assert names.parse_writer_claim_key(names.writer_claim_key(12, "w00003")) == (12, "w00003")
    assert names.parse_ack_key(names.ack_key(12, "rcv-7")) == (12, "rcv-7")
    assert names.parse_receiver_key(names.receiver_key("rcv-7")) == "rcv-7"
    assert names.manifest_key(12).startswith(names.version_prefix(12))
    assert names.ack_key(12, "r").startswith(names.acks_prefix(12))


@pytest.mark.parametrize(
    "parse, key",
    [
        (names.parse_manifest_key, "v0000012/MANIFEST.json"),
        (names.parse_manifest_key, "v00000012/MANIFEST.json.bak"),
        (names.parse_blob_key, "v00000012/tp0/../w00000.blob"),
        (names.parse_blob_key, "v00000012/writers/w00000.blob"),
        (names.parse_blob_key, "v00000012/tp0/w00000.json"),
        (names.parse_ack_key, "acks/v00000012/../../x.json"),
        (names.parse_receiver_key, "receivers/.hidden.json"),
        (names.parse_writer_marker_key, "v00000012/writers/sub/w.json"),
        (names.parse_writer_claim_key, "v00000012/writers/w.json"),
        (names.parse_writer_claim_key, "v00000012/writers/../w.claim"),
        # other scripts' digits, which \\d matches and int() reads: gc deleted such keys
        (
            names.parse_manifest_key,
            "v\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661/MANIFEST.json",
        ),
        (
            names.parse_manifest_key,
            "v\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff11/MANIFEST.json",
        ),
        (names.parse_ack_key, "acks/v\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661/r.json"),
        (
            names.parse_writer_marker_key,
            "v\u0966\u0966\u0966\u0966\u0966\u0966\u0966\u0967/writers/w.json",
        ),
        (names.parse_version_dir, "v\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661"),
    ],
)
def test_key_parsers_reject_anything_the_builders_would_not_produce(parse, key) -> None:
    with pytest.raises(ManifestError):
        parse(key)


def test_the_writers_directory_cannot_be_used_as_a_shard_id() -> None:
    with pytest.raises(ManifestError, match="reserved"):
        names.blob_key(1, "writers", "w00000")
