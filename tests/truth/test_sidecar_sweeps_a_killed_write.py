"""A ``deltasync pull`` sidecar killed while writing ``<shard>.safetensors`` leaves its temporary
file, a whole shard's worth of ``--dir``. A sidecar restarted at once keeps it while it is young
(it may be a write in progress) and removes it once nothing has written it for STALE_TEMP_S, as
it runs. (It swept only at its start, so a sidecar restarted within 5 minutes of a kill kept
the dead one's file for as long as it ran: a shard's worth of a disk that may be filling up,
per kill.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from truth_kit import Rig, assert_same_bits

from deltasync import LocalStore
from deltasync.atomic import STALE_TEMP_S
from deltasync.commands.pull import META_VERSION

REPO = Path(__file__).resolve().parents[2]

# The first sidecar dies (os._exit: nothing of it runs after, as under SIGKILL) at the rename
# that would publish its file, so the temp file is written whole and left behind.
_DIES_AT_THE_RENAME = """
import os, sys
import deltasync.atomic as atomic
real = os.replace
def replace(src, dst, *args, **kwargs):
    if str(dst).endswith("tp0.safetensors"):
        os._exit(137)
    return real(src, dst, *args, **kwargs)
atomic.os.replace = replace
from deltasync.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _pull_args(store_path: Path, out: Path) -> list[str]:
    return [
        "pull",
        str(store_path),
        "--engine",
        "vllm",
        "--tp",
        "2",
        "--shard",
        "tp0",
        "--dir",
        str(out),
        "--receiver-id",
        "side0",
    ]


@pytest.mark.timeout(120)
def test_a_sidecar_restarted_right_after_a_kill_mid_write_removes_the_killed_writes_temp_file_once_stale(
    tmp_path,
):
    store_path, out = tmp_path / "store", tmp_path / "out"
    rig = Rig(LocalStore(store_path, durable=False), tmp_path)
    rig.publish(0)
    killed = subprocess.run(
        [sys.executable, "-c", _DIES_AT_THE_RENAME, *_pull_args(store_path, out), "--once"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert killed.returncode == 137, killed.stderr
    left = list(out.glob(".tp0.safetensors.tmp-*"))
    assert len(left) == 1 and left[0].stat().st_size > 0, "the kill left no temp file"
    assert not (out / "tp0.safetensors").exists()

    restarted = subprocess.Popen(
        [sys.executable, "-m", "deltasync", *_pull_args(store_path, out), "--interval", "0.05"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        file = out / "tp0.safetensors"
        _wait(lambda: _version(file) == "0", restarted, "the restarted sidecar wrote no file")
        rig.publish(1)
        _wait(lambda: _version(file) == "1", restarted, "the sidecar did not take version 1")
        assert left[0].exists(), "a young temp file (a write in progress?) was removed"
        # time passes: nothing writes the killed write's file
        at = time.time() - STALE_TEMP_S - 60
        os.utime(left[0], (at, at))
        _wait(lambda: not left[0].exists(), restarted, "the killed write's temp file was kept")
        assert not list(out.glob(".tp0.safetensors.tmp-*"))
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(timeout=30) == 0, restarted.stderr.read()
    finally:
        if restarted.poll() is None:
            restarted.kill()
    with safe_open(str(file), framework="pt") as f:
        assert f.metadata()[META_VERSION] == "1"
        held = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    assert_same_bits(held, rig.oracle[(rig.trainer.pub.run_id, 1)]["tp0"], "v1")


def _version(file: Path) -> str | None:
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.metadata()[META_VERSION]
    except Exception:  # missing, or being replaced
        return None


def _wait(predicate, proc, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
