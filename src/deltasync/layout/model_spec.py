"""The canonical tensors of a decoder-only checkpoint, derived from its config.

Canonical coordinates are the tensor names and row-major flat indices of the published HF
*checkpoint* (the safetensors files on the hub): one tensor per projection, and for Qwen3-MoE
one tensor per expert (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``). Every
other layout (the trainer's own parameters, an inference engine's fused shards) is mapped to
and from these names by a table.

Families (checked against transformers 5.19's modeling code and the state dicts it builds):
Qwen3 and Qwen3-MoE (``q_norm``/``k_norm`` per layer, optional attention biases on q/k/v/o),
Llama and Mistral (optional ``attention_bias`` on q/k/v/o, Llama's optional ``mlp_bias`` on
gate/up/down), Qwen2 / Qwen2.5 (biases on q/k/v, none on o) and Gemma (tied embeddings by
default, ``head_dim`` 256 by default; its ``1 + w`` norm scaling happens in the forward pass, the
checkpoint holds ``w``). The hand-written engine tables cover Qwen3 and Qwen3-MoE; the other
families get theirs from the layout probe.

This module knows configs and shapes only. It does not know any engine's layout, does not
read files and does not import ``transformers`` (a ``PretrainedConfig`` is accepted, but only
as an object with ``to_dict()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deltasync.errors import LayoutError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "mistral", "qwen2", "gemma")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# transformers 5.19's config defaults where a config.json leaves the field out.
_HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma": 256}  # others: hidden_size // num_attention_heads
# num_key_value_heads: each config class's own default (llama: num_attention_heads)
_KV_HEADS_DEFAULT = {"qwen3": 32, "qwen3_moe": 4, "qwen2": 32, "mistral": 8, "gemma": 16}
# the families whose config class reads an explicit null num_key_value_heads as
# num_attention_heads (the others refuse it)
_KV_HEADS_NULL_IS_HEADS = ("qwen3", "qwen2", "llama")
_TIED_DEFAULT = {"gemma": True}


# A count the shapes are built from one by one (layers, experts): far above any model, so a
# config holding a number like 2**63 is refused instead of enumerated until memory runs out.
MAX_COUNT = 1 << 20


def _flag(name: str, cfg: Mapping[str, Any], default: bool) -> bool:
    """``cfg[name]`` as a JSON boolean (absent or null: ``default``); anything else, such as
    the string ``"false"`` that ``bool()`` reads as true, is a LayoutError naming it."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LayoutError(
            f"model config field {name!r} must be true or false (a JSON boolean), got "
            f"{value!r}; fix the config"
        )
    return value


def _pos_int(name: str, value: Any, *, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(
            f"model config field {name!r} must be a positive integer, got {value!r}; fix the config"
        )
    if hi is not None and value > hi:
        raise LayoutError(
            f"model config field {name!r} is {value}, above the {hi} supported; fix the config"
        )
    return value


def _layer_list(name: str, value: Any) -> set[int]:
    """A config's list of layer indices (None: empty)."""
    if value is None:
        return set()
    if not isinstance(value, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise LayoutError(
            f"model config field {name!r} must be a list of layer indices, got {value!r}; "
            "fix the config (e.g. [] or [0, 3])"
        )
    return set(value)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a model of one of the supported families, validated at construction.

    ``attention_bias``: biases on q/k/v/o (Qwen2 always has q/k/v biases and no o bias, so the
    field is ignored there); ``mlp_bias``: biases on gate/up/down (Llama). ``moe_layers`` lists the decoder layers that hold a sparse MoE block; the other layers of a
    MoE model hold a dense MLP of ``intermediate_size`` (``mlp_only_layers`` /
    ``decoder_sparse_step`` in the HF config).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # Every tensor of these checkpoints is bf16, the MoE router (mlp.gate) included.
    dtype: torch.dtype = field(default=torch.bfloat16)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model_type {self.model_type!r} is not supported by the layout tables; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
        ):
            _pos_int(
                name, getattr(self, name), hi=MAX_COUNT if name == "num_hidden_layers" else None
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise LayoutError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); fix the model config"
            )
        if self.dtype != torch.bfloat16:
            raise LayoutError(
                f"dtype must be torch.bfloat16 (BF16 sync only), got {self.dtype}; leave dtype "
                "at its default"
            )
        if self.model_type != "qwen3_moe":
            if self.num_experts or self.moe_layers:
                raise LayoutError(
                    f"a {self.model_type!r} (dense) config cannot have experts or MoE layers; "
                    "leave num_experts and moe_layers unset, or use model_type 'qwen3_moe'"
                )
        else:
            _pos_int("num_experts", self.num_experts, hi=MAX_COUNT)
            _pos_int("moe_intermediate_size", self.moe_intermediate_size)
        if self.mlp_bias and self.model_type != "llama":
            raise LayoutError(
                f"mlp_bias is a Llama option; {self.model_type!r} has no MLP biases: remove "
                "mlp_bias from the config (or set it to false)"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]
        if bad or list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise LayoutError(
                f"moe_layers {self.moe_layers!r} must be sorted, distinct layer indices "
                f"in 0..{self.num_hidden_layers - 1}"
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ModelSpec:
        """Build from a transformers ``config.json`` dict or a ``PretrainedConfig``.

        Missing optional fields take transformers 5.19's defaults: ``tie_word_embeddings``
        False (True for ``gemma``); ``attention_bias`` and ``mlp_bias`` False; ``head_dim`` 128
        for ``qwen3`` (the Qwen3Config default), 256 for ``gemma``, else ``hidden_size //
        num_attention_heads`` (the modeling code falls back to that; vLLM does the same);
        ``num_key_value_heads`` the config class's default (``num_attention_heads`` for
        ``llama``; 32 for ``qwen3`` and ``qwen2``, 4 for ``qwen3_moe``, 8 for ``mistral``, 16
        for ``gemma``); ``decoder_sparse_step`` 1; ``mlp_only_layers`` empty.
        """
        if not isinstance(config, Mapping):
            to_dict = getattr(config, "to_dict", None)
            if to_dict is None:
                raise LayoutError(
                    f"expected a config dict or a transformers PretrainedConfig, got {type(config).__name__}"
                )
            config = to_dict()
        cfg = dict(config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model_type {model_type!r} is not supported: deltasync's model specs cover "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}; add this family's canonical tensors first"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise LayoutError(
                    f"model config has no {key!r} (required for model_type {model_type!r}); "
                    "pass the config.json the model was saved with (save_pretrained writes it)"
                )
            return cfg[key]

        hidden = _pos_int("hidden_size", need("hidden_size"))
        heads = _pos_int("num_attention_heads", need("num_attention_heads"))
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            head_dim = _HEAD_DIM_DEFAULT.get(model_type, hidden // heads)
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None and "num_key_value_heads" in cfg:  # null, not absent
            if model_type not in _KV_HEADS_NULL_IS_HEADS:
                raise LayoutError(
                    f"model config has num_key_value_heads null, which transformers refuses "
                    f"for model_type {model_type!r}: give the number of kv heads"
                )
            kv_heads = heads
        elif kv_heads is None:
            kv_heads = _KV_HEADS_DEFAULT.get(model_type, heads)
        kwargs: dict[str, Any] = {
            "model_type": model_type,
            "vocab_size": need("vocab_size"),
            "hidden_size": hidden,
            "num_hidden_layers": need("num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": need("intermediate_size"),
            "tie_word_embeddings": _flag(
                "tie_word_embeddings", cfg, _TIED_DEFAULT.get(model_type, False)
            ),
            "attention_bias": _flag("attention_bias", cfg, False),
            "mlp_bias": _flag("mlp_bias", cfg, False),
        }
        if model_type == "qwen3_moe":
            # transformers 5.x serialises the expert count as num_local_experts (attribute_map).
            num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if num_experts is None:
                raise LayoutError(
                    "model config has no 'num_experts' (required for qwen3_moe); set "
                    "num_experts (or num_local_experts) in the model config"
                )
            num_experts = _pos_int("num_experts", num_experts, hi=MAX_COUNT)
            step = cfg.get("decoder_sparse_step")  # 0 divides by zero in transformers and vLLM
            step = _pos_int("decoder_sparse_step", 1 if step is None else step)
            mlp_only = _layer_list("mlp_only_layers", cfg.get("mlp_only_layers"))
            shared = cfg.get("shared_expert_intermediate_size")
            if shared not in (None, 0):  # vLLM's qwen3_moe.py builds a shared expert from it
                raise LayoutError(
                    f"model config has shared_expert_intermediate_size {shared!r}: vLLM builds "
                    "a shared expert for each MoE layer from it, which transformers' Qwen3-MoE "
                    "and deltasync's tensors do not have, so it would never be synced; remove "
                    "the field (or set it to 0) to serve the model the trainer has"
                )
            n_layers = _pos_int("num_hidden_layers", kwargs["num_hidden_layers"], hi=MAX_COUNT)
            # Same rule as Qwen3MoeDecoderLayer (transformers) and vLLM's qwen3_moe.py.
            kwargs.update(
                num_experts=num_experts,
                moe_intermediate_size=need("moe_intermediate_size"),
                moe_layers=tuple(
                    i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0
                ),
            )
        return cls(**kwargs)

    # ------------------------------------------------------------------ canonical tensors

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k (``self_attn.q_norm`` / ``k_norm``): the Qwen3 families."""
        return self.model_type in QK_NORM_MODEL_TYPES

    @property
    def attention_biases(self) -> tuple[str, ...]:
        """The attention projections that carry a bias."""
        if self.model_type == "qwen2":
            return ("q_proj", "k_proj", "v_proj")
        return ("q_proj", "k_proj", "v_proj", "o_proj") if self.attention_bias else ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor name and shape, in checkpoint order."""
        h, v = self.hidden_size, self.vocab_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            out[p + "self_attn.k_proj.weight"] = (self.kv_size, h)
            out[p + "self_attn.v_proj.weight"] = (self.kv_size, h)
            out[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            bias_sizes = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
            for proj in self.attention_biases:
                out[p + f"self_attn.{proj}.bias"] = (bias_sizes.get(proj, h),)
            if self.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                out[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            if self.is_moe_layer(i):
                im = self.moe_intermediate_size
                out[p + "mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = (im, h)
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = (im, h)
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, im)
            else:
                out[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
                out[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
                out[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
                if self.mlp_bias:
                    out[p + "mlp.gate_proj.bias"] = (self.intermediate_size,)
                    out[p + "mlp.up_proj.bias"] = (self.intermediate_size,)
                    out[p + "mlp.down_proj.bias"] = (h,)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (v, h)
        return out

    def numel(self) -> int:
        total = 0
        for shape in self.canonical_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total
