"""HFEngine: a ``transformers`` Qwen3 / Qwen3-MoE model whose parameters are the ``hf`` shard.

The receiver layout ``ReceiverLayout.build(spec, engine="hf")`` names exactly the model's
``named_parameters()`` (fused expert tensors for Qwen3-MoE, no tied ``lm_head`` alias), so the
adapter hands those parameters out as they are and updates are scattered straight into them:
no copy of the model, no reload. The model stays in BF16, the dtype the trainer publishes.

This module knows transformers models and the adapter interface; it knows nothing about
stores, versions or how updates are produced.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deltasync.engines.base import UNLOADED, load_dense
from deltasync.errors import ConfigError
from deltasync.format import TensorUpdate, apply_updates, check_tensors_match
from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync.layout.hf_model import HF_SHARD

_CONFIG_ONLY_KEYS = ("model_type", "architectures", "torch_dtype", "dtype")


def build_hf_model(hf_config: Mapping[str, Any], *, dtype: torch.dtype = torch.bfloat16):
    """A config-built (randomly initialised) transformers causal LM in ``dtype``, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ConfigError("hf_config has no 'model_type'")
    for k in _CONFIG_ONLY_KEYS:
        cfg.pop(k, None)
    config = AutoConfig.for_model(model_type, **cfg)
    # sdpa: the same attention kernel the TP engine calls, so an fp64 comparison of the two
    # differs only by summation order (see TPQwen3Engine's docstring).
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class HFEngine:
    """Engine adapter over a transformers model; ``params()`` are its own parameters."""

    def __init__(self, model: torch.nn.Module, *, version: int = UNLOADED) -> None:
        self.model = model
        self.version = version
        self.spec = ModelSpec.from_hf_config(model.config)
        self._params = dict(model.named_parameters())
        check_tensors_match(
            {n: p.data for n, p in self._params.items()},
            ReceiverLayout.build(self.spec, engine="hf").local_specs(HF_SHARD),
            what="HFEngine",
            hint="build the engine and the layout from the same config",
        )

    @classmethod
    def from_config(
        cls,
        hf_config: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor] | None = None,
        *,
        version: int = UNLOADED,
    ) -> HFEngine:
        """A BF16 model from a config; ``weights`` (the ``hf`` shard's tensors) loaded if given."""
        engine = cls(build_hf_model(hf_config), version=UNLOADED)
        if weights is not None:
            engine.load(weights, version=version)
        return engine

    def params(self) -> Mapping[str, torch.Tensor]:
        # .data: the same storage without autograd, so index_copy_ on a leaf is allowed.
        return {n: p.data for n, p in self._params.items()}

    def apply(self, updates: Sequence[TensorUpdate]) -> int:
        return apply_updates(updates, self.params())

    def load(self, weights: Mapping[str, torch.Tensor], *, version: int) -> None:
        load_dense(self.params(), weights)
        self.version = version

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, *, compute_dtype: torch.dtype | None = None):
        """Logits of every position, computed by the transformers forward pass.

        ``compute_dtype=None`` runs the model as held (BF16). Otherwise a copy of the model is
        cast to ``compute_dtype`` first (test references only: it holds a second model).
        """
        model = self.model
        if compute_dtype is not None and compute_dtype != self.spec.dtype:
            model = copy.deepcopy(model).to(compute_dtype)
        return model(input_ids=input_ids).logits
