#!/usr/bin/env bash
# Fetch, on a machine with access to PyPI, the wheels scripts/gpu_tier.sh installs on a device
# machine that cannot reach a package index: the runtime dependencies its image lacks or holds
# at another version than constraints.txt pins, built for its Python (3.12, manylinux x86-64).
# They land in .whl/ (ignored by git); a device run carries that folder and gpu_tier.sh
# installs it into /tmp/site before anything imports deltasync.
#
#   bash scripts/gpu_wheels.sh            # zstandard and xxhash at their pinned versions
#   GPU_WHEELS_PYTHON=3.11 bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${GPU_WHEELS_PYTHON:-3.12}

pinned() {  # the version constraints.txt pins for package $1
  local line
  line=$(grep -E "^$1==" constraints.txt) || { echo "gpu_wheels: $1 is not pinned" >&2; exit 2; }
  echo "${line#*==}"
}

mkdir -p .whl
rm -f .whl/*.whl
for name in zstandard xxhash; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$(pinned "$name")"
done
ls -l .whl
