"""A whole in-cluster job under torchrun (the ``cluster-worker`` command); the other tests
start their groups with ``spawn``, as the benchmark program does with the same job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # the same job as the spawn-based tests, under torchrun
@pytest.mark.timeout(90)
def test_two_fsdp_writers_and_a_receiver_under_torchrun_end_bit_identical() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=3",
            "-m",
            "deltasync",
            "cluster-worker",
            "--writers",
            "2",
            "--tp",
            "1",
            "--versions",
            "3",
            "--timeout-s",
            "20",
            "--part-kib",
            "1",  # every delta streamed in many parts
        ],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]
    by_rank = {line["rank"]: line for line in lines}
    assert sorted(by_rank) == [0, 1, 2]
    assert [by_rank[r]["writer"] for r in (0, 1)] == ["w00000", "w00001"]
    for r in (0, 1):  # an anchor and 3 deltas, each writer sending its half every time
        assert len(by_rank[r]["bytes"]) == 4 and min(by_rank[r]["bytes"]) > 0
    assert by_rank[2]["shard"] == "tp0" and by_rank[2]["exact"] is True


@pytest.mark.timeout(90)
def test_a_job_started_with_too_few_processes_says_how_many_to_start_on_every_rank() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",  # the job: 1 writer + tp 2 receivers = 3 ranks
            "-m",
            "deltasync",
            "cluster-worker",
            "--versions",
            "1",
            "--timeout-s",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
        check=False,
    )
    assert done.returncode != 0
    # both ranks say it (their lines may interleave on the shared pipe), before any collective
    said = "process group has 2: start it with torchrun --nproc-per-node 3"
    assert done.stderr.count(said) == 2, done.stderr[-3000:]
    assert "SendFailedError" not in done.stderr and "PeerFailedError" not in done.stderr
