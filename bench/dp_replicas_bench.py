"""DP replicas: one send per replica ("direct") or a receiver-side forward ("forward")?

A program, not a test (``python -m deltasync_bench.dp_replicas_bench``). For each payload size
and replica count it runs the same in-cluster job (1 writer, vLLM TP=2, real AdamW steps) in
both modes over gloo on this machine, and reports per delta version the median of:

- sync: the writer's whole ``sync`` (the joint commit makes it every rank's sync time);
- writer transfer: the writer's exchange time; receiver wait/forward: the receivers' first and
  second exchange; the bytes the writer sends and the bytes forwarded;
- the busiest sender's bytes (traffic model of ``RolePlan.traffic``): what a real network link
  would have to carry, which loopback on two shared cores does not show.

Prints a table and ends with one JSON line. Every run ends with the bitwise check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from deltasync.cluster import ClusterConfig
from deltasync.exchange import ExchangeConfig, spawn
from deltasync_examples.cluster_job import TINY_QWEN3, ClusterJob, run_cluster_sync

MEDIUM_QWEN3 = dict(
    model_type="qwen3",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=8003,
    tie_word_embeddings=False,
)

CASES = [  # (name, model, lr)
    ("tiny lr=1e-5", TINY_QWEN3, 1e-5),
    ("medium lr=1e-5", MEDIUM_QWEN3, 1e-5),
    ("medium lr=1e-3", MEDIUM_QWEN3, 1e-3),
]


def run(model: dict, lr: float, replicas: int, mode: str, versions: int) -> dict:
    job = ClusterJob(
        model=model,
        tp=2,
        replicas=replicas,
        dp_mode=mode,
        versions=versions,
        lr=lr,
        cluster=ClusterConfig(exchange=ExchangeConfig(timeout_s=60)),
    )
    world = 1 + 2 * replicas
    results = spawn(run_cluster_sync, world, job, timeout_s=600)
    writer, receivers = results[0], results[1:]
    assert all(r["exact"] for r in receivers), "a receiver is not bit-identical"
    deltas = writer["reports"][1:]
    med = lambda xs: statistics.median(xs)
    sent = med(r["bytes_sent"] for r in deltas)
    forwarded = (
        sum(
            med(rep["payload_bytes"] for rep in r["reports"][1:])
            for r in receivers
            if r["replica"] > 0
        )
        if mode == "forward"
        else 0
    )
    busiest = max(
        sent,
        max(
            (
                med(rep["payload_bytes"] for rep in r["reports"][1:]) * (replicas - 1)
                for r in receivers
                if r["replica"] == 0
            ),
            default=0,
        )
        if mode == "forward"
        else 0,
    )
    return {
        "sync_ms": med(r["total_s"] for r in deltas) * 1e3,
        "writer_transfer_ms": med(r["transfer_s"] for r in deltas) * 1e3,
        "receiver_wait_ms": med(med(rep["wait_s"] for rep in r["reports"][1:]) for r in receivers)
        * 1e3,
        "forward_ms": max(med(rep["forward_s"] for rep in r["reports"][1:]) for r in receivers)
        * 1e3,
        "writer_bytes": sent,
        "forwarded_bytes": forwarded,
        "busiest_sender_bytes": busiest,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deltasync_bench.dp_replicas_bench",
        description="In-cluster DP replicas over gloo: one send per replica (direct) or a "
        "receiver-side forward, per payload size and replica count; ends with one JSON line.",
    )
    parser.add_argument(
        "versions", nargs="?", type=int, default=6, help="delta versions per run (default 6)"
    )
    versions = parser.parse_args(argv).versions
    if versions < 1:
        parser.error(f"versions must be >= 1, got {versions}")
    rows = []
    print(
        f"{'case':16} {'R':>2} {'mode':8} {'sync ms':>8} {'w.xfer ms':>9} {'fwd ms':>7} "
        f"{'writer MB':>9} {'busiest MB':>10}"
    )
    for name, model, lr in CASES:
        for replicas in (2, 3):
            for mode in ("direct", "forward"):
                t = time.perf_counter()
                r = run(model, lr, replicas, mode, versions)
                r.update(case=name, replicas=replicas, mode=mode, wall_s=time.perf_counter() - t)
                rows.append(r)
                print(
                    f"{name:16} {replicas:>2} {mode:8} {r['sync_ms']:8.1f} "
                    f"{r['writer_transfer_ms']:9.1f} {r['forward_ms']:7.1f} "
                    f"{r['writer_bytes'] / 1e6:9.3f} {r['busiest_sender_bytes'] / 1e6:10.3f}",
                    flush=True,
                )
    print(json.dumps({"bench": "dp_replicas", "versions": versions, "rows": rows}))


if __name__ == "__main__":
    main()
