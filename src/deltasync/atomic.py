"""The one atomic, durable file write: temp file in the same directory, fsync, rename, fsync dir.

A reader of ``path`` sees the old file or the new one, never a prefix, and after a power loss
the new file is either fully there or not there at all:

1. the bytes go to a hidden temp file next to ``path`` (``.{name}.tmp-{uuid}``; the same
   directory, so the rename below never crosses a filesystem), created ``O_EXCL |
   O_NOFOLLOW`` (a link planted under that name is never followed) with ``mode``;
2. the temp file is fsynced (its contents are on disk before its name is);
3. ``os.replace`` publishes it under ``path`` in one directory operation;
4. the directory is fsynced (the new name itself is on disk).

``durable=False`` skips both fsyncs (scratch directories in tests and benchmarks only: the
write is still atomic for readers, just not crash-durable). The local store, both receiver
journals, the pulled safetensors file, layout files and the native kernel cache all write
through here.

Errors of the write are the OS's own ``OSError``; each caller turns them into its typed error
naming what it was writing.

The same module holds the one file format of a receiver's local records (journals and state
files): the store path's receiver (``receiver/journal.py``: ``state.json``, ``journal.json``) and
the in-cluster one (``cluster/cluster_journal.py``) keep what their live tensors hold in small
JSON files. Their state machines differ; the file is the same: one canonical JSON object
(sorted keys, no whitespace, ASCII, no NaN), written atomically and durably as above, readable
by its owner only (``RECORD_MODE``), and read back strictly: a missing file is ``None``
(nothing recorded), an unreadable or non-JSON file is a
:class:`~deltasync.errors.LocalStateError` naming the file and the remedy (restore the receiver
from an anchor); checking the fields is the caller's.

And the one bounded read of a small file a user names (a key file, a model config, a layout
listing): :func:`read_regular`, and :func:`read_json` for the JSON ones.

This module knows files and JSON: nothing about keys, versions, stores or tensors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from deltasync.errors import LocalStateError, full_disk_remedy

TMP_MARK = ".tmp-"  # every temp file's name holds this after a leading '.'

Chunks = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


def read_regular(
    path: str | os.PathLike[str],
    *,
    limit: int,
    what: str,
    error: type[Exception],
) -> tuple[bytes, os.stat_result]:
    """The bytes (at most ``limit``) and status of the regular file ``path``, else ``error``
    naming it.

    A path a user passes may name anything: a FIFO (a plain ``open`` blocks until a writer
    comes, forever), a device (``/dev/zero`` reads without end until memory runs out), a
    directory. So the file is opened ``O_NONBLOCK`` (a FIFO without a writer opens at once),
    checked with ``fstat`` on that descriptor (no window for a swap between check and read),
    and read to at most ``limit + 1`` bytes, so a file that grew after the ``fstat`` is refused
    too.

    Args:
        path: the file.
        limit: the most bytes accepted.
        what: what the file is, for the message (``"key file"``, ``"model config"``).
        error: the typed error to raise.
    """
    p = str(Path(path))
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"cannot read {what} {p!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory, " if stat.S_ISDIR(st.st_mode) else ""
            raise error(f"{what} {p!r} is {kind}not a regular file: pass the file itself")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)  # a file that grows after the fstat is caught here too
    except OSError as exc:
        raise error(f"cannot read {what} {p!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        size = (
            f"{limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"{limit} bytes"
        )
        raise error(f"{what} {p!r} is larger than {size}: not a {what} (check the path)")
    return data, st


def read_json(
    path: str | os.PathLike[str],
    *,
    limit: int,
    what: str,
    error: type[Exception],
    remedy: str | None = None,
) -> Any:
    """The JSON value in the regular file ``path`` (read as :func:`read_regular` reads it).

    Strict UTF-8: a binary file is ``error`` naming it, not a UnicodeDecodeError; so is JSON
    nested too deeply for the parser (RecursionError). Every such error ends with ``remedy``
    when one is given (what the caller's user can do)."""
    tail = f"; {remedy}" if remedy else ""
    try:
        data, _ = read_regular(path, limit=limit, what=what, error=error)
    except error as exc:
        if not tail:
            raise
        raise error(f"{exc}{tail}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        reason = "not UTF-8 text (a binary file?)"
    except RecursionError:
        reason = "JSON nested too deeply"
    except ValueError as exc:  # json.JSONDecodeError
        reason = f"not valid JSON ({exc})"
    raise error(f"cannot read {what} {str(path)!r}: {reason}{tail}")


def temp_path_for(path: Path) -> Path:
    """A fresh hidden temp name next to ``path``, unique across processes and threads."""
    return path.parent / f".{path.name}{TMP_MARK}{uuid.uuid4().hex}"


STALE_TEMP_S = 300.0  # a temp file untouched this long is a killed write's, not a slow one's


def sweep_stale_temps(
    paths: Iterable[Path], *, older_than_s: float = STALE_TEMP_S, now: float | None = None
) -> int:
    """Remove the temp files :func:`write_atomic` left next to ``paths`` (a process killed
    mid-write leaves one each time, a whole shard file's for the pull sidecar) that nothing
    has written for ``older_than_s``: a write in progress keeps its file's mtime fresh, so a
    second process writing there (a misconfiguration, not a crash) keeps its own. Returns how
    many were removed; what cannot be listed or removed is left as it is."""
    now = time.time() if now is None else now
    removed = 0
    by_dir: dict[Path, list[str]] = {}
    for path in paths:
        by_dir.setdefault(path.parent, []).append(f".{path.name}{TMP_MARK}")
    for directory, prefixes in by_dir.items():
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if not entry.name.startswith(tuple(prefixes)):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue
    return removed


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` durable; a directory that is already gone is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` if it exists; used to clean up temp files on every failure path."""
    with contextlib.suppress(OSError):
        path.unlink()


def process_umask() -> int:
    """This process's umask, for a file meant to get the mode a plain ``open`` would give
    it. Read from ``/proc/self/status`` (Linux) without changing it: setting and restoring
    it, the only portable way, widens for that instant every file another thread creates."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o077)  # (the narrow mask meanwhile: a race makes a file too private)
    os.umask(umask)
    return umask


def write_temp(
    path: Path, chunks: Chunks, *, durable: bool = True, mode: int = 0o644
) -> tuple[Path, int]:
    """Write ``chunks`` to a new temp file next to ``path``; fsync it when ``durable``.

    Args:
        path: the file the temp file will later be published as (its directory must exist).
        chunks: bytes, or an iterable of bytes-like chunks (a stream is written as it comes).
        durable: fsync the temp file.
        mode: the file's permissions, exactly (the umask does not widen or narrow them).

    Returns:
        ``(temp_path, bytes_written)``. The caller publishes it (``os.replace`` or
        ``os.link``) and then calls :func:`fsync_dir`. On any failure the temp file is removed
        and the error re-raised.
    """
    tmp = temp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    written = 0
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb", buffering=0) as f:
            for chunk in (
                (chunks,) if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks
            ):
                view = memoryview(chunk).cast("B")
                while view:
                    n = f.write(view)
                    written += n
                    view = view[n:]
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        unlink_quietly(tmp)
        raise
    return tmp, written


def write_atomic(
    path: str | os.PathLike[str],
    data: Chunks | Callable[[Path], None],
    *,
    durable: bool = True,
    mode: int | None = None,
    sync_dir: bool = True,
    over_files_only: bool = False,
) -> int:
    """Atomically and durably replace ``path`` with ``data``.

    Args:
        path: the destination file; its directory must exist.
        data: bytes, an iterable of bytes chunks, or a callable that writes the temp file
            itself given its path (e.g. ``safetensors.torch.save_file`` or a compiler).
        durable: fsync the file and its directory (False: atomic for readers only).
        mode: the file's permissions (None: 0o644 for bytes; a callable's own choice).
        sync_dir: with ``durable``, also fsync the directory. False: after a power loss
            ``path`` holds the new bytes or the old ones, whole either way (for a record
            whose loss only costs a repair; the next durable write there syncs it too).
        over_files_only: refuse (OSError EEXIST, before anything is written) a ``path`` that
            exists and is neither a regular file nor a symlink: a user's ``--out /dev/null``
            must not replace the device (as root it would, for every process of the machine),
            nor a FIFO or a directory. A symlink is replaced by the file, its target untouched.

    Returns:
        The number of bytes now in ``path``.
    """
    path = Path(path)
    if over_files_only:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
                raise FileExistsError(
                    errno.EEXIST, f"{kind} is there, not a file to replace", str(path)
                )
    if callable(data):
        tmp = temp_path_for(path)
        try:
            data(tmp)
            if mode is not None:
                os.chmod(tmp, mode, follow_symlinks=False)
            if durable:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            written = tmp.stat().st_size
        except BaseException:
            unlink_quietly(tmp)
            raise
    else:
        tmp, written = write_temp(path, data, durable=durable, mode=0o644 if mode is None else mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if durable and sync_dir:
        fsync_dir(path.parent)
    return written


REMEDY = "remove it and restore this receiver from an anchor"
RECORD_MODE = 0o600  # a receiver's local records are its own business
STATE_DIR_MODE = 0o700


def encode_record(obj: dict[str, Any]) -> bytes:
    """The canonical bytes of a record."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def read_record(path: Path, *, follow_links: bool = True) -> Any:
    """The JSON value stored at ``path``, or None when there is no file.

    Args:
        path: the record file.
        follow_links: False refuses a link at ``path`` (LocalStateError): a record in a
            directory of deltasync's own, where only someone else could have put one.

    Returns:
        The decoded JSON value (the caller checks its fields), or None.
    """
    try:  # O_NONBLOCK: a FIFO put there opens at once and is refused below, not waited on
        nofollow = 0 if follow_links else os.O_NOFOLLOW
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | nofollow)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        if getattr(exc, "errno", None) == errno.ELOOP:  # a link where a record goes
            raise LocalStateError(
                f"{str(path)!r} is a symbolic link, so not a deltasync record: {REMEDY}"
            ) from None
        raise LocalStateError(f"cannot read {str(path)!r}: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LocalStateError(
                f"{str(path)!r} is not a regular file, so not a deltasync record: {REMEDY}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as exc:
        raise LocalStateError(f"cannot read {str(path)!r}: {exc}") from exc
    finally:
        os.close(fd)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LocalStateError(
            f"{str(path)!r} is not valid JSON ({exc}); it was not written by deltasync or was "
            f"damaged: {REMEDY}"
        ) from exc


def write_record(
    path: Path, obj: dict[str, Any], *, durable: bool = True, sync_dir: bool = True
) -> None:
    """Atomically (and, when ``durable``, durably) replace the record at ``path``.

    Args:
        path: the record file; its directory must exist.
        obj: the record, a JSON object.
        durable: fsync file and directory (False only on scratch disks in tests).
        sync_dir: see :func:`write_atomic`.
    """
    try:
        write_atomic(path, encode_record(obj), durable=durable, mode=RECORD_MODE, sync_dir=sync_dir)
    except OSError as exc:  # strerror: the temp file's random name would make each message new
        raise LocalStateError(
            f"cannot write {str(path)!r}: {exc.strerror or exc}{full_disk_remedy(exc, path.parent)}"
        ) from exc


class InBackground:
    """``fn(*args)`` on a thread of its own (a record write whose fsyncs overlap the caller's
    work: they release the GIL); :meth:`wait` waits for it and returns what it raised.

    The thread is a parked worker when one is idle (started for an earlier job and waiting
    for the next), else a new one: a receiver's pull hands out three such writes, and
    starting a thread for each cost ~0.3 ms of CPU apiece in a process holding torch (a
    small model's pull: ~1 ms of its 8-9). At most ``MAX_PARKED`` idle workers are kept; a
    forked child starts with none (its parent's workers do not exist there). While a job
    runs, its worker carries the job's ``name``."""

    def __init__(self, fn: Callable[..., object], *args: object, name: str) -> None:
        self._fn, self._args, self.name = fn, args, name
        self._error: BaseException | None = None
        self._done = threading.Event()
        _Worker.take().give(self)

    def _run(self) -> None:
        try:
            self._fn(*self._args)
        except BaseException as exc:  # handed to whoever waits
            self._error = exc
        self._fn = self._args = None

    def wait(self, timeout_s: float | None = None) -> BaseException | None:
        """What the job raised (None: nothing), once it ends; with ``timeout_s``, at most that
        long (:attr:`finished` then says whether it did)."""
        self._done.wait(timeout_s)
        return self._error

    @property
    def finished(self) -> bool:
        return self._done.is_set()


MAX_PARKED = 4  # idle InBackground workers kept for the next jobs
_PARKED_NAME = "deltasync-parked"
_parked: list[_Worker] = []
_parked_lock = threading.Lock()


class _Worker:
    """One daemon thread running InBackground jobs one at a time, parked between them."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[InBackground] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=_PARKED_NAME, daemon=True).start()

    @staticmethod
    def take() -> _Worker:
        with _parked_lock:
            if _parked:
                return _parked.pop()
        return _Worker()

    def give(self, job: InBackground) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            me.name = job.name
            job._run()
            me.name = _PARKED_NAME
            with _parked_lock:  # parked before the waiter wakes: its next job finds it
                parked = len(_parked) < MAX_PARKED
                if parked:
                    _parked.append(self)
            job._done.set()
            if not parked:
                return


def _forget_workers() -> None:
    """In a forked child: the parent's parked workers are not threads of this process."""
    global _parked, _parked_lock
    _parked, _parked_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


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
