"""Dense refit (ByteCheckpoint-style): every version ships the full BF16 shard as safetensors,
and each receiver loads it fully and copies it into its live tensors."""

from __future__ import annotations

import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltasync import ReceiverLayout, Store, TrainerLayout
from deltasync_bench.compare.systems.base import (
    ClusterSent,
    SyncTimes,
    baseline_key,
    canonical_bf16,
    empty_live,
    receive_payload,
    send_payloads,
    wait_for_key,
)


class DenseTrainer:
    def __init__(
        self, *, params, tlayout: TrainerLayout, rlayout: ReceiverLayout, timeout_s: float, **_
    ) -> None:
        self.params, self.tlayout, self.rlayout = params, tlayout, rlayout
        self.timeout_s = timeout_s

    def _payloads(self):
        shards = self.rlayout.split(canonical_bf16(self.params, self.tlayout))
        for shard in list(shards):
            yield shard, st_save({n: t.contiguous() for n, t in shards.pop(shard).items()})

    def store_sync(self, version: int, store: Store) -> int:
        total = 0
        for shard, data in self._payloads():  # one shard serialized at a time
            store.put(baseline_key("dense", version, shard), data)
            total += len(data)
        return total

    def bootstrap(self, store: Store) -> int:
        return self.store_sync(0, store)

    def detect_alone(self, path: str) -> float | None:
        return None  # a dense refit detects nothing

    def settle(self) -> float:
        return time.time()  # store_sync returns once every shard is stored

    def cluster_sync(self, version: int) -> ClusterSent:
        t0 = time.perf_counter()
        payloads = dict(self._payloads())
        return send_payloads(payloads, self.rlayout, started=t0, timeout_s=self.timeout_s)


class DenseReceiver:
    def __init__(self, *, rlayout: ReceiverLayout, shard: str, timeout_s: float, **_) -> None:
        self.shard, self.timeout_s = shard, timeout_s
        self._live = empty_live(rlayout, shard)

    def _load(self, data: bytes, t0: float) -> SyncTimes:
        loaded = st_load(data)
        t1 = time.perf_counter()
        for n, t in self._live.items():
            t.copy_(loaded[n])
        t2 = time.perf_counter()
        return SyncTimes(transfer_s=t1 - t0, pause_s=t2 - t1, bytes=len(data))

    def bootstrap(self, store: Store) -> None:
        self.store_pull(0, store)

    def store_pull(self, version: int, store: Store) -> SyncTimes:
        key = baseline_key("dense", version, self.shard)
        wait_for_key(store, key, timeout_s=self.timeout_s)
        seen_at, seen_cpu, t0 = time.time(), time.process_time(), time.perf_counter()
        times = self._load(store.get(key), t0)
        times.seen_at, times.seen_cpu = seen_at, seen_cpu
        return times

    def cluster_sync(self, version: int) -> SyncTimes:
        payload, wait_s = receive_payload(timeout_s=self.timeout_s)
        times = self._load(payload, time.perf_counter())
        times.wait_s = wait_s
        return times

    def live(self) -> dict[str, torch.Tensor]:
        return self._live
