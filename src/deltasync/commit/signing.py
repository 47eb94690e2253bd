"""HMAC-SHA256 signing of manifests with a key shared by publisher and receivers.

The signed bytes are a domain tag followed by the manifest's canonical JSON without its
``signature`` field. Because the manifest lists every blob's size and xxh3-128 digest and each
shard's state digest, the signature also covers every blob: a receiver that verifies the
manifest and then each blob's digest trusts nothing the key holder did not write.

A receiver configured with a key rejects unsigned manifests as well as forged ones (see
:func:`check_signature`); one without a key accepts both signed and unsigned manifests.
This module knows nothing about stores or where keys come from.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

from deltasync.commit.canonical import canonical_json
from deltasync.commit.model import Manifest
from deltasync.errors import ConfigError, SignatureError

_DOMAIN = b"deltasync-manifest-hmac-sha256-v1\n"
MIN_KEY_BYTES = 16


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise ConfigError(f"signing key must be bytes, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"signing key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
            "(e.g. secrets.token_bytes(32))"
        )
    return bytes(key)


def signing_bytes(manifest: Manifest) -> bytes:
    """Exactly the bytes the HMAC covers."""
    return _DOMAIN + canonical_json(manifest.to_dict(include_signature=False))


def _mac(manifest: Manifest, key: bytes) -> str:
    return hmac.new(_check_key(key), signing_bytes(manifest), hashlib.sha256).hexdigest()


def sign(manifest: Manifest, key: bytes) -> Manifest:
    """A copy of ``manifest`` carrying its HMAC-SHA256 signature (any old one is replaced)."""
    return replace(manifest, signature=_mac(manifest, key))


def verify(manifest: Manifest, key: bytes) -> None:
    """Raise SignatureError unless ``manifest`` carries a valid signature under ``key``."""
    expected = _mac(manifest, key)
    if manifest.signature is None:
        raise SignatureError(
            f"manifest {manifest.version} is unsigned, but this receiver requires signed "
            "manifests; configure the publisher with the same signing key"
        )
    if not hmac.compare_digest(expected, manifest.signature):
        raise SignatureError(
            f"manifest {manifest.version} signature does not verify: it was altered after "
            "signing or signed with a different key; refusing to apply it"
        )


def check_signature(manifest: Manifest, key: bytes | None) -> None:
    """Receiver policy: with a key, require a valid signature; without one, accept any."""
    if key is not None:
        verify(manifest, key)
