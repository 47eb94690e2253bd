"""The engine adapter interface, and the adapters that run in the receiver's own process.

An adapter exposes the engine's *live* local tensors by local name, in the layout of its
receiver shard (``ReceiverLayout.local_specs(shard_id)``), applies decoded updates into them
in place, and carries the version those tensors are at. That is all a receiver needs: it never
copies the model, and it never learns how the engine computes.

- ``params()``: local name -> the tensor the engine computes with (not a copy). Tied aliases
  (``lm_head.weight`` under tied embeddings) are not listed; the layout routes to the target.
- ``apply(updates)``: validate every update against every target first, then write; a bad
  update raises :class:`~deltasync.errors.ApplyError` with every tensor unchanged. Returns
  the number of elements written.
- ``version``: the version the tensors are at. The receiver sets it after a verified apply
  (the engine does not decide what a version is); ``-1`` means "not loaded yet".

:class:`TensorDictEngine` is the plain implementation over a dict of tensors (one TP rank of
:class:`~deltasync.engines.tp_qwen3.TPQwen3Engine`, tests). :class:`HFEngine` is a
``transformers`` Qwen3 / Qwen3-MoE model whose parameters are the ``hf`` shard: the layout
``ReceiverLayout.build(spec, engine="hf")`` names exactly the model's ``named_parameters()``
(fused expert tensors for Qwen3-MoE, no tied ``lm_head`` alias), so updates are scattered
straight into them: no copy of the model, no reload. The model stays in BF16, the dtype the
trainer publishes.

This module knows tensors, the codec's ``TensorUpdate`` and transformers models; nothing about
stores, versions or how updates are produced.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from deltasync.errors import ApplyError, ConfigError
from deltasync.format import (
    TensorUpdate,
    apply_updates,
    check_targets_writable,
    check_tensors_match,
)
from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync.layout.hf_model import HF_SHARD, require_transformers

UNLOADED = -1


@runtime_checkable
class EngineAdapter(Protocol):
    """Live local tensors of one receiver shard, written in place."""

    version: int

    def params(self) -> Mapping[str, torch.Tensor]: ...

    def apply(self, updates: Sequence[TensorUpdate]) -> int: ...


def check_every_parameter_written(
    engine: str, params: Iterable[str], written: Iterable[str], shard: str
) -> None:
    """Refuse an engine model with parameters that no tensor of its receiver shard writes
    (``params``: the model's parameter names; ``written``: the names the shard's targets
    are). A version taken would leave them as loaded while the engine reports it, as with
    the shared expert vLLM builds for a Qwen3-MoE config that asks for one."""
    uncovered = sorted(set(params) - set(written))
    if uncovered:
        raise ConfigError(
            f"the {engine} model has parameters {uncovered[:4]} ({len(uncovered)} in all) that "
            f"no tensor of receiver shard {shard!r} writes: the engine would report each "
            "version while computing with them as loaded. Serve a model whose every weight "
            "the trainer's checkpoint has, with a config deltasync's layouts cover"
        )


def load_dense(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite every live tensor with a full dense copy (initial load or anchor restore)."""
    if set(tensors) != set(params):
        raise ApplyError(
            f"dense load: names differ from the engine's; missing "
            f"{sorted(set(params) - set(tensors))[:4]}, unexpected "
            f"{sorted(set(tensors) - set(params))[:4]}. Nothing was written"
        )
    for name, t in tensors.items():
        p = params[name]
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ApplyError(
                f"dense load: {name!r} is {tuple(t.shape)} {t.dtype}, the engine holds "
                f"{tuple(p.shape)} {p.dtype}. Nothing was written"
            )
    # a copy into read-only memory would kill the process midway through the load
    check_targets_writable(((name, params[name]) for name in tensors), "dense load: ")
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


class TensorDictEngine:
    """An engine adapter over a plain ``{local_name: tensor}`` dict it owns."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, version: int = UNLOADED) -> None:
        self._tensors = dict(tensors)
        self.version = version

    def params(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def apply(self, updates: Sequence[TensorUpdate]) -> int:
        return apply_updates(updates, self._tensors)


_CONFIG_ONLY_KEYS = ("model_type", "architectures", "torch_dtype", "dtype")


def build_hf_model(hf_config: Mapping[str, Any], *, dtype: torch.dtype = torch.bfloat16):
    """A config-built (randomly initialised) transformers causal LM in ``dtype``, eval mode."""
    require_transformers()
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
