"""Private scratch files in a receiver's state dir, taken only where they leave its journal room.

A first pull larger than its staging budget parks data in unlinked files beside the
receiver's records: the spilled blobs (:func:`deltasync.receiver.staging.spill_blob`) and a
catch-up verify's large decoded pieces (:class:`deltasync.format.stash.Stash`). Both write
while the pull still has its own records to write in the same directory (the journal before
the first live write, the state file after the last), so both take a file only where
``HEADROOM`` bytes stay free beside it: a scratch file that took that room would fail the pull
at its journal, and every retry after it, where holding the data in memory succeeds.

A scratch file has no name (``O_TMPFILE`` where the file system has it, else unlinked as it is
created): nothing is left to sweep after a crash, and its blocks are freed when it closes.

Errors are the OS's own ``OSError`` (``ENOSPC`` for a directory without the room); each caller
decides what it does instead (both hold the data in memory, with a warning naming the dir).
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import BinaryIO

# Room a scratch file leaves free in its dir for the pull's journal and state file.
HEADROOM = 1 << 20


def check_room(directory: str, size: int) -> None:
    """Raise ``OSError`` (``ENOSPC``) unless ``directory`` has ``size`` bytes free and
    ``HEADROOM`` to spare (or the OS's error, where it cannot be asked)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if free < size + HEADROOM:
        raise OSError(
            errno.ENOSPC,
            f"{free} bytes free, fewer than the {size} to write and {HEADROOM} to spare",
        )


def scratch_file(directory: str, size: int, *, buffering: int = -1) -> BinaryIO:
    """A new unlinked file in ``directory`` for ``size`` bytes (checked by
    :func:`check_room` first); the caller closes it. ``buffering=0``: a write error
    (``ENOSPC``) is raised by the write that meets it."""
    check_room(directory, size)
    return tempfile.TemporaryFile(dir=directory, buffering=buffering)
