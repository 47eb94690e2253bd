"""The one file format of a receiver's local records (journals and state files).

Both receivers, the storage path's (``receiver/journal.py``: ``state.json``, ``journal.json``)
and the in-cluster one (``cluster/journal.py``), keep what their live tensors hold in small JSON
files written here. Their state machines differ (one journals the store keys of a chain to
replay, the other the version being applied); the file is the same:

- one JSON object, canonical: sorted keys, no whitespace, ASCII, no NaN;
- written through :func:`deltasync.atomic.write_atomic` (temp file, fsync, rename, directory
  fsync), so a crash leaves the old record or the new one, never half of either; readable by
  their owner only (``RECORD_MODE``);
- read back strictly: a missing file is ``None`` (nothing recorded), an unreadable or
  non-JSON file is a :class:`~deltasync.errors.LocalStateError` naming the file and the remedy
  (restore the receiver from an anchor); checking the fields is the caller's.

This module knows files and JSON; it knows nothing about versions, stores or tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltasync.atomic import fsync_dir, write_atomic
from deltasync.errors import LocalStateError

REMEDY = "remove it and restore this receiver from an anchor"
RECORD_MODE = 0o600  # a receiver's local records are its own business
STATE_DIR_MODE = 0o700


def encode_record(obj: dict[str, Any]) -> bytes:
    """The canonical bytes of a record."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def read_record(path: Path) -> Any:
    """The JSON value stored at ``path``, or None when there is no file.

    Args:
        path: the record file.

    Returns:
        The decoded JSON value (the caller checks its fields), or None.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LocalStateError(f"cannot read {str(path)!r}: {exc}") from exc
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LocalStateError(
            f"{str(path)!r} is not valid JSON ({exc}); it was not written by deltasync or was "
            f"damaged: {REMEDY}"
        ) from exc


def write_record(path: Path, obj: dict[str, Any], *, durable: bool = True) -> None:
    """Atomically (and, when ``durable``, durably) replace the record at ``path``.

    Args:
        path: the record file; its directory must exist.
        obj: the record, a JSON object.
        durable: fsync file and directory (False only on scratch disks in tests).
    """
    try:
        write_atomic(path, encode_record(obj), durable=durable, mode=RECORD_MODE)
    except OSError as exc:
        raise LocalStateError(f"cannot write {str(path)!r}: {exc}") from exc


def remove_record(path: Path, *, durable: bool = True) -> None:
    """Remove the record at ``path`` (durably: the directory is fsynced); missing is fine."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LocalStateError(f"cannot remove {str(path)!r}: {exc}") from exc
    if durable:
        fsync_dir(path.parent)
