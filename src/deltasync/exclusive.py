"""Holding something for one user at a time.

- :class:`FileHold`: a file held for this process (a receiver's state dir, an in-cluster
  receiver's journal). A second process that would replay the first one's journal as a
  crash's, or overwrite its records, is refused by name before it writes anything;
- :func:`one_call_at_a_time`: an object's methods that refuse a second thread's call while one
  runs (two threads posting one rank's collectives abort another process in gloo; two pulls
  replay each other's journals).

The file hold is a POSIX lock (``lockf``), owned by the process: holders of one process share
it (a restart modelled in-process, an engine's reload reopening the same directory), and it
ends with the process, however it ends, or once the last holder of the process releases it or
is collected. One descriptor per file stays open until then: closing any descriptor of the
file drops the process's lock, so the registry below is the only place that opens one.

This module knows files, processes and threads; nothing about versions or tensors.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from deltasync.errors import ConfigError, LocalStateError, full_disk_remedy

# Files this process holds: the lock file's real path -> [the pid that locked it (a forked
# child holds none of its parent's POSIX locks), its descriptor, how many holders share it].
_HELD: dict[str, list[int]] = {}
# Re-entrant: a holder collected in a reference cycle runs its finalizer (``_release``) on
# whatever thread the collection starts on, possibly inside a ``FileHold`` call of this very
# thread that holds the guard.
_HELD_GUARD = threading.RLock()


def _new_guard_after_fork() -> None:
    """A forked child starts with a free guard: the thread that held it (if one did at the
    fork) does not exist there, and none of the parent's POSIX locks is the child's."""
    global _HELD_GUARD
    _HELD_GUARD = threading.RLock()


os.register_at_fork(after_in_child=_new_guard_after_fork)


def _release(key: str, pid: int) -> None:
    """One holder of ``key`` is gone; the last one's going releases the lock."""
    if pid != os.getpid():  # a forked child's copy of its parent's holder
        return
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is None or held[0] != pid:
            return
        held[2] -= 1
        if held[2] == 0:
            del _HELD[key]
            os.close(held[1])  # the process's lock on the file goes with it


class FileHold:
    """This process's hold of the lock file ``path``, on behalf of ``owner``.

    ``what`` names the thing held in messages (``receiver state dir '/x'``), ``remedy`` says
    what a refused user should do. Raises LocalStateError naming the holder's pid when another
    process holds it, or naming ``what`` when the lock file cannot be opened or stamped;
    nothing is left open or written then.
    """

    def __init__(self, path: str | os.PathLike[str], *, what: str, owner: str, remedy: str) -> None:
        self.path = Path(path)
        self.what = what
        self.owner = owner
        self.remedy = remedy
        key = self._key()
        self._refuse_special()  # also where this process holds what a link points to
        with _HELD_GUARD:
            held = _HELD.get(key)
            if held is not None and held[0] == os.getpid():
                held[2] += 1
            else:  # the descriptor stays open: see the module docstring
                _HELD[key] = [os.getpid(), self._take(), 1]
            self._release = weakref.finalize(self, _release, key, os.getpid())

    def _key(self) -> str:
        try:
            return os.path.realpath(self.path)
        except ValueError as exc:  # a NUL byte in the path
            raise LocalStateError(f"cannot hold {self.what}: {exc}") from None

    def _refused(self, why: str) -> LocalStateError:
        return LocalStateError(
            f"cannot hold the lock of {self.what} ({str(self.path)!r}): {why}; remove it (it "
            "is recreated). Nothing was written"
        )

    def _refuse_special(self) -> None:
        """A lock file is a regular file or nothing yet: never a link (the pid stamp would
        truncate what it names) nor a special file (a FIFO would block the open)."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._unopenable(exc) from exc
        if stat.S_ISLNK(mode):
            raise self._refused("it is a symbolic link (a lock file is never followed)")
        if not stat.S_ISREG(mode):
            raise self._refused("it is not a regular file")

    def _unopenable(self, exc: OSError) -> LocalStateError:
        return LocalStateError(
            f"cannot open the lock {str(self.path)!r} of {self.what}: {exc.strerror or exc}. "
            "Free space or inodes on its volume, or make its directory exist and writable; "
            "nothing was written"
        )

    def _take(self) -> int:
        """Open, lock and stamp (our pid) the lock file: its descriptor."""
        # Never through a link, never a special file, also if one is put there after the
        # check above (the open itself refuses a link; the descriptor is checked).
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refused(
                    "it is a symbolic link (a lock file is never followed)"
                ) from None
            raise self._unopenable(exc) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._refused("it is not a regular file")
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise LocalStateError(
                f"{self.what} is in use by another process (pid {holder[:16] or 'unknown'}); "
                f"{self.owner} cannot share it. {self.remedy}. Nothing was written"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk: the pid is only for the message of a refusal
            os.close(fd)
            remedy = full_disk_remedy(exc, self.path.parent)
            raise LocalStateError(
                f"cannot write the lock of {self.what}: {exc.strerror or exc}{remedy}"
            ) from exc
        return fd

    @property
    def held(self) -> bool:
        """Whether this holder still holds the file (not released nor collected)."""
        return self._release.alive

    def release(self) -> None:
        """This holder's share ends now (as when it is collected); idempotent."""
        self._release()

    def retake(self) -> None:
        """Lock the file again where it is now, after something removed it (and the
        directory it was in) behind this process: the lock held went with the old file.
        LocalStateError if another process took the new one meanwhile."""
        key = self._key()
        with _HELD_GUARD:
            held = _HELD.get(key)
            if not self._release.alive or held is None or held[0] != os.getpid():
                return
            if _still(self.path, held[1]):  # not replaced after all (another holder retook
                return  # it first): opening and closing it again would drop the lock
            fd = self._take()
            os.close(held[1])  # the old file's: its lock means nothing now
            held[1] = fd


def _still(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    was = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)


F = TypeVar("F", bound=Callable[..., Any])


def one_call_at_a_time(
    kind: str, calls: str, untouched: str = "Nothing was written"
) -> Callable[[F], F]:
    """Make a method refuse to run beside another thread's call of any method so marked on
    the same object: ConfigError before anything is read, sent or written. Same-thread
    nesting is fine. The object has ``_busy`` (a ``threading.RLock``), ``_who`` (its name in
    messages) and ``_closed`` (set by its ``close``: every marked method but ``close`` is then
    refused too, since what it would write is no longer held); ``kind`` names what it is (``a
    receiver``), ``calls`` the marked methods, ``untouched`` what the refusal left alone.
    """

    def mark(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._busy.acquire(blocking=False):
                raise ConfigError(
                    f"{self._who}: {method.__name__}() was called while another thread's "
                    f"{calls} runs on it. {kind[0].upper()}{kind[1:]} takes one call at a "
                    f"time: serialize them. {untouched}"
                )
            try:
                if self._closed and method.__name__ != "close":
                    raise ConfigError(
                        f"{self._who}: {method.__name__}() after close(): what it holds was "
                        f"let go (another process may have it now). Build a new one. {untouched}"
                    )
                return method(self, *args, **kwargs)
            finally:
                self._busy.release()

        return guarded  # type: ignore[return-value]

    return mark
