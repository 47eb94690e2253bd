"""Canonical JSON out, strict JSON in, and the field checkers the records share.

Canonical bytes (sorted keys, no whitespace, ASCII, no NaN) are what gets signed, so two
processes that build the same record produce the same bytes. The strict reader rejects what
``json.loads`` would quietly accept from a hostile store: oversized input, duplicate keys,
NaN/Infinity, absurd nesting or digit strings. Every checker raises ManifestError naming the
record and the field, and checks ranges before any arithmetic (a 309-digit integer is refused,
not converted to a float that overflows). :func:`parsing` turns anything else a builder of a
record raises on hostile input into a ManifestError naming the record. Nothing here knows what
the records mean.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from deltasync.errors import DeltaSyncError, ManifestError

# ``\Z``, not ``$``: ``$`` also matches before a trailing newline.
DIGEST_RE = re.compile(r"[0-9a-f]{32}\Z")
# A shard's parts digest (several writers without the full state; defined with the state
# digest in deltasync.layout.digest): "w{W}:" + 32 hex, W plain decimal 2..65536.
PARTS_DIGEST_RE = re.compile(r"w([1-9][0-9]{0,4}):[0-9a-f]{32}\Z")
MAX_PARTS_WRITERS = 65536
BLOB_DIGEST_RE = re.compile(r"[0-9a-f]{64}\Z")
SIGNATURE_RE = re.compile(r"[0-9a-f]{64}\Z")
# Seconds since the epoch (or durations): 10**11 s is ~3000 years, beyond any real clock.
MAX_SECONDS = 10**11
_SHOWN = 80  # characters of a rejected value quoted in an error


def show(value: Any) -> str:
    """A short repr of a rejected value (huge integers and strings are cut, never expanded)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_SHOWN:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, dict)):
        return f"a JSON {'list' if isinstance(value, list) else 'object'}"
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails is shown by its type only
        return f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


_NAMES_SHOWN = 8  # field names quoted in an error, at most


def show_names(names: Any) -> str:
    """The field names of an error, each cut like :func:`show`, at most ``_NAMES_SHOWN`` of
    them (a hostile object may hold many): ``'a', 'b' and 3 more``."""
    names = sorted(names, key=str)
    shown = ", ".join(show(n) for n in names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown if more <= 0 else f"{shown} and {more} more"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError(f"duplicate JSON field {show(k)}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ManifestError(f"JSON constant {name} is not allowed")


def strict_loads(data: bytes | str, *, what: str, max_bytes: int) -> dict[str, Any]:
    """Parse one JSON object of at most ``max_bytes`` bytes."""
    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ManifestError(f"{what} is not valid Unicode: {exc}") from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"{what} must be bytes or str, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ManifestError(f"{what} is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        obj = json.loads(
            bytes(data).decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
        )
    except ManifestError as exc:
        raise ManifestError(f"{what} is not valid: {exc}") from None
    # JSONDecodeError, UnicodeDecodeError and over-long digit strings are ValueErrors.
    except (ValueError, RecursionError, OverflowError) as exc:
        raise ManifestError(f"{what} is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


@contextmanager
def parsing(what: str) -> Iterator[None]:
    """Inside, any error that is not a DeltaSyncError becomes a ManifestError naming ``what``
    (e.g. the store key), so hostile bytes can only ever produce typed errors."""
    try:
        yield
    except ManifestError:
        raise
    except DeltaSyncError as exc:
        raise ManifestError(f"{what}: {exc}") from exc
    except Exception as exc:
        raise ManifestError(
            f"{what} is malformed: {type(exc).__name__}: {show(str(exc))}"
        ) from None


def expect_fields(
    obj: Mapping[str, Any], *, what: str, required: set[str], optional: set[str] = frozenset()
) -> None:
    if not isinstance(obj, Mapping):
        raise ManifestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - required - optional
    if unknown:
        raise ManifestError(f"{what} has unknown field(s) {show_names(unknown)}")
    missing = required - set(obj)
    if missing:
        raise ManifestError(f"{what} is missing field(s) {sorted(missing)}")


def check_int(value: Any, *, what: str, lo: int, hi: int) -> int:
    # bool is an int in Python but never a valid count or version here.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ManifestError(f"{what} must be an integer in [{lo}, {hi}], got {show(value)}")
    return value


def check_time(value: Any, *, what: str) -> float:
    """Seconds (a timestamp or a duration) in [0, MAX_SECONDS], as a float.

    The range is checked on the integer before it is converted: ``float(10**309)`` raises
    OverflowError, which a record built from hostile JSON must never do."""
    ok = not isinstance(value, bool) and (
        (isinstance(value, int) and 0 <= value <= MAX_SECONDS)
        or (isinstance(value, float) and math.isfinite(value) and 0 <= value <= MAX_SECONDS)
    )
    if not ok:
        raise ManifestError(
            f"{what} must be a finite number of seconds in [0, {MAX_SECONDS}], got {show(value)}"
        )
    return float(value)


def check_digest(value: Any, *, what: str, parts: bool = True) -> str:
    """A state digest (32 lowercase hex, xxh3-128) or, with ``parts``, a shard's parts digest
    (``w{W}:`` and 32 lowercase hex, W from 2 to 65536 in plain decimal)."""
    if isinstance(value, str) and DIGEST_RE.match(value):
        return value
    m = PARTS_DIGEST_RE.match(value) if parts and isinstance(value, str) else None
    if m is not None and 2 <= int(m.group(1)) <= MAX_PARTS_WRITERS:
        return value
    forms = "32 lowercase hex characters (xxh3-128)"
    if parts:
        forms += f", or w<writers 2..{MAX_PARTS_WRITERS}>: and 32 lowercase hex (a parts digest)"
    raise ManifestError(f"{what} must be {forms}, got {show(value)}")


def check_blob_digest(value: Any, *, what: str) -> str:
    if not isinstance(value, str) or not BLOB_DIGEST_RE.match(value):
        raise ManifestError(
            f"{what} must be 64 lowercase hex characters (BLAKE2b-256), got {show(value)}"
        )
    return value


def check_mac(value: Any, *, what: str) -> str:
    if not isinstance(value, str) or not SIGNATURE_RE.match(value):
        raise ManifestError(
            f"{what} must be 64 lowercase hex characters (HMAC-SHA256), got {show(value)}"
        )
    return value


def check_choice(value: Any, *, what: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ManifestError(f"{what} must be one of {list(choices)}, got {show(value)}")
    return value
