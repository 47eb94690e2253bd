"""The three systems compared by ``deltasync bench``; each has a trainer side and a receiver side.

A trainer side turns the trainer's current fp32 params into what it ships for version v:
either through a Store (``store_sync``) or as per-shard payload bytes for the in-cluster
exchange (``cluster_payloads``). A receiver side brings its live BF16 shard tensors to version v
(``store_pull`` / ``cluster_apply``) and reports how long the weights were unavailable (pause).
"""

from deltasync_bench.compare.systems.base import ReceiverSide, SyncTimes, TrainerSide


def make_trainer_side(name: str, **kw) -> TrainerSide:
    if name == "dense":
        from deltasync_bench.compare.systems.dense import DenseTrainer

        return DenseTrainer(**kw)
    if name == "snapshot":
        from deltasync_bench.compare.systems.snapshot import SnapshotTrainer

        return SnapshotTrainer(**kw)
    if name == "deltasync":
        from deltasync_bench.compare.systems.deltasync_system import DeltasyncTrainer

        return DeltasyncTrainer(**kw)
    raise ValueError(f"unknown system {name!r}")


def make_receiver_side(name: str, **kw) -> ReceiverSide:
    if name == "dense":
        from deltasync_bench.compare.systems.dense import DenseReceiver

        return DenseReceiver(**kw)
    if name == "snapshot":
        from deltasync_bench.compare.systems.snapshot import SnapshotReceiver

        return SnapshotReceiver(**kw)
    if name == "deltasync":
        from deltasync_bench.compare.systems.deltasync_system import DeltasyncReceiver

        return DeltasyncReceiver(**kw)
    raise ValueError(f"unknown system {name!r}")


SYSTEMS = ("dense", "snapshot", "deltasync")

__all__ = [
    "SYSTEMS",
    "ReceiverSide",
    "SyncTimes",
    "TrainerSide",
    "make_receiver_side",
    "make_trainer_side",
]
