"""Starting groups: spawn's results, hard timeout and error reporting; torchrun's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltasync.errors import ConfigError
from deltasync.exchange import SpawnError, init_from_env, spawn

from exchange_testkit import exit_on_rank_one, raise_on_rank_one, report_environment, sleep_forever

HERE = Path(__file__).parent


@pytest.mark.timeout(30)
def test_spawn_gives_each_child_a_torchrun_environment_and_returns_results_in_rank_order() -> None:
    results = spawn(report_environment, 3, "hello", timeout_s=20)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r == {
            "rank": rank,
            "tag": "hello",
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
        }


@pytest.mark.timeout(30)
def test_spawn_kills_children_that_outlive_the_hard_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    # 8 s: on a loaded 2-core machine starting a child from the forkserver can take seconds,
    # and the children must have written their pid files before they are killed.
    with pytest.raises(SpawnError, match=r"ranks \[0, 1\] still running after timeout_s=8"):
        spawn(sleep_forever, 2, str(tmp_path), timeout_s=8)
    assert time.monotonic() - start < 20
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(30)
def test_spawn_raises_with_the_childs_traceback_when_a_child_raises() -> None:
    with pytest.raises(SpawnError, match=r"(?s)rank 1 raised.*ValueError: rank one refuses"):
        spawn(raise_on_rank_one, 2, timeout_s=20)


@pytest.mark.timeout(30)
def test_spawn_reports_a_child_that_exits_without_a_result_unless_it_may_die() -> None:
    with pytest.raises(SpawnError, match="rank 1 exited with code 3 without a result"):
        spawn(exit_on_rank_one, 2, timeout_s=20)
    assert spawn(exit_on_rank_one, 2, timeout_s=20, may_die={1}) == [0, None]


def test_init_from_env_without_a_launcher_names_the_missing_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="RANK is not set"):
        init_from_env()


@pytest.mark.timeout(60)
def test_a_program_started_by_torchrun_initialises_from_its_environment_and_exchanges() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(HERE / "torchrun_program.py")],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    got = {line["rank"]: line["got"] for line in lines}
    assert got == {
        0: {"0": "0->0", "1": "1->0"},
        1: {"0": "0->1", "1": "1->1"},
    }
