"""Trainer side of the sync through shared storage: stream updates into blobs and commit them.

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
from deltasync.publish.publisher import Publisher, PublishReport
from deltasync.publish.trainer_sync import TrainerSync

__all__ = [
    "AckTimeoutError",
    "CommitTimeoutError",
    "MissingWritersError",
    "PublishReport",
    "Publisher",
    "PublisherConfig",
    "StalenessTimeoutError",
    "TrainerSync",
]
