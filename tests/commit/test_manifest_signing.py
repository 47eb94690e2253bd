"""HMAC-SHA256 manifest signatures: a keyed receiver refuses unsigned and forged manifests."""

from __future__ import annotations

import json

import pytest

from deltasync.commit import Manifest, check_signature, sign, verify
from deltasync.errors import ConfigError, SignatureError

from store_manifest_samples import B2, D2, make_manifest

KEY = b"0123456789abcdef-shared-secret"


def test_a_signed_manifest_verifies_after_a_json_round_trip() -> None:
    signed = sign(make_manifest(), KEY)
    assert signed.signature is not None and len(signed.signature) == 64
    again = Manifest.from_json(signed.to_json())
    verify(again, KEY)
    check_signature(again, KEY)
    assert again.unsigned() == make_manifest()


def test_an_unsigned_manifest_is_rejected_by_a_receiver_with_a_key() -> None:
    with pytest.raises(SignatureError, match="unsigned"):
        verify(make_manifest(), KEY)
    with pytest.raises(SignatureError, match="unsigned"):
        check_signature(make_manifest(), KEY)


def test_a_receiver_without_a_key_accepts_signed_and_unsigned_manifests() -> None:
    check_signature(make_manifest(), None)
    check_signature(sign(make_manifest(), KEY), None)


def test_a_manifest_signed_with_another_key_is_rejected() -> None:
    with pytest.raises(SignatureError, match="does not verify"):
        verify(sign(make_manifest(), b"another-key-of-16+bytes"), KEY)


@pytest.mark.parametrize(
    "field, value",
    [
        (("blobs", 0, "digest"), B2),
        (("blobs", 0, "size"), 1235),
        (("shard_digests", "tp0"), D2),
        (("version",), 8),
        (("base_version",), 5),
        (("created_at",), 1700000001.25),
    ],
)
def test_any_edit_after_signing_is_detected(field: tuple, value) -> None:
    d = json.loads(sign(make_manifest(), KEY).to_json())
    target = d
    for p in field[:-1]:
        target = target[p]
    if field[0] == "version":
        # Keep the forged manifest self-consistent so only the signature can catch it.
        d["blobs"] = [dict(b, key=b["key"].replace("v00000007", "v00000008")) for b in d["blobs"]]
    target[field[-1]] = value
    forged = Manifest.from_json(json.dumps(d))
    with pytest.raises(SignatureError, match="does not verify"):
        verify(forged, KEY)


def test_stripping_blobs_from_a_signed_manifest_is_detected() -> None:
    d = json.loads(sign(make_manifest(), KEY).to_json())
    d["blobs"] = d["blobs"][:1]
    with pytest.raises(SignatureError):
        verify(Manifest.from_json(json.dumps(d)), KEY)


@pytest.mark.parametrize("key", [b"", b"short", "a-str-key-that-is-long-enough"])
def test_weak_or_mistyped_keys_are_a_config_error(key) -> None:
    with pytest.raises(ConfigError, match="key"):
        sign(make_manifest(), key)
