#!/usr/bin/env bash
# The CPU test tier. The S3 tests start their own S3-compatible server (moto) on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
