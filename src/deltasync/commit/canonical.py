"""Canonical JSON out, strict JSON in, and the field checkers the records share.

Canonical bytes (sorted keys, no whitespace, ASCII, no NaN) are what gets signed, so two
processes that build the same record produce the same bytes. The strict reader rejects what
``json.loads`` would quietly accept from a hostile store: oversized input, duplicate keys,
NaN/Infinity, absurd nesting or digit strings. Every checker raises ManifestError naming the
record and the field. Nothing here knows what the records mean.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from deltasync.errors import ManifestError

DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")
SIGNATURE_RE = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError(f"duplicate JSON field {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ManifestError(f"JSON constant {name} is not allowed")


def strict_loads(data: bytes | str, *, what: str, max_bytes: int) -> dict[str, Any]:
    """Parse one JSON object of at most ``max_bytes`` bytes."""
    if isinstance(data, str):
        data = data.encode("utf-8")
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
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise ManifestError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def expect_fields(
    obj: Mapping[str, Any], *, what: str, required: set[str], optional: set[str] = frozenset()
) -> None:
    if not isinstance(obj, Mapping):
        raise ManifestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - required - optional
    if unknown:
        raise ManifestError(f"{what} has unknown field(s) {sorted(unknown)}")
    missing = required - set(obj)
    if missing:
        raise ManifestError(f"{what} is missing field(s) {sorted(missing)}")


def check_int(value: Any, *, what: str, lo: int, hi: int) -> int:
    # bool is an int in Python but never a valid count or version here.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ManifestError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def check_time(value: Any, *, what: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ManifestError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_digest(value: Any, *, what: str) -> str:
    if not isinstance(value, str) or not DIGEST_RE.match(value):
        raise ManifestError(f"{what} must be 32 lowercase hex characters (xxh3-128), got {value!r}")
    return value


def check_choice(value: Any, *, what: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ManifestError(f"{what} must be one of {list(choices)}, got {value!r}")
    return value
