"""The physical floor of one sync on this machine, measured in the same run as the systems.

floor = max(detection reading θ, m, v at the measured memory read bandwidth (12 bytes per
trainer element), the payload over the link) + the receiver's scatter of its changed elements.

- memory bandwidth: a reduction over a 256 MiB fp32 buffer with every torch thread, best of 3;
- link: the emulated rate for a throttled store; unthrottled and in-cluster paths have no
  slower link than memory here, so the measured memory bandwidth stands in (a lower floor:
  the ratio against it is conservative);
- payload: the fewest bytes any system moved for that version (the exact change set, encoded);
- scatter: ``index_copy_`` of the busiest shard's changed elements (sorted int64 positions,
  bf16 values) into a shard-sized bf16 tensor, on one thread, best of 7 (with the machine's
  threads it read 0.2 ms or 8 ms for the same scatter, as the other thread was busy or not).

This module knows arithmetic over measured numbers; nothing about systems or processes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from deltasync_bench.common import memory_read_gbps


@dataclass(frozen=True, kw_only=True)
class Floor:
    detect_s: float  # 12 bytes per element at the memory bandwidth
    link_s: float  # payload bytes over the link
    scatter_s: float
    memory_gbps: float
    link_bytes_per_s: float
    payload_bytes: float
    scatter_elements: int

    @property
    def total_s(self) -> float:
        return max(self.detect_s, self.link_s) + self.scatter_s

    def to_json(self) -> dict:
        return {**asdict(self), "floor_s": self.total_s}


def measure_memory_gbps() -> float:
    return memory_read_gbps(256 * 2**20, repeat=3)


def measure_scatter_s(shard_elements: int, changed: int, repeat: int = 7) -> float:
    """Best wall time of scattering ``changed`` sorted positions into ``shard_elements``, on
    one thread."""
    changed = max(0, min(int(changed), int(shard_elements)))
    if changed == 0:
        return 0.0
    target = torch.zeros(int(shard_elements), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(int(shard_elements), generator=g)[:changed].sort().values
    vals = torch.ones(changed, dtype=torch.bfloat16)
    best = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeat):
            t = time.perf_counter()
            target.index_copy_(0, idx, vals)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return best


def floor_of(
    *,
    trainer_elements: int,
    payload_bytes: float,
    link_gbps: float | None,
    memory_gbps: float,
    shard_elements: int,
    scatter_elements: int,
) -> Floor:
    """The floor of one path: see the module docstring."""
    mem_bps = memory_gbps * 1e9
    link_bps = link_gbps * 1e9 / 8 if link_gbps else mem_bps
    return Floor(
        detect_s=12 * trainer_elements / mem_bps,
        link_s=payload_bytes / link_bps,
        scatter_s=measure_scatter_s(shard_elements, scatter_elements),
        memory_gbps=memory_gbps,
        link_bytes_per_s=link_bps,
        payload_bytes=payload_bytes,
        scatter_elements=int(scatter_elements),
    )
