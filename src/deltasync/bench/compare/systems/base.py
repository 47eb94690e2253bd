"""What every system provides to the benchmark roles, and shared helpers (keys, bf16 state)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.publish import updates
from deltasync.store import Store


@dataclass
class SyncTimes:
    transfer_s: float = 0.0  # fetch + verify + decode, weights still serving
    pause_s: float = 0.0  # live weights unavailable (apply / reload)
    bytes: int = 0


class TrainerSide(Protocol):
    def bootstrap(self, store: Store) -> int: ...
    def store_sync(self, version: int, store: Store) -> int: ...
    def cluster_payloads(self, version: int) -> dict[str, bytes]: ...


class ReceiverSide(Protocol):
    def bootstrap(self, store: Store) -> None: ...
    def store_pull(self, version: int, store: Store) -> SyncTimes: ...
    def cluster_apply(self, version: int, payload: bytes) -> SyncTimes: ...
    def live(self) -> dict[str, torch.Tensor]: ...


def canonical_bf16(params: dict[str, torch.Tensor], tlayout: TrainerLayout) -> dict[str, torch.Tensor]:
    """The full canonical BF16 state (round-to-nearest-even from fp32)."""
    return updates.canonical_bf16(params, trainer_layout=tlayout)


def baseline_key(system: str, version: int, shard: str) -> str:
    # Baselines keep their payloads beside deltasync's run layout, under their own prefix.
    return f"baseline-{system}/v{version:08d}/{shard}.bin"


def wait_for_key(store: Store, key: str, timeout_s: float = 600.0) -> None:
    t0 = time.perf_counter()
    while not store.exists(key):
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{key} did not appear within {timeout_s} s")
        time.sleep(0.002)


def empty_live(layout: ReceiverLayout, shard: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(shard).items()}
