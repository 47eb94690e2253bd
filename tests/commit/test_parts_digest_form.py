"""The parts digest a manifest lists for a shard of a multi-writer version published without
the full state: its definition, the strict form ``check_digest`` accepts, and the writer
marker field its parts come from (validated, under the MAC)."""

from __future__ import annotations

import json

import pytest
import xxhash

from deltasync.commit import Manifest, WriterMarker
from deltasync.commit.canonical import check_digest
from deltasync.errors import ManifestError, SignatureError
from deltasync.layout.digest import is_parts_digest, parse_parts_digest, parts_digest

from store_manifest_samples import D1, D2

HEX = "0123456789abcdef" * 2


def test_a_parts_digest_is_the_xxh3_128_of_the_writers_part_digests_in_writer_order() -> None:
    h = xxhash.xxh3_128()
    h.update(bytes.fromhex(D1) + bytes.fromhex(D2))
    assert parts_digest([D1, D2]) == "w2:" + h.hexdigest()
    assert parts_digest([D2, D1]) != parts_digest([D1, D2])
    assert parse_parts_digest(parts_digest([D1, D2, D1])) == (3, parts_digest([D1, D2, D1])[3:])
    assert is_parts_digest(parts_digest([D1, D2])) and not is_parts_digest(D1)
    for bad in ([D1], [D1, "x" * 32], [D1, D1.upper()]):
        with pytest.raises(ManifestError):
            parts_digest(bad)


@pytest.mark.parametrize("good", [HEX, f"w2:{HEX}", f"w17:{HEX}", f"w65536:{HEX}"])
def test_check_digest_accepts_a_state_digest_and_a_parts_digest(good: str) -> None:
    assert check_digest(good, what="d") == good


@pytest.mark.parametrize(
    "bad",
    [
        f"w1:{HEX}",  # one writer lists the state digest
        f"w0:{HEX}",
        f"w02:{HEX}",  # leading zero
        f"w65537:{HEX}",
        f"w100000:{HEX}",
        f"W2:{HEX}",
        f"w2:{HEX.upper()}",
        f"w2:{HEX[:-1]}",
        f"w2:{HEX}0",
        f"w2:{HEX}\n",
        f"w+2:{HEX}",
        f"w٢:{HEX}",  # a non-ASCII digit
        f"w2 :{HEX}",
        "w2:",
        2,
        None,
    ],
)
def test_check_digest_refuses_every_other_form(bad: object) -> None:
    with pytest.raises(ManifestError):
        check_digest(bad, what="d")
    if isinstance(bad, str):
        assert parse_parts_digest(bad) is None


def test_a_fingerprint_is_never_a_parts_digest() -> None:
    with pytest.raises(ManifestError):
        check_digest(f"w2:{HEX}", what="fingerprint", parts=False)
    with pytest.raises(ManifestError):
        WriterMarker(version=1, writer="w00000", created_at=1.0, blobs=(), layout=f"w2:{HEX}")


def test_a_manifest_lists_parts_digests_as_read() -> None:
    digests = {"tp0": parts_digest([D1, D2]), "tp1": parts_digest([D2, D1])}
    m = Manifest(
        version=1,
        base_version=0,
        kind="delta",
        format_version=1,
        created_at=1.0,
        writers=("w00000", "w00001"),
        blobs=(),
        shard_digests=digests,
        run_id="r1",
        base_digests={"tp0": D1, "tp1": D2},
    )
    assert dict(Manifest.from_json(m.to_json()).shard_digests) == digests


def test_a_writer_marker_states_its_part_digests_validated_and_under_its_mac() -> None:
    key = b"k" * 16
    marker = WriterMarker(
        version=3, writer="w00001", created_at=5.0, blobs=(), part_digests={"tp1": D2, "tp0": D1}
    )
    again = WriterMarker.from_json(marker.to_json(key), signing_key=key)
    assert again.part_digests == {"tp0": D1, "tp1": D2}
    assert WriterMarker(version=3, writer="w00001", created_at=5.0, blobs=()).part_digests is None
    d = json.loads(marker.to_json(key))
    d["part_digests"]["tp0"] = D2  # someone without the key changes a part
    with pytest.raises(SignatureError):
        WriterMarker.from_json(json.dumps(d), signing_key=key)
    for bad in ({}, {"tp0": "x" * 32}, {"tp0": f"w2:{HEX}"}, {"tp0": D1.upper()}, {"../x": D1}):
        with pytest.raises(ManifestError):
            WriterMarker(version=3, writer="w00001", created_at=5.0, blobs=(), part_digests=bad)
    d = json.loads(marker.to_json())
    d["part_digests"] = [D1]
    with pytest.raises(ManifestError):
        WriterMarker.from_json(json.dumps(d))
