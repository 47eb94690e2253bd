"""Streaming shard digests equal the digests of the dense split, for every layout shape."""

from __future__ import annotations

import pytest
import torch

from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync.layout.digests import shard_state_digests
from deltasync.manifest import state_digest

CONFIGS = {
    "qwen3_odd_vocab_kv_lt_tp": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=96, vocab_size=251, tie_word_embeddings=True),
    "qwen3_untied": dict(model_type="qwen3", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=8, intermediate_size=64, vocab_size=130,
                         tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2, vocab_size=97, tie_word_embeddings=False),
}


_LAYOUTS = [("hf", 1, 1), ("vllm", 1, 1), ("vllm", 2, 1), ("vllm", 4, 1), ("vllm", 2, 2), ("vllm", 2, 4)]
CASES = [(name, *lay) for name, cfg in CONFIGS.items() for lay in _LAYOUTS
         if lay[2] == 1 or cfg["model_type"] == "qwen3_moe"]  # expert parallelism: MoE only


@pytest.mark.parametrize("name,engine,tp,ep", CASES)
def test_streaming_shard_digests_equal_the_digest_of_the_dense_split(name, engine, tp, ep):
    cfg = CONFIGS[name]
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(cfg), engine=engine, tp=tp, ep=ep)
    g = torch.Generator().manual_seed(7)
    full = {n: torch.randn(s.shape, generator=g).to(torch.bfloat16) for n, s in layout.canonical_specs().items()}
    split = layout.split(full)
    want = {s: state_digest(t) for s, t in split.items()}
    assert shard_state_digests(layout.table, full) == want
    # and a single flipped bit anywhere changes exactly the shards that hold it
    name0 = next(iter(full))
    full[name0].view(torch.int16).reshape(-1)[0] ^= 1
    got = shard_state_digests(layout.table, full)
    assert got != want
