"""vLLM tier: the hung-store cases of ``hung_store_cases.py``, run in ``.venv-vllm``.

Those cases drive the deltasync backend class directly, which imports vLLM; the tier runs in
``.venv`` (the engines run in ``.venv-vllm`` subprocesses), so the cases run there too: one
pytest process over that file, and one test here per case, failing with the case's own
report."""

from __future__ import annotations

import ast
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from vllm_runs import VLLM_PYTHON, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CASES = Path(__file__).with_name("hung_store_cases.py")
ROOT = Path(__file__).resolve().parents[2]
NAMES = [
    node.name
    for node in ast.parse(CASES.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str | None]:
    """Every case's outcome by its test id: None when it passed, else its report."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run scripts/vllm_env.sh first"
    report = tmp_path_factory.mktemp("hung-store") / "cases.xml"
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-m",
            "pytest",
            str(CASES.relative_to(ROOT)),
            "-m",
            "vllm",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ],
        cwd=ROOT,
        env=vllm_env(1),
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
        out[case.get("name")] = (
            None
            if not bad
            else "\n".join(f"{e.tag}: {e.get('message')}\n{e.text or ''}" for e in bad)
        )
    return out


@pytest.mark.parametrize("name", NAMES)
def test_hung_store_case(outcomes, name):
    ran = {k: v for k, v in outcomes.items() if k == name or k.startswith(f"{name}[")}
    assert ran, f"{name} did not run in .venv-vllm (collected: {sorted(outcomes)})"
    failed = {k: v for k, v in ran.items() if v is not None}
    assert not failed, "\n\n".join(f"{k}:\n{v[-4000:]}" for k, v in failed.items())
