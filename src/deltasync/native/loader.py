"""Builds and loads the small C kernels in ``kernels/detect.c`` (detection, BF16 gather,
order check) with ctypes.

The library is compiled on first use with the system C compiler into a per-user cache
directory keyed by the source hash, the flags and the machine, written to a temporary name and
renamed so concurrent processes never load a half-written file. If no compiler is available,
:func:`load` returns ``None`` and callers use the bit-identical torch implementation.

This module knows how to build and call the kernels; it knows nothing about optimizers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_SRC = Path(__file__).with_name("kernels") / "detect.c"
# No -ffast-math: the error bound assumes IEEE semantics for every operation, in source order.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None


def _cache_dir() -> Path:
    base = Path(os.path.expanduser("~")) / ".cache" / "deltasync"
    try:
        base.mkdir(parents=True, exist_ok=True)
        probe = base / ".w"
        probe.touch()
        probe.unlink()
        return base
    except OSError:
        d = Path(tempfile.gettempdir()) / f"deltasync-{os.getuid()}"
        d.mkdir(parents=True, exist_ok=True)
        return d


def _build() -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH")
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + platform.machine().encode() + platform.node().encode())
    out = _cache_dir() / f"detect-{key.hexdigest()[:16]}.so"
    if not out.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, str(_SRC), "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, out)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {_SRC.name} failed: {exc.stderr.strip()[:500]}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
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
    lib.ds_first_not_increasing.argtypes = [p, i64]
    lib.ds_first_not_increasing.restype = i64
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here (reason in ``build_error``)."""
    global _lib, _tried, build_error
    with _lock:
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (RuntimeError, OSError) as exc:
                build_error = str(exc)
                _lib = None
        return _lib


def usable(*tensors) -> bool:
    """Whether the kernels can take these tensors: every one a contiguous CPU tensor (they
    read raw pointers) and the library built here."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and load() is not None
