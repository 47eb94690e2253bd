"""A torchrun program for the launcher test: init from the environment, exchange, print JSON."""

from __future__ import annotations

import torch.distributed as dist

from deltasync.commands.apps import emit_json_line
from deltasync.exchange import ExchangeConfig, exchange, init_from_env

if __name__ == "__main__":
    init_from_env(backend="gloo", timeout_s=30)
    rank, w = dist.get_rank(), dist.get_world_size()
    got = exchange(
        {dst: f"{rank}->{dst}".encode() for dst in range(w)}, config=ExchangeConfig(timeout_s=10)
    )
    # both ranks share torchrun's stdout pipe: one write(2) per line keeps the lines whole
    emit_json_line({"rank": rank, "got": {s: bytes(t.numpy()).decode() for s, t in got.items()}})
    dist.destroy_process_group()
