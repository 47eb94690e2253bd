"""Receiver side of the sync through shared storage: stage, journal, apply, verify, ack.

- :class:`Receiver`: one inference shard's live tensors kept at the newest committed version;
- :func:`mapped_shard_tensors`: live tensors in a shared file that outlives the writer.
"""

from deltasync.errors import LocalStateError, MissingBlobError
from deltasync.receiver.journal import Journal, JournalStep, LocalState, StateDir
from deltasync.receiver.mapped import mapped_shard_tensors
from deltasync.receiver.staging import check_chain, fetch_version
from deltasync.receiver.store_receiver import PullReport, Receiver, ReceiverConfig

__all__ = [
    "Journal",
    "JournalStep",
    "LocalState",
    "LocalStateError",
    "MissingBlobError",
    "PullReport",
    "Receiver",
    "ReceiverConfig",
    "StateDir",
    "check_chain",
    "fetch_version",
    "mapped_shard_tensors",
]
