#!/usr/bin/env bash
# The device tier, in one go, on a machine with a CUDA device (about 2 minutes on an H200):
#   1. the pytest tests marked `gpu` (deselected by default in pyproject's addopts);
#   2. AdamWTracker detection throughput on CUDA (the torch implementation of detect.py) over
#      GPU_TIER_ELEMS fp32 elements (default 1e9, 8 params), after one AdamW step at lr 3e-6,
#      checked against the BF16 ground truth (missed must be 0), ending with one JSON line.
# Wheels for packages that machine lacks (zstandard) travel in .whl/ and are installed into
# /tmp/site. The whole log goes to $OUT/gpu_tier.log (or /tmp/gpu_tier/gpu_tier.log).
#   3. bench/gpu_sync_bench.py: a CUDA trainer's streamed store-path sync to CPU receivers
#      (GPU_TIER_SYNC_MODEL, default qwen3-0.6b), bit-exact per version.
# Environment: PYTHON (default python3), GPU_TIER_ELEMS, GPU_TIER_DEVICE (default cuda; cpu
# only to dry-run the script's logic on a machine without one), GPU_TIER_SYNC_MODEL,
# GPU_TIER_SKIP_TESTS=1 / GPU_TIER_SKIP_DETECT=1 to run only the later stages.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${OUT:-/tmp/gpu_tier}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
GPU_TIER_SYNC_MODEL=${GPU_TIER_SYNC_MODEL:-qwen3-0.6b}
export PYTHONUNBUFFERED=1

tier() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "gpu_tier: wheel install failed"; return 2; }
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  echo "== device"
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  "$PY" - <<'EOF'
import platform, sys, torch
from deltasync.native import loader as native
print(f"python {sys.version.split()[0]} ({sys.executable}), {platform.machine()}")
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    pr = torch.cuda.get_device_properties(0)
    print(f"device {pr.name}, {pr.multi_processor_count} SMs, {pr.total_memory / 2**30:.0f} GiB")
lib = native.load()
print(f"native C kernels (CPU only): {'built' if lib is not None else 'NOT built: ' + str(native.build_error)}")
from importlib import metadata
for dist in ("numpy", "safetensors", "zstandard", "xxhash", "transformers", "pytest", "pytest-timeout"):
    try:
        print(f"  {dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"  {dist} missing")
EOF

  local rc_tests=0 rc_bench=0
  if [ "${GPU_TIER_SKIP_TESTS:-0}" != 1 ]; then
  echo "== pytest -m gpu"
  timeout 270 "$PY" -m pytest -m gpu -p no:cacheprovider -q -o addopts=-ra --durations=8 \
    tests/format/test_format_gpu.py tests/layout/test_routing.py tests/trainer/test_tracker_gpu.py \
    tests/sync/test_publish_gpu.py
  rc_tests=$?
  fi

  if [ "${GPU_TIER_SKIP_DETECT:-0}" != 1 ]; then
  echo "== detection throughput on the device"
  timeout 150 "$PY" - <<'EOF'
import json, os, time
import torch
from deltasync import AdamWTracker
from deltasync.trainer import detect
from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars

dev = torch.device(os.environ.get("GPU_TIER_DEVICE", "cuda"))
if dev.type == "cuda" and not torch.cuda.is_available():
    raise SystemExit("gpu_tier bench: no CUDA device")
total = int(float(os.environ.get("GPU_TIER_ELEMS", "1e9")))
nparams = 8
per = total // nparams
total = per * nparams
LR, WD, BETAS, EPS = 3e-6, 0.01, (0.9, 0.999), 1e-8
COPY_TBS = 4.3  # H200 device-to-device copy rate measured here (KINDS.md), bytes read + written

def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()

def timed(fn, reps=3):
    fn()  # warm-up (allocator, launches)
    ts = []
    for _ in range(reps):
        sync(); t0 = time.perf_counter(); out = fn(); sync()
        ts.append(time.perf_counter() - t0)
    return min(ts), out

copy_tbs = None
if dev.type == "cuda":  # this machine's own copy rate, 2 x 4 GiB per copy
    a = torch.empty(1 << 30, dtype=torch.float32, device=dev); b = torch.empty_like(a)
    t, _ = timed(lambda: b.copy_(a), reps=5)
    copy_tbs = 2 * a.numel() * 4 / t / 1e12
    del a, b

g = torch.Generator(device=dev).manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(per // 1000, 1000, device=dev, generator=g) * 0.02)
      for _ in range(nparams)]
named = [(f"layer{i}.weight", p) for i, p in enumerate(ps)]
opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
tracker = AdamWTracker(opt, named)
assert tracker.fallback == {}, tracker.fallback
for p in ps:
    p.grad = torch.randn(p.shape, device=dev, generator=g)
opt.step()  # step 1 (m/sqrt(v) ~ +-1 everywhere): the measured version is step 2
tracker.clear()
before = [p.detach().to(torch.bfloat16).view(torch.int16).clone() for p in ps]
for p in ps:
    p.grad.normal_(generator=g)
sync(); t0 = time.perf_counter(); opt.step(); sync(); step_s = time.perf_counter() - t0
for p in ps:
    p.grad = None

t_changed, ch = timed(tracker.changed)
t_values, cv = timed(tracker.changed_values)
missed = extra = true = bad_values = 0
for name, p, b in zip([n for n, _ in named], ps, before):
    truth = b.view(-1) != p.detach().to(torch.bfloat16).view(torch.int16).view(-1)
    idx, vals = cv.get(name, (torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0)))
    assert torch.equal(idx, ch[name]) if name in ch else idx.numel() == 0
    det = torch.zeros_like(truth)
    det[idx.to(dev)] = True
    missed += int((truth & ~det).sum()); extra += int((det & ~truth).sum()); true += int(truth.sum())
    want = p.detach().reshape(-1)[idx.to(dev)].to(torch.bfloat16).view(torch.int16).cpu()
    bad_values += int((vals.view(torch.int16) != want).sum())

# the bitset kernel alone (what several steps per version run), as shipped and with larger
# other chunk sizes patched in for this measurement only (the torch path is launch-bound at 2**20)
state = opt.state
k = kernel_scalars(StepHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                             decoupled=True, step=int(float(state[ps[0]]["step"]))))
bits = [torch.zeros(detect.bitset_bytes(p.numel()), dtype=torch.uint8, device=dev) for p in ps]

def bitset_pass():
    for p, bb in zip(ps, bits):
        bb.zero_()
        detect.detect_adamw_(p.detach(), state[p]["exp_avg"], state[p]["exp_avg_sq"], k, bb)
    return None

shipped = detect._DEVICE_CHUNK if dev.type != "cpu" else detect._CHUNK
kernel_rows = []
ref_bits = None
for chunk in dict.fromkeys((shipped, 1 << 20, 1 << 24, 1 << 26)):
    if dev.type != "cuda" and chunk != shipped:
        continue
    detect._DEVICE_CHUNK = chunk
    try:
        t, _ = timed(bitset_pass)
    finally:
        detect._DEVICE_CHUNK = shipped
    same = True
    if ref_bits is None:
        ref_bits = [bb.clone() for bb in bits]
    else:
        same = all(torch.equal(a, bb) for a, bb in zip(ref_bits, bits))
    kernel_rows.append((chunk, t, same))

rd = 12 * total  # bytes read: p, m, v (fp32)
def row(label, t, extra_note=""):
    gbs = rd / t / 1e9
    ref = copy_tbs or COPY_TBS
    print(f"{label:<42} {t * 1e3:9.1f} ms {total / t / 1e9:8.2f} Gelem/s {gbs:9.1f} GB/s "
          f"{100 * gbs / (ref * 1e3):6.1f}% of copy {extra_note}")
    return {"s": round(t, 5), "elems_per_s": round(total / t), "gb_per_s": round(gbs, 1)}

print(f"device {dev}, {nparams} params x {per} = {total} fp32 elements, AdamW lr={LR} wd={WD}, "
      f"measured version = step 2 (one step per version)")
if copy_tbs:
    print(f"device-to-device copy here: {copy_tbs:.2f} TB/s (read+write); KINDS.md: {COPY_TBS} TB/s")
print(f"optimizer step (default implementation, for reference): {step_s * 1e3:.1f} ms")
print(f"{'what (GB/s counts 12 B read per element)':<42} {'time':>12} {'rate':>16} {'GB/s':>14}")
res = {"changed": row("changed() (indices)", t_changed),
       "changed_values": row("changed_values() (indices + bf16 values)", t_values)}
res["bitset_pass"] = []
for chunk, t, same in kernel_rows:
    r = row(f"detect_adamw_ bitset, chunk 2**{chunk.bit_length() - 1}", t,
            "" if chunk == shipped else f"(patched in; same bits: {same})")
    r.update(chunk=chunk, same_bits_as_shipped=same)
    res["bitset_pass"].append(r)
print(f"exactness vs bf16 ground truth: true {true}, missed {missed}, extra {extra} "
      f"({100 * extra / max(true, 1):.2f}% of true), wrong values {bad_values}")
out = {"bench": "gpu_tier_detect", "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
       "torch": torch.__version__, "elements": total, "params": nparams, "lr": LR, "weight_decay": WD,
       "true": true, "missed": missed, "extra": extra, "wrong_values": bad_values,
       "copy_tb_per_s": round(copy_tbs, 3) if copy_tbs else None, "step_s": round(step_s, 5), **res}
try:
    from deltasync.jsonline import emit_json_line
    emit_json_line(out)
except ImportError:
    print(json.dumps(out))
if missed or bad_values:
    raise SystemExit(f"gpu_tier bench: {missed} missed elements, {bad_values} wrong values")
EOF
  rc_bench=$?
  fi

  echo "== store-path sync from a CUDA trainer ($GPU_TIER_SYNC_MODEL)"
  timeout 300 "$PY" bench/gpu_sync_bench.py --model "$GPU_TIER_SYNC_MODEL" --versions 3
  local rc_sync=$?
  echo "== gpu_tier: pytest rc=$rc_tests, bench rc=$rc_bench, sync rc=$rc_sync"
  [ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_sync" -eq 0 ]
}

tier 2>&1 | tee "$LOG_DIR/gpu_tier.log"
exit "${PIPESTATUS[0]}"
