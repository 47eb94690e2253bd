"""Small Qwen3 / Qwen3-MoE configs and the (tp, ep) sizes the layout tests run them under."""

from __future__ import annotations

import random

import torch
from kit import bits_equal

from deltasync.layout import ModelSpec

CONFIGS: dict[str, dict] = {
    # odd vocab, head_dim != hidden/heads, 2 kv heads (< TP 4, 8; = TP 2), tied
    "dense_tied": {
        "model_type": "qwen3",
        "vocab_size": 101,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "tie_word_embeddings": True,
    },
    # kv heads = TP 8, untied
    "dense_untied": {
        "model_type": "qwen3",
        "vocab_size": 203,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 16,
        "intermediate_size": 64,
        "tie_word_embeddings": False,
    },
    # a dense MLP layer inside a MoE model (mlp_only_layers), tied
    "moe_tied": {
        "model_type": "qwen3_moe",
        "vocab_size": 131,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "num_experts": 8,
        "mlp_only_layers": [1],
        "tie_word_embeddings": True,
    },
    # 6 experts over EP 4 (uneven), 1 kv head, decoder_sparse_step 2, a TP rank of pure vocab padding
    "moe_untied": {
        "model_type": "qwen3_moe",
        "vocab_size": 77,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 24,
        "moe_intermediate_size": 8,
        "num_experts": 6,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": False,
    },
}

PARALLEL: dict[str, list[tuple[int, int]]] = {
    "dense_tied": [(1, 1), (2, 1), (4, 1), (8, 1)],
    "dense_untied": [(1, 1), (2, 1), (4, 1), (8, 1)],
    "moe_tied": [(1, 1), (2, 1), (8, 1), (1, 2), (2, 2), (2, 4), (4, 4)],
    "moe_untied": [(1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 4)],
}

CASES = [(name, tp, ep) for name, combos in PARALLEL.items() for tp, ep in combos]


def random_config(seed: int) -> tuple[dict, int, int]:
    """A random valid config and a (tp, ep) that vLLM would accept for it."""
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4, 8])
    heads = tp * rng.choice([1, 2])
    kv = rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0 and (d % tp == 0 or tp % d == 0)])
    moe = rng.random() < 0.5
    cfg = {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": rng.randrange(40, 300) | 1,
        "hidden_size": rng.choice([8, 16, 24]),
        "num_hidden_layers": rng.choice([1, 2]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": rng.choice([4, 8]),
        "intermediate_size": tp * rng.choice([2, 3]),
        "tie_word_embeddings": rng.random() < 0.5,
    }
    ep = 1
    if moe:
        cfg.update(
            num_experts=rng.choice([tp, tp + 1, 2 * tp + 1]),
            moe_intermediate_size=tp * rng.choice([1, 2]),
        )
        ep = rng.choice([1, tp, 2 * tp])
    return cfg, tp, ep


def random_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 canonical tensors with all bit patterns in play (incl. -0.0 and NaNs)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in spec.canonical_shapes().items():
        n = 1
        for d in shape:
            n *= d
        bits = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
        out[name] = bits.view(torch.bfloat16).reshape(shape)
    return out


bitwise_equal = bits_equal  # the kit's, under this folder's name
