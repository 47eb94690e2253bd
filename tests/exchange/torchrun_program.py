"""A torchrun program for the launcher test: init from the environment, exchange, print JSON."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from deltasync.exchange import ExchangeConfig, exchange, init_from_env

if __name__ == "__main__":
    init_from_env(backend="gloo", timeout_s=30)
    rank, w = dist.get_rank(), dist.get_world_size()
    got = exchange(
        {dst: f"{rank}->{dst}".encode() for dst in range(w)}, config=ExchangeConfig(timeout_s=10)
    )
    line = json.dumps({"rank": rank, "got": {s: bytes(t.numpy()).decode() for s, t in got.items()}})
    # One write(2) per line: both ranks share torchrun's stdout pipe, and a buffered print can be
    # split across writes and interleave with the other rank's line (seen once in CI-like load).
    os.write(1, (line + "\n").encode())
    dist.destroy_process_group()
