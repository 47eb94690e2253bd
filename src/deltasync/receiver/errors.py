"""Error kinds of the receiver, subclasses of :mod:`deltasync.errors` classes.

This module knows nothing else.
"""

from __future__ import annotations

from deltasync.errors import IntegrityError, KeyNotFoundError, ManifestError


class MissingBlobError(ManifestError, KeyNotFoundError):
    """A committed manifest lists a blob the store does not have (deleted or never uploaded)."""


class LocalStateError(IntegrityError):
    """The receiver's local state directory (state file, journal) is unreadable or belongs to
    another receiver or shard."""
