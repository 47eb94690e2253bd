"""Error kinds of the in-cluster sync, subclasses of :mod:`deltasync.errors` classes.

A receiver raises the same typed errors as the storage path for the same faults (a damaged
blob: DigestMismatchError; a wrong base: BlobBaseMismatchError; a state digest that does not
match: IntegrityError; a writer's blob missing: MissingBlobError). The kinds here cover what
only a process group has: a payload's framing, and a version that another rank failed.

This module knows nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

from deltasync.errors import BaseVersionMismatchError, FormatError, PeerFailedError


class EnvelopeError(FormatError):
    """A payload is not a well-formed envelope (damaged in transit, or not from deltasync)."""


class AnchorRequiredError(BaseVersionMismatchError):
    """A receiver that holds no verified version (fresh, or dirty after a failed digest check)
    was sent a delta; only an anchor (``sync(anchor=True)`` on the writers) can restore it."""


class SyncAbortedError(PeerFailedError):
    """Another rank failed its part of a version; every other rank raises this, with the same
    message, and nobody commits the version: the trainer keeps its baseline and the receivers
    their committed version, so calling ``sync`` again on every rank retries it.

    ``failures`` maps each failed rank to its error (``"ClassName: message"``);
    ``anchor_required`` is True when a failed receiver can only be restored by an anchor."""

    def __init__(self, message: str, *, failures: Mapping[int, str], anchor_required: bool) -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.anchor_required = anchor_required
