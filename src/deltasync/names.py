"""Every key, path and tag deltasync writes is built here, and nowhere else.

Store keys are relative to a run prefix (a directory or ``s3://bucket/prefix``) and always use
``/``. Parsing functions are the exact inverses of the builders and reject anything else, so a
hostile manifest cannot smuggle a path such as ``../../etc`` into a key.

This module knows string formats only: no I/O, no tensors.
"""

from __future__ import annotations

import re

from deltasync.errors import ManifestError
from deltasync.validate import check_int

LATEST = "LATEST"
_VERSION_DIGITS = 8
MAX_VERSION = 10**_VERSION_DIGITS - 1  # the largest version a key can name

# Shard ids and writer ids are short, path-safe tokens (no '/', no '..', no leading dot).
MAX_TOKEN = 128  # the longest id or name check_token accepts
_TOKEN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.=-]{{0,{MAX_TOKEN - 1}}}")


def check_token(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe path component, else raise ManifestError naming it."""
    # fullmatch: ``re.match`` with ``$`` would also accept a trailing newline.
    if not isinstance(value, str) or not _TOKEN.fullmatch(value) or ".." in value:
        raise ManifestError(
            f"{kind} {value!r} is not a safe name: use 1-128 characters from [A-Za-z0-9_.=-], "
            "starting with a letter or digit, without '..'"
        )
    return value


def check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise ManifestError(f"version must be an int, got {version!r}")
    if not 0 <= version <= MAX_VERSION:
        raise ManifestError(f"version {version!r} is out of range 0..{MAX_VERSION}")
    return version


def check_version_arg(owner: str, version: object, *, hint: str = "") -> int:
    """``version`` as a caller passed it to ``owner`` (a method or request field): an int in
    ``0..MAX_VERSION``, else a ConfigError naming it, with ``hint`` as the remedy. (A version
    read from the store is :func:`check_version`'s: a ManifestError.)"""
    return check_int(owner, "version", version, lo=0, hi=MAX_VERSION, hint=hint)


def version_dir(version: int) -> str:
    return f"v{check_version(version):0{_VERSION_DIGITS}d}"


def version_prefix(version: int) -> str:
    """List prefix of everything stored for one version (blobs, markers, manifest)."""
    return f"{version_dir(version)}/"


# Short-lived keys a store writes to learn what its server honours (nothing else reads them).
PROBES_PREFIX = "probes/"


def probe_key(token: str) -> str:
    return f"{PROBES_PREFIX}{check_token('probe', token)}"


MANIFEST_FILE = "MANIFEST.json"
VERSIONS_PREFIX = "v"  # list prefix under which every version directory lives
# The same keys as ten narrower list prefixes (``v0`` ... ``v9``): together they cover every
# version directory, and a local listing never walks a tree such as ``venv/`` or ``var/``.
VERSION_DIGIT_PREFIXES = tuple(f"{VERSIONS_PREFIX}{d}" for d in range(10))


def manifest_key(version: int) -> str:
    return f"{version_dir(version)}/{MANIFEST_FILE}"


# Directory names inside a version directory that are not receiver shards.
_RESERVED_SHARDS = frozenset({"writers"})


def blob_key(version: int, shard: str, writer: str) -> str:
    shard = check_token("shard", shard)
    if shard in _RESERVED_SHARDS:
        raise ManifestError(f"shard id {shard!r} is reserved; pick another receiver shard id")
    return f"{version_dir(version)}/{shard}/{check_token('writer', writer)}.blob"


def writer_marker_key(version: int, writer: str) -> str:
    return f"{writers_prefix(version)}{check_token('writer', writer)}.json"


def writer_claim_key(version: int, writer: str) -> str:
    """A writer's claim of a version (several writers): stored once, before its first blob."""
    return f"{writers_prefix(version)}{check_token('writer', writer)}.claim"


def writer_abandoned_key(version: int, writer: str) -> str:
    """A writer's notice that its attempt at a version failed (several writers): the others
    stop waiting for it instead of waiting out their timeout."""
    return f"{writers_prefix(version)}{check_token('writer', writer)}.abandoned"


def writers_prefix(version: int) -> str:
    return f"{version_dir(version)}/writers/"


def ack_key(version: int, receiver: str) -> str:
    return f"{acks_prefix(version)}{check_token('receiver', receiver)}.json"


def acks_prefix(version: int) -> str:
    return f"acks/{version_dir(version)}/"


RECEIVERS_PREFIX = "receivers/"


def receiver_key(receiver: str) -> str:
    """Registration record of a live receiver (its id and the version it holds)."""
    return f"{RECEIVERS_PREFIX}{check_token('receiver', receiver)}.json"


def parse_version_dir(component: str) -> int:
    # [0-9], not \d: \d also takes other scripts' digits, which int() reads ("v٠٠٠٠٠٠٠١" was 1)
    m = re.fullmatch(rf"v([0-9]{{{_VERSION_DIGITS}}})", component)
    if not m:
        raise ManifestError(f"{component!r} is not a version directory (expected v########)")
    return int(m.group(1))


# --- parsers: exact inverses of the builders; anything else raises ManifestError ---------


def _parse(kind: str, key: str, pattern: str) -> tuple[str, ...]:
    m = re.fullmatch(pattern, key) if isinstance(key, str) else None
    if not m:
        raise ManifestError(f"{key!r} is not a {kind} key")
    return m.groups()


_V = rf"(v[0-9]{{{_VERSION_DIGITS}}})"
_T = r"([^/]+)"


def parse_manifest_key(key: str) -> int:
    (vdir,) = _parse("manifest", key, rf"{_V}/{re.escape(MANIFEST_FILE)}")
    return parse_version_dir(vdir)


def parse_blob_key(key: str) -> tuple[int, str, str]:
    """``(version, shard, writer)`` of a blob key."""
    vdir, shard, writer = _parse("blob", key, rf"{_V}/{_T}/{_T}\.blob")
    version = parse_version_dir(vdir)
    if blob_key(version, shard, writer) != key:  # also re-checks the tokens
        raise ManifestError(f"{key!r} is not a blob key")
    return version, shard, writer


def parse_writer_marker_key(key: str) -> tuple[int, str]:
    vdir, writer = _parse("writer marker", key, rf"{_V}/writers/{_T}\.json")
    return parse_version_dir(vdir), check_token("writer", writer)


def parse_writer_claim_key(key: str) -> tuple[int, str]:
    vdir, writer = _parse("writer claim", key, rf"{_V}/writers/{_T}\.claim")
    return parse_version_dir(vdir), check_token("writer", writer)


def parse_writer_abandoned_key(key: str) -> tuple[int, str]:
    vdir, writer = _parse("writer abandoned", key, rf"{_V}/writers/{_T}\.abandoned")
    return parse_version_dir(vdir), check_token("writer", writer)


def parse_ack_key(key: str) -> tuple[int, str]:
    """``(version, receiver)`` of an ack key."""
    vdir, receiver = _parse("ack", key, rf"acks/{_V}/{_T}\.json")
    return parse_version_dir(vdir), check_token("receiver", receiver)


def parse_receiver_key(key: str) -> str:
    (receiver,) = _parse("receiver", key, rf"{re.escape(RECEIVERS_PREFIX)}{_T}\.json")
    return check_token("receiver", receiver)


def shard_id(tp_rank: int, ep_rank: int | None = None) -> str:
    """Receiver shard id: ``tp{r}`` or ``tp{r}-ep{e}``. DP replicas share one id."""
    if ep_rank is None:
        return f"tp{tp_rank}"
    return f"tp{tp_rank}-ep{ep_rank}"


def writer_id(rank: int) -> str:
    return f"w{rank:05d}"


# Local (receiver-side) files.
JOURNAL_FILE = "journal.json"
STATE_FILE = "state.json"
LOCK_FILE = "lock"  # held (a POSIX lock) by the one process whose receiver uses the directory
# safetensors metadata: the receiver shard a file holds (its TP/EP ranks' files have the same
# tensor names and shapes, so only this tells them apart)
META_SHARD = "deltasync_shard"
