"""The code base passes the project's ruff rules (pyproject ``[tool.ruff.lint]``): no undefined or
unused names, no syntax errors, imports in order. ruff is pinned in the ``test`` extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is not installed: it is pinned in the project's test extra (make test)"
    done = subprocess.run(
        [exe, "check", "--no-cache", "src", "tests", "bench"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
