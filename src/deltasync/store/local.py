"""LocalStore: the embedded default, one file per key under a root directory.

The root is a boundary: a store directory may be shared with other users, so nothing below the
root is trusted to be what its name says. Every operation walks the key's directories one
component at a time from a descriptor of the root (``openat`` with ``O_NOFOLLOW``), so:

- a symbolic link anywhere below the root is never followed (reading, writing, listing or
  deleting through ``acks/v00000000 -> $HOME`` is refused with a StoreError naming the key);
- only regular files are keys: a FIFO, socket, device or link where a key should be is
  refused when read (opened non-blocking, so a FIFO cannot hang the reader) and is invisible
  to ``list`` and ``exists``;
- ``get(key, max_bytes=n)`` checks the file's size before reading a byte, so a blob replaced
  by an 8 GiB sparse file costs nothing; every ``OSError`` becomes a StoreError naming the key.

Every write goes to a temporary file in the key's own directory (created ``O_EXCL`` and
``O_NOFOLLOW`` with ``file_mode``), is fsynced, and is then published with one atomic
directory operation, followed by an fsync of the directory:

- ``put``: rename over the key (readers see the old or the new file, never a prefix);
- ``put_if_absent``: ``link`` to the key, which fails with EEXIST if the key exists, so
  exactly one of several racing writers (threads or processes, on one host or over a POSIX
  filesystem with atomic link) wins, and the winner's file is complete the moment it appears.

Temporary files start with '.', a prefix :func:`check_key` forbids, so no key can name one and
``list`` never returns one. A crash can leave temporary files behind; they are invisible and
``sweep_temp_files`` removes them; ``delete`` of a directory's last key also removes those
nothing has written for :data:`DEAD_TEMP_S` with the directory (gc of a version a killed
trainer was uploading to leaves nothing behind). The root itself is the caller's choice and
may be reached through links; only what lies below it is held to these rules.

This module knows nothing about what the bytes mean.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from deltasync.atomic import TMP_MARK
from deltasync.errors import (
    FULL_ERRNOS,
    CommitConflictError,
    KeyNotFoundError,
    OutcomeUnknownError,
    StoreError,
)
from deltasync.store.base import (
    MAX_KEY_LENGTH,
    Bytes,
    as_bytes,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)
from deltasync.validate import check_int

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Non-blocking: opening a FIFO for reading would otherwise wait for a writer forever.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_PREAD = 0x7FFFF000  # the most one read(2) returns on Linux
# A temp file nothing has written for this long is a killed writer's: deleting a directory's
# last key removes such files with the directory (far beyond any write's pause, and beyond the
# orphan grace after which gc deletes an attempt that never committed).
DEAD_TEMP_S = 3600.0


class _Missing(Exception):
    pass


class _DirGone(Exception):
    """A directory a write had opened was removed before the write created its file or
    subdirectory in it (a delete of that directory's last key pruned it meanwhile): the write
    starts over."""


class _LinkRefused(StoreError):
    """A path through a link or a special file (FIFO, socket, device): never a key of this
    store; ``exists`` and ``list`` do not see it, reads and writes name it."""


class LocalStore:
    """Files under ``root``; ``durable=False`` skips fsyncs (benchmarks on scratch disks).

    ``file_mode`` / ``dir_mode`` are the exact permissions of the files and directories this
    store creates (default: owner read-write, group read, nothing for others; use 0o600 /
    0o700 when trainer and receivers run as one user on a machine shared with others)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = True,
        durable: bool = True,
        file_mode: int = 0o640,
        dir_mode: int = 0o750,
    ):
        self.root = Path(root).absolute()
        self.durable = durable
        self.file_mode = check_int("LocalStore", "file_mode", file_mode, lo=0, hi=0o777)
        self.dir_mode = check_int("LocalStore", "dir_mode", dir_mode, lo=0, hi=0o777)
        try:
            if create and not self.root.is_dir():
                self._make_root()
            is_dir = self.root.is_dir()
        except (OSError, ValueError) as exc:  # a name too long, a NUL byte
            raise StoreError(
                f"local store root {str(self.root)!r} cannot be used: {type(exc).__name__}: {exc}"
            ) from None
        if not is_dir:
            raise StoreError(
                f"local store root {str(self.root)!r} is not a directory; create it first"
            )

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # --- walking below the root ---------------------------------------------------------

    def _fail(self, what: str, key: str, exc: BaseException) -> StoreError:
        remedy = ""
        if getattr(exc, "errno", None) in FULL_ERRNOS:  # nothing is stored under the key
            remedy = (
                f". The store's filesystem is full: free space under {str(self.root)!r} "
                "(`deltasync gc` deletes the versions no receiver needs), then write again"
            )
        return StoreError(f"{what} {key!r} in {self!r} failed: {type(exc).__name__}: {exc}{remedy}")

    def _refuse_link(self, key: str, dfd: int, name: str) -> None:
        """Raise StoreError if ``name`` in ``dfd`` is a link or other non-directory entry
        (ENOTDIR/ELOOP from an O_NOFOLLOW open); a regular file means the key is absent."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise _Missing from None
        if stat.S_ISLNK(st.st_mode):
            raise _LinkRefused(
                f"{key!r} in {self!r} passes through the symbolic link {name!r}; LocalStore "
                "never follows links below its root (someone else wrote into this store)"
            )
        if stat.S_ISREG(st.st_mode):
            raise _Missing
        raise _LinkRefused(
            f"{key!r} in {self!r} passes through {name!r}, which is neither a directory nor a "
            "file (someone else wrote into this store)"
        )

    @contextmanager
    def _dirs(self, key: str, parts: list[str], *, create: bool) -> Iterator[list[int]]:
        """Descriptors of the root and of each directory in ``parts`` (``create``: making the
        missing ones with ``dir_mode``). Raises _Missing when one is absent and not created."""
        fds: list[int] = []
        try:
            try:
                fds.append(os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            except OSError as exc:
                raise self._fail("opening the root for", key, exc) from exc
            for part in parts:
                fds.append(self._open_dir(key, fds[-1], part, create=create))
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def _open_dir(self, key: str, dfd: int, name: str, *, create: bool) -> int:
        for _ in range(3):  # a concurrent delete may prune what we just made: retry
            try:
                return os.open(name, _DIR, dir_fd=dfd)
            except FileNotFoundError:
                if not create:
                    raise _Missing from None
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise self._fail("opening a directory of", key, exc) from exc
                try:
                    self._refuse_link(key, dfd, name)
                except _Missing:
                    if create:
                        raise StoreError(
                            f"cannot store {key!r} in {self!r}: {name!r} exists and is a file"
                        ) from None
                    raise
                raise AssertionError("unreachable: _refuse_link always raises") from exc
            try:
                os.mkdir(name, self.dir_mode, dir_fd=dfd)
            except FileExistsError:
                continue  # a racing writer made it; open it on the next round
            except FileNotFoundError:
                # the directory it goes in was pruned after its open (a concurrent delete of
                # its last key): a write starts over from the root
                raise _DirGone from None
            except OSError as exc:
                raise self._fail("creating a directory of", key, exc) from exc
            self._chmod_dir(key, dfd, name)
            try:
                self._fsync(dfd)  # a new directory entry is durable only once its parent is
            except OSError as exc:
                raise self._fail("creating a directory of", key, exc) from exc
        raise StoreError(f"directory {name!r} of {key!r} in {self!r} keeps vanishing")

    def _make_root(self) -> None:
        """Create the root and its missing parents with ``dir_mode`` exactly (mkdir's mode is
        filtered by the umask: 0o700 under 077, world-writable under 000). A directory another
        process made meanwhile is theirs: its mode is left alone."""
        missing, path = [], self.root
        while not path.is_dir() and path.parent != path:
            missing.append(path)
            path = path.parent
        try:
            for path in reversed(missing):
                try:
                    path.mkdir(mode=self.dir_mode)
                except FileExistsError:
                    continue
                os.chmod(path, self.dir_mode)
        except OSError as exc:
            raise StoreError(f"cannot create local store root {str(self.root)!r}: {exc}") from exc

    def _chmod_dir(self, key: str, dfd: int, name: str) -> None:
        # mkdir's mode is filtered by the umask; set it exactly (through a descriptor, so a
        # link swapped in meanwhile is refused rather than followed).
        try:
            fd = os.open(name, _DIR, dir_fd=dfd)
        except OSError:
            return  # replaced or removed meanwhile: the next open decides
        try:
            os.fchmod(fd, self.dir_mode)
        except OSError as exc:
            raise self._fail("setting the mode of a directory of", key, exc) from exc
        finally:
            os.close(fd)

    def _fsync(self, dfd: int) -> None:
        if self.durable:
            os.fsync(dfd)

    @staticmethod
    def _split(key: str) -> list[str]:
        return check_key(key).split("/")

    # --- reads --------------------------------------------------------------------------

    @contextmanager
    def _open_file(self, key: str) -> Iterator[tuple[int, int]]:
        """``(fd, size)`` of the regular file of ``key``; KeyNotFoundError if absent, StoreError
        if a link or a non-regular file stands in its place."""
        parts = self._split(key)
        try:
            with self._dirs(key, parts[:-1], create=False) as fds:
                try:
                    fd = os.open(parts[-1], _READ, dir_fd=fds[-1])
                except FileNotFoundError:
                    raise _Missing from None
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise StoreError(
                            f"{key!r} in {self!r} is a symbolic link; LocalStore never follows "
                            "links below its root (someone else wrote into this store)"
                        ) from None
                    raise self._fail("opening", key, exc) from exc
        except _Missing:
            raise KeyNotFoundError(f"key {key!r} not found in {self!r}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise KeyNotFoundError(f"key {key!r} not found in {self!r} (it is a directory)")
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(
                    f"{key!r} in {self!r} is not a regular file (a FIFO, socket or device); "
                    "refusing to read it (someone else wrote into this store)"
                )
            yield fd, st.st_size
        finally:
            os.close(fd)

    def _read(self, key: str, fd: int, start: int, length: int) -> bytes:
        # One allocation: ``os.pread`` returns the bytes object it read into (a bytearray filled
        # and then copied to ``bytes`` would hold the object twice at the peak). Linux reads a
        # regular file whole in one call up to ~2 GiB; a larger object (an anchor of a large
        # shard) is read into one bytearray in parts, and returned as that bytearray: joining
        # the parts into ``bytes`` would hold it twice.
        try:
            if length <= _MAX_PREAD:
                data = os.pread(fd, length, start)
                if len(data) == length:
                    return data
                buf, done = bytearray(length), len(data)  # a short read: go on in place
                buf[:done] = data
                del data
            else:
                buf, done = bytearray(length), 0
            view = memoryview(buf)
            while done < length:
                n = os.preadv(fd, [view[done : done + _MAX_PREAD]], start + done)
                if not n:
                    break
                done += n
            view.release()
        except OSError as exc:
            raise self._fail("reading", key, exc) from exc
        if done != length:  # the file shrank under us: only possible if someone edits it
            raise StoreError(f"short read of {key!r} in {self!r}: {done} of {length} bytes")
        return buf

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_max_bytes(key, max_bytes)
        with self._open_file(key) as (fd, size):
            if max_bytes is not None and size > max_bytes:
                raise too_large(key, self, size, max_bytes)
            return self._read(key, fd, 0, size)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        with self._open_file(key) as (fd, size):
            if start + length > size:
                raise StoreError(
                    f"get_range({key!r}, {start}, {length}) reads past the end of the "
                    f"{size}-byte object in {self!r}"
                )
            return self._read(key, fd, start, length)

    def _lstat(self, key: str) -> os.stat_result | None:
        """The entry of ``key`` itself (not followed), or None when it is absent."""
        parts = self._split(key)
        try:
            with self._dirs(key, parts[:-1], create=False) as fds:
                return os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
        except (_Missing, FileNotFoundError):
            return None
        except OSError as exc:
            raise self._fail("looking up", key, exc) from exc

    def exists(self, key: str) -> bool:
        try:
            st = self._lstat(key)
        except _LinkRefused:
            return False  # a path through a link is not a key (and list never shows it)
        return st is not None and stat.S_ISREG(st.st_mode)

    def size(self, key: str) -> int:
        return self._key_stat(key).st_size

    def modified(self, key: str) -> float:
        """When the object was last written (POSIX seconds: the file's mtime, kept by the
        rename that published it). Raises KeyNotFoundError if absent."""
        return self._key_stat(key).st_mtime

    def _key_stat(self, key: str) -> os.stat_result:
        st = self._lstat(key)
        if st is None or stat.S_ISDIR(st.st_mode):
            raise KeyNotFoundError(f"key {key!r} not found in {self!r}")
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(
                f"{key!r} in {self!r} is a link or not a regular file; it is not a key "
                "(someone else wrote into this store)"
            )
        return st

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by string prefix.
        head, _, _ = prefix.rpartition("/")
        parts = head.split("/") if head else []
        keys: list[str] = []
        try:
            with self._dirs(prefix, parts, create=False) as fds:
                self._walk(fds[-1], head + "/" if head else "", prefix, keys)
        except _Missing:
            return []
        except _LinkRefused:
            return []  # the prefix's directory is a link: nothing of ours lies below it
        except OSError as exc:
            raise self._fail("listing", prefix, exc) from exc
        keys.sort()
        return keys

    def _walk(self, dfd: int, base: str, prefix: str, out: list[str]) -> None:
        with os.scandir(dfd) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue  # temporary files of writes in flight, and reserved names
            key = base + name
            if len(key) > MAX_KEY_LENGTH:
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                is_file = entry.is_file(follow_symlinks=False)
            except OSError:
                continue  # vanished meanwhile
            if is_dir:
                sub = key + "/"
                if not (sub.startswith(prefix) or prefix.startswith(sub)):
                    continue
                try:
                    fd = os.open(name, _DIR, dir_fd=dfd)
                except OSError:
                    continue  # removed, or swapped for a link since scandir: not ours
                try:
                    self._walk(fd, sub, prefix, out)
                finally:
                    os.close(fd)
            elif is_file and key.startswith(prefix):
                try:
                    out.append(check_key(key))
                except StoreError:
                    continue  # a name this API could never address (written by someone else)

    # --- writes -------------------------------------------------------------------------

    def put(self, key: str, data: Bytes) -> None:
        self.put_stream(key, (data,))

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        return self._publish(key, chunks, exclusive=False)

    def put_if_absent(self, key: str, data: Bytes) -> None:
        self._publish(key, (data,), exclusive=True)

    def _publish(self, key: str, chunks: Iterable[Bytes], *, exclusive: bool) -> int:
        parts = self._split(key)
        name = parts[-1]
        # The temp name must fit NAME_MAX too: keep at most 100 bytes of the key's name.
        stem = name.encode("utf-8")[:100].decode("utf-8", "ignore")
        tmp = f".{stem}{TMP_MARK}{uuid.uuid4().hex}"
        # A directory pruned between its open and the create starts the write over (no chunk
        # has been read by then).
        for _ in range(3):
            try:
                return self._publish_in(key, parts, tmp, chunks, exclusive=exclusive)
            except _DirGone:
                continue
        raise StoreError(
            f"cannot store {key!r} in {self!r}: its directory keeps being removed (a concurrent "
            "delete of that directory's last key); write it again"
        )

    def _publish_in(
        self, key: str, parts: list[str], tmp: str, chunks: Iterable[Bytes], *, exclusive: bool
    ) -> int:
        name = parts[-1]
        with self._dirs(key, parts[:-1], create=True) as fds:
            dfd = fds[-1]
            written = self._write_temp(key, dfd, tmp, chunks)
            renamed = False  # the temp name is removed unless a rename moved it
            try:
                if exclusive:
                    # link() never replaces an existing name (not even a link), and the file
                    # it publishes is complete.
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                else:
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    renamed = True
            except FileExistsError:
                raise CommitConflictError(
                    f"key {key!r} already exists in {self!r}; another writer committed it first"
                ) from None
            except OSError as exc:
                raise self._fail("publishing", key, exc) from exc
            finally:
                if not renamed:  # linked, or failed (a directory planted at the key)
                    self._unlink_quietly(dfd, tmp)
            try:
                self._fsync(dfd)
            except OSError as exc:
                # The key is in place, and readers may see it already; a crash may still lose it.
                raise OutcomeUnknownError(
                    f"publishing {key!r} in {self!r}: the key is in place but the fsync of its "
                    f"directory failed ({type(exc).__name__}: {exc}), so a crash may still "
                    "lose it: treat it as possibly written"
                ) from exc
        return written

    def _write_temp(self, key: str, dfd: int, tmp: str, chunks: Iterable[Bytes]) -> int:
        try:
            fd = os.open(tmp, _CREATE, self.file_mode, dir_fd=dfd)
        except FileNotFoundError:
            raise _DirGone from None  # the opened directory was removed (nothing written)
        except OSError as exc:
            raise self._fail("writing", key, exc) from exc
        written = 0
        try:
            os.fchmod(fd, self.file_mode)  # exactly, whatever the umask
            for chunk in chunks:
                view = memoryview(as_bytes(chunk)).cast("B")
                while view:
                    n = os.write(fd, view)
                    written += n
                    view = view[n:]
            if self.durable:
                os.fsync(fd)
        except BaseException as exc:
            os.close(fd)
            self._unlink_quietly(dfd, tmp)
            if isinstance(exc, OSError):
                raise self._fail("writing", key, exc) from exc
            raise
        os.close(fd)
        return written

    @staticmethod
    def _unlink_quietly(dfd: int, name: str) -> None:
        with suppress(OSError):
            os.unlink(name, dir_fd=dfd)

    def delete(self, key: str) -> None:
        parts = self._split(key)
        try:
            with self._dirs(key, parts[:-1], create=False) as fds:
                try:
                    st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
                except FileNotFoundError:
                    return
                if stat.S_ISDIR(st.st_mode):
                    raise StoreError(
                        f"cannot delete {key!r} in {self!r}: it is a directory, not a key"
                    )
                try:
                    # Removes the entry itself: a link is unlinked, never what it points to.
                    os.unlink(parts[-1], dir_fd=fds[-1])
                except FileNotFoundError:
                    return
                self._fsync(fds[-1])
                self._prune_empty_dirs(fds, parts)
        except _Missing:
            return
        except OSError as exc:
            raise self._fail("deleting", key, exc) from exc

    def _prune_empty_dirs(self, fds: list[int], parts: list[str]) -> None:
        # fds[i] is the directory holding parts[i]; never remove the root (fds[0] itself).
        for i in range(len(parts) - 2, -1, -1):
            try:
                os.rmdir(parts[i], dir_fd=fds[i])
            except OSError as exc:
                # Not empty: a key is left (stop climbing), or only what writers killed
                # mid-write left there (their temp files: keys deleted, e.g. by gc, would
                # otherwise leave the directory and a blob's worth of temp file forever).
                if exc.errno != errno.ENOTEMPTY or not self._drop_dead_temps(fds[i + 1]):
                    return
                try:
                    os.rmdir(parts[i], dir_fd=fds[i])
                except OSError:
                    return
            self._fsync(fds[i])

    def _drop_dead_temps(self, dfd: int, depth: int = 2) -> bool:
        """Empty the directory ``dfd`` of dead writes' temp files: True when it is empty now.
        Subdirectories (``depth`` levels) holding nothing else are removed as the scan meets
        them; the temp files at this level go only when nothing else is here. A temp file is
        a dead write's once nothing has written it for :data:`DEAD_TEMP_S` (a write in
        progress keeps its mtime fresh); a key, link, younger temp file or other entry keeps
        its own directory and the directories above it."""
        now = time.time()
        dead: list[str] = []
        try:
            with os.scandir(dfd) as it:
                entries = list(it)
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and depth > 0:
                    sub = os.open(entry.name, _DIR, dir_fd=dfd)
                    try:
                        emptied = self._drop_dead_temps(sub, depth - 1)
                    finally:
                        os.close(sub)
                    if not emptied:
                        return False
                    os.rmdir(entry.name, dir_fd=dfd)
                elif (
                    stat.S_ISREG(st.st_mode)
                    and entry.name.startswith(".")
                    and TMP_MARK in entry.name
                    and now - st.st_mtime > DEAD_TEMP_S
                ):
                    dead.append(entry.name)
                else:
                    return False
            for name in dead:
                os.unlink(name, dir_fd=dfd)
        except OSError:
            return False  # raced with a writer or a delete: leave it for the next pass
        self._fsync(dfd)
        return True

    def sweep_temp_files(self) -> int:
        """Remove temporary files left by crashed writers; returns how many were removed.

        Only call this when no writer is active: it cannot tell a crashed write from a slow one.
        """
        removed = 0
        # From a descriptor of the root (which may be reached through links, as every other
        # operation reaches it), never following a link below it.
        with self._dirs("", [], create=False) as fds:
            for _, _, filenames, dfd in os.fwalk(".", follow_symlinks=False, dir_fd=fds[0]):
                for name in filenames:
                    if name.startswith(".") and TMP_MARK in name:
                        self._unlink_quietly(dfd, name)
                        removed += 1
        return removed
