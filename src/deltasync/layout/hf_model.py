"""The ``transformers`` model's own layout: its parameters as a table, and as a probe target.

Two views of one thing, the transformers class's parameters against the checkpoint's tensors.

**A hand-written table** (:func:`build_hf_table`: the ``hf`` receiver layout, TP = 1, and read
backwards the trainer layout). ``transformers`` 5.19 builds the dense families with exactly
the checkpoint's tensors, and ``Qwen3MoeForCausalLM`` with the experts of each sparse layer
fused into two parameters (checked in ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``,
``Qwen3MoeExperts``, and the ``"qwen2_moe"`` entry of ``transformers/conversion_mapping.py``
that ``qwen3_moe`` uses):

- ``mlp.experts.gate_up_proj`` (E, 2*I, H): checkpoint ``experts.*.gate_proj.weight`` then
  ``experts.*.up_proj.weight`` stacked over experts (MergeModulelist(dim=0)) and concatenated on
  dim 1 (Concatenate(dim=1)), i.e. expert e's gate is ``[e, :I]`` and its up ``[e, I:]``; the
  forward pass agrees (``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` → gate, up);
- ``mlp.experts.down_proj`` (E, H, I): ``experts.*.down_proj.weight`` stacked, not transposed.

The router is ``mlp.gate.weight`` (E, H) in both. With ``tie_word_embeddings`` the model holds
one parameter, ``model.embed_tokens.weight``; ``lm_head.weight`` appears in ``state_dict()`` as
an alias of the same storage and is listed as such, never as a second tensor to write.

**A probe target** (:class:`TransformersLoader`). transformers 5.x loads a checkpoint through
``core_model_loading.convert_and_load_state_dict_in_model`` with the model's conversion
mapping (``conversion_mapping.get_model_conversion_mapping``): the renamings and fusing
operations above. ``load_weights`` runs that conversion on the tensors given, then re-ties tied
weights (the loader replaces parameters; ``from_pretrained`` re-ties after it);
``probe_groups`` keeps the tensors one converter fuses (a layer's experts) in one call.
Probing it learns the same table from the library itself, for any family it knows; the
hand-written table is the cross-check. ``checkpoint_shapes`` gives the checkpoint names and
shapes a model saves, from its state dict and the reverse of the same mapping, without
materialising weights (meta device).

``transformers`` is imported lazily, and only at a release whose loader takes the arguments
passed here (:func:`require_transformers`: 5.16 or later). This module knows the transformers
classes' parameters; it knows no inference engine's layout and does no file I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from deltasync.errors import LayoutError
from deltasync.layout.blocks import Block, view_cols
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.table import LayoutTable, Placement, Shape
from deltasync.names import shard_id

HF_SHARD = shard_id(0)
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}
# The first transformers release whose core_model_loading takes no tp_plan (what is called here).
MIN_TRANSFORMERS = (5, 16)
_INSTALL = "pip install 'transformers>=5.16,<6' (deltasync's models extra)"


def require_transformers() -> ModuleType:
    """``transformers``, at :data:`MIN_TRANSFORMERS` or later.

    Raises:
        LayoutError: it is missing or older, naming the version found and the install command.
    """
    try:
        import transformers
    except ImportError as exc:
        raise LayoutError(f"this needs transformers ({exc}); {_INSTALL}") from None
    found = transformers.__version__
    parts = re.match(r"(\d+)\.(\d+)", found)
    if parts is None or (int(parts[1]), int(parts[2])) < MIN_TRANSFORMERS:
        raise LayoutError(
            f"transformers {found} is installed; deltasync's transformers loader needs "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))} or later: {_INSTALL}"
        )
    return transformers


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


# ---------------------------------------------------------------------- probe target


def _glob_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


class TransformersLoader:
    """``load_weights`` / ``named_parameters`` / ``probe_groups`` over a transformers model."""

    def __init__(self, model: torch.nn.Module) -> None:
        require_transformers()
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.model = model
        self.mapping = get_model_conversion_mapping(model)
        self._fusing = [
            (i, [_glob_regex(p) for p in getattr(conv, "source_patterns", [])])
            for i, conv in enumerate(self.mapping)
            if type(conv).__name__ == "WeightConverter"
        ]

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.model.named_parameters(remove_duplicate=remove_duplicate)

    def probe_groups(self, names: Sequence[str]) -> list[list[str]]:
        """Checkpoint tensors one converter fuses (same prefix, same converter) go together."""
        groups: dict[tuple[str, int], list[str]] = {}
        for n in names:
            key = (n, -1)
            for i, patterns in self._fusing:
                m = next((p.search(n) for p in patterns if p.search(n)), None)
                if m is not None:
                    key = (n[: m.start()], i)
                    break
            groups.setdefault(key, []).append(n)
        return list(groups.values())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        state = dict(weights)
        bars = not hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            info, _ = convert_and_load_state_dict_in_model(
                self.model,
                state,
                LoadStateDictConfig(weight_mapping=self.mapping, dtype=torch.bfloat16),
            )
        finally:
            if not bars:
                hf_logging.enable_progress_bar()
        problems = {
            "unexpected": sorted(info.unexpected_keys),
            "mismatched": sorted(str(k) for k in info.mismatched_keys),
            "conversion errors": sorted(info.conversion_errors),
        }
        problems = {k: v for k, v in problems.items() if v}
        if problems or info.error_msgs:
            raise LayoutError(
                f"transformers could not load {sorted(state)[:3]}...: {problems} "
                f"{info.error_msgs}; the installed transformers builds other tensors for this "
                "config than deltasync does: check the model config's fields"
            )
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        return set(state)


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensor names and shapes ``save_pretrained`` would write for ``model``.

    Tied aliases (``lm_head.weight`` with tied embeddings) are left out: checkpoints of tied
    models carry the embedding once. Works on a meta-device model (no weights are read).
    """
    require_transformers()
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters())
    state = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()}
    try:
        reverted = revert_weight_conversion(model, state)
    except Exception as exc:  # a conversion that cannot run on meta tensors
        raise LayoutError(
            f"cannot derive checkpoint names for {type(model).__name__}: {exc}"
        ) from exc
    return {n: tuple(t.shape) for n, t in reverted.items()}


def meta_model(config: Any) -> torch.nn.Module:
    """A transformers causal LM built from ``config`` on the meta device (no memory, no init)."""
    transformers = require_transformers()

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def empty_model(config: Any) -> torch.nn.Module:
    """A transformers causal LM with uninitialised bf16 CPU storage (for probing only)."""
    model = meta_model(config).to_empty(device="cpu")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
