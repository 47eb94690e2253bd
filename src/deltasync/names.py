"""Every key, path and tag deltasync writes is built here, and nowhere else.

Store keys are relative to a run prefix (a directory or ``s3://bucket/prefix``) and always use
``/``. Parsing functions are the exact inverses of the builders and reject anything else, so a
hostile manifest cannot smuggle a path such as ``../../etc`` into a key.

This module knows string formats only: no I/O, no tensors.
"""

from __future__ import annotations

import re

from deltasync.errors import ManifestError

LATEST = "LATEST"
_VERSION_DIGITS = 8
_MAX_VERSION = 10**_VERSION_DIGITS - 1

# Shard ids and writer ids are short, path-safe tokens (no '/', no '..', no leading dot).
_TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,127}$")


def check_token(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe path component, else raise ManifestError naming it."""
    if not isinstance(value, str) or not _TOKEN.match(value) or ".." in value:
        raise ManifestError(
            f"{kind} {value!r} is not a safe name: use 1-128 characters from [A-Za-z0-9_.=-], "
            "starting with a letter or digit, without '..'"
        )
    return value


def check_version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= _MAX_VERSION:
        raise ManifestError(f"version {version!r} is out of range 0..{_MAX_VERSION}")
    return version


def version_dir(version: int) -> str:
    return f"v{check_version(version):0{_VERSION_DIGITS}d}"


def manifest_key(version: int) -> str:
    return f"{version_dir(version)}/MANIFEST.json"


def blob_key(version: int, shard: str, writer: str) -> str:
    return f"{version_dir(version)}/{check_token('shard', shard)}/{check_token('writer', writer)}.blob"


def writer_marker_key(version: int, writer: str) -> str:
    return f"{version_dir(version)}/writers/{check_token('writer', writer)}.json"


def ack_key(version: int, receiver: str) -> str:
    return f"acks/{version_dir(version)}/{check_token('receiver', receiver)}.json"


def receiver_key(receiver: str) -> str:
    """Registration record of a live receiver (its id and the version it holds)."""
    return f"receivers/{check_token('receiver', receiver)}.json"


def parse_version_dir(component: str) -> int:
    m = re.fullmatch(r"v(\d{%d})" % _VERSION_DIGITS, component)
    if not m:
        raise ManifestError(f"{component!r} is not a version directory (expected v########)")
    return int(m.group(1))


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
