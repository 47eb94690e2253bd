"""Snapshot delta (PULSE-style): the trainer keeps a BF16 copy of the previous version and diffs
against it bitwise; receivers patch a retained host copy of their shard and reload it whole."""

from __future__ import annotations

import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deltasync import ReceiverLayout, Store, TrainerLayout
from deltasync.format import TensorUpdate, apply_updates, decode_blob, encode_blob
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


class SnapshotTrainer:
    def __init__(
        self, *, params, tlayout: TrainerLayout, rlayout: ReceiverLayout, timeout_s: float, **_
    ) -> None:
        self.params, self.tlayout, self.rlayout = params, tlayout, rlayout
        self.timeout_s = timeout_s
        self.prev: dict[str, torch.Tensor] = {}  # the retained BF16 copy (canonical): 1x model

    def _diff(self, cur: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        changes = {}
        for name, t in cur.items():
            flat = t.reshape(-1)
            prev = self.prev.get(name)
            if prev is None:
                idx = torch.arange(flat.numel(), dtype=torch.int64)
            else:
                idx = torch.nonzero(flat.view(torch.int16) != prev.view(torch.int16)).reshape(-1)
            if idx.numel():
                changes[name] = (idx, flat.index_select(0, idx))
        return changes

    def detect_alone(self, path: str) -> float | None:
        """Its detection: cast to BF16 and diff against the retained copy (nothing kept)."""
        t = time.perf_counter()
        self._diff(canonical_bf16(self.params, self.tlayout))
        return time.perf_counter() - t

    def settle(self) -> float:
        return time.time()  # store_sync returns once every shard is stored

    def _payloads(self, version: int) -> dict[str, bytes]:
        cur = canonical_bf16(self.params, self.tlayout)
        changes = self._diff(cur)
        self.prev = {n: t.reshape(-1) for n, t in cur.items()}
        self.last_changed_elements = sum(int(i.numel()) for i, _ in changes.values())
        routed = self.rlayout.route_changes(changes)
        # the busiest shard's changed elements (the floor's scatter), from the exact change set
        self.last_shard_elements = max(
            (sum(int(i.numel()) for i, _ in per.values()) for per in routed.values()), default=0
        )
        specs = {s.id: self.rlayout.local_specs(s.id) for s in self.rlayout.shards()}
        out = {}
        for shard in specs:
            ups = [
                TensorUpdate(
                    name=n,
                    shape=tuple(specs[shard][n].shape),
                    dtype=torch.bfloat16,
                    indices=i,
                    values=v,
                )
                for n, (i, v) in sorted(routed.get(shard, {}).items())
            ]
            out[shard] = encode_blob(
                ups,
                version=version,
                base_version=version - 1 if version else -1,
                shard=shard,
                writer="w00000",
            )
        return out

    def store_sync(self, version: int, store: Store) -> int:
        total = 0
        for shard, data in self._payloads(version).items():
            store.put(baseline_key("snapshot", version, shard), data)
            total += len(data)
        return total

    def bootstrap(self, store: Store) -> int:
        # Version 0 is a full checkpoint (safetensors per shard), as PULSE-style systems start
        # from; the retained BF16 copy is taken here.
        cur = canonical_bf16(self.params, self.tlayout)
        total = 0
        shards = self.rlayout.split(cur)
        for shard in list(shards):
            data = st_save({n: t.contiguous() for n, t in shards.pop(shard).items()})
            store.put(baseline_key("snapshot", 0, shard), data)
            total += len(data)
        self.prev = {n: t.reshape(-1) for n, t in cur.items()}
        return total

    def cluster_sync(self, version: int) -> ClusterSent:
        t0 = time.perf_counter()
        payloads = self._payloads(version)
        return send_payloads(payloads, self.rlayout, started=t0, timeout_s=self.timeout_s)


class SnapshotReceiver:
    def __init__(self, *, rlayout: ReceiverLayout, shard: str, timeout_s: float, **_) -> None:
        self.shard, self.timeout_s = shard, timeout_s
        self.specs = rlayout.local_specs(shard)
        self._live = empty_live(rlayout, shard)
        self.host = {
            n: t.clone() for n, t in self._live.items()
        }  # the retained host copy: 1x shard

    def _apply(self, data: bytes, t0: float) -> SyncTimes:
        blob = decode_blob(data, expected=self.specs, shard=self.shard)
        apply_updates(blob.updates, self.host)
        t1 = time.perf_counter()
        for n, t in self._live.items():  # reload the whole shard into the engine
            t.copy_(self.host[n])
        t2 = time.perf_counter()
        return SyncTimes(transfer_s=t1 - t0, pause_s=t2 - t1, bytes=len(data))

    def bootstrap(self, store: Store) -> None:
        loaded = st_load(store.get(baseline_key("snapshot", 0, self.shard)))
        for n, t in self.host.items():
            t.copy_(loaded[n])
            self._live[n].copy_(loaded[n])

    def store_pull(self, version: int, store: Store) -> SyncTimes:
        key = baseline_key("snapshot", version, self.shard)
        wait_for_key(store, key, timeout_s=self.timeout_s)
        seen_at, seen_cpu, t0 = time.time(), time.process_time(), time.perf_counter()
        times = self._apply(store.get(key), t0)
        times.seen_at, times.seen_cpu = seen_at, seen_cpu
        return times

    def cluster_sync(self, version: int) -> SyncTimes:
        payload, wait_s = receive_payload(timeout_s=self.timeout_s)
        times = self._apply(payload, time.perf_counter())
        times.wait_s = wait_s
        return times

    def live(self) -> dict[str, torch.Tensor]:
        return self._live
