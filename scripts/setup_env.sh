#!/usr/bin/env bash
# Create .venv (once) and install deltasync with the exact versions of constraints.txt.
# torch is installed first and alone, pinned, so pip takes the local CPU wheel
# instead of resolving a multi-GB CUDA build for some other package's range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.deltasync-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ setup.py -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[models,s3,bench,test]"
  touch "$STAMP"
fi
