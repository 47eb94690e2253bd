"""AdamWTracker detection throughput on a CUDA device, checked against the BF16 ground truth.

    python -m deltasync_bench.gpu_detect_bench [--elements 1e9] [--device cuda]

Builds ``--elements`` fp32 elements in 8 parameters on the device, takes one real
``torch.optim.AdamW`` step at lr 3e-6 (m/sqrt(v) ~ ±1 everywhere) and measures the second:
``changed()`` and ``changed_values()`` of the tracker, and the bitset kernel alone at the
shipped chunk size and at larger ones patched in for this measurement only (the torch path is
launch-bound at 2^20 elements on an H200). Rates count 12 bytes read per element (θ, m, v)
against this device's own copy rate. It checks every detected position and value against the
BF16 bits before and after the step (``missed`` and ``wrong_values`` must be 0) and ends with
one JSON line; a miss or a wrong value fails it. ``--device cpu`` dry-runs the logic.
"""

from __future__ import annotations

import argparse
import time

import torch

from deltasync import AdamWTracker
from deltasync.trainer import detect
from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
from deltasync_bench.common import emit_json

LR, WD, BETAS, EPS = 3e-6, 0.01, (0.9, 0.999), 1e-8
NPARAMS = 8
COPY_TBS = 4.3  # H200 device-to-device copy rate (read + write) when none is measured here


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(dev: torch.device, fn, reps: int = 3):
    fn()  # warm-up (allocator, launches)
    best, out = float("inf"), None
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(total: int, dev: torch.device) -> dict:
    copy_tbs = None
    if dev.type == "cuda":  # this machine's own copy rate, 2 x 4 GiB per copy
        a = torch.empty(1 << 30, dtype=torch.float32, device=dev)
        b = torch.empty_like(a)
        t, _ = _timed(dev, lambda: b.copy_(a), reps=5)
        copy_tbs = 2 * a.numel() * 4 / t / 1e12
        del a, b

    per = total // NPARAMS
    total = per * NPARAMS
    g = torch.Generator(device=dev).manual_seed(0)
    ps = [
        torch.nn.Parameter(torch.randn(per // 1000, 1000, device=dev, generator=g) * 0.02)
        for _ in range(NPARAMS)
    ]
    named = [(f"layer{i}.weight", p) for i, p in enumerate(ps)]
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    tracker = AdamWTracker(opt, named)
    assert tracker.fallback == {}, tracker.fallback
    for p in ps:
        p.grad = torch.randn(p.shape, device=dev, generator=g)
    opt.step()  # step 1: the measured version is step 2
    tracker.clear()
    before = [p.detach().to(torch.bfloat16).view(torch.int16).clone() for p in ps]
    for p in ps:
        p.grad.normal_(generator=g)
    _sync(dev)
    t0 = time.perf_counter()
    opt.step()
    _sync(dev)
    step_s = time.perf_counter() - t0
    for p in ps:
        p.grad = None

    t_changed, ch = _timed(dev, tracker.changed)
    t_values, cv = _timed(dev, tracker.changed_values)
    missed = extra = true = bad_values = 0
    for (name, p), b in zip(named, before, strict=True):
        truth = b.view(-1) != p.detach().to(torch.bfloat16).view(torch.int16).view(-1)
        empty = (torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0))
        idx, vals = cv.get(name, empty)
        assert torch.equal(idx, ch[name]) if name in ch else idx.numel() == 0
        det = torch.zeros_like(truth)
        det[idx.to(dev)] = True
        missed += int((truth & ~det).sum())
        extra += int((det & ~truth).sum())
        true += int(truth.sum())
        want = p.detach().reshape(-1)[idx.to(dev)].to(torch.bfloat16).view(torch.int16).cpu()
        bad_values += int((vals.view(torch.int16).cpu() != want).sum())

    # the bitset kernel alone (what several steps per version run), at the shipped chunk size
    # and at larger ones patched in for this measurement only
    k = kernel_scalars(
        StepHyper(
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=WD,
            decoupled=True,
            step=int(float(opt.state[ps[0]]["step"])),
        )
    )
    bits = [torch.zeros(detect.bitset_bytes(p.numel()), dtype=torch.uint8, device=dev) for p in ps]

    def bitset_pass() -> None:
        for p, bb in zip(ps, bits, strict=True):
            bb.zero_()
            st = opt.state[p]
            detect.detect_adamw_(p.detach(), st["exp_avg"], st["exp_avg_sq"], k, bb)

    shipped = detect._DEVICE_CHUNK if dev.type != "cpu" else detect._CHUNK
    kernel_rows, ref_bits = [], None
    for chunk in dict.fromkeys((shipped, 1 << 20, 1 << 24, 1 << 26)):
        if dev.type != "cuda" and chunk != shipped:
            continue
        detect._DEVICE_CHUNK = chunk
        try:
            t, _ = _timed(dev, bitset_pass)
        finally:
            detect._DEVICE_CHUNK = shipped
        if ref_bits is None:
            ref_bits, same = [bb.clone() for bb in bits], True
        else:
            same = all(torch.equal(a, bb) for a, bb in zip(ref_bits, bits, strict=True))
        kernel_rows.append((chunk, t, same))

    read = 12 * total  # bytes read: p, m, v (fp32)
    ref = copy_tbs or COPY_TBS

    def row(label: str, t: float, note: str = "") -> dict:
        gbs = read / t / 1e9
        print(
            f"{label:<42} {t * 1e3:9.1f} ms {total / t / 1e9:8.2f} Gelem/s {gbs:9.1f} GB/s "
            f"{100 * gbs / (ref * 1e3):6.1f}% of copy {note}"
        )
        return {"s": round(t, 5), "elems_per_s": round(total / t), "gb_per_s": round(gbs, 1)}

    print(
        f"device {dev}, {NPARAMS} params x {per} = {total} fp32 elements, AdamW lr={LR} "
        f"wd={WD}, measured version = step 2 (one step per version)"
    )
    if copy_tbs:
        print(f"device-to-device copy here: {copy_tbs:.2f} TB/s (read+write)")
    print(f"optimizer step (default implementation, for reference): {step_s * 1e3:.1f} ms")
    print(
        f"{'what (GB/s counts 12 B read per element)':<42} {'time':>12} {'rate':>16} {'GB/s':>14}"
    )
    res: dict = {
        "changed": row("changed() (indices)", t_changed),
        "changed_values": row("changed_values() (indices + bf16 values)", t_values),
        "bitset_pass": [],
    }
    for chunk, t, same in kernel_rows:
        note = "" if chunk == shipped else f"(patched in; same bits: {same})"
        r = row(f"detect_adamw_ bitset, chunk 2**{chunk.bit_length() - 1}", t, note)
        r.update(chunk=chunk, same_bits_as_shipped=same)
        res["bitset_pass"].append(r)
    print(
        f"exactness vs bf16 ground truth: true {true}, missed {missed}, extra {extra} "
        f"({100 * extra / max(true, 1):.2f}% of true), wrong values {bad_values}"
    )
    return {
        "bench": "gpu_detect",
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "elements": total,
        "params": NPARAMS,
        "lr": LR,
        "weight_decay": WD,
        "true": true,
        "missed": missed,
        "extra": extra,
        "wrong_values": bad_values,
        "copy_tb_per_s": round(copy_tbs, 3) if copy_tbs else None,
        "step_s": round(step_s, 5),
        **res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=1e9, help="fp32 elements in all (1e9)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_detect_bench: no CUDA device (use --device cpu for a dry run)")
    out = run(int(args.elements), dev)
    emit_json(out)
    if out["missed"] or out["wrong_values"]:
        print(
            f"gpu_detect_bench: {out['missed']} missed elements, {out['wrong_values']} wrong values"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
