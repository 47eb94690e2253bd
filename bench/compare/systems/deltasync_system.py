"""deltasync in the benchmark: the product's own trainer and receiver paths, as users run them.

Store path: ``TrainerSync(overlap=True)`` (AdamWTracker + Publisher: once a delta is known to
be large the trainer waits for nothing; detection, routing, encoding, marker, manifest with
shard digests and LATEST run in the background while the next forward/backward runs, and the
optimizer's next step is the barrier) and ``Receiver.pull`` (stage, journal, scatter, digest
check, ack), started when the version's manifest appears. In-cluster path:
``ClusterSender(overlap=True)`` / ``ClusterReceiver.sync`` on the benchmark's gloo group (rank 0
the trainer, rank 1 + i shard i): the trainer waits for nothing (the AdamWTracker holds the
optimizer's steps for the sender); detection, routing, blobs in envelopes with the shard state
digests (on, the default) streamed in parts, the two-round exchanges, the receivers' staging,
journal, scatter and digest check, and the joint commit run in the background, and the
optimizer's next step waits until detection and the background no longer read the params.
The tracker's positions stay in the sender's carry until the joint commit. Both paths share
the one tracker; the in-cluster versions come after the store-path ones (the run's order),
starting from the version the store path left every receiver at.
"""

from __future__ import annotations

import os
import time

import torch

from deltasync import (
    AdamWTracker,
    ClusterConfig,
    ClusterReceiver,
    ClusterSender,
    ExchangeConfig,
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    ReceiverLayout,
    Store,
    TrainerLayout,
    TrainerSync,
    names,
)
from deltasync.cluster import RolePlan
from deltasync.trainer.handoff import INLINE_BELOW, VALUES_IN_FLIGHT
from deltasync_bench.compare.systems.base import ClusterSent, SyncTimes, empty_live, wait_for_key


def _plan(rlayout: ReceiverLayout) -> RolePlan:
    # The roles' ranks: the trainer is rank 0, receiver shard i is rank 1 + i.
    return RolePlan.contiguous(num_writers=1, shards=[s.id for s in rlayout.shards()])


def _cluster_config(timeout_s: float) -> ClusterConfig:
    return ClusterConfig(
        exchange=ExchangeConfig(timeout_s=timeout_s),
        wait_for_version_s=timeout_s,
        commit_timeout_s=timeout_s,
    )


class DeltasyncTrainer:
    def __init__(
        self,
        *,
        params,
        tlayout: TrainerLayout,
        rlayout: ReceiverLayout,
        trainer,
        timeout_s: float,
        **_,
    ) -> None:
        self.params, self.tlayout, self.rlayout = params, tlayout, rlayout
        self.opt = trainer.opt
        self.tracker = AdamWTracker(trainer.opt, trainer.named)
        self.timeout_s = timeout_s
        self.sync: TrainerSync | None = None
        self.sender: ClusterSender | None = None
        self._pubs: dict[int, Publisher] = {}
        self.last_changed_elements: int | None = None
        self.last_phases: dict[str, float] | None = None
        self._version = 0  # the version every receiver holds

    def _publisher(self, store: Store) -> Publisher:
        pub = self._pubs.get(id(store))
        if pub is None:
            cfg = PublisherConfig(anchor_every=1_000_000, session="bench")
            pub = self._pubs[id(store)] = Publisher(
                store, receiver_layout=self.rlayout, trainer_layout=self.tlayout, config=cfg
            )
        return pub

    def bootstrap(self, store: Store) -> int:
        self.sync = TrainerSync(
            self.tracker, self._publisher(store), self.params, overlap=True, optimizer=self.opt
        )
        self.sync.step_published(0, anchor=True)
        return sum(r.bytes_sent for r in self.sync.wait() or [])

    def detect_alone(self, path: str) -> float | None:
        """The tracker's pass on the current step as the overlapped sync's capture runs it
        (``iter_capture``): positions, the values of a chunked parameter's at most
        ``VALUES_IN_FLIGHT`` changed elements, and on the store path a small delta's values
        up to ``inline_below`` changed elements (the store path's sync passes no such budget
        when it expects a large delta, so this reads a little more than it then). The
        background reads the other values later, inside the latency; the shard digests the
        capture can feed are not detection and are not hashed here. Asking again gives the
        same answer, so the sync right after detects it again."""
        budget = 0 if path == "cluster" or self.sync is None else self.sync.inline_below
        t = time.perf_counter()
        for _ in self.tracker.iter_capture(budget, values_max=VALUES_IN_FLIGHT):
            pass
        return time.perf_counter() - t

    def store_sync(self, version: int, store: Store) -> int:
        """Returns once the changes are captured (the commit runs on); bytes come at settle."""
        assert self.sync is not None
        if self.sender is not None:
            raise RuntimeError(
                "the benchmark runs every store-path version before the in-cluster ones"
            )
        self.sync.publishers = [self._publisher(store)]
        self.sync.step_published(version)
        self._version = version
        return 0

    def settle(self) -> float:
        """Wait for the version in flight; when it committed (time.time())."""
        if self.sender is not None:
            return self._settle_cluster()
        pending = None if self.sync is None else self.sync.in_flight
        if pending is None:
            return time.time()
        reports = self.sync.wait() or []
        self.last_changed_elements = sum(r.elements_sent for r in reports)
        self.last_bytes = sum(r.bytes_sent for r in reports)
        self.last_shard_elements = max(
            (n for r in reports for n in r.shard_elements.values()), default=0
        )
        assert pending.finished_at is not None
        return pending.finished_at

    def cluster_sync(self, version: int) -> ClusterSent:
        """Returns once the changes are captured (the send runs on); bytes come at settle."""
        if self.sender is None:  # receivers hold the store path's last version
            if self.sync is not None:
                self.sync.close()  # its optimizer hook: the store path is done
            self.sender = ClusterSender(
                self.tracker,
                self.params,
                plan=_plan(self.rlayout),
                trainer_layout=self.tlayout,
                receiver_layout=self.rlayout,
                version=self._version,
                config=_cluster_config(self.timeout_s),
                overlap=True,
                optimizer=self.opt,
                # the store path's last delta on this tracker: a small one's successor is
                # sent whole on this thread from the first version on, as TrainerSync did
                expect_small=self.last_changed_elements is not None
                and self.last_changed_elements < INLINE_BELOW,
            )
        pending = self.sender.sync(version)
        self._version = version
        return ClusterSent(bytes=0, stall_s=pending.captured_s)

    def _settle_cluster(self) -> float:
        assert self.sender is not None
        pending = self.sender.in_flight
        if pending is None:
            return time.time()
        rep = self.sender.wait()
        assert rep is not None and pending.finished_at is not None
        self.last_changed_elements = rep.elements
        self.last_bytes = rep.bytes_sent
        self.last_shard_elements = max(rep.shard_elements.values(), default=0)
        # where the background's time went (the joint commit waits for the receivers' apply)
        self.last_phases = {
            k: getattr(rep, k)
            for k in (
                "captured_s",
                "detect_s",
                "build_s",
                "digest_s",
                "encode_s",
                "transfer_s",
                "commit_s",
            )
        }
        return pending.finished_at


class DeltasyncReceiver:
    def __init__(
        self, *, rlayout: ReceiverLayout, shard: str, store_root: str, timeout_s: float, **_
    ) -> None:
        self.rlayout, self.shard, self.timeout_s = rlayout, shard, timeout_s
        self._live = empty_live(rlayout, shard)
        # beside the store, inside the run's temporary directory (run.py), removed with it
        self.state_dir = f"{store_root}-rx-{shard}"
        self._rx: dict[int, Receiver] = {}
        self.cluster: ClusterReceiver | None = None
        self.version = 0

    def _receiver(self, store: Store) -> Receiver:
        rx = self._rx.get(id(store))
        if rx is None:
            rx = self._rx[id(store)] = Receiver.for_layout(
                store,
                self.rlayout,
                self.shard,
                self._live,
                self.state_dir,
                ReceiverConfig(receiver_id=f"rx-{self.shard}", verify_on_open=False),
            )
        return rx

    def bootstrap(self, store: Store) -> None:
        self._receiver(store).pull()

    def store_pull(self, version: int, store: Store) -> SyncTimes:
        # A receiver learns of a version when its manifest appears (free metadata polls).
        wait_for_key(store, names.manifest_key(version), timeout_s=self.timeout_s)
        seen_at, seen_cpu = time.time(), time.process_time()
        rep = self._receiver(store).pull()
        if rep.version != version:
            raise RuntimeError(
                f"receiver {self.shard} reached version {rep.version}, expected {version}"
            )
        self.version = version
        return SyncTimes(
            transfer_s=rep.stage_s + rep.verify_s,
            pause_s=rep.pause_s,
            bytes=rep.bytes_fetched,
            seen_at=seen_at,
            seen_cpu=seen_cpu,
            stage_s=rep.stage_s,
            verify_s=rep.verify_s,
        )

    def cluster_sync(self, version: int) -> SyncTimes:
        if self.cluster is None:  # the live tensors hold the store path's last version
            os.makedirs(self.state_dir, exist_ok=True)
            self.cluster = ClusterReceiver(
                self._live,
                plan=_plan(self.rlayout),
                layout=self.rlayout,
                version=self.version,
                config=_cluster_config(self.timeout_s),
                journal_path=os.path.join(self.state_dir, "cluster-journal.json"),
            )
        rep = self.cluster.sync()
        if rep.version != version:
            raise RuntimeError(
                f"receiver {self.shard} reached version {rep.version}, expected {version}"
            )
        self.version = version
        return SyncTimes(
            transfer_s=rep.stage_s + rep.verify_s,
            pause_s=rep.pause_s,
            bytes=rep.payload_bytes,
            wait_s=rep.wait_s + rep.forward_s,
            stage_s=rep.stage_s,
            verify_s=rep.verify_s,
        )

    def live(self) -> dict[str, torch.Tensor]:
        return self._live
