"""Stores that stand in for a real one: ``MemoryStore`` and ``ThrottledStore``.

``MemoryStore`` is a thread-safe dict of bytes, for unit tests and single-process demos. It gives
the same guarantees as the other backends (atomic put, exclusive put_if_absent, sorted list)
under one lock, and copies on the way in so a caller mutating its buffer after ``put`` cannot
change what was stored. It does not persist anything and is not shared between processes.

``ThrottledStore`` wraps any store so reads and writes share a node's emulated link rate.
Benchmarks run every role on one machine, where "storage" is a local disk or a loopback S3
server far faster than a real cross-cluster link. Wrapping the store in a token bucket makes
the bytes that cross the (emulated) link cost link time: over any interval, bytes moved are
at most ``rate * interval + burst``. The time an operation takes is max(its own I/O time, its
bytes / rate), not their sum, because the inner operation runs while the bucket refills.
Reads (get, get_range) and writes (put, put_stream, put_if_absent) draw from separate buckets
by default (a full-duplex NIC); ``full_duplex=False`` makes them share one. Metadata calls
(exists, list, size, delete) are free. The wrapper knows nothing about what it moves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from deltasync.errors import CommitConflictError, ConfigError, KeyNotFoundError, StoreError
from deltasync.store.base import (
    Bytes,
    Store,
    as_bytes,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
    written_at,
)


class MemoryStore:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self._objects: dict[str, bytes] = {}
        self._written: dict[str, float] = {}  # key -> time.time() of its last write
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryStore({self.name!r})" if self.name else "MemoryStore()"

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_key(key)
        check_max_bytes(key, max_bytes)
        with self._lock:
            try:
                data = self._objects[key]
            except KeyError:
                raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(key, self, len(data), max_bytes)
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        data = self.get(key)
        if start + length > len(data):
            raise StoreError(
                f"get_range({key!r}, {start}, {length}) reads past the end of the "
                f"{len(data)}-byte object in {self!r}"
            )
        return data[start : start + length]

    def put(self, key: str, data: Bytes) -> None:
        check_key(key)
        blob = bytes(as_bytes(data))
        with self._lock:
            self._objects[key] = blob
            self._written[key] = time.time()

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        check_key(key)
        blob = b"".join(bytes(as_bytes(c)) for c in chunks)
        with self._lock:
            self._objects[key] = blob
            self._written[key] = time.time()
        return len(blob)

    def put_if_absent(self, key: str, data: Bytes) -> None:
        check_key(key)
        blob = bytes(as_bytes(data))
        with self._lock:
            if key in self._objects:
                raise CommitConflictError(
                    f"key {key!r} already exists in {self!r}; another writer committed it first"
                )
            self._objects[key] = blob
            self._written[key] = time.time()

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
            self._written.pop(key, None)

    def size(self, key: str) -> int:
        return len(self.get(key))

    def modified(self, key: str) -> float:
        """When the object was last written (POSIX seconds). Raises KeyNotFoundError if
        absent."""
        check_key(key)
        with self._lock:
            try:
                return self._written[key]
            except KeyError:
                raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None


@dataclass(frozen=True, kw_only=True)
class ThrottleConfig:
    """``gbps`` is in gigabits per second (10**9 bit/s), as link speeds are quoted."""

    gbps: float
    burst_bytes: int = 1 * 2**20
    full_duplex: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.gbps, (int, float)) or not self.gbps > 0:
            raise ConfigError(f"ThrottleConfig.gbps must be a number > 0, got {self.gbps!r}")
        if not isinstance(self.burst_bytes, int) or self.burst_bytes < 0:
            raise ConfigError(
                f"ThrottleConfig.burst_bytes must be an int >= 0, got {self.burst_bytes!r}"
            )

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


class TokenBucket:
    """Thread-safe; callers reserve bytes and learn when their reservation is paid for.

    Reservations may drive the balance negative: the caller then waits until the bucket has
    refilled past its debt, so concurrent callers queue fairly in reservation order.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int) -> None:
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` and return the monotonic time at which they are paid for."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            debt = -self._tokens
        return now + (debt / self.rate if debt > 0 else 0.0)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class ThrottledStore:
    """A Store that moves bytes through ``inner`` no faster than ``gbps``."""

    def __init__(
        self, inner: Store, gbps: float, *, burst_bytes: int = 1 * 2**20, full_duplex: bool = True
    ) -> None:
        self.inner = inner
        self.config = ThrottleConfig(gbps=gbps, burst_bytes=burst_bytes, full_duplex=full_duplex)
        self._read = TokenBucket(self.config.bytes_per_s, burst_bytes)
        self._write = (
            self._read if not full_duplex else TokenBucket(self.config.bytes_per_s, burst_bytes)
        )

    def __repr__(self) -> str:
        return f"ThrottledStore({self.inner!r}, gbps={self.config.gbps})"

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data = self.inner.get(key, max_bytes=max_bytes)
        _sleep_until(self._read.reserve(len(data)))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        deadline = self._read.reserve(length)
        data = self.inner.get_range(key, start, length)
        _sleep_until(deadline)
        return data

    def put(self, key: str, data: Bytes) -> None:
        deadline = self._write.reserve(len(as_bytes(data)))
        self.inner.put(key, data)
        _sleep_until(deadline)

    def put_if_absent(self, key: str, data: Bytes) -> None:
        deadline = self._write.reserve(len(as_bytes(data)))
        self.inner.put_if_absent(key, data)
        _sleep_until(deadline)

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        def paced() -> Iterator[Bytes]:
            for chunk in chunks:
                _sleep_until(self._write.reserve(len(as_bytes(chunk))))
                yield chunk

        return self.inner.put_stream(key, paced())

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def modified(self, key: str) -> float | None:
        return written_at(self.inner, key)
