"""Routing throughput: changed canonical elements per second, canonical → every vLLM shard.

A Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 q / 8 kv heads of 128, intermediate
3072, vocabulary 151936, tied embeddings) in vLLM's layout at TP=4. Each canonical tensor gets a
sorted random change set of about ``--fraction`` of its elements (random gaps, so every tensor,
the 155 M-element embedding included, is hit evenly). Timed:

- ``route``: ``ReceiverLayout.route`` per tensor (local indices + source positions);
- ``route_values``: the same with values gathered;
- ``route_changes``: all tensors at once, merged per local tensor (what a publisher encodes).

Throughput counts canonical changed elements (an element held by several shards counts once).
Checked after timing: on a smaller model with the same per-tensor tables (same dims, fewer
layers) the timed runs' outputs are compared with a dense ``split`` of labelled weights,
element by element: ``route``'s local indices and source positions, ``route_values``' local
indices and values, and ``route_changes``' merged indices and values per local tensor (which
must also be sorted and complete on the whole model).

    python bench/route_bench.py [--tp 4] [--fraction 0.01] [--repeat 3]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync_bench.common import emit_json, memory_read_gbps, print_table

QWEN3_06B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "tie_word_embeddings": True,
}
TARGET_MELEM_S = 20.0


def change_sets(
    spec: ModelSpec, fraction: float, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sorted distinct indices with mean gap 1/fraction, and random bf16 values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    mean_gap = max(1, round(1 / fraction))
    for name, shape in spec.canonical_shapes().items():
        n = 1
        for d in shape:
            n *= d
        k = max(1, int(n * fraction * 1.05) + 16)
        idx = torch.cumsum(torch.randint(1, 2 * mean_gap, (k,), generator=g), 0) - 1
        idx = idx[idx < n]
        vals = torch.randint(-(2**15), 2**15, (idx.numel(),), generator=g, dtype=torch.int32)
        out[name] = (idx, vals.to(torch.int16).view(torch.bfloat16))
    return out


def run_route(layout, changes):
    return {name: layout.route(name, idx) for name, (idx, _) in changes.items()}


def run_route_values(layout, changes):
    return {name: layout.route_values(name, idx, vals) for name, (idx, vals) in changes.items()}


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def verify(cfg: dict, tp: int, routed: dict, merged: dict, changes: dict, valued: dict) -> int:
    """Check the timed runs' routing of a 1-layer model's tensors against a dense split.

    Splitting ``arange(1, numel + 1)`` labels every local element with the canonical element it
    holds (0 for padding), so for each local tensor the expected routed set is exactly the
    labelled elements whose canonical index changed, and each one's value is that canonical
    element's changed value. The timed ``route`` output must equal the set, with
    ``indices[positions]`` naming the same canonical elements; ``route_values`` (``valued``)
    must give the same local indices with their values, and ``route_changes`` (``merged``) the
    whole sorted set per local tensor with its values, bit for bit.
    """
    small = ModelSpec.from_hf_config(dict(cfg, num_hidden_layers=1))
    layout = ReceiverLayout.build(small, "vllm", tp)
    shapes = small.canonical_shapes()
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += math.prod(shape)
    # Labels unique across tensors: canonical element i of `name` is offsets[name] + i + 1.
    shards = layout.split(
        {
            n: torch.arange(
                offsets[n] + 1, offsets[n] + math.prod(s) + 1, dtype=torch.int32
            ).reshape(s)
            for n, s in shapes.items()
        }
    )
    changed = torch.zeros(total + 1, dtype=torch.bool)  # label 0 (padding) is never changed
    value_of = torch.zeros(total + 1, dtype=torch.int16)  # each changed label's value bits
    for name in shapes:
        changed[changes[name][0] + (offsets[name] + 1)] = True
        value_of[changes[name][0] + (offsets[name] + 1)] = changes[name][1].view(torch.int16)
    checked = 0
    for shard, tensors in shards.items():
        for local, lab in tensors.items():
            lab = lab.reshape(-1).to(torch.int64)
            expected = torch.nonzero(changed.index_select(0, lab)).squeeze(1)
            got = []
            for name in shapes:
                hit = routed[name].get(shard, {}).get(local)
                if hit is None:
                    continue
                local_idx, pos = hit
                src = changes[name][0].index_select(0, pos) + (offsets[name] + 1)
                if not torch.equal(src, lab.index_select(0, local_idx)):
                    raise SystemExit(
                        f"route_bench: {name} -> {shard}/{local}: elements routed to the wrong place"
                    )
                v_idx, v_vals = valued[name].get(shard, {}).get(local, (None, None))
                if v_idx is None or not torch.equal(v_idx, local_idx):
                    raise SystemExit(
                        f"route_bench: route_values {name} -> {shard}/{local}: indices differ "
                        "from route's"
                    )
                want = value_of.index_select(0, lab.index_select(0, local_idx))
                if not torch.equal(v_vals.view(torch.int16), want):
                    raise SystemExit(
                        f"route_bench: route_values {name} -> {shard}/{local}: wrong values"
                    )
                got.append(local_idx)
            got_all = torch.sort(torch.cat(got)).values if got else expected[:0]
            if not torch.equal(got_all, expected):
                raise SystemExit(
                    f"route_bench: {shard}/{local}: routed {got_all.numel()} elements, "
                    f"the dense split says {expected.numel()}"
                )
            if expected.numel():
                m_idx, m_vals = merged.get(shard, {}).get(local, (expected[:0], None))
                want = value_of.index_select(0, lab.index_select(0, expected))
                if not torch.equal(m_idx, expected) or not torch.equal(
                    m_vals.view(torch.int16), want
                ):
                    raise SystemExit(
                        f"route_bench: route_changes {shard}/{local}: indices or values differ "
                        "from the dense split"
                    )
            checked += expected.numel()
    counts: dict[tuple[str, str], int] = {}
    for per_shard in routed.values():
        for shard, per_local in per_shard.items():
            for local, (local_idx, _) in per_local.items():
                counts[(shard, local)] = counts.get((shard, local), 0) + local_idx.numel()
    if {(s, n) for s, d in merged.items() for n in d} != set(counts):
        raise SystemExit("route_bench: route_changes and route disagree on which tensors changed")
    for shard, per_local in merged.items():
        for local, (idx, vals) in per_local.items():
            if idx.numel() != counts[(shard, local)] or idx.numel() != vals.numel():
                raise SystemExit(f"route_bench: route_changes lost elements of {shard}/{local}")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise SystemExit(
                    f"route_bench: route_changes output for {shard}/{local} is not sorted"
                )
    return checked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--threads",
        default="1,0",
        help="comma-separated torch thread counts to time (0: torch's default); default 1,0",
    )
    args = ap.parse_args(argv)
    default_threads = torch.get_num_threads()
    thread_counts = [int(x) or default_threads for x in args.threads.split(",")]

    spec = ModelSpec.from_hf_config(QWEN3_06B)
    t0 = time.perf_counter()
    layout = ReceiverLayout.build(spec, "vllm", args.tp)
    build_s = time.perf_counter() - t0
    changes = change_sets(spec, args.fraction, seed=0)
    n_changed = sum(idx.numel() for idx, _ in changes.values())

    timings: dict[int, dict[str, float]] = {}
    routed = merged = valued = None
    for threads in thread_counts:
        torch.set_num_threads(threads)
        route_s, routed = best_of(lambda: run_route(layout, changes), args.repeat)
        values_s, valued = best_of(lambda: run_route_values(layout, changes), args.repeat)
        changes_s, merged = best_of(lambda: layout.route_changes(changes), args.repeat)
        timings[threads] = {"route": route_s, "route_values": values_s, "route_changes": changes_s}
    torch.set_num_threads(default_threads)
    n_local = sum(
        li.numel() for per in routed.values() for d in per.values() for li, _ in d.values()
    )

    checked = verify(QWEN3_06B, args.tp, routed, merged, changes, valued)
    # Floor: routing reads an index and writes (local index, position) per routed copy.
    gbps = memory_read_gbps(1 << 28)
    floor = gbps * 1e9 / (8 + 16 * n_local / n_changed)

    rows = []
    for threads, modes in timings.items():
        for mode, secs in modes.items():
            rows.append(
                [
                    mode,
                    threads,
                    f"{n_changed:,}",
                    f"{secs * 1e3:.1f}",
                    f"{n_changed / secs / 1e6:.1f}",
                ]
            )
    print_table(
        f"canonical -> vLLM TP={args.tp} routing, Qwen3-0.6B shape ({spec.numel() / 1e6:.0f} M elements), "
        f"{args.fraction:.1%} changed, {n_local / n_changed:.2f} routed copies per element",
        ["mode", "threads", "changed elements", "ms (best)", "M elements/s"],
        rows,
    )
    print(
        f"table build {build_s * 1e3:.0f} ms; memory read {gbps:.1f} GB/s -> index-traffic floor "
        f"~{floor / 1e6:.0f} M elements/s; verified {checked:,} routed elements against a dense split"
    )
    best_threads = min(timings, key=lambda t: timings[t]["route"])
    best = {m: n_changed / s_ / 1e6 for m, s_ in timings[best_threads].items()}
    emit_json(
        {
            "bench": "route",
            "model": "qwen3-0.6b",
            "engine": "vllm",
            "tp": args.tp,
            "fraction": args.fraction,
            "changed_elements": n_changed,
            "routed_elements": n_local,
            "best_threads": best_threads,
            "route_melem_s": round(best["route"], 1),
            "route_values_melem_s": round(best["route_values"], 1),
            "route_changes_melem_s": round(best["route_changes"], 1),
            "by_threads": {
                str(t): {m: round(n_changed / s_ / 1e6, 1) for m, s_ in v.items()}
                for t, v in timings.items()
            },
            "target_melem_s": TARGET_MELEM_S,
            "meets_target": best["route"] >= TARGET_MELEM_S,
            "build_ms": round(build_s * 1e3, 1),
            "memory_read_gbps": round(gbps, 2),
            "verified_elements": checked,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
