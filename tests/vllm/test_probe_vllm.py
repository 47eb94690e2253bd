"""vLLM tier: the layout probe on real vLLM-CPU models learns the hand-written tables.

Run with ``pytest tests/vllm -m vllm`` after ``scripts/vllm_env.sh``. Each case starts one
vLLM engine in ``.venv-vllm`` (this file, run as a script, is the job: vLLM keeps global state,
one engine per process), probes it with :func:`deltasync.engines.vllm_probe.probe_vllm_layout`
(every worker builds a fresh instance of its own model class and probes its ``load_weights``)
and writes the learned layout as JSON; the test, in whichever venv runs pytest, compares it
with the hand-written ``vllm`` rules block for block. Families without hand-written rules are
probed, and synced end to end, in ``test_vllm_families.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_runs import TINY, VLLM_PYTHON, vllm_env

CASES = {
    "qwen3_untied": dict(
        TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
    ),
    "qwen3_tied": dict(
        TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True
    ),
    "qwen3_moe": dict(
        TINY,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
}
# Qwen3-MoE at TP 1 is probed (and synced) in test_vllm_backend.py; here both TP 2 workers
TP = {"qwen3_moe": 2}


def job(spec_path: str) -> None:
    """In ``.venv-vllm``: write a checkpoint, start vLLM on it, probe the worker's model."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import transformers
    from vllm import LLM

    spec = json.loads(Path(spec_path).read_text())
    ckpt = Path(spec["tmp"]) / "checkpoint"
    config = transformers.AutoConfig.for_model(**spec["config"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(ckpt)
    llm = LLM(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        tensor_parallel_size=spec["tp"],
    )
    from deltasync.engines.vllm_probe import probe_vllm_layout
    from deltasync.layout.probed import layout_to_json

    layout = probe_vllm_layout(llm, spec["config"])
    Path(spec["out"]).write_text(json.dumps(layout_to_json(layout.table, layout.shards())))


if __name__ == "__main__":
    job(sys.argv[1])
    sys.exit(0)


import pytest
from vllm_runs import as_rule_names, table_key

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _run_job(tmp: Path, config: dict, tp: int) -> dict:
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run scripts/vllm_env.sh first"
    spec = {"tmp": str(tmp), "config": config, "tp": tp, "out": str(tmp / "layout.json")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(VLLM_PYTHON), __file__, str(tmp / "spec.json")],
        env=vllm_env(tp),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp / "layout.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_probing_a_running_vllm_cpu_engine_learns_the_hand_written_table(case, tmp_path):
    from deltasync.layout import ModelSpec
    from deltasync.layout.probed import layout_from_json
    from deltasync.layout.vllm_rules import build_vllm_table

    config, tp = CASES[case], TP.get(case, 1)
    probed, shards, _ = layout_from_json(_run_job(tmp_path, config, tp))
    spec = ModelSpec.from_hf_config(config)
    expected = build_vllm_table(spec, tp, 1)
    assert [s.id for s in shards] == [f"tp{r}" for r in range(tp)]
    got = table_key(probed)
    if spec.is_moe:
        got = as_rule_names(got)
    assert got == table_key(expected)
