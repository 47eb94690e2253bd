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

This module knows files only: nothing about keys, JSON or tensors. Errors are the OS's own
``OSError``; each caller turns them into its typed error naming what it was writing.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

TMP_MARK = ".tmp-"  # every temp file's name holds this after a leading '.'

Chunks = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


def temp_path_for(path: Path) -> Path:
    """A fresh hidden temp name next to ``path``, unique across processes and threads."""
    return path.parent / f".{path.name}{TMP_MARK}{uuid.uuid4().hex}"


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
) -> int:
    """Atomically and durably replace ``path`` with ``data``.

    Args:
        path: the destination file; its directory must exist.
        data: bytes, an iterable of bytes chunks, or a callable that writes the temp file
            itself given its path (e.g. ``safetensors.torch.save_file`` or a compiler).
        durable: fsync the file and its directory (False: atomic for readers only).
        mode: the file's permissions (None: 0o644 for bytes; a callable's own choice).

    Returns:
        The number of bytes now in ``path``.
    """
    path = Path(path)
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
    if durable:
        fsync_dir(path.parent)
    return written
