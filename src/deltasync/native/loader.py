"""Builds and loads the small C kernels in ``kernels/detect.c`` (detection, BF16 gather,
order check) with ctypes.

The library is compiled on first use with the system C compiler into a private per-user cache
directory (``$XDG_CACHE_HOME/deltasync`` or ``~/.cache/deltasync``; mode 0700, owned by the
user, checked with ``lstat`` so a symlink or someone else's directory is never used), keyed by
the source hash, the flags and the machine, and written through the atomic write helper so
concurrent processes never load a half-written file. The SHA-256 of the built library is
recorded next to it and checked before every load; a mismatch rebuilds it. If no directory
passes the checks, the library is built into a fresh ``mkdtemp`` directory for this process.

If no compiler is available, :func:`load` returns ``None``, logs the reason and the remedy
once, and callers use the bit-identical torch implementation (~20x slower detection). A user
who wants the torch path anyway (to compare the two, or to rule the kernels out while
debugging) calls :func:`disable` (and :func:`enable` to undo it): an explicit call in the
process, not an environment variable, so the choice is visible in the code that makes it.

This module knows how to build and call the kernels; it knows nothing about optimizers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from deltasync.atomic import write_atomic
from deltasync.native.inputs import kernel_ready

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("kernels") / "detect.c"
# No -ffast-math: the error bound assumes IEEE semantics for every operation, in source order.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_disabled = False
build_error: str | None = None


class CacheDirError(RuntimeError):
    """A kernel cache directory failed the ownership/permission checks."""


def check_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing and check, with ``lstat``, that it is a real
    directory (not a symlink) owned by this user and not accessible to group or others.

    Raises:
        CacheDirError: naming the path and what is wrong with it.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise CacheDirError(f"{path}: {exc}") from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"{path} is not a plain directory (a symlink or a file)")
    if st.st_uid != os.getuid():
        raise CacheDirError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        try:  # ours, just too open (e.g. created under a lax umask before): tighten it
            os.chmod(path, 0o700)
        except OSError as exc:
            raise CacheDirError(
                f"{path} has mode {oct(st.st_mode & 0o777)} and cannot be made 0700"
            ) from exc
        if os.lstat(path).st_mode & 0o077:
            raise CacheDirError(f"{path} is still accessible to group/others")
    return path


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    try:
        return check_private_dir(base / "deltasync")
    except CacheDirError as exc:
        log.warning("native kernel cache %s; building into a private temporary directory", exc)
    # never a predictable shared-temp name: a fresh directory only this process knows
    return Path(tempfile.mkdtemp(prefix="deltasync-kernels-"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(out: Path, digest_file: Path) -> bool:
    """Whether ``out`` is a regular file of ours whose hash is the recorded one."""
    try:
        st = os.lstat(out)
        want = digest_file.read_text().strip()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    return _sha256(out) == want


def _build() -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH")
    src = _SRC.read_bytes()
    key = hashlib.sha256(
        src + " ".join(_FLAGS).encode() + platform.machine().encode() + platform.node().encode()
    )
    out = _cache_dir() / f"detect-{key.hexdigest()[:16]}.so"
    digest_file = out.with_name(out.name + ".sha256")
    for _attempt in range(3):  # another process may replace the file mid-check: rebuild
        if _verified(out, digest_file):
            break

        def compile_to(tmp: Path) -> None:
            subprocess.run(
                [cc, *_FLAGS, str(_SRC), "-o", str(tmp)], check=True, capture_output=True, text=True
            )
            os.chmod(tmp, 0o700)

        try:
            write_atomic(out, compile_to, durable=False)  # a lost cache file is rebuilt
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {_SRC.name} failed: {exc.stderr.strip()[:500]}") from exc
        write_atomic(digest_file, _sha256(out).encode(), durable=False)
    if not _verified(out, digest_file):
        raise RuntimeError(f"{out} does not match its recorded SHA-256 after 3 builds")
    lib = ctypes.CDLL(str(out))
    f, i64, p = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p
    lib.ds_adamw_detect.argtypes = [p, p, p, i64, f, f, f, f, f, f, f, p]
    lib.ds_adamw_detect.restype = i64
    lib.ds_bits_count.argtypes = [p, i64]
    lib.ds_bits_count.restype = i64
    lib.ds_bits_to_indices.argtypes = [p, i64, i64, p]
    lib.ds_bits_to_indices.restype = i64
    lib.ds_adamw_detect_list.argtypes = [p, p, p, i64, f, f, f, f, f, f, f, i64, p, p]
    lib.ds_adamw_detect_list.restype = i64
    lib.ds_gather_bf16.argtypes = [p, p, i64, p]
    lib.ds_gather_bf16.restype = i64
    lib.ds_cast_bf16.argtypes = [p, i64, p]
    lib.ds_cast_bf16.restype = i64
    lib.ds_gaps_encode.argtypes = [p, i64, i64, p, p]
    lib.ds_gaps_encode.restype = i64
    lib.ds_gaps_decode.argtypes = [p, i64, p, i64, p]
    lib.ds_gaps_decode.restype = i64
    lib.ds_cast_bf16_rows.argtypes = [p, i64, i64, i64, p]
    lib.ds_cast_bf16_rows.restype = i64
    lib.ds_first_not_increasing.argtypes = [p, i64]
    lib.ds_first_not_increasing.restype = i64
    return lib


def disable() -> None:
    """Run every kernel user of this process (detection, BF16 gathers, order checks) on the
    bit-identical torch path from now on, as if no compiler were installed.

    Results do not change (the two paths are bit-identical; tests compare them), only speed:
    detection is ~20x slower on CPU. Call it before building trackers when comparing the paths
    or ruling the kernels out; :func:`enable` undoes it.
    """
    global _disabled
    with _lock:
        if not _disabled:
            log.info("deltasync native kernels disabled by disable(): the torch path runs")
        _disabled = True


def enable() -> None:
    """Undo :func:`disable`: the kernels run again where they build (the next :func:`load`)."""
    global _disabled
    with _lock:
        _disabled = False


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here (reason in ``build_error``,
    logged once with the remedy) or :func:`disable` was called.

    Returns:
        The loaded library, or None.
    """
    global _lib, _tried, build_error
    with _lock:
        if _disabled:
            return None
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (RuntimeError, OSError) as exc:
                build_error = str(exc)
                _lib = None
                log.warning(
                    "deltasync native kernels unavailable (%s): change detection runs on the "
                    "exact torch path, ~20x slower on CPU. Remedy: install a C compiler "
                    "(e.g. apt-get install gcc) and make ~/.cache/deltasync writable, or set "
                    "XDG_CACHE_HOME to a private directory.",
                    build_error,
                )
        return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: every one kernel-ready (a plain, contiguous,
    aligned CPU tensor: see :mod:`deltasync.native.inputs`) and the library built here."""
    return all(kernel_ready(t) for t in tensors) and load() is not None
