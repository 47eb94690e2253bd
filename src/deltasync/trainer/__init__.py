"""Trainer side: find which BF16 elements changed, without a snapshot of the previous model."""

from deltasync.trainer.adamw_tracker import AdamWTracker
from deltasync.trainer.protocol import LocalShard, Tracker
from deltasync.trainer.snapshot_tracker import SnapshotTracker

__all__ = ["AdamWTracker", "LocalShard", "SnapshotTracker", "Tracker"]
