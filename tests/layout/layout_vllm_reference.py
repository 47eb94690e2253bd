"""An independent, dense re-statement of vLLM's weight loaders for Qwen3 / Qwen3-MoE.

It builds one shard the way vLLM's loaders fill parameters (narrow the checkpoint tensor, copy
into a narrowed slice of the fused parameter), with ``narrow``/``cat`` instead of the layout
table, so the table's block arithmetic is checked against a second formulation of the same
conventions (see the citations in ``deltasync/layout/vllm_rules.py``).
"""

from __future__ import annotations

import torch


def reference_vllm_shard(
    full, spec, tp: int, ep: int, tp_rank: int, ep_rank: int
) -> dict[str, torch.Tensor]:
    h, hd, v = spec.hidden_size, spec.head_dim, spec.vocab_size
    out: dict[str, torch.Tensor] = {}

    padded = (v + 63) // 64 * 64
    per = padded // tp

    def vocab(w: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(per, h, dtype=w.dtype)
        start = tp_rank * per
        n = max(0, min(v - start, per))
        t[:n] = w[start : start + n]
        return t

    out["model.embed_tokens.weight"] = vocab(full["model.embed_tokens.weight"])
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    out["model.norm.weight"] = full["model.norm.weight"].clone()

    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    q_l = nh // tp * hd
    kv_heads_l = max(1, nkv // tp)
    replicas = max(1, tp // nkv)
    kv_l = kv_heads_l * hd
    kv_shard = tp_rank // replicas
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = torch.cat(
            [
                full[a + "q_proj.weight"].narrow(0, tp_rank * q_l, q_l),
                full[a + "k_proj.weight"].narrow(0, kv_shard * kv_l, kv_l),
                full[a + "v_proj.weight"].narrow(0, kv_shard * kv_l, kv_l),
            ]
        )
        out[a + "o_proj.weight"] = full[a + "o_proj.weight"].narrow(1, tp_rank * q_l, q_l).clone()
        for n in (
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ):
            out[p + n] = full[p + n].clone()
        if i not in spec.moe_layers:
            il = spec.intermediate_size // tp
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [
                    full[p + "mlp.gate_proj.weight"].narrow(0, tp_rank * il, il),
                    full[p + "mlp.up_proj.weight"].narrow(0, tp_rank * il, il),
                ]
            )
            out[p + "mlp.down_proj.weight"] = (
                full[p + "mlp.down_proj.weight"].narrow(1, tp_rank * il, il).clone()
            )
            continue
        out[p + "mlp.gate.weight"] = full[p + "mlp.gate.weight"].clone()
        E, im = spec.num_experts, spec.moe_intermediate_size
        if ep > 1:
            # determine_expert_map, "linear": an expert_map of -1 except this rank's experts.
            base, rem = E // ep, E % ep
            n_local = base + 1 if ep_rank < rem else base
            expert_map = torch.full((E,), -1)
            s = ep_rank * base + min(ep_rank, rem)
            expert_map[s : s + n_local] = torch.arange(n_local)
            moe_tp, moe_rank = 1, 0
        else:
            n_local, expert_map, moe_tp, moe_rank = E, torch.arange(E), tp, tp_rank
        iml = im // moe_tp
        w13 = torch.empty(n_local, 2 * iml, h, dtype=full[p + "mlp.gate.weight"].dtype)
        w2 = torch.empty(n_local, h, iml, dtype=w13.dtype)
        for g in range(E):
            j = int(expert_map[g])
            if j < 0:
                continue
            ex = p + f"mlp.experts.{g}."
            w13[j].narrow(0, 0, iml).copy_(
                full[ex + "gate_proj.weight"].narrow(0, moe_rank * iml, iml)
            )
            w13[j].narrow(0, iml, iml).copy_(
                full[ex + "up_proj.weight"].narrow(0, moe_rank * iml, iml)
            )
            w2[j].copy_(full[ex + "down_proj.weight"].narrow(1, moe_rank * iml, iml))
        out[p + "mlp.experts.w13_weight"] = w13
        out[p + "mlp.experts.w2_weight"] = w2
    return out
