"""HMAC-SHA256 signing with a key shared by publisher and receivers: manifests and records.

Manifests: the signed bytes are a domain tag followed by the manifest's canonical JSON
without its ``signature`` field. The manifest lists every blob's size and BLAKE2b-256 digest,
each shard's state digest and the run's identity, so the signature also covers every blob: a
receiver that verifies the manifest and then each blob's digest trusts nothing the key holder
did not write. :func:`check_signature_bytes` checks the MAC over the raw stored bytes before
any JSON is parsed (a forged 64 MiB manifest costs one hash, not a parse).

Records (writer markers, acks, receiver registrations) carry a ``mac`` over their own
canonical JSON under a domain tag of their kind, so a marker cannot pass for an ack, nor a
manifest for either. With a key configured, the committer signs nothing it cannot verify and
retention and staleness count only receivers whose records verify.

A reader configured with a key rejects unsigned objects as well as forged ones (see
:func:`check_signature`); one without a key accepts both signed and unsigned ones. This module
knows nothing about stores; :func:`load_key_file` is its one piece of I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from dataclasses import replace
from pathlib import Path

from deltasync.atomic import read_regular
from deltasync.commit.canonical import canonical_json
from deltasync.commit.model import Manifest
from deltasync.errors import ConfigError, SignatureError

log = logging.getLogger(__name__)

_DOMAIN = b"deltasync-manifest-hmac-sha256-v1\n"
_RECORD_DOMAINS = {
    "writer marker": b"deltasync-writer-marker-hmac-sha256-v1\n",
    "ack": b"deltasync-ack-hmac-sha256-v1\n",
    "receiver record": b"deltasync-receiver-record-hmac-sha256-v1\n",
    "writer abandoned": b"deltasync-writer-abandoned-hmac-sha256-v1\n",
    "writer claim": b"deltasync-writer-claim-hmac-sha256-v1\n",
}
MIN_KEY_BYTES = 16
# In canonical JSON the signature is never the first field ("base_version" sorts before it),
# and a '"' preceded by ',' is always a real string delimiter, never inside a string.
_SIGNATURE_FIELD = re.compile(rb',"signature":"([0-9a-f]{64})"')


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


def check_signature_bytes(data: bytes, key: bytes | None, *, what: str) -> None:
    """With a key, raise SignatureError unless the stored bytes ``data`` are a manifest the
    key holder signed, checked on the raw bytes before any parsing (``what`` names it).

    The publisher stores canonical JSON, so removing the ``signature`` member leaves exactly
    the signed bytes. The parsed manifest is verified again after parsing (:func:`verify`)."""
    if key is None:
        return
    key = _check_key(key)
    found = list(_SIGNATURE_FIELD.finditer(bytes(data)))
    if not found:
        raise SignatureError(
            f"{what} is unsigned (or not canonical JSON), but this reader requires signed "
            "manifests; configure the publisher with the same signing key"
        )
    if len(found) > 1:
        raise SignatureError(f"{what} carries {len(found)} signature fields; refusing it")
    m = found[0]
    signed = bytes(data[: m.start()]) + bytes(data[m.end() :])
    expected = hmac.new(key, _DOMAIN + signed, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, m.group(1).decode("ascii")):
        raise SignatureError(
            f"{what} signature does not verify: it was altered after signing or signed with a "
            "different key; refusing it before parsing"
        )


def record_mac(kind: str, unsigned_json: bytes, key: bytes) -> str:
    """HMAC-SHA256 of a record's canonical JSON (without its ``mac``) under its kind's tag."""
    return hmac.new(
        _check_key(key), _RECORD_DOMAINS[kind] + unsigned_json, hashlib.sha256
    ).hexdigest()


def check_record_mac(
    kind: str, unsigned_json: bytes, mac: str | None, key: bytes | None, *, what: str
) -> None:
    """With a key, raise SignatureError unless ``mac`` authenticates the record."""
    if key is None:
        return
    if mac is None:
        raise SignatureError(
            f"{what} is unsigned, but a signing key is configured: it was not written by a "
            "deltasync process holding the key; ignoring it"
        )
    if not hmac.compare_digest(record_mac(kind, unsigned_json, key), mac):
        raise SignatureError(
            f"{what} does not verify under the signing key: forged, altered, or written with "
            "another key; ignoring it"
        )


def load_key_file(path: str | os.PathLike[str]) -> bytes:
    """The signing key stored in ``path`` (raw bytes; one trailing newline is dropped).

    Args:
        path: the key file. A file that its group or others may read draws a warning: anyone
            who reads the key can sign manifests every receiver applies.

    Returns:
        The key bytes (at least MIN_KEY_BYTES).
    """
    p = Path(path)
    data, st = read_regular(p, limit=4096, what="key file", error=ConfigError)
    if st.st_mode & 0o077:
        log.warning(
            "key file %r is readable by its group or others (mode %o): anyone who can "
            "read it can sign versions every receiver applies; chmod 600 it",
            str(p),
            stat.S_IMODE(st.st_mode),
        )
    key = data[:-1] if data.endswith(b"\n") else data
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"key file {str(p)!r} holds {len(key)} bytes; a signing key needs at least "
            f"{MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom > key && chmod 600 key)"
        )
    return key
