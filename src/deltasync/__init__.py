"""deltasync: sparse, bit-exact BF16 policy-weight sync from an RL trainer to rollout workers.

The public API is re-exported flat from here; the README's module tree says where each part
lives. Subpackages expose more for advanced callers, but these names are the stable surface.

Each name is imported when first used (``from deltasync import Publisher`` works as usual):
``import deltasync`` alone loads no torch, so the ``deltasync`` command answers a Ctrl-C
pressed while it starts like one pressed later (status 130), not with a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender
    from deltasync.errors import DeltaSyncError
    from deltasync.exchange import ExchangeConfig
    from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
    from deltasync.publish import Publisher, PublisherConfig, PublishReport, TrainerSync
    from deltasync.receiver import PullReport, Receiver, ReceiverConfig
    from deltasync.store import LocalStore, MemoryStore, S3Config, S3Store, Store, open_store
    from deltasync.trainer import AdamWTracker, SnapshotTracker, Tracker

__version__ = "0.1.0"

# public name -> the subpackage that defines it
_SOURCES = {
    "ClusterConfig": "deltasync.cluster",
    "ClusterReceiver": "deltasync.cluster",
    "ClusterSender": "deltasync.cluster",
    "DeltaSyncError": "deltasync.errors",
    "ExchangeConfig": "deltasync.exchange",
    "ModelSpec": "deltasync.layout",
    "ReceiverLayout": "deltasync.layout",
    "TrainerLayout": "deltasync.layout",
    "Publisher": "deltasync.publish",
    "PublisherConfig": "deltasync.publish",
    "PublishReport": "deltasync.publish",
    "TrainerSync": "deltasync.publish",
    "PullReport": "deltasync.receiver",
    "Receiver": "deltasync.receiver",
    "ReceiverConfig": "deltasync.receiver",
    "LocalStore": "deltasync.store",
    "MemoryStore": "deltasync.store",
    "S3Config": "deltasync.store",
    "S3Store": "deltasync.store",
    "Store": "deltasync.store",
    "open_store": "deltasync.store",
    "AdamWTracker": "deltasync.trainer",
    "SnapshotTracker": "deltasync.trainer",
    "Tracker": "deltasync.trainer",
}

__all__ = [  # = _SOURCES and __version__ (a literal, for linters and star imports)
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


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # imported once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
