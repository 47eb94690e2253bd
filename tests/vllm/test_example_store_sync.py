"""vLLM tier: ``examples/vllm_store_sync.py`` runs as documented (docs/integration.md).

The example trains a config-built model, publishes every version to a store and pushes it
into a real vLLM-CPU engine through vLLM's own weight-transfer API, then compares the
engine's live tensors with a dense split bitwise; its last line is a JSON summary. Run for
the hand-tabled Qwen3 and for a family whose layout it probes from the running engine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_runs import VLLM_PYTHON, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_store_sync.py"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_example_lands_every_version_bit_exact_in_the_engine(family, tmp_path) -> None:
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(EXAMPLE),
            "--family",
            family,
            "--versions",
            "2",
            "--store",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=vllm_env(tp=1),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["family"] == family
    assert [r["version"] for r in summary["rows"]] == [1, 2]
    assert all(r["elements"] > 0 for r in summary["rows"])
    assert summary["all_exact"] is True, summary["rows"]
