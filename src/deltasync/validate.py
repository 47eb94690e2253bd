"""Config-field validators: the one set every config dataclass uses in ``__post_init__``.

Each check raises :class:`~deltasync.errors.ConfigError` naming ``Owner.field``, the accepted
range and the value given, so a bad setting is reported where it is constructed, before
anything runs. ``bool`` is never accepted where a number is meant (``True`` is an ``int`` in
Python, and ``level=True`` is a typo, not a level).

This module knows field values only: nothing about what the settings mean.
"""

from __future__ import annotations

import math

from deltasync.errors import ConfigError


def check_int(
    owner: str, field: str, value: object, *, lo: int, hi: int | None = None, hint: str = ""
) -> int:
    """Return ``value`` if it is an int in ``[lo, hi]`` (no upper bound when ``hi`` is None).

    Args:
        owner: the config class name, e.g. ``"PublisherConfig"``, or the method's.
        field: the field name.
        value: the value given.
        lo: smallest accepted value.
        hi: largest accepted value, or None.
        hint: the remedy, appended to the error.

    Returns:
        ``value``, unchanged.
    """
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value >= lo and (hi is None or value <= hi):
        return value
    accepted = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ConfigError(
        f"{owner}.{field} must be an int {accepted}, got {value!r}" + (f": {hint}" if hint else "")
    )


def check_number(
    owner: str,
    field: str,
    value: object,
    *,
    positive: bool = True,
    finite: bool = True,
    unit: str = "",
) -> float:
    """Return ``value`` if it is a real number > 0 (``positive``) or >= 0, finite if asked.

    Args:
        owner: the config class name.
        field: the field name.
        value: the value given.
        positive: require > 0 (True) or >= 0 (False).
        finite: refuse infinity (NaN is always refused).
        unit: named in the message, e.g. ``"seconds"``.

    Returns:
        ``value``, unchanged.
    """
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (math.isfinite(value) or (not finite and value == math.inf))
        and (value > 0 if positive else value >= 0)
    )
    if ok:
        return value
    what = f"number of {unit}" if unit else "number"
    what = f"finite {what}" if finite else what
    bound = "> 0" if positive else ">= 0"
    raise ConfigError(f"{owner}.{field} must be a {what} {bound}, got {value!r}")


# The longest duration a config may give (~31.7 years). A wait's timeout becomes a
# ``timedelta``, int64 milliseconds in the collectives' status rows and int64 nanoseconds in
# the backends: a larger finite value overflows there, mid-version and on every rank, as an
# untyped ValueError / OverflowError that also breaks the process group.
MAX_SECONDS = 10**9


def check_seconds(owner: str, field: str, value: object) -> float:
    """``check_number`` for a duration that must be > 0 seconds, at most ``MAX_SECONDS``."""
    check_number(owner, field, value, unit="seconds")
    if value > MAX_SECONDS:
        raise ConfigError(
            f"{owner}.{field} must be at most {MAX_SECONDS} seconds (~31 years), got {value!r}: "
            "a wait that long overflows the collectives' timeouts; pass a real bound"
        )
    return value


def check_bool(owner: str, field: str, value: object) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{field} must be a bool, got {value!r}")
    return value


def check_instance(
    owner: str, field: str, value: object, kind: type | tuple[type, ...], *, remedy: str = ""
) -> object:
    """Return ``value`` if it is an instance of ``kind`` (one of them, for a tuple); the error
    ends with ``remedy`` when one is given."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        want = " or ".join(k.__name__ for k in kinds)
        tail = f": {remedy}" if remedy else ""
        raise ConfigError(f"{owner}.{field} must be a {want}, got {type(value).__name__}{tail}")
    return value


def check_signing_key(owner: str, value: object, *, min_bytes: int) -> bytes | None:
    """Return ``value`` if it is None or a bytes key of at least ``min_bytes`` bytes."""
    if value is not None and (not isinstance(value, bytes) or len(value) < min_bytes):
        raise ConfigError(
            f"{owner}.signing_key must be bytes of at least {min_bytes} bytes "
            "(e.g. secrets.token_bytes(32)) or None"
        )
    return value
