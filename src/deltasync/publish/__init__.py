"""Trainer side of the sync through shared storage: plan updates, publish, commit, retain.

- :mod:`~deltasync.publish.updates`: pure planning, tracker output -> per-shard updates
  (reused by the in-cluster exchange);
- :class:`Publisher`: one writer's ``publish``, ``wait_for_acks``, ``gc``;
- :class:`TrainerSync`: tracker + publishers, clearing the tracker only after a commit.
"""

from deltasync.errors import (
    AckTimeoutError,
    CommitTimeoutError,
    MissingWritersError,
    StalenessTimeoutError,
)
from deltasync.publish.config import PublisherConfig
from deltasync.publish.publisher import Publisher
from deltasync.publish.report import PublishReport
from deltasync.publish.retention import GcPlan, plan_deletions
from deltasync.publish.trainer_sync import TrainerSync
from deltasync.publish.updates import (
    canonical_changes,
    every_element,
    full_shard_tensors,
    route_to_shards,
    shard_digests,
    shard_updates,
    state_digests,
    tracker_changes,
    tracker_stream,
)

__all__ = [
    "AckTimeoutError",
    "CommitTimeoutError",
    "GcPlan",
    "MissingWritersError",
    "PublishReport",
    "Publisher",
    "PublisherConfig",
    "StalenessTimeoutError",
    "TrainerSync",
    "canonical_changes",
    "every_element",
    "full_shard_tensors",
    "plan_deletions",
    "route_to_shards",
    "shard_digests",
    "shard_updates",
    "state_digests",
    "tracker_changes",
    "tracker_stream",
]
