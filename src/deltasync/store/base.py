"""The storage protocol: a handful of byte-level operations on string keys.

A store holds immutable-ish blobs under keys relative to one run prefix (a directory, an S3
``bucket/prefix``, or a dict). Keys use ``/`` separators and are checked by :func:`check_key`
the same way on every backend, so a key that is rejected on S3 is rejected on disk too.

Guarantees every implementation gives (and ``tests/store`` checks on each of them):

- ``put`` is atomic per key: a reader sees the old bytes or the new bytes, never a mix or a
  prefix of them;
- ``put_if_absent`` is atomic and exclusive: among racing writers exactly one succeeds, the
  others get :class:`~deltasync.errors.CommitConflictError`; this is the fencing primitive
  that commits manifests;
- ``delete`` of a missing key is not an error (retention may run twice);
- ``list`` returns every key that starts with ``prefix``, sorted;
- ``get(key, max_bytes=n)`` raises :class:`~deltasync.errors.ObjectTooLargeError` for an
  object larger than ``n`` bytes before reading it whole (the size is checked first), so a
  reader of a store shared with others bounds its memory by what it expects; every failure is
  a :class:`~deltasync.errors.StoreError` naming the key.

One method is optional: ``modified(key) -> float``, when the object was last written (POSIX
seconds). Retention asks it (through :func:`written_at`) before deleting an attempt that never
committed, whose manifest may still be in flight; a store without it keeps such attempts.

Remote backends retry transient failures through :class:`RetryPolicy` (capped exponential
backoff with full jitter): :func:`backoff_delays` is the pure schedule (seeded, so tests can pin
it); :func:`call_with_retries` runs an operation, retrying only what the caller's
``is_transient`` says is transient, and raises the last error once the attempts or the deadline
are spent.

This module knows nothing about versions, manifests or what the bytes mean: all policy lives
above it (see :mod:`deltasync.commit`), nor about S3 or HTTP.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from deltasync.errors import (
    ConfigError,
    InvalidKeyError,
    ObjectTooLargeError,
    RetriesExhausted,
    StoreError,
)
from deltasync.validate import check_int, check_number

log = logging.getLogger(__name__)

MAX_KEY_LENGTH = 1024
MAX_COMPONENT_BYTES = 255  # NAME_MAX of every common filesystem, and so of LocalStore

Bytes = bytes | bytearray | memoryview


@runtime_checkable
class Store(Protocol):
    """Byte storage under string keys relative to one run prefix."""

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Whole object (bytes-like: ``LocalStore`` returns an object over 2 GiB as the
        bytearray it read it into). Raises KeyNotFoundError if absent, ObjectTooLargeError if
        it is larger than ``max_bytes`` (None: no bound)."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from offset ``start``; the range must lie inside the object."""
        ...

    def put(self, key: str, data: Bytes) -> None:
        """Create or replace atomically."""
        ...

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        """Create or replace atomically from chunks (multipart on S3); returns bytes written."""
        ...

    def put_if_absent(self, key: str, data: Bytes) -> None:
        """Create atomically; raise CommitConflictError if the key already exists."""
        ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` (a plain string prefix), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key; a missing key is not an error."""
        ...

    def size(self, key: str) -> int:
        """Object size in bytes. Raises KeyNotFoundError if absent."""
        ...


def check_store(owner: str, store: object) -> Store:
    """``store`` if it has the Store methods (looked up as a call would: a wrapper forwarding
    them through ``__getattr__`` passes), else a ConfigError naming ``owner`` and the remedy;
    a path or URL handed in the store's place is the usual case."""
    missing = [m for m in _STORE_METHODS if not callable(getattr(store, m, None))]
    if missing:
        hint = (
            "; a path or URL is opened with deltasync.open_store(...)"
            if isinstance(store, str | bytes | os.PathLike)
            else ""
        )
        raise ConfigError(
            f"{owner}: store must be a Store (LocalStore, S3Store, open_store(url)), got "
            f"{type(store).__name__} without {', '.join(missing[:3])}{hint}"
        )
    return store  # type: ignore[return-value]


_STORE_METHODS = tuple(n for n, f in vars(Store).items() if not n.startswith("_") and callable(f))


def written_at(store: object, key: str) -> float | None:
    """When ``key`` was last written (POSIX seconds), or None when ``store`` cannot tell (it
    has no ``modified``, or wraps one that has none). Raises KeyNotFoundError if absent."""
    modified = getattr(store, "modified", None)
    return None if modified is None else modified(key)


def _check_chars(what: str, value: str) -> None:
    if "\\" in value:
        raise InvalidKeyError(f"{what} {value!r} contains a backslash; use '/' separators")
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise InvalidKeyError(f"{what} {value!r} contains a control character")
    if value.startswith("/"):
        raise InvalidKeyError(f"{what} {value!r} is absolute; keys are relative to the run prefix")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"{what} is {len(value)} characters long (at most {MAX_KEY_LENGTH})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKeyError(f"{what} {value!r} is not valid Unicode (a lone surrogate)") from None


def _check_component(what: str, value: str, component: str) -> None:
    if component in ("", ".", ".."):
        raise InvalidKeyError(
            f"{what} {value!r} has an empty, '.' or '..' path component; "
            "keys must not escape or alias the run prefix"
        )
    # Components starting with '.' are reserved for backends' temporary files, so a key can
    # never name (or list) a half-written temp file.
    if component.startswith("."):
        raise InvalidKeyError(f"{what} {value!r} has a component starting with '.' (reserved)")
    size = len(component.encode("utf-8"))
    if size > MAX_COMPONENT_BYTES:
        raise InvalidKeyError(
            f"{what} {value[:64]!r}... has a {size}-byte path component (at most "
            f"{MAX_COMPONENT_BYTES} bytes in UTF-8)"
        )


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidKeyError naming it."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be a str, got {type(key).__name__}")
    if key == "":
        raise InvalidKeyError("key is empty")
    _check_chars("key", key)
    for component in key.split("/"):
        _check_component("key", key, component)
    return key


def check_prefix(prefix: str) -> str:
    """Like :func:`check_key`, but '' is allowed and the last component may be empty/partial."""
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix == "":
        return prefix
    _check_chars("prefix", prefix)
    components = prefix.split("/")
    for component in components[:-1]:
        _check_component("prefix", prefix, component)
    last = components[-1]
    if last in (".", "..") or last.startswith("."):
        raise InvalidKeyError(f"prefix {prefix!r} ends in a '.'-component (reserved)")
    if len(last.encode("utf-8")) > MAX_COMPONENT_BYTES:
        raise InvalidKeyError(
            f"prefix {prefix[:64]!r}... ends in a component over {MAX_COMPONENT_BYTES} bytes"
        )
    return prefix


def check_max_bytes(key: str, max_bytes: int | None) -> None:
    """Refuse a ``max_bytes`` that is not None or an int >= 0 (StoreError naming the key)."""
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
    ):
        raise StoreError(f"get({key!r}): max_bytes must be None or an int >= 0, got {max_bytes!r}")


def too_large(key: str, store: object, size: int | str, max_bytes: int) -> ObjectTooLargeError:
    """The error of a read that would exceed its bound (``size``: what the store reports)."""
    return ObjectTooLargeError(
        f"{key!r} in {store!r} is {size} bytes, more than the {max_bytes} this read allows: "
        "the store holds something other than what was committed (a broken or hostile "
        "writer); nothing was read past the bound"
    )


def check_range(key: str, start: int, length: int) -> None:
    for name, value in (("start", start), ("length", length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StoreError(
                f"get_range({key!r}): {name} must be a non-negative int, got {value!r}"
            )


def as_bytes(data: Bytes) -> bytes | memoryview:
    """Accept bytes-like input without copying where the backend can write a memoryview."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        view = memoryview(data)
        if view.c_contiguous:
            return view.cast("B") if view.format != "B" or view.ndim != 1 else view
        return memoryview(view.tobytes())
    raise StoreError(f"data must be bytes-like, got {type(data).__name__}")


T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``max_attempts`` tries in all (1 = no retry), within ``deadline_s`` seconds of the first."""

    max_attempts: int = 8
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        check_int("RetryPolicy", "max_attempts", self.max_attempts, lo=1)
        for name in ("base_delay_s", "max_delay_s", "deadline_s"):
            check_number(
                "RetryPolicy",
                name,
                getattr(self, name),
                positive=False,
                finite=False,
                unit="seconds",
            )
        if self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"RetryPolicy.max_delay_s ({self.max_delay_s}) must be >= base_delay_s "
                f"({self.base_delay_s})"
            )


def backoff_delays(policy: RetryPolicy, rng: random.Random | None = None) -> Iterator[float]:
    """Sleep before attempt 2, 3, ...: uniform in [0, min(max, base * 2**i)] ("full jitter"),
    which spreads out writers that all lost the server at the same moment."""
    rng = rng or random.Random()
    for i in range(policy.max_attempts - 1):
        yield rng.uniform(0.0, min(policy.max_delay_s, policy.base_delay_s * (2**i)))


def call_with_retries(
    op: Callable[[int], T],
    *,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``op(attempt)`` (attempt counts from 0) until it returns or fails permanently.

    A non-transient error propagates at once; a transient one is retried after a backoff delay
    while attempts and the deadline last, then RetriesExhausted is raised from it.
    """
    t0 = clock()
    delays = backoff_delays(policy)
    attempt = 0
    while True:
        try:
            return op(attempt)
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempt += 1
            delay = next(delays, None)
            elapsed = clock() - t0
            if delay is None or elapsed + delay > policy.deadline_s:
                log.warning(
                    "store operation failed after %d attempt(s) in %.1f s: %s: %s",
                    attempt,
                    elapsed,
                    type(exc).__name__,
                    exc,
                )
                raise RetriesExhausted(exc, attempt, elapsed) from exc
            log.info(
                "transient store error on attempt %d (%s: %s); retrying in %.2f s",
                attempt,
                type(exc).__name__,
                exc,
                delay,
            )
            sleep(delay)
