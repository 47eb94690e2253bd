"""Trainer side: find which BF16 elements changed, without a snapshot of the previous model."""

from deltasync.trainer.adamw_tracker import AdamWTracker, Fallback
from deltasync.trainer.gather import gather_bf16
from deltasync.trainer.protocol import LocalShard, PublishRole, Tracker, publish_role
from deltasync.trainer.snapshot_tracker import SnapshotTracker

__all__ = [
    "AdamWTracker",
    "Fallback",
    "LocalShard",
    "PublishRole",
    "SnapshotTracker",
    "Tracker",
    "gather_bf16",
    "publish_role",
]
