"""Peak resident memory of this process over a window, via Linux's resettable high-water mark.

Writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS, so the peak
*during* one sync can be read without sampling. Elsewhere it degrades to ``ru_maxrss``.
"""

from __future__ import annotations

import resource


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
