#!/usr/bin/env bash
# The CPU test tier. The S3 tests start their own S3-compatible server (moto) on 127.0.0.1.
# Two pytest-xdist workers (DELTASYNC_TEST_WORKERS; 0 runs in one process), each test file on
# one worker (its module fixtures, some of them multi-process runs, run once): many tests wait
# out real timeouts of real processes, so two workers overlap those waits on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -n "${DELTASYNC_TEST_WORKERS:-2}" --dist loadfile "$@"
