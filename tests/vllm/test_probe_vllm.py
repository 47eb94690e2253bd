"""vLLM tier: the layout probe on real vLLM-CPU models learns the hand-written tables.

Run with ``pytest tests/vllm -m vllm`` after ``scripts/vllm_env.sh``. Each case starts one
vLLM engine in ``.venv-vllm`` (this file, run as a script, is the job: vLLM keeps global state,
one engine per process), probes the worker's model through its own ``load_weights``
(``collective_rpc``), and writes the learned layout as JSON; the test, in whichever venv runs
pytest, compares it with the ``vllm`` rules (Qwen3) or with the probe of the vLLM-convention
reference loader (other families), block for block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

BASE = dict(
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
)
CASES = {
    "qwen3_untied": dict(
        BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
    ),
    "qwen3_tied": dict(
        BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True
    ),
    "llama_untied": dict(
        BASE, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False
    ),
    # vLLM's Qwen2 takes head_dim = hidden_size // num_attention_heads (transformers honours a
    # head_dim field): with BASE's head_dim it holds half of q, which the probe reports.
    "qwen2_tied": dict(
        BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=True,
        hidden_size=256,
        intermediate_size=512,
    ),
    "gemma": dict(BASE, model_type="gemma", architectures=["GemmaForCausalLM"]),
    "qwen3_moe": dict(
        BASE,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
}


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
    )
    config_dict = spec["config"]

    def probe(worker) -> dict:
        import transformers as tf

        from deltasync.layout import ShardInfo
        from deltasync.layout.hf_loader import checkpoint_shapes, meta_model
        from deltasync.layout.probe import probe_shard
        from deltasync.layout.probed import assemble_table, layout_to_json

        canon = checkpoint_shapes(meta_model(tf.AutoConfig.for_model(**config_dict)))
        if config_dict.get("tie_word_embeddings"):
            canon.pop("lm_head.weight", None)
        engine_model = worker.model_runner.model
        shard = probe_shard(engine_model, canon)
        table = assemble_table(canon, {"tp0": shard})
        return layout_to_json(table, [ShardInfo("tp0", 0, 0)])

    (doc,) = llm.collective_rpc(probe)
    Path(spec["out"]).write_text(json.dumps(doc))


if __name__ == "__main__":
    job(sys.argv[1])
    sys.exit(0)


import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _run_job(tmp: Path, config: dict) -> dict:
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run scripts/vllm_env.sh first"
    spec = {"tmp": str(tmp), "config": config, "out": str(tmp / "layout.json")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [str(VLLM_PYTHON), __file__, str(tmp / "spec.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp / "layout.json").read_text())


def _key(table):
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


@pytest.mark.parametrize("case", list(CASES))
def test_probing_a_vllm_cpu_model_learns_the_vllm_convention_table(case, tmp_path):
    from deltasync.layout import ModelSpec
    from deltasync.layout.probe import probe_shard
    from deltasync.layout.probed import assemble_table, layout_from_json
    from deltasync.layout.reference_loader import VllmReferenceLoader
    from deltasync.layout.vllm_rules import build_vllm_table

    config = CASES[case]
    probed, shards, _ = layout_from_json(_run_job(tmp_path, config))
    spec = ModelSpec.from_hf_config(config)
    if spec.model_type in ("qwen3", "qwen3_moe"):
        expected = build_vllm_table(spec, 1, 1)
    else:
        canon = spec.canonical_shapes()
        expected = assemble_table(canon, {"tp0": probe_shard(VllmReferenceLoader(spec), canon)})
    assert [s.id for s in shards] == ["tp0"]
    got = _key(probed)
    if spec.is_moe:
        # vLLM 0.32 holds the experts under its MoE runner (``mlp.experts.routed_experts.
        # w13_weight``) and lists the router a second time as ``mlp.experts.gate.weight`` (the
        # same storage); the rules keep the names of vLLM's FusedMoE (the engine adapter maps
        # them). The probe sees the live names; the geometry must be the rules'.
        assert (
            all(
                alias.endswith(".mlp.experts.gate.weight") and target.endswith(".mlp.gate.weight")
                for alias, target in got[2]["tp0"].items()
            )
            and got[2]["tp0"]
        )
        got = _renamed(got, ".mlp.experts.routed_experts.", ".mlp.experts.")
    assert got == _key(expected)


def _renamed(key, old: str, new: str):
    placements, shapes, _ = key
    placements = {
        n: sorted((s, loc.replace(old, new), b) for s, loc, b in pls)
        for n, pls in placements.items()
    }
    shapes = {sid: {n.replace(old, new): v for n, v in m.items()} for sid, m in shapes.items()}
    return placements, shapes, {sid: {} for sid in shapes}
