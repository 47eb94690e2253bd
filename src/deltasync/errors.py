"""Typed errors for deltasync.

Every error a user can trigger is a subclass of :class:`DeltaSyncError` and its message names
what was wrong (tensor, version, file, rank) and what to do about it. ``assert`` is used only
for internal invariants, never for user input.

This is the library's one error hierarchy: every error class lives here, so callers catch by
kind (``FormatError``, ``StoreError``, ``VersionError``, ...) without knowing which package
raised it. This module knows nothing about tensors, stores or processes; it only names failure
kinds.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping


class DeltaSyncError(Exception):
    """Base class of every deltasync error."""


def error_line(exc: DeltaSyncError) -> str:
    """The one line the command line prints on stderr for a typed error (then status 2)."""
    return f"deltasync: error: {type(exc).__name__}: {exc}"


# A write refused for room: the filesystem (or the user's quota on it) is full.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def full_disk_remedy(exc: BaseException, directory: str | os.PathLike[str]) -> str:
    """The remedy a message about a failed write ends with when ``exc`` says the filesystem
    (or a quota) is full: free space where the write goes; '' for any other error."""
    if getattr(exc, "errno", None) not in FULL_ERRNOS:
        return ""
    return f" (its filesystem is full: free space in {os.fspath(directory)!r}, then try again)"


# --- configuration ------------------------------------------------------------------------


class ConfigError(DeltaSyncError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted range."""


class UnsupportedOptimizerError(ConfigError):
    """The optimizer (or one of its settings) is outside what the AdamW error bound covers."""


class TensorInputError(ConfigError):
    """A tensor handed to a native kernel entry point (or a tracker) cannot be read as asked:
    wrong dtype, shape, device or kind (meta, sparse, a tensor subclass such as DTensor); the
    message names the tensor and what to pass instead."""


# --- wire format --------------------------------------------------------------------------


class FormatError(DeltaSyncError):
    """A blob is malformed: bad magic, unknown format version, bad lengths or records."""


class TruncatedBlobError(FormatError):
    """A blob ends before its declared contents do."""


class DigestMismatchError(FormatError):
    """A blob's digest does not match its contents (corruption or tampering)."""


class BlobMismatchError(FormatError):
    """A well-formed blob does not fit its target: wrong tensor name, dtype, shape, index range,
    version, base version or shard."""


class InvalidUpdateError(FormatError, ValueError):
    """A TensorUpdate (or the arguments of encode_blob) cannot be written: it would make an
    invalid record. Raised on the writer's side, before any byte is produced."""


class BlobLimitError(FormatError):
    """A blob declares a size beyond a decoder limit (max_decompressed_bytes, MAX_NUMEL, ...).
    Raised before anything of that size is allocated."""


class EnvelopeError(FormatError):
    """An in-cluster payload is not a well-formed envelope (damaged in transit, or not from
    deltasync)."""


# --- layouts ------------------------------------------------------------------------------


class LayoutError(DeltaSyncError):
    """A model config, tensor name or shape does not fit the layout table."""


class LayoutProbeError(LayoutError):
    """The layout probe cannot learn a layout: an engine's loader changes values on the way in
    or drops elements. ``refused`` maps each checkpoint tensor at fault to the reason."""

    def __init__(self, message: str, refused: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.refused: dict[str, str] = dict(refused or {})


# --- applying to targets ------------------------------------------------------------------


class ApplyError(DeltaSyncError):
    """An update cannot be applied to the given target tensors, or an engine did not take a
    version as asked. Refused before the first write, nothing was written; an engine's step
    that failed after the write (a finish, a cache reset, a resume) says so in the message."""


# --- versions and storage -----------------------------------------------------------------


class VersionError(DeltaSyncError):
    """A version chain is inconsistent (wrong base, gap, regression)."""


class BaseVersionMismatchError(VersionError):
    """A delta's base version is not the receiver's current version."""


class BlobBaseMismatchError(BlobMismatchError, BaseVersionMismatchError):
    """A well-formed blob must be applied on a different base version than the receiver holds.
    It is both a BlobMismatchError (format view) and a BaseVersionMismatchError (version view)."""


class AnchorRequiredError(BaseVersionMismatchError):
    """A receiver that holds no verified version (fresh, or dirty after a failed digest check)
    was sent a delta; only an anchor (``sync(anchor=True)`` on the writers) can restore it."""


class StalenessTimeoutError(VersionError, TimeoutError):
    """Bounded staleness: some live receiver stayed too far behind for too long."""


class AckTimeoutError(VersionError, TimeoutError):
    """``wait_for_acks`` ran out of time; the message names the receivers still missing."""


class StoreError(DeltaSyncError):
    """A storage backend operation failed."""


class OutcomeUnknownError(StoreError):
    """A write failed after its request may have reached the store: the store may hold it now
    or apply it later (a reply lost past the retries). Treat the key as possibly written."""


class KeyNotFoundError(StoreError, KeyError):
    """A key is not present in the store."""


class InvalidKeyError(StoreError, ValueError):
    """A key (or list prefix) is not a safe relative path; nothing was read or written."""


class ObjectTooLargeError(StoreError):
    """An object is larger than the bound its reader passed (``Store.get(key, max_bytes=...)``);
    refused from its size, before it was read whole."""


class CommitConflictError(StoreError):
    """Another writer committed the same key first (conditional write lost)."""


class MissingWritersError(StoreError, TimeoutError):
    """The committer waited for writer markers that never came (the message names them)."""


class CommitTimeoutError(StoreError, TimeoutError):
    """A non-committing writer waited for the committer's manifest that never came."""


class ManifestError(DeltaSyncError):
    """A manifest is missing, malformed, or inconsistent with the blobs it names."""


class SignatureError(ManifestError):
    """A manifest is unsigned or its signature does not verify with the configured key."""


class ReceiverLayoutRequiredError(ConfigError):
    """A version lists a parts digest of the receiver's shard (several writers published it
    without the full state), which is checked with the receiver layout, and the receiver has
    none: build it with ``Receiver.for_layout`` (``deltasync pull``: pass ``--config``). Nothing
    was written."""


class KeyRequiredError(SignatureError, ConfigError):
    """A manifest is signed and the receiver reading it has no key: a configuration to fix
    (give it the trainer's key), not a manifest to wait out."""


class LayoutMismatchError(ManifestError):
    """A version was published for another receiver layout (engine, TP/EP, model config) than
    the receiver's; refused before anything is fetched, naming both layouts."""


class MissingBlobError(ManifestError, KeyNotFoundError):
    """A committed manifest lists a blob the store does not have (deleted or never uploaded)."""


class IntegrityError(DeltaSyncError):
    """After an apply, a receiver's state digest does not match the committed manifest."""


class DriftError(IntegrityError):
    """A chain refused before any write: the live tensors no longer hold the version it builds
    on (something else wrote them: an engine's own reload). The receiver holds no version
    now; its next pull restores the newest anchor (``ReceiverConfig.restore_drift``: the same
    pull)."""


class LocalStateError(IntegrityError):
    """The receiver's local state directory (state file, journal) is unreadable or belongs to
    another receiver or shard."""


# --- in-cluster exchange ------------------------------------------------------------------


class ExchangeError(DeltaSyncError):
    """The torch.distributed exchange failed."""


class PeerFailedError(ExchangeError):
    """Another rank reported a failure in round 1; every rank raises this together."""


class ExchangeTimeoutError(ExchangeError):
    """A wait in the exchange exceeded its timeout; the message names the peer and the round."""


class SpawnError(ExchangeError):
    """A spawned child raised, died without reporting, or outlived the hard timeout."""


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


class FingerprintMismatchError(ConfigError):
    """The ranks of one in-cluster group were built for different models, engines, TP/EP,
    role plans, layouts or lineages. Every rank raises it in the preflight of a version, before
    any payload moves, with a message naming each rank's configuration; nothing was written and
    the group is still usable."""


class SendFailedError(DeltaSyncError):
    """A version sent in the background (``ClusterSender(overlap=True)``) did not commit
    jointly. Raised at the writer's next call (``sync``, ``wait``, ``close``), naming the
    version; its changed positions are kept and go out with the next version, so nothing is
    lost: call ``sync`` again on every rank.

    ``version`` is the version that failed; ``anchor_required`` is True when some receiver can
    only be restored by an anchor; ``group_broken`` is True when a rank died or hung, so the
    group must be re-created first (``use_group``). The original error is the ``__cause__``."""

    def __init__(
        self, message: str, *, version: int, anchor_required: bool, group_broken: bool
    ) -> None:
        super().__init__(message)
        self.version = version
        self.anchor_required = anchor_required
        self.group_broken = group_broken


class ApplicationMissingError(DeltaSyncError):
    """A CLI command's application (``deltasync_examples`` or ``deltasync_bench``, installed
    beside the library from the repository's ``examples/`` and ``bench/``) is not importable;
    the message names the package and how to install it."""


class PublishFailedError(DeltaSyncError):
    """A version published in the background (``TrainerSync(overlap=True)``) did not commit.
    Raised at the next call, naming the version; its changed positions are kept and go out
    with the next version, so nothing is lost: call ``step_published`` again.

    ``version`` is the version that failed; the original error is the ``__cause__``.
    ``committed``: True when the version did commit and only what follows a commit failed
    (advancing LATEST, the wait for acknowledgements); False when it did not; None when its
    manifest write got no verdict and may still land (its number is not published again)."""

    def __init__(self, message: str, *, version: int, committed: bool | None = False) -> None:
        super().__init__(message)
        self.version = version
        self.committed = committed


class ParamsEditedError(DeltaSyncError):
    """Parameters were written in place while a version sent in the background still read
    them (after ``TrainerSync.step_published`` or ``ClusterSender.sync`` returned, before the
    next optimizer step or ``wait()``): what it read may mix their old and new bits, so it was
    not committed. On the store path it is the ``__cause__`` of the next call's
    :class:`PublishFailedError`; in-cluster the writer's preflight row carries it to every rank
    and the next call raises :class:`SendFailedError`. The version's changes are kept and
    these parameters go out in full with the next version.

    ``version`` is the version that was not committed; ``names`` the parameters whose version
    counters moved."""

    def __init__(self, message: str, *, version: int, names: tuple[str, ...]) -> None:
        super().__init__(message)
        self.version = version
        self.names = names


# --- internal signals (never reach a caller) ----------------------------------------------


class StreamAborted(Exception):
    """Raised inside an upload's chunk iterator so the store discards the partial object."""


class RetriesExhausted(Exception):
    """Carries the last transient error and how many attempts were made; the backend turns it
    into a StoreError naming the operation."""

    def __init__(self, last: BaseException, attempts: int, elapsed_s: float) -> None:
        super().__init__(str(last))
        self.last = last
        self.attempts = attempts
        self.elapsed_s = elapsed_s


class SendInterruptedError(DeltaSyncError):
    """An interrupt (``KeyboardInterrupt``, ``SystemExit``) stopped a version's publish or send
    on the caller's thread. The caller saw the interrupt itself; the sender's next call reports
    the version as not committed (its changes kept), or as committed if its commit landed first.
    The interrupt is the ``__cause__``."""

    @classmethod
    def of(cls, exc: BaseException, what: str) -> Exception:
        """``exc`` itself when it is an ``Exception``, else this error about ``what``."""
        if isinstance(exc, Exception):
            return exc
        err = cls(f"{what} was interrupted ({type(exc).__name__}) on the caller's thread")
        err.__cause__ = exc
        return err


class CaptureAbandonedError(DeltaSyncError):
    """Detection failed while a background publish or send was already taking the parameters
    it had captured: that version stops before anything of it is committed. The detection
    error is the ``__cause__``; the caller sees that error itself (where detection went on
    after the call returned, as the cause of the error its next call raises)."""
