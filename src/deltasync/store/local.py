"""LocalStore: the embedded default, one file per key under a root directory.

Every write goes to a temporary file in the key's own directory, is fsynced, and is then
published with one atomic directory operation, followed by an fsync of the directory:

- ``put``: ``os.replace(tmp, path)`` (readers see the old or the new file, never a prefix);
- ``put_if_absent``: ``os.link(tmp, path)``, which fails with EEXIST if the key exists, so
  exactly one of several racing writers (threads or processes, on one host or over a POSIX
  filesystem with atomic link) wins, and the winner's file is complete the moment it appears.

Temporary files start with '.', a prefix :func:`check_key` forbids, so no key can name one and
``list`` never returns one. A crash can leave temporary files behind; they are invisible and
``sweep_temp_files`` removes them.

This module knows nothing about what the bytes mean.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from deltasync.atomic import TMP_MARK, fsync_dir, unlink_quietly, write_temp
from deltasync.errors import CommitConflictError, KeyNotFoundError, StoreError
from deltasync.store.base import Bytes, as_bytes, check_key, check_prefix, check_range


class LocalStore:
    """Files under ``root``; ``durable=False`` skips fsyncs (benchmarks on scratch disks)."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, durable: bool = True):
        self.root = Path(root).absolute()
        self.durable = durable
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create local store root {str(self.root)!r}: {exc}"
                ) from exc
        if not self.root.is_dir():
            raise StoreError(
                f"local store root {str(self.root)!r} is not a directory; create it first"
            )

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # --- reads --------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None
        except OSError as exc:
            raise StoreError(f"reading {key!r} from {self!r} failed: {exc}") from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if start + length > size:
                    raise StoreError(
                        f"get_range({key!r}, {start}, {length}) reads past the end of the "
                        f"{size}-byte object in {self!r}"
                    )
                f.seek(start)
                data = f.read(length)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None
        except OSError as exc:
            raise StoreError(f"reading {key!r} from {self!r} failed: {exc}") from exc
        if len(data) != length:  # the file shrank under us: only possible if someone edits it
            raise StoreError(f"short read of {key!r} in {self!r}: {len(data)} of {length} bytes")
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None
        if not path.is_file():
            raise KeyNotFoundError(f"key {key!r} not found in {self!r} (it is a directory)")
        return st.st_size

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by string prefix.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if rel == "." else rel + "/"
            for name in filenames:
                if name.startswith("."):
                    continue  # temporary files of writes in flight
                key = base + name
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys

    # --- writes -------------------------------------------------------------------------

    def put(self, key: str, data: Bytes) -> None:
        self.put_stream(key, (data,))

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        path = self._path(key)
        tmp, written = self._write_temp(key, path, chunks)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            unlink_quietly(tmp)
            raise StoreError(f"publishing {key!r} in {self!r} failed: {exc}") from exc
        self._fsync_dir(path.parent)
        return written

    def put_if_absent(self, key: str, data: Bytes) -> None:
        path = self._path(key)
        tmp, _ = self._write_temp(key, path, (data,))
        try:
            # link() never replaces an existing name, and the file it publishes is complete.
            os.link(tmp, path)
        except FileExistsError:
            raise CommitConflictError(
                f"key {key!r} already exists in {self!r}; another writer committed it first"
            ) from None
        except OSError as exc:
            raise StoreError(f"publishing {key!r} in {self!r} failed: {exc}") from exc
        finally:
            unlink_quietly(tmp)
        self._fsync_dir(path.parent)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            raise StoreError(
                f"cannot delete {key!r} in {self!r}: it is a directory, not a key"
            ) from None
        except OSError as exc:
            raise StoreError(f"deleting {key!r} in {self!r} failed: {exc}") from exc
        self._fsync_dir(path.parent)
        self._prune_empty_dirs(path.parent)

    def sweep_temp_files(self) -> int:
        """Remove temporary files left by crashed writers; returns how many were removed.

        Only call this when no writer is active: it cannot tell a crashed write from a slow one.
        """
        removed = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(".") and TMP_MARK in name:
                    unlink_quietly(Path(dirpath) / name)
                    removed += 1
        return removed

    # --- helpers ------------------------------------------------------------------------

    def _write_temp(self, key: str, path: Path, chunks: Iterable[Bytes]) -> tuple[Path, int]:
        # A concurrent delete may prune the (empty) directory between mkdir and open: retry.
        for attempt in range(3):
            self._ensure_dir(key, path.parent)
            try:
                return write_temp(path, (as_bytes(c) for c in chunks), durable=self.durable)
            except FileNotFoundError:
                if attempt == 2:
                    raise StoreError(f"directory for {key!r} in {self!r} keeps vanishing") from None
            except OSError as exc:
                raise StoreError(f"writing {key!r} to {self!r} failed: {exc}") from exc
        raise AssertionError("unreachable")

    def _ensure_dir(self, key: str, directory: Path) -> None:
        if directory.is_dir():
            return
        missing = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                if not d.is_dir():
                    raise StoreError(
                        f"cannot store {key!r} in {self!r}: {str(d)!r} exists and is a file"
                    ) from None
            # A new directory entry is durable only once its parent is fsynced.
            self._fsync_dir(d.parent)

    def _fsync_dir(self, directory: Path) -> None:
        if self.durable:
            fsync_dir(directory)

    def _prune_empty_dirs(self, directory: Path) -> None:
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (or already gone): stop climbing
            directory = directory.parent
