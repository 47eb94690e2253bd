"""Error kinds of the publisher, subclasses of :mod:`deltasync.errors` classes.

Each names what was waited for, for how long, and what to do. This module knows nothing else.
"""

from __future__ import annotations

from deltasync.errors import StoreError, VersionError


class MissingWritersError(StoreError, TimeoutError):
    """The committer waited for writer markers that never came (the message names them)."""


class CommitTimeoutError(StoreError, TimeoutError):
    """A non-committing writer waited for the committer's manifest that never came."""


class StalenessTimeoutError(VersionError, TimeoutError):
    """Bounded staleness: some live receiver stayed too far behind for too long."""


class AckTimeoutError(VersionError, TimeoutError):
    """``wait_for_acks`` ran out of time; the message names the receivers still missing."""
