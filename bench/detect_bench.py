"""``deltasync bench detect``: detection and codec throughput against this machine's memory floor.

Builds a ~0.5B-element fp32 parameter set, runs real AdamW steps (random gradients through
``torch.optim.AdamW`` at an RL learning rate; no hand-made sparsity), and measures in one run:
STREAM-like memory read bandwidth, AdamWTracker detection (the kernel alone and ``changed()``
with index extraction), the SnapshotTracker, the same detection in plain torch (the naive
baseline), and encode/decode/apply of the resulting sparse update. It checks ``missed == 0``
against the bitwise truth and that decode+apply reproduces the new BF16 weights exactly.
Every flag is checked first (a ConfigError naming it, exit 2), before anything is allocated.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError
from deltasync.trainer import AdamWTracker, SnapshotTracker
from deltasync.trainer.adamw_bound import kernel_scalars
from deltasync.trainer.detect import bitset_bytes, detect_adamw_
from deltasync.validate import check_int, check_number
from deltasync_bench.common import emit_json, memory_read_gbps, print_table, timed


@dataclass(frozen=True, kw_only=True)
class DetectBenchConfig:
    elements: int = 500_000_000
    tensors: int = 20
    lr: float = 3e-6
    weight_decay: float = 0.1
    warmup_steps: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("DetectBenchConfig", "tensors", self.tensors, lo=1)
        check_int("DetectBenchConfig", "elements", self.elements, lo=self.tensors)
        # AdamW's own range; an infinite lr makes every param inf/NaN, which nothing detects
        check_number("DetectBenchConfig", "lr", self.lr)
        check_number("DetectBenchConfig", "weight_decay", self.weight_decay, positive=False)
        check_int("DetectBenchConfig", "warmup_steps", self.warmup_steps, lo=0)
        check_int("DetectBenchConfig", "seed", self.seed, lo=0)


def run(cfg: DetectBenchConfig) -> dict:
    torch.manual_seed(cfg.seed)
    per = cfg.elements // cfg.tensors
    params = [torch.nn.Parameter(torch.empty(per).normal_(0.0, 0.02)) for _ in range(cfg.tensors)]
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)

    def step() -> None:
        for p in params:
            p.grad = torch.empty_like(p).normal_(0.0, 1e-3)
        opt.step()
        for p in params:
            p.grad = None  # keep peak memory at params + optimizer state

    for _ in range(cfg.warmup_steps):  # realistic m, v (not the first-step special case)
        step()
    gbps = memory_read_gbps()
    floor = gbps * 1e9 / 12.0  # θ, m, v: 12 bytes read per element

    tracker = AdamWTracker(opt, named)
    truth = SnapshotTracker(named)
    old_bf16 = {n: p.detach().to(torch.bfloat16) for n, p in named}
    step()

    # detection kernel alone, repeated on the same step (it only ORs bits; idempotent)
    pending = list(tracker._pending)
    hyper = pending[0][1]
    scal = kernel_scalars(hyper)
    bits = [torch.zeros(bitset_bytes(p.numel()), dtype=torch.uint8) for p in params]

    def kernel_pass(force_torch: bool = False) -> None:
        for p, b in zip(params, bits, strict=False):
            st = opt.state[p]
            detect_adamw_(
                p.detach(), st["exp_avg"], st["exp_avg_sq"], scal, b, force_torch=force_torch
            )

    t_kernel, _ = timed(kernel_pass, repeat=3)
    t_torch, _ = timed(lambda: kernel_pass(True), repeat=1)
    bits.clear()  # the scratch bitsets (n/8 bytes) are not needed past the kernel timing
    t_changed, changed = timed(tracker.changed)
    t_snap, truth_changed = timed(truth.changed)
    t_snap_clear, _ = timed(truth.clear)

    missed = extra = true = 0
    for name in truth_changed.keys() | changed.keys():
        a = changed.get(name, torch.empty(0, dtype=torch.int64))
        b = truth_changed.get(name, torch.empty(0, dtype=torch.int64))
        inter = int(torch.isin(b, a).sum())
        missed += b.numel() - inter
        extra += a.numel() - inter
        true += b.numel()

    codec = _codec_round_trip(named, changed, old_bf16)
    n = cfg.elements
    res = {
        "elements": n,
        "lr": cfg.lr,
        "memory_read_gbps": round(gbps, 2),
        "floor_elements_per_s": floor,
        "detect_elements_per_s": n / t_kernel,
        "detect_fraction_of_floor": (n / t_kernel) / floor,
        "changed_call_elements_per_s": n / t_changed,
        "naive_torch_elements_per_s": n / t_torch,
        "snapshot_elements_per_s": n / t_snap,
        "snapshot_clear_s": t_snap_clear,
        "snapshot_bytes": truth.snapshot_bytes(),
        "tracker_bytes": tracker.memory_bytes(),
        "true_changed": true,
        "changed_fraction": true / n,
        "missed": missed,
        "extra_over_true": extra / max(true, 1),
        **codec,
    }
    rows = [
        ["memory read (STREAM-like)", f"{gbps:.1f} GB/s", "floor", f"{floor / 1e6:.0f} M el/s"],
        [
            "AdamWTracker kernel",
            f"{t_kernel:.3f} s",
            f"{n / t_kernel / 1e6:.0f} M el/s",
            f"{res['detect_fraction_of_floor']:.2f} of floor",
        ],
        [
            "AdamWTracker.changed()",
            f"{t_changed:.3f} s",
            f"{n / t_changed / 1e6:.0f} M el/s",
            "kernel + indices",
        ],
        [
            "naive torch detection",
            f"{t_torch:.3f} s",
            f"{n / t_torch / 1e6:.0f} M el/s",
            f"{(n / t_torch) / floor:.2f} of floor",
        ],
        [
            "SnapshotTracker.changed()",
            f"{t_snap:.3f} s",
            f"{n / t_snap / 1e6:.0f} M el/s",
            f"+{truth.snapshot_bytes() / 2**30:.2f} GiB held",
        ],
        [
            "changed / extra / missed",
            f"{true}",
            f"{extra} ({res['extra_over_true']:.4f})",
            f"{missed}",
        ],
        [
            "encode",
            f"{codec['encode_s']:.3f} s",
            f"{codec['blob_bytes'] / 2**20:.1f} MiB blob",
            f"{codec['encode_elements_per_s'] / 1e6:.0f} M el/s",
        ],
        [
            "decode",
            f"{codec['decode_s']:.3f} s",
            "",
            f"{codec['decode_elements_per_s'] / 1e6:.0f} M el/s",
        ],
        [
            "apply",
            f"{codec['apply_s']:.3f} s",
            "",
            f"{codec['apply_elements_per_s'] / 1e6:.0f} M el/s",
        ],
    ]
    print_table(
        f"detection on {n / 1e6:.0f} M elements, AdamW lr={cfg.lr}",
        ["what", "time", "rate", "note"],
        rows,
    )
    return res


def _codec_round_trip(named, changed, old_bf16) -> dict:
    """Encode the changed values, decode, apply onto the old BF16 weights; must equal new BF16."""
    from deltasync.format import apply_updates, decode_blob, encode_blob, sparse_update

    params = dict(named)
    t0 = time.perf_counter()
    updates = [sparse_update(n, params[n].detach(), idx) for n, idx in changed.items()]
    blob = encode_blob(updates, version=1, base_version=0, shard="tp0", writer="w00000")
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = decode_blob(blob, version=1, base_version=0, shard="tp0")
    t_dec = time.perf_counter() - t0
    t0 = time.perf_counter()
    apply_updates(decoded.updates, old_bf16)
    t_app = time.perf_counter() - t0
    exact = all(
        torch.equal(old_bf16[n].view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))
        for n, p in named
    )
    nnz = sum(int(i.numel()) for i in changed.values())
    return {
        "blob_bytes": len(blob),
        "encode_s": t_enc,
        "decode_s": t_dec,
        "apply_s": t_app,
        "encode_elements_per_s": nnz / t_enc,
        "decode_elements_per_s": nnz / t_dec,
        "apply_elements_per_s": nnz / t_app,
        "exact": exact,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DetectBenchConfig()
    p.add_argument("--elements", type=int, default=d.elements)
    p.add_argument("--tensors", type=int, default=d.tensors)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)


def main(args: argparse.Namespace) -> int:
    if args.tensors < 1 or args.elements < args.tensors:
        raise ConfigError(
            f"--elements ({args.elements}) must be >= --tensors ({args.tensors}) >= 1"
        )
    cfg = DetectBenchConfig(  # --lr, --weight-decay, --seed: ConfigError naming the field
        elements=args.elements,
        tensors=args.tensors,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
    )
    res = run(cfg)
    exact = res["missed"] == 0 and res["exact"]
    print("exact:", "yes" if exact else "NO")
    emit_json(res)
    return 0 if exact else 1
