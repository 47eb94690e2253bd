"""Manifest JSON: exact round trips, canonical bytes, and strict rejection of hostile input."""

from __future__ import annotations

import json

import pytest

from deltasync.commit import Manifest, ManifestLimits
from deltasync.errors import ManifestError

from store_manifest_samples import B1, D1, D2, blob, make_manifest


def good_dict() -> dict:
    return json.loads(make_manifest().to_json())


def test_a_manifest_round_trips_through_json_exactly() -> None:
    m = make_manifest()
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert again.to_json() == m.to_json()
    assert again.blobs_for("tp0") == (blob(7, "tp0", "w00000"), blob(7, "tp0", "w00001"))
    assert again.total_bytes == 3 * 1234
    assert again.shards == ("tp0", "tp1")


def test_json_is_canonical_so_equal_manifests_have_equal_bytes() -> None:
    a = make_manifest()
    b = make_manifest(
        writers=("w00000", "w00001"),
        blobs=tuple(reversed(a.blobs)),
        shard_digests={"tp0": D1, "tp1": D2},
    )
    assert a.to_json() == b.to_json()
    text = a.to_json().decode()
    assert " " not in text and "\n" not in text
    assert list(json.loads(text)) == sorted(json.loads(text))


def test_an_anchor_has_no_base_and_a_delta_has_an_earlier_one() -> None:
    anchor = make_manifest(kind="anchor", base_version=None)
    assert Manifest.from_json(anchor.to_json()).base_version is None
    with pytest.raises(ManifestError, match="base_version null"):
        make_manifest(kind="anchor", base_version=6)
    with pytest.raises(ManifestError, match="base_version"):
        make_manifest(base_version=7)
    with pytest.raises(ManifestError, match="base_version"):
        make_manifest(base_version=None)
    with pytest.raises(ManifestError, match="version 0 cannot be a delta"):
        make_manifest(version=0, base_version=0, blobs=(), writers=("w00000",))


def test_a_manifest_stored_under_another_versions_key_is_refused() -> None:
    data = make_manifest().to_json()
    assert Manifest.from_json(data, expected_version=7).version == 7
    with pytest.raises(ManifestError, match="replayed or misplaced"):
        Manifest.from_json(data, expected_version=8)


def _set(path: tuple, value):
    def mutate(d: dict) -> None:
        target = d
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple):
    def mutate(d: dict) -> None:
        target = d
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]

    return mutate


HOSTILE = {
    "path traversal key": (_set(("blobs", 0, "key"), "../../etc/passwd"), "is not the key"),
    "absolute key": (_set(("blobs", 0, "key"), "/v00000007/tp0/w00000.blob"), "is not the key"),
    "key of another version": (
        _set(("blobs", 0, "key"), "v00000006/tp0/w00000.blob"),
        "is not the key",
    ),
    "traversal in shard": (_set(("blobs", 0, "shard"), ".."), "not a safe name"),
    "slash in writer": (_set(("blobs", 0, "writer"), "w/../x"), "not a safe name"),
    "absurd size": (_set(("blobs", 0, "size"), 2**70), "size"),
    "size above the reader's limit": (_set(("blobs", 0, "size"), 65 * 2**30), "max_blob_bytes"),
    "zero size": (_set(("blobs", 0, "size"), 0), "size"),
    "negative size": (_set(("blobs", 0, "size"), -5), "size"),
    "float size": (_set(("blobs", 0, "size"), 12.0), "size"),
    "bool size": (_set(("blobs", 0, "size"), True), "size"),
    "short digest": (_set(("blobs", 0, "digest"), B1[:63]), "64 lowercase hex"),
    "xxh3 digest": (_set(("blobs", 0, "digest"), D1), "64 lowercase hex"),
    "uppercase digest": (_set(("blobs", 0, "digest"), B1.upper()), "64 lowercase hex"),
    "non-hex digest": (_set(("blobs", 0, "digest"), "g" * 64), "64 lowercase hex"),
    "digest with a newline": (_set(("blobs", 0, "digest"), B1 + "\n"), "64 lowercase hex"),
    "bad shard digest": (_set(("shard_digests", "tp0"), "x"), "32 lowercase hex"),
    "unknown kind": (_set(("kind",), "patch"), "kind"),
    "extra top-level field": (_set(("extra",), 1), "unknown field"),
    "extra blob field": (_set(("blobs", 0, "path"), "/tmp/x"), "unknown field"),
    "missing field": (_delete(("shard_digests",)), "missing field"),
    "missing blob field": (_delete(("blobs", 0, "digest")), "missing field"),
    "string version": (_set(("version",), "7"), "version"),
    "bool version": (_set(("version",), True), "version"),
    "negative version": (_set(("version",), -1), "version"),
    "huge version": (_set(("version",), 10**9), "version"),
    "format version 0": (_set(("format_version",), 0), "format_version"),
    "negative created_at": (_set(("created_at",), -1.0), "created_at"),
    "blob from an unlisted writer": (_set(("writers",), ["w00000"]), "not in writers"),
    "blob for a shard without digest": (_delete(("shard_digests", "tp1")), "no shard digest"),
    "duplicate writer": (_set(("writers",), ["w00000", "w00000", "w00001"]), "twice"),
    "no writers": (_set(("writers",), []), "non-empty"),
    "no shard digests": (_set(("shard_digests",), {}), "non-empty"),
    "blobs not a list": (_set(("blobs",), {"a": 1}), "list"),
    "blob not an object": (_set(("blobs", 0), "v00000007/tp0/w00000.blob"), "object"),
    "bad signature": (_set(("signature",), "zz"), "signature"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifests_are_rejected_with_a_manifest_error(case: str) -> None:
    mutate, match = HOSTILE[case]
    d = good_dict()
    mutate(d)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(d).encode())


def test_a_duplicated_blob_is_rejected() -> None:
    d = good_dict()
    d["blobs"].append(dict(d["blobs"][0]))
    with pytest.raises(ManifestError, match="listed twice"):
        Manifest.from_json(json.dumps(d))


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"version": 7, "version": 8}', "duplicate JSON field"),
        (b'{"created_at": NaN}', "NaN"),
        (b'{"created_at": Infinity}', "Infinity"),
        (b"[1, 2, 3]", "JSON object"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"{" * 100000 + b"}" * 100000, "not valid JSON"),
        (b'{"version": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_malformed_json_is_rejected_with_a_manifest_error(raw: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(raw)


def test_reader_limits_bound_the_manifest_size_and_blob_count() -> None:
    data = make_manifest().to_json()
    with pytest.raises(ManifestError, match="limit"):
        Manifest.from_json(data, limits=ManifestLimits(max_manifest_bytes=len(data) - 1))
    with pytest.raises(ManifestError, match="limit"):
        Manifest.from_json(data, limits=ManifestLimits(max_blobs=2))
    with pytest.raises(ManifestError, match="max_blob_bytes"):
        Manifest.from_json(data, limits=ManifestLimits(max_blob_bytes=1000))
    # A reader may also allow more than the defaults.
    big = make_manifest(blobs=(blob(7, "tp0", "w00000", size=100 * 2**30),))
    with pytest.raises(ManifestError, match="max_blob_bytes"):
        Manifest.from_json(big.to_json())
    assert Manifest.from_json(big.to_json(), limits=ManifestLimits(max_blob_bytes=2**40)) == big
