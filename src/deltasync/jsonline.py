"""One JSON object per stdout line, written with a single ``write(2)``.

Several ranks of one job (torchrun, ``mp.spawn``) share one stdout pipe, and the machine-readable
lines they print are parsed by tests, benchmarks and users' scripts. ``print(s)`` is not one
write: CPython writes the text and the ``"\\n"`` separately (always when unbuffered, and often
when flushing), so two ranks finishing together produce ``{...}{...}\\n\\n``. A single write of at
most ``PIPE_BUF`` (4096) bytes to a pipe is atomic on POSIX, so lines from different processes
never mix. Longer lines are still written in one call, but the kernel may then split them.

This module knows nothing about what the objects mean.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def emit_json_line(obj: Any, *, sort_keys: bool = False) -> None:
    """Write ``json.dumps(obj) + "\\n"`` to stdout as one ``write(2)`` (after flushing what
    ``print`` buffered, so the order of this process's output is kept)."""
    data = (json.dumps(obj, sort_keys=sort_keys) + "\n").encode()
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured (pytest capsys, StringIO)
        sys.stdout.write(data.decode())
        sys.stdout.flush()
        return
    view = memoryview(data)
    while view:  # a pipe or file takes it whole; the loop is for signals and odd files
        view = view[os.write(fd, view) :]
