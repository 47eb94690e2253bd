"""MemoryStore: a thread-safe dict of bytes, for unit tests and single-process demos.

It gives the same guarantees as the other backends (atomic put, exclusive put_if_absent,
sorted list) under one lock, and copies on the way in so a caller mutating its buffer after
``put`` cannot change what was stored. It does not persist anything and is not shared between
processes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from deltasync.errors import CommitConflictError, KeyNotFoundError, StoreError
from deltasync.store.base import (
    Bytes,
    as_bytes,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)


class MemoryStore:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self._objects: dict[str, bytes] = {}
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

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        check_key(key)
        blob = b"".join(bytes(as_bytes(c)) for c in chunks)
        with self._lock:
            self._objects[key] = blob
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

    def size(self, key: str) -> int:
        return len(self.get(key))
