"""The code base passes the project's ruff rules (pyproject ``[tool.ruff.lint]``: pyflakes, import
order, bugbear, pyupgrade, simplify, ruff's own) and is ``ruff format``-clean. ruff is pinned in
the ``test`` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


TREES = ["src", "tests", "bench", "examples", "setup.py"]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is not installed: it is pinned in the project's test extra (make test)"
    return subprocess.run(
        [exe, *args, "--no-cache", *TREES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ruff_finds_nothing() -> None:
    done = _ruff("check")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_tree_is_ruff_formatted() -> None:
    done = _ruff("format", "--check")
    assert done.returncode == 0, (
        "run `ruff format` on:\n" + done.stdout[-4000:] + done.stderr[-2000:]
    )
