"""Streaming shard digests equal the digests of the dense split, for every layout shape."""

from __future__ import annotations

import pytest
import torch

from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync.layout.digest import shard_state_digests, state_digest

CONFIGS = {
    "qwen3_odd_vocab_kv_lt_tp": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=96,
        vocab_size=251,
        tie_word_embeddings=True,
    ),
    "qwen3_untied": dict(
        model_type="qwen3",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=64,
        vocab_size=130,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
        tie_word_embeddings=False,
    ),
}


_LAYOUTS = [
    ("hf", 1, 1),
    ("vllm", 1, 1),
    ("vllm", 2, 1),
    ("vllm", 4, 1),
    ("vllm", 2, 2),
    ("vllm", 2, 4),
]
CASES = [
    (name, *lay)
    for name, cfg in CONFIGS.items()
    for lay in _LAYOUTS
    if lay[2] == 1 or cfg["model_type"] == "qwen3_moe"
]  # expert parallelism: MoE only


@pytest.mark.parametrize("name,engine,tp,ep", CASES)
def test_streaming_shard_digests_equal_the_digest_of_the_dense_split(name, engine, tp, ep):
    cfg = CONFIGS[name]
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(cfg), engine=engine, tp=tp, ep=ep)
    g = torch.Generator().manual_seed(7)
    full = {
        n: torch.randn(s.shape, generator=g).to(torch.bfloat16)
        for n, s in layout.canonical_specs().items()
    }
    split = layout.split(full)
    want = {s: state_digest(t) for s, t in split.items()}
    assert shard_state_digests(layout.table, full) == want
    # and a single flipped bit anywhere changes exactly the shards that hold it
    name0 = next(iter(full))
    full[name0].view(torch.int16).reshape(-1)[0] ^= 1
    got = shard_state_digests(layout.table, full)
    assert got != want


@pytest.mark.parametrize("name", list(CONFIGS))
def test_canonical_views_equal_to_canonical_and_share_memory_where_they_can(name):
    from deltasync.layout import TrainerLayout

    spec = ModelSpec.from_hf_config(CONFIGS[name])
    tl = TrainerLayout.build(spec)
    g = torch.Generator().manual_seed(3)
    params = {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}
    views = tl.canonical_views(params)
    full = tl.to_canonical(params)
    assert views.keys() == full.keys()
    for n in full:
        assert torch.equal(views[n].view(torch.int32), full[n].view(torch.int32))
    bases = {p.data_ptr() for p in params.values()}
    shared = sum(any(v.untyped_storage().data_ptr() == b for b in bases) for v in views.values())
    assert shared == len(views)  # every Qwen3 / Qwen3-MoE canonical tensor is a view


@pytest.mark.parametrize("name", list(CONFIGS))
def test_digests_of_fp32_views_cast_on_the_fly_equal_digests_of_the_bf16_split(name):
    from deltasync.layout import TrainerLayout

    spec = ModelSpec.from_hf_config(CONFIGS[name])
    tl = TrainerLayout.build(spec)
    layout = ReceiverLayout.build(spec, engine="vllm", tp=2)
    g = torch.Generator().manual_seed(4)
    params = {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}
    want = {
        s: state_digest(t)
        for s, t in layout.split(
            tl.to_canonical({n: p.to(torch.bfloat16) for n, p in params.items()})
        ).items()
    }
    got = shard_state_digests(layout.table, tl.canonical_views(params), dtype=torch.bfloat16)
    assert got == want
