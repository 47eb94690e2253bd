"""Peak resident memory of this process over a window, via Linux's resettable high-water mark.

Writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS, so the peak
*during* one sync can be read without sampling. Elsewhere it degrades to ``ru_maxrss``.

:func:`trim` hands memory that is free in the C heap back to the OS (glibc ``malloc_trim``)
before a baseline is read: otherwise RSS keeps what an earlier, larger operation (the anchor
at bootstrap) freed but the allocator kept, and every later "peak above baseline" would be
measured on top of memory no object holds. A no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource

_libc = None
try:  # glibc only: malloc_trim is a GNU extension
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):
    _libc = None


def trim() -> None:
    """Collect garbage and return the C heap's free memory to the OS (before a baseline)."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    kib = _status_kib("VmRSS")
    return (
        kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    kib = _status_kib("VmHWM")
    return (
        kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
