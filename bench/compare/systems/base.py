"""What every system provides to the benchmark roles, and shared helpers (keys, bf16 state,
the in-cluster exchange of the baselines' payloads)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from deltasync import ExchangeConfig, ReceiverLayout, Store, TrainerLayout


@dataclass
class SyncTimes:
    transfer_s: float = 0.0  # fetch + verify + decode, weights still serving
    pause_s: float = 0.0  # live weights unavailable (apply / reload)
    bytes: int = 0
    wait_s: float = 0.0  # in-cluster: from entering the sync until this rank's payload arrived
    seen_at: float | None = None  # store path: when the version became visible (time.time())
    seen_cpu: float | None = None  # ... and the process's CPU seconds then (process_time())
    stage_s: float | None = None  # of transfer_s: fetch and decode (where the system says)
    verify_s: float | None = None  # of transfer_s: the state check before the first write


@dataclass(frozen=True)
class ClusterSent:
    bytes: int  # payload bytes the trainer sent
    stall_s: float  # from the start of the sync until the exchange began (detect, encode)


class TrainerSide(Protocol):
    def bootstrap(self, store: Store) -> int: ...
    def store_sync(self, version: int, store: Store) -> int: ...
    def cluster_sync(self, version: int) -> ClusterSent: ...
    # Seconds its change detection alone takes on the current step (None: it has none), as
    # its sync on ``path`` ("store" or "cluster") runs it; it must leave nothing changed,
    # the sync right after it detects again.
    def detect_alone(self, path: str) -> float | None: ...
    # Wait until the last version is committed; returns when that happened (time.time()).
    def settle(self) -> float: ...


class ReceiverSide(Protocol):
    def bootstrap(self, store: Store) -> None: ...
    def store_pull(self, version: int, store: Store) -> SyncTimes: ...
    def cluster_sync(self, version: int) -> SyncTimes: ...
    def live(self) -> dict[str, torch.Tensor]: ...


def wait_for_key(store: Store, key: str, *, timeout_s: float, poll_s: float = 0.002) -> None:
    """Poll until ``key`` exists (a receiver waiting for a version to be published): metadata
    calls are free on the emulated link."""
    deadline = time.monotonic() + timeout_s
    while not store.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key!r} did not appear within {timeout_s} s")
        time.sleep(poll_s)


def canonical_bf16(
    params: dict[str, torch.Tensor], tlayout: TrainerLayout
) -> dict[str, torch.Tensor]:
    """The full canonical BF16 state (round-to-nearest-even from fp32)."""
    return tlayout.to_canonical({n: p.detach().to(torch.bfloat16) for n, p in params.items()})


def baseline_key(system: str, version: int, shard: str) -> str:
    # Baselines keep their payloads beside deltasync's run layout, under their own prefix.
    return f"baseline-{system}/v{version:08d}/{shard}.bin"


def empty_live(layout: ReceiverLayout, shard: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(shard).items()}


def send_payloads(
    payloads: dict[str, bytes], rlayout: ReceiverLayout, *, started: float, timeout_s: float
) -> ClusterSent:
    """A baseline trainer's in-cluster sync: one exchange from rank 0 to every shard's rank
    (``1 + index`` in ``rlayout.shards()``); ``started`` is when the sync began (perf_counter)."""
    from deltasync.exchange import exchange

    stall = time.perf_counter() - started
    rank = {s.id: 1 + i for i, s in enumerate(rlayout.shards())}
    exchange({rank[s]: p for s, p in payloads.items()}, config=ExchangeConfig(timeout_s=timeout_s))
    return ClusterSent(bytes=sum(len(p) for p in payloads.values()), stall_s=stall)


def receive_payload(*, timeout_s: float) -> tuple[bytes, float]:
    """A baseline receiver's side of that exchange: its payload and how long it waited."""
    from deltasync.exchange import exchange

    t = time.perf_counter()
    got = exchange({}, config=ExchangeConfig(timeout_s=timeout_s))
    return (bytes(got[0].numpy()) if 0 in got else b""), time.perf_counter() - t
