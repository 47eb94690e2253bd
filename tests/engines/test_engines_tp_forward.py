"""TPQwen3Engine: its forward pass from vLLM-convention shards equals the transformers model's.

Both sides compute in fp64 from the same BF16 weights. Norm statistics (fp32) and RoPE tables
(built in fp32) are computed the same way on both sides, so what remains is the order of fp64
summation (partial sums per TP rank, then the all-reduce): about K * 2^-53 * sum|terms|, i.e.
~1e-15 for these sizes. We demand 1e-9, far below what any misplaced element does (swapping
one rank's k and v heads moves logits by ~1). Bitwise equality is not a fair demand here: a
row-parallel matmul sums in a different order than the dense one.
"""

from __future__ import annotations

import pytest
import torch

from deltasync.engines import HFEngine, TPQwen3Engine
from deltasync.errors import ConfigError, VersionError
from deltasync.layout import TrainerLayout

from engines_helpers import tiny_hf_config

TOLERANCE = 1e-9


def _random_hf_engine(hf_config: dict, seed: int = 0) -> HFEngine:
    torch.manual_seed(seed)
    hf = HFEngine.from_config(hf_config)
    with torch.no_grad():  # larger than the init's 0.02 so that every path moves the logits
        for p in hf.model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.1)
    hf.version = 0
    return hf


@pytest.mark.parametrize(
    "heads,kv_heads,tp,tie",
    [(4, 2, 2, False), (4, 2, 4, False), (8, 2, 2, True), (4, 4, 2, True), (4, 2, 1, False)],
)
def test_tp_forward_from_vllm_shards_matches_the_transformers_forward(heads, kv_heads, tp, tie):
    cfg = tiny_hf_config(heads=heads, kv_heads=kv_heads, tie=tie)
    hf = _random_hf_engine(cfg)
    canonical = TrainerLayout(hf.spec).to_canonical(hf.model.state_dict())
    tpe = TPQwen3Engine.from_canonical(
        cfg, canonical, tp=tp, compute_dtype=torch.float64, version=0
    )
    ids = torch.randint(0, cfg["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1))
    ours, theirs = tpe.logits(ids), hf.logits(ids, compute_dtype=torch.float64)
    assert ours.shape == theirs.shape == (3, 11, cfg["vocab_size"])
    assert theirs.abs().max() > 0.5  # the comparison is not between two near-zero tensors
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_swapping_one_ranks_k_and_v_heads_moves_the_logits_far_beyond_the_tolerance():
    cfg = tiny_hf_config()
    hf = _random_hf_engine(cfg)
    canonical = TrainerLayout(hf.spec).to_canonical(hf.model.state_dict())
    tpe = TPQwen3Engine.from_canonical(cfg, canonical, tp=2, compute_dtype=torch.float64, version=0)
    qkv = tpe.rank("tp1").params()["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows, kv_rows = 2 * 16, 1 * 16
    k = qkv[q_rows : q_rows + kv_rows].clone()
    qkv[q_rows : q_rows + kv_rows] = qkv[q_rows + kv_rows :]
    qkv[q_rows + kv_rows :] = k
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(2))
    diff = (tpe.logits(ids) - hf.logits(ids, compute_dtype=torch.float64)).abs().max().item()
    assert diff > 1e6 * TOLERANCE


def test_fp32_forward_is_bit_reproducible_for_the_same_weights():
    cfg = tiny_hf_config()
    hf = _random_hf_engine(cfg)
    canonical = TrainerLayout(hf.spec).to_canonical(hf.model.state_dict())
    a = TPQwen3Engine.from_canonical(cfg, canonical, tp=2, version=3)
    b = TPQwen3Engine.from_canonical(cfg, canonical, tp=2, version=3)
    ids = torch.randint(0, cfg["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.logits(ids).view(torch.int32), b.logits(ids).view(torch.int32))


def test_running_the_model_while_ranks_are_at_different_versions_raises():
    cfg = tiny_hf_config()
    tpe = TPQwen3Engine.from_canonical(cfg, _canonical_zeros(cfg), tp=2, version=0)
    tpe.rank("tp0").version = 1
    with pytest.raises(VersionError, match="different versions"):
        tpe.logits(torch.zeros((1, 2), dtype=torch.int64))


def test_a_moe_config_is_refused_with_a_config_error():
    cfg = dict(tiny_hf_config(), model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match="MoE"):
        TPQwen3Engine.from_canonical(cfg, {}, tp=2)


def _canonical_zeros(cfg: dict) -> dict[str, torch.Tensor]:
    from deltasync.layout import ModelSpec

    spec = ModelSpec.from_hf_config(cfg)
    return {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in spec.canonical_shapes().items()}
