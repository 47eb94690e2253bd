"""Detection throughput on FSDP2-style DTensor shards vs plain tensors, and the cost of the
version-counter check that catches edits outside the optimizer.

One process, a one-rank gloo group: the same fp32 parameters (``--params`` tensors of
``--rows`` x ``--cols``) are tracked once as plain ``nn.Parameter`` and once as DTensors
(``Shard(0)`` on a one-rank mesh, so the local shard is the whole tensor and both runs detect
the same elements). After one AdamW step each, ``changed_values()`` is timed (best of
``--repeat``), and so is the version check alone (``tracker.out_of_band``).

Checked against the bitwise truth: the elements whose BF16 cast differs before and after the
step. Each run must report every one of them (``missed`` 0) with its BF16 value, and both runs
the same positions; a run that is not exact prints ``exact: NO`` and exits 1.

Prints a table, then one JSON line.

    .venv/bin/python bench/detect_dtensor.py --params 64 --rows 1024 --cols 1024
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from deltasync import AdamWTracker


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _bf16(p: torch.Tensor) -> torch.Tensor:
    """The BF16 cast of the local shard, flat (on a one-rank mesh: the whole tensor)."""
    local = p.detach()
    local = local.to_local() if hasattr(local, "to_local") else local
    return local.to(torch.bfloat16).reshape(-1)


def _check(before: list[torch.Tensor], params: list, got: dict) -> tuple[dict, int, int]:
    """The run's changes against the bitwise truth: ``(positions, missed, wrong values)``;
    extra positions (an element whose fp32 moved within its BF16 cell) are allowed."""
    positions, missed, wrong = {}, 0, 0
    for i, (b, p) in enumerate(zip(before, params, strict=True)):
        after = _bf16(p)
        truth = torch.nonzero(after.view(torch.int16) != b.view(torch.int16)).reshape(-1)
        idx, vals = got.get(f"p{i}", (truth[:0], after[:0]))
        idx = idx.to(torch.int64)
        missed += int((~torch.isin(truth, idx)).sum())
        wrong += int((vals.view(torch.int16) != after[idx].view(torch.int16)).sum())
        positions[f"p{i}"] = idx
    return positions, missed, wrong


def _run(params: list[torch.nn.Parameter], grads: list[torch.Tensor], repeat: int) -> dict:
    opt = torch.optim.AdamW(params, lr=3e-6, weight_decay=0.01, foreach=False)
    tracker = AdamWTracker(opt, [(f"p{i}", p) for i, p in enumerate(params)], strict=True)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone() if not hasattr(p, "device_mesh") else _like(p, g)
    before = [_bf16(p) for p in params]
    opt.step()
    got = tracker.changed_values()
    found = sum(int(i.numel()) for i, _ in got.values())
    positions, missed, wrong = _check(before, params, got)
    detect_s = _best(tracker.changed_values, repeat)
    check_s = _best(lambda: tracker.out_of_band, max(repeat, 20))
    local_s = _best(tracker.local_params, max(repeat, 20))  # resolving every local shard
    return {
        "detect_s": detect_s,
        "version_check_s": check_s,
        "local_view_s": local_s,
        "changed": found,
        "missed": missed,
        "wrong_values": wrong,
        "positions": positions,
    }


def _like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(g, p.device_mesh, p.placements)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(args.rows, args.cols, generator=g) * 0.02 for _ in range(args.params)]
    grads = [torch.randn(args.rows, args.cols, generator=g) for _ in range(args.params)]
    plain = [torch.nn.Parameter(b.clone()) for b in base]
    dt = [torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Shard(0)])) for b in base]
    res = {"plain": _run(plain, grads, args.repeat), "dtensor": _run(dt, grads, args.repeat)}
    dist.destroy_process_group()
    n = args.params * args.rows * args.cols
    print(
        f"{'params':>8} {'elements':>12} {'kind':>8} {'detect s':>10} {'M elem/s':>10} "
        f"{'changed':>10} {'version check us':>17} {'local views us':>15}"
    )
    for kind, r in res.items():
        print(
            f"{args.params:>8} {n:>12} {kind:>8} {r['detect_s']:>10.4f} "
            f"{n / r['detect_s'] / 1e6:>10.1f} {r['changed']:>10} "
            f"{r['version_check_s'] * 1e6:>17.1f} {r['local_view_s'] * 1e6:>15.1f}"
        )
    plain, dtensor = (res[k].pop("positions") for k in ("plain", "dtensor"))
    same = plain.keys() == dtensor.keys() and all(torch.equal(plain[k], dtensor[k]) for k in plain)
    exact = same and all(r["missed"] == 0 and r["wrong_values"] == 0 for r in res.values())
    for kind, r in res.items():
        if r["missed"] or r["wrong_values"]:
            print(
                f"{kind}: missed {r['missed']} changed elements, {r['wrong_values']} wrong values"
            )
    if not same:
        print("plain and DTensor runs report different positions")
    print("exact:", "yes" if exact else "NO")
    out = {
        "bench": "detect_dtensor",
        "params": args.params,
        "elements": n,
        "threads": torch.get_num_threads(),
        **{f"{k}_{m}": v for k, r in res.items() for m, v in r.items()},
        "dtensor_over_plain": res["dtensor"]["detect_s"] / res["plain"]["detect_s"],
        "version_check_us_per_param": res["dtensor"]["version_check_s"] * 1e6 / args.params,
        "exact": exact,
    }
    print(json.dumps(out))
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
