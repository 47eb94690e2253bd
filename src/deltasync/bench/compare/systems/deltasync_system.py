"""deltasync in the benchmark: the product's own trainer and receiver paths.

Store path: ``TrainerSync`` (AdamWTracker + Publisher: detection, routing, encoding, marker,
manifest with shard digests, LATEST) and ``Receiver.pull`` (stage, journal, scatter, digest
check, ack). In-cluster path: the same detection, routing and blobs, moved by the two-round
exchange; receivers verify and decode before the pause and scatter in place.
"""

from __future__ import annotations

import time

import torch

from deltasync.bench.compare.systems.base import SyncTimes, empty_live
from deltasync.format import apply_updates, decode_blob, encode_blobs
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.publish import (
    Publisher,
    PublisherConfig,
    TrainerSync,
    shard_updates,
    tracker_changes,
)
from deltasync.receiver import Receiver, ReceiverConfig
from deltasync.store import Store
from deltasync.trainer import AdamWTracker


class DeltasyncTrainer:
    def __init__(self, *, params, tlayout: TrainerLayout, rlayout: ReceiverLayout, trainer, **_) -> None:
        self.params, self.tlayout, self.rlayout = params, tlayout, rlayout
        self.tracker = AdamWTracker(trainer.opt, trainer.named)
        self.sync: TrainerSync | None = None
        self._pubs: dict[int, Publisher] = {}
        self.last_changed_elements: int | None = None

    def _publisher(self, store: Store) -> Publisher:
        pub = self._pubs.get(id(store))
        if pub is None:
            cfg = PublisherConfig(anchor_every=1_000_000, session="bench")
            pub = self._pubs[id(store)] = Publisher(store, receiver_layout=self.rlayout,
                                                    trainer_layout=self.tlayout, config=cfg)
        return pub

    def bootstrap(self, store: Store) -> int:
        self.sync = TrainerSync(self.tracker, self._publisher(store), self.params)
        return sum(r.bytes_sent for r in self.sync.step_published(0, anchor=True))

    def store_sync(self, version: int, store: Store) -> int:
        assert self.sync is not None
        self.sync.publishers = [self._publisher(store)]
        reports = self.sync.step_published(version)
        self.last_changed_elements = sum(r.elements_sent for r in reports)
        return sum(r.bytes_sent for r in reports)

    def cluster_payloads(self, version: int) -> dict[str, bytes]:
        assert self.sync is not None
        changed, values = tracker_changes(self.tracker)
        ups = shard_updates(changed, self.params, trainer_layout=self.tlayout, receiver_layout=self.rlayout,
                            values=values)
        # every shard gets a blob, an empty one if nothing of it changed
        jobs = {s.id: ups.get(s.id, []) for s in self.rlayout.shards()}
        out = dict(encode_blobs(jobs, version=version, base_version=version - 1, writer="w00000-bench"))
        self.tracker.clear()  # the bench's exchange is its commit (receivers verify digests)
        self.sync.baseline = version
        return out


class DeltasyncReceiver:
    def __init__(self, *, rlayout: ReceiverLayout, shard: str, store_root: str, **_) -> None:
        self.rlayout, self.shard = rlayout, shard
        self.specs = rlayout.local_specs(shard)
        self._live = empty_live(rlayout, shard)
        self.state_dir = f"{store_root}-rx-{shard}"
        self._rx: dict[int, Receiver] = {}
        self.version = 0

    def _receiver(self, store: Store) -> Receiver:
        rx = self._rx.get(id(store))
        if rx is None:
            rx = self._rx[id(store)] = Receiver.for_layout(
                store, self.rlayout, self.shard, self._live, self.state_dir,
                ReceiverConfig(receiver_id=f"rx-{self.shard}", verify_on_open=False))
        return rx

    def bootstrap(self, store: Store) -> None:
        self._receiver(store).pull()

    def store_pull(self, version: int, store: Store) -> SyncTimes:
        rep = self._receiver(store).pull()
        if rep.version != version:
            raise RuntimeError(f"receiver {self.shard} reached version {rep.version}, expected {version}")
        self.version = version
        return SyncTimes(transfer_s=rep.stage_s + rep.verify_s, pause_s=rep.pause_s, bytes=rep.bytes_fetched)

    def cluster_apply(self, version: int, payload: bytes) -> SyncTimes:
        t0 = time.perf_counter()
        blob = decode_blob(payload, expected=self.specs, version=version, base_version=self.version,
                           shard=self.shard)
        t1 = time.perf_counter()
        apply_updates(blob.updates, self._live)
        t2 = time.perf_counter()
        self.version = version
        return SyncTimes(transfer_s=t1 - t0, pause_s=t2 - t1, bytes=len(payload))

    def live(self) -> dict[str, torch.Tensor]:
        return self._live
