"""Receiver side of the sync through shared storage: stage, journal, apply, verify, ack.

- :class:`Receiver`: one inference shard's live tensors kept at the newest committed version;
- :func:`mapped_shard_tensors`: live tensors in a shared file that outlives the writer;
- :class:`StateDir` / :class:`LocalState`: the receiver's local state directory (the CLI's
  ``pull`` reads it).
"""

from deltasync.errors import LayoutMismatchError, LocalStateError, MissingBlobError
from deltasync.receiver.journal import LocalState, StateDir
from deltasync.receiver.mapped import mapped_shard_tensors
from deltasync.receiver.store_receiver import PullReport, Receiver, ReceiverConfig

__all__ = [
    "LayoutMismatchError",
    "LocalState",
    "LocalStateError",
    "MissingBlobError",
    "PullReport",
    "Receiver",
    "ReceiverConfig",
    "StateDir",
    "mapped_shard_tensors",
]
