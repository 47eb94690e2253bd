"""deltasync: sparse, bit-exact BF16 policy-weight sync from an RL trainer to rollout workers.

The public API is re-exported flat from here; the README's module tree says where each part
lives. Subpackages expose more for advanced callers, but these names are the stable surface.
"""

from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender
from deltasync.errors import DeltaSyncError
from deltasync.exchange import ExchangeConfig
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.publish import Publisher, PublisherConfig, PublishReport, TrainerSync
from deltasync.receiver import PullReport, Receiver, ReceiverConfig
from deltasync.store import LocalStore, MemoryStore, S3Config, S3Store, Store, open_store
from deltasync.trainer import AdamWTracker, SnapshotTracker, Tracker

__version__ = "0.1.0"

__all__ = [
    "AdamWTracker",
    "ClusterConfig",
    "ClusterReceiver",
    "ClusterSender",
    "DeltaSyncError",
    "ExchangeConfig",
    "LocalStore",
    "MemoryStore",
    "ModelSpec",
    "PublishReport",
    "Publisher",
    "PublisherConfig",
    "PullReport",
    "Receiver",
    "ReceiverConfig",
    "ReceiverLayout",
    "S3Config",
    "S3Store",
    "SnapshotTracker",
    "Store",
    "Tracker",
    "TrainerLayout",
    "TrainerSync",
    "__version__",
    "open_store",
]
