"""In-cluster transport throughput: the two-round exchange against plain gloo loopback.

One run, real processes on 127.0.0.1 (gloo, CPU), 1 sender + ``--receivers`` receivers:

- ``loopback``: the ceiling. Rank 0 sends one ``--loopback-mb`` uint8 tensor to rank 1 with a
  plain ``send``/``recv`` (the other ranks wait at a barrier); best of ``--repeat``.
- ``isend``: the same bytes as plain concurrent ``isend``/``irecv`` with the sizes known in
  advance (no round 1, no plan): what fan-out alone costs on this machine.
- ``exchange``: a 1%-dense delta of a ``--params``-element BF16 model (sorted int32 indices +
  bf16 values, 6 bytes per changed element, ~30 MB for 0.5 B parameters) split by index range
  into one payload per receiver shard (TP-style), sent by ``exchange()`` from rank 0. Timed per
  repetition from a barrier to the slowest rank's return; throughput is payload bytes over that
  time. Rows for a few ``max_chunk_bytes``; the JSON line reports the default ExchangeConfig.

Checked after timing: every receiver's bytes hash (sha256) to what the sender sent, in every
repetition, and the loopback receiver got the exact pattern. Prints a table, then one JSON line:
{"loopback_gbps", "exchange_gbps", "ratio", "peak_staging_bytes", "exact", ...}.

    python bench/exchange_bench.py [--params 500000000] [--density 0.01] [--receivers 4]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch
import torch.distributed as dist

from deltasync.exchange import ExchangeConfig, exchange, init_from_env, spawn
from deltasync_bench.common import emit_json, peak_rss_bytes, print_table

DEFAULT = ExchangeConfig()
CHUNK_ROWS_MB = (1, 8, DEFAULT.max_chunk_bytes >> 20)


def delta_shards(params: int, density: float, shards: int, seed: int = 0) -> list[bytes]:
    """Sorted changed positions (mean gap 1/density) and random bf16 bit patterns, split into
    ``shards`` contiguous index ranges; each shard is its int32 local indices then its values."""
    g = torch.Generator().manual_seed(seed)
    mean_gap = max(1, round(1 / density))
    k = int(params * density * 1.05) + 16
    idx = torch.cumsum(torch.randint(1, 2 * mean_gap, (k,), generator=g), 0) - 1
    idx = idx[idx < params]
    values = torch.randint(-(2**15), 2**15, (idx.numel(),), generator=g, dtype=torch.int32)
    values = values.to(torch.int16)  # bf16 bit patterns, carried as raw bytes
    rows = -(-params // shards)
    out = []
    for s in range(shards):
        keep = (idx >= s * rows) & (idx < (s + 1) * rows)
        local = (idx[keep] - s * rows).to(torch.int32)
        out.append(local.numpy().tobytes() + values[keep].numpy().tobytes())
    return out


def worker(rank: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    init_from_env(backend="gloo", timeout_s=120)
    out: dict = {"rank": rank}
    out["loopback_s"] = _loopback(rank, args)

    payloads = {}
    if rank == 0:
        shards = delta_shards(args.params, args.density, args.receivers)
        payloads = {1 + i: shard for i, shard in enumerate(shards)}
        out["sent"] = {dst: hashlib.sha256(p).hexdigest() for dst, p in payloads.items()}
        out["payload_bytes"] = sum(len(p) for p in payloads.values())
    out["fanout_s"] = _raw_fanout(rank, payloads, args)
    out["runs"] = {}
    for chunk_mb in CHUNK_ROWS_MB:
        config = ExchangeConfig(max_chunk_bytes=chunk_mb << 20, timeout_s=60)
        times, round1, round2, digests, staging, messages = [], [], [], set(), 0, 0
        for _ in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            got = exchange(payloads, config=config)
            times.append(time.perf_counter() - start)
            round1.append(got.stats.round1_s)
            round2.append(got.stats.round2_s)
            staging = max(staging, got.stats.peak_staging_bytes)
            messages = got.stats.messages
            if rank != 0:
                digests.add(hashlib.sha256(got[0].numpy().tobytes()).hexdigest())
        out["runs"][chunk_mb] = {
            "times": times,
            "round1": round1,
            "round2": round2,
            "digests": sorted(digests),
            "staging": staging,
            "messages": messages,
        }
    out["peak_rss_bytes"] = peak_rss_bytes()
    dist.destroy_process_group()
    return out


def _loopback(rank: int, args: argparse.Namespace) -> list[float]:
    n = args.loopback_mb << 20
    if rank > 1:
        pattern = buf = torch.empty(0, dtype=torch.uint8)
    else:
        pattern = torch.arange(251, dtype=torch.uint8).repeat(n // 251 + 1)[:n]
        buf = pattern.clone() if rank == 0 else torch.empty(n, dtype=torch.uint8)
    times = []
    for _ in range(args.repeat):
        if rank == 1:
            buf.zero_()  # so that a receive that wrote nothing fails the check (not timed)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)
        times.append(time.perf_counter() - start)
        if rank == 1 and not torch.equal(buf, pattern):
            raise RuntimeError("loopback receiver got different bytes than were sent")
    return times


def _raw_fanout(rank: int, payloads: dict[int, bytes], args: argparse.Namespace) -> list[float]:
    """The same bytes as plain concurrent isend/irecv with known sizes: no round 1, no plan."""
    sizes = torch.zeros(1 + args.receivers, dtype=torch.int64)
    for dst, p in payloads.items():
        sizes[dst] = len(p)
    dist.broadcast(sizes, src=0)  # untimed: the raw path is told the sizes for free
    sources = {d: torch.frombuffer(bytearray(p), dtype=torch.uint8) for d, p in payloads.items()}
    target = torch.empty(int(sizes[rank]), dtype=torch.uint8)
    times = []
    for _ in range(args.repeat):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            works = [dist.isend(t, dst=d) for d, t in sources.items()]
        else:
            works = [dist.irecv(target, src=0)]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=500_000_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--receivers", type=int, default=4)
    parser.add_argument("--loopback-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()

    wall = time.perf_counter()
    results = spawn(worker, 1 + args.receivers, args, timeout_s=args.timeout_s)
    sender = results[0]
    loop_s = min(max(r["loopback_s"][i] for r in results[:2]) for i in range(args.repeat))
    loopback_gbps = (args.loopback_mb << 20) / loop_s / 1e9
    total = sender["payload_bytes"]

    exact = True
    mb = 1e6
    rows = [
        [
            "loopback",
            f"{(args.loopback_mb << 20) / mb:.1f}",
            "-",
            "1",
            "-",
            "-",
            f"{loop_s * 1e3:.1f}",
            f"{loopback_gbps:.2f}",
            "1.00",
            "yes",
        ],
    ]
    fan = statistics.median(max(r["fanout_s"][i] for r in results) for i in range(args.repeat))
    rows.append(
        [
            "isend",
            f"{total / mb:.1f}",
            "-",
            f"{args.receivers}",
            "-",
            "-",
            f"{fan * 1e3:.1f}",
            f"{total / fan / 1e9:.2f}",
            f"{total / fan / 1e9 / loopback_gbps:.2f}",
            "-",
        ]
    )
    summary = {}
    for chunk_mb in CHUNK_ROWS_MB:
        runs = [r["runs"][chunk_mb] for r in results]
        # Per repetition the exchange lasts until its slowest rank returns.
        per_rep = [max(run["times"][i] for run in runs) for i in range(args.repeat)]
        median = statistics.median(per_rep)
        round1, round2 = (
            statistics.median(max(run[key][i] for run in runs) for i in range(args.repeat))
            for key in ("round1", "round2")
        )
        gbps = total / median / 1e9
        staging = max(run["staging"] for run in runs)
        ok = all(
            results[dst]["runs"][chunk_mb]["digests"] == [sender["sent"][dst]]
            for dst in range(1, 1 + args.receivers)
        )
        exact &= ok
        summary[chunk_mb] = (gbps, staging)
        rows.append(
            [
                "exchange",
                f"{total / mb:.1f}",
                f"{chunk_mb}M",
                f"{sender['runs'][chunk_mb]['messages']}",
                f"{round1 * 1e3:.1f}",
                f"{round2 * 1e3:.1f}",
                f"{median * 1e3:.1f}",
                f"{gbps:.2f}",
                f"{gbps / loopback_gbps:.2f}",
                "yes" if ok else "NO",
            ]
        )
    print_table(
        f"1 -> {args.receivers} ranks (loopback 1 -> 1): {args.params / 1e9:g}B params, "
        f"{args.density:.0%} dense, median of {args.repeat}",
        ["path", "MB", "chunk", "msgs", "r1 ms", "r2 ms", "ms", "GB/s", "/loop", "ok"],
        rows,
    )
    gbps, staging = summary[DEFAULT.max_chunk_bytes >> 20]
    emit_json(
        {
            "loopback_gbps": round(loopback_gbps, 3),
            "exchange_gbps": round(gbps, 3),
            "ratio": round(gbps / loopback_gbps, 3),
            "peak_staging_bytes": staging,
            "max_chunk_bytes": DEFAULT.max_chunk_bytes,
            "payload_bytes": total,
            "raw_fanout_gbps": round(total / fan / 1e9, 3),
            "receivers": args.receivers,
            "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in results),
            "wall_s": round(time.perf_counter() - wall, 1),
            "exact": bool(exact),
        }
    )
    if not exact:
        raise SystemExit("received bytes differ from what was sent")


if __name__ == "__main__":
    main()
