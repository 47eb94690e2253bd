"""Error kinds specific to the wire format, all subclasses of :mod:`deltasync.errors` classes.

Catching :class:`deltasync.errors.FormatError` catches every decode failure; the subclasses here
only let callers tell three cases apart without parsing messages.

This module knows nothing about bytes or tensors.
"""

from __future__ import annotations

from deltasync.errors import BaseVersionMismatchError, BlobMismatchError, FormatError


class InvalidUpdateError(FormatError, ValueError):
    """A TensorUpdate (or the arguments of encode_blob) cannot be written: it would make an
    invalid record. Raised on the writer's side, before any byte is produced."""


class BlobLimitError(FormatError):
    """A blob declares a size beyond a decoder limit (max_decompressed_bytes, MAX_NUMEL, ...).
    Raised before anything of that size is allocated."""


class BlobBaseMismatchError(BlobMismatchError, BaseVersionMismatchError):
    """A well-formed blob must be applied on a different base version than the receiver holds.
    It is both a BlobMismatchError (format view) and a BaseVersionMismatchError (version view)."""
