"""A ``transformers`` model as a probe target: its own checkpoint conversion as ``load_weights``.

transformers 5.x loads a checkpoint through ``core_model_loading.convert_and_load_state_dict_in_model``
with the model's conversion mapping (``conversion_mapping.get_model_conversion_mapping``): the
renamings and fusing operations (``MergeModulelist``, ``Concatenate``, ...) that turn e.g. a
Qwen3-MoE checkpoint's per-expert tensors into the fused ``mlp.experts.gate_up_proj``. Probing
that path learns the trainer-side layout (transformers parameters <-> checkpoint tensors) and
the ``hf`` receiver layout from the library itself, for any family it knows.

``TransformersLoader`` wraps a model: ``load_weights`` runs the conversion on the tensors given,
then re-ties tied weights (the loader replaces parameters; ``from_pretrained`` re-ties after
it); ``probe_groups`` keeps the tensors one converter fuses (a layer's experts) in one call.
``checkpoint_shapes`` gives the checkpoint names and shapes a model saves, from its state dict
and the reverse of the same mapping, without materialising weights (meta device).

``transformers`` is imported lazily; nothing here knows layout tables.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from deltasync.errors import LayoutError


def _glob_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


class TransformersLoader:
    """``load_weights`` / ``named_parameters`` / ``probe_groups`` over a transformers model."""

    def __init__(self, model: torch.nn.Module) -> None:
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
                f"transformers could not load {sorted(state)[:3]}...: {problems} {info.error_msgs}"
            )
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        return set(state)


def checkpoint_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensor names and shapes ``save_pretrained`` would write for ``model``.

    Tied aliases (``lm_head.weight`` with tied embeddings) are left out: checkpoints of tied
    models carry the embedding once. Works on a meta-device model (no weights are read).
    """
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
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def empty_model(config: Any) -> torch.nn.Module:
    """A transformers causal LM with uninitialised bf16 CPU storage (for probing only)."""
    model = meta_model(config).to_empty(device="cpu")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
