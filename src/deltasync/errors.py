"""Typed errors for deltasync.

Every error a user can trigger is a subclass of :class:`DeltaSyncError` and its message names
what was wrong (tensor, version, file, rank) and what to do about it. ``assert`` is used only
for internal invariants, never for user input.

This module knows nothing about tensors, stores or processes; it only names failure kinds.
"""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every deltasync error."""


# --- configuration ------------------------------------------------------------------------


class ConfigError(DeltaSyncError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted range."""


class UnsupportedOptimizerError(ConfigError):
    """The optimizer (or one of its settings) is outside what the AdamW error bound covers."""


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


# --- layouts ------------------------------------------------------------------------------


class LayoutError(DeltaSyncError):
    """A model config, tensor name or shape does not fit the layout table."""


# --- applying to targets ------------------------------------------------------------------


class ApplyError(DeltaSyncError):
    """An update cannot be applied to the given target tensors; nothing was written."""


# --- versions and storage -----------------------------------------------------------------


class VersionError(DeltaSyncError):
    """A version chain is inconsistent (wrong base, gap, regression)."""


class BaseVersionMismatchError(VersionError):
    """A delta's base version is not the receiver's current version."""


class StoreError(DeltaSyncError):
    """A storage backend operation failed."""


class KeyNotFoundError(StoreError, KeyError):
    """A key is not present in the store."""


class CommitConflictError(StoreError):
    """Another writer committed the same key first (conditional write lost)."""


class ManifestError(DeltaSyncError):
    """A manifest is missing, malformed, or inconsistent with the blobs it names."""


class SignatureError(ManifestError):
    """A manifest is unsigned or its signature does not verify with the configured key."""


class IntegrityError(DeltaSyncError):
    """After an apply, a receiver's state digest does not match the committed manifest."""


# --- in-cluster exchange ------------------------------------------------------------------


class ExchangeError(DeltaSyncError):
    """The torch.distributed exchange failed."""


class PeerFailedError(ExchangeError):
    """Another rank reported a failure in round 1; every rank raises this together."""


class ExchangeTimeoutError(ExchangeError):
    """A wait in the exchange exceeded its timeout; the message names the peer and the round."""
