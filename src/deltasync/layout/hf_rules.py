"""The transformers model's own parameters for Qwen3 / Qwen3-MoE, as a layout table.

``transformers`` 5.19 builds ``Qwen3ForCausalLM`` with exactly the checkpoint's tensors, and
``Qwen3MoeForCausalLM`` with the experts of each sparse layer fused into two parameters
(checked in ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``, ``Qwen3MoeExperts``, and
the ``"qwen2_moe"`` entry of ``transformers/conversion_mapping.py`` that ``qwen3_moe`` uses):

- ``mlp.experts.gate_up_proj`` (E, 2*I, H): checkpoint ``experts.*.gate_proj.weight`` then
  ``experts.*.up_proj.weight`` stacked over experts (MergeModulelist(dim=0)) and concatenated on
  dim 1 (Concatenate(dim=1)), i.e. expert e's gate is ``[e, :I]`` and its up ``[e, I:]``; the
  forward pass agrees (``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` → gate, up);
- ``mlp.experts.down_proj`` (E, H, I): ``experts.*.down_proj.weight`` stacked, not transposed.

The router is ``mlp.gate.weight`` (E, H) in both. With ``tie_word_embeddings`` the model holds
one parameter, ``model.embed_tokens.weight``; ``lm_head.weight`` appears in ``state_dict()`` as
an alias of the same storage and is listed as such, never as a second tensor to write.

This is the ``hf`` receiver layout (TP = 1) and, read backwards, the trainer layout.
"""

from __future__ import annotations

from deltasync.layout.blocks import Block, view_cols
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.table import LayoutTable, Placement, Shape
from deltasync.names import shard_id

HF_SHARD = shard_id(0)
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}


def hf_param_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """The transformers model's parameter names and shapes (``named_parameters()``)."""
    out: dict[str, Shape] = {}
    h, im = spec.hidden_size, spec.moe_intermediate_size
    for name, shape in spec.canonical_shapes().items():
        if ".mlp.experts." not in name:
            out[name] = shape
            continue
        prefix = name.split(".mlp.experts.")[0] + ".mlp.experts."
        out.setdefault(prefix + "gate_up_proj", (spec.num_experts, 2 * im, h))
        out.setdefault(prefix + "down_proj", (spec.num_experts, h, im))
    return out


def build_hf_table(spec: ModelSpec) -> LayoutTable:
    canon = spec.canonical_shapes()
    params = hf_param_shapes(spec)
    h, im = spec.hidden_size, spec.moe_intermediate_size
    placements: dict[str, list[Placement]] = {}
    for name, shape in canon.items():
        cols = view_cols(shape)
        if ".mlp.experts." not in name:
            block = Block(src_cols=cols, dst_cols=cols, src_row=0, dst_row=0, rows=shape[0])
            placements[name] = [Placement(HF_SHARD, name, block)]
            continue
        # model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
        prefix, rest = name.split(".mlp.experts.")
        e_str, proj, _ = rest.split(".")
        e = int(e_str)
        if proj == "down_proj":
            local, row = f"{prefix}.mlp.experts.down_proj", e * h
        else:
            local = f"{prefix}.mlp.experts.gate_up_proj"
            row = e * 2 * im + (im if proj == "up_proj" else 0)
        block = Block(src_cols=cols, dst_cols=cols, src_row=0, dst_row=row, rows=shape[0])
        placements[name] = [Placement(HF_SHARD, local, block)]
    aliases = {HF_SHARD: dict(TIED_ALIASES)} if spec.tie_word_embeddings else {}
    return LayoutTable(
        src_shapes=canon, dst_shapes={HF_SHARD: params}, placements=placements, aliases=aliases
    )
