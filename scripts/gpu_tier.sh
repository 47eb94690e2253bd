#!/usr/bin/env bash
# The device tier, in one go, on a machine with a CUDA device (about 2 minutes on an H200):
#   1. the pytest tests marked `gpu` (deselected by default in pyproject's addopts);
#   2. bench/gpu_detect_bench.py: AdamWTracker detection throughput on CUDA (the torch
#      implementation of detect.py) over GPU_TIER_ELEMS fp32 elements (default 1e9, 8 params),
#      after one AdamW step at lr 3e-6, checked against the BF16 ground truth (missed must be 0).
# Wheels for packages that machine lacks (zstandard) or holds at another version travel in
# .whl/ and are installed into /tmp/site: fetch them first where PyPI is reachable
# (`bash scripts/gpu_wheels.sh`) and carry `.whl` in the device run. The whole log goes to
# $OUT/gpu_tier.log (or /tmp/gpu_tier/gpu_tier.log).
#   3. bench/gpu_sync_bench.py: a CUDA trainer's store-path sync to CPU receivers, blocking and
#      overlapped (GPU_TIER_SYNC_MODEL, default qwen3-0.6b), bit-exact per version.
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

# bench/ is the package deltasync_bench and examples/ deltasync_examples once installed; without
# an install, a folder of symlinks under those names puts them on PYTHONPATH.
python_apps() {
  local d=/tmp/gpu_tier_apps
  mkdir -p "$d"
  ln -sfn "$PWD/bench" "$d/deltasync_bench"
  ln -sfn "$PWD/examples" "$d/deltasync_examples"
  echo "$d"
}

tier() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "gpu_tier: wheel install failed"; return 2; }
    export PYTHONPATH=/tmp/site
  fi
  # the library and its benchmark programs, importable without an install
  PYTHONPATH="$PWD/src:$(python_apps)${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
  echo "== device"
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  "$PY" -m deltasync_bench.device_info

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
  timeout 150 "$PY" -m deltasync_bench.gpu_detect_bench --elements "${GPU_TIER_ELEMS:-1e9}" \
    --device "${GPU_TIER_DEVICE:-cuda}"
  rc_bench=$?
  fi

  echo "== store-path sync from a CUDA trainer ($GPU_TIER_SYNC_MODEL)"
  timeout 300 "$PY" -m deltasync_bench.gpu_sync_bench --model "$GPU_TIER_SYNC_MODEL" --versions 3
  local rc_sync=$?
  echo "== gpu_tier: pytest rc=$rc_tests, bench rc=$rc_bench, sync rc=$rc_sync"
  [ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_sync" -eq 0 ]
}

tier 2>&1 | tee "$LOG_DIR/gpu_tier.log"
exit "${PIPESTATUS[0]}"
