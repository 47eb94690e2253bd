"""ModelSpec: canonical tensors from a Qwen3 / Qwen3-MoE config."""

from __future__ import annotations

import math

import pytest

from deltasync.errors import LayoutError
from deltasync.layout import ModelSpec

from layout_cases import CONFIGS


def test_dense_config_lists_every_checkpoint_tensor_with_an_explicit_head_dim():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_untied"])  # head_dim 16 while hidden/heads = 6
    shapes = spec.canonical_shapes()
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (8 * 16, 48)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (8 * 16, 48)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (48, 8 * 16)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert shapes["lm_head.weight"] == (203, 48)
    assert len(shapes) == 1 + 2 * 11 + 2
    assert spec.numel() == sum(math.prod(s) for s in shapes.values())


def test_moe_config_has_dense_layers_where_mlp_only_layers_or_the_sparse_step_say():
    tied = ModelSpec.from_hf_config(CONFIGS["moe_tied"])
    assert tied.moe_layers == (0, 2)
    shapes = tied.canonical_shapes()
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (40, 32)
    assert shapes["model.layers.2.mlp.gate.weight"] == (8, 32)
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (32, 16)
    assert "lm_head.weight" not in shapes
    assert ModelSpec.from_hf_config(CONFIGS["moe_untied"]).moe_layers == (
        1,
    )  # decoder_sparse_step 2


def test_defaults_follow_transformers_when_fields_are_missing():
    cfg = {
        k: v
        for k, v in CONFIGS["dense_untied"].items()
        if k not in ("head_dim", "tie_word_embeddings")
    }
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.head_dim == 128 and not spec.tie_word_embeddings  # Qwen3Config defaults
    moe = {k: v for k, v in CONFIGS["moe_tied"].items() if k != "head_dim"}
    assert ModelSpec.from_hf_config(moe).head_dim == 32 // 8  # Qwen3-MoE falls back to hidden/heads
    legacy = dict(CONFIGS["moe_tied"])
    legacy["num_local_experts"] = legacy.pop("num_experts")  # how transformers 5.x serialises it
    assert ModelSpec.from_hf_config(legacy).num_experts == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "not supported"),
        ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": None}, "not supported"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"vocab_size": None}, "vocab_size"),
        # bool("false") is True: an untied model read as tied lost its lm_head in a split
        ({"tie_word_embeddings": "false"}, r"'tie_word_embeddings' must be true or false"),
        ({"attention_bias": "false"}, r"'attention_bias' must be true or false"),
        ({"mlp_bias": 0}, r"'mlp_bias' must be true or false \(a JSON boolean\), got 0"),
    ],
)
def test_unsupported_or_invalid_configs_raise_a_layout_error_naming_the_field(change, message):
    with pytest.raises(LayoutError, match=message):
        ModelSpec.from_hf_config(dict(CONFIGS["dense_tied"], **change))


def test_a_dense_family_with_experts_is_refused():
    from deltasync.layout import ModelSpec as Spec

    with pytest.raises(LayoutError, match="experts"):
        Spec(
            model_type="llama",
            vocab_size=10,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            intermediate_size=8,
            num_experts=4,
        )


def test_family_defaults_follow_transformers_when_the_config_leaves_them_out():
    base = {
        k: v
        for k, v in CONFIGS["dense_tied"].items()
        if k not in ("head_dim", "tie_word_embeddings")
    }
    gemma = ModelSpec.from_hf_config(dict(base, model_type="gemma"))
    assert gemma.tie_word_embeddings and gemma.head_dim == 256 and not gemma.qk_norm
    llama = ModelSpec.from_hf_config(dict(base, model_type="llama"))
    assert not llama.tie_word_embeddings and llama.head_dim == 32 // 8
    qwen2 = ModelSpec.from_hf_config(dict(base, model_type="qwen2"))
    assert qwen2.attention_biases == ("q_proj", "k_proj", "v_proj")
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2.canonical_shapes()
    assert qwen2.canonical_shapes()["model.layers.0.self_attn.k_proj.bias"] == (qwen2.kv_size,)


def test_a_moe_config_without_experts_is_refused():
    cfg = {k: v for k, v in CONFIGS["moe_tied"].items() if k != "num_experts"}
    with pytest.raises(LayoutError, match="num_experts"):
        ModelSpec.from_hf_config(cfg)
    with pytest.raises(LayoutError, match="PretrainedConfig"):
        ModelSpec.from_hf_config(42)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "gemma"])
def test_a_config_without_kv_heads_takes_its_config_class_default(model_type):
    # a config.json without num_key_value_heads (Llama-1 style): the model transformers builds
    # from it is the truth, whatever each family's default is
    import transformers

    cfg = {k: v for k, v in CONFIGS["dense_tied"].items() if k != "num_key_value_heads"}
    cfg.update(model_type=model_type, num_attention_heads=64, hidden_size=256, head_dim=4)
    if model_type == "qwen3_moe":
        cfg.update(num_experts=4, moe_intermediate_size=8)
    built = transformers.AutoConfig.for_model(**cfg)
    assert ModelSpec.from_hf_config(cfg).num_key_value_heads == built.num_key_value_heads


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "gemma"])
def test_a_null_kv_head_count_is_read_as_its_config_class_reads_it(model_type):
    # An explicit null took the family's default for a missing field (32 for Qwen3), where
    # Qwen3Config, Qwen2Config and LlamaConfig read it as num_attention_heads; the others
    # refuse it.
    import transformers

    cfg = dict(CONFIGS["dense_tied"], num_key_value_heads=None)
    cfg.update(model_type=model_type, num_attention_heads=8, hidden_size=64, head_dim=8)
    if model_type == "qwen3_moe":
        cfg.update(num_experts=4, moe_intermediate_size=8)
    try:
        built = transformers.AutoConfig.for_model(**cfg)
    except Exception:  # the config class refuses a null
        with pytest.raises(LayoutError, match="num_key_value_heads null"):
            ModelSpec.from_hf_config(cfg)
        return
    assert ModelSpec.from_hf_config(cfg).num_key_value_heads == built.num_key_value_heads == 8


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mlp_only_layers", 1, "must be a list of layer indices"),
        ("mlp_only_layers", ["0"], "must be a list of layer indices"),
        ("num_hidden_layers", 2**63, "above the"),
        ("num_experts", 2**40, "above the"),
        ("decoder_sparse_step", 0, "must be a positive integer"),  # was read as 1
    ],
)
def test_config_fields_a_model_cannot_have_are_layout_errors_not_crashes_or_endless_loops(
    field, value, message
):
    # mlp_only_layers=1 was a TypeError; 2**63 layers were enumerated until memory ran out
    cfg = dict(CONFIGS["moe_tied"], **{field: value})
    with pytest.raises(LayoutError, match=f"{field}.*{message}"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("size", [None, 0, 16])
def test_a_shared_expert_vllm_would_build_and_no_tensor_of_ours_holds_is_refused(size):
    # vLLM's qwen3_moe.py builds shared_expert + shared_expert_gate from this field;
    # transformers' Qwen3-MoE (the trainer) has neither, so it would never be synced
    cfg = dict(CONFIGS["moe_tied"])
    if size is not None:
        cfg["shared_expert_intermediate_size"] = size
    if not size:
        assert ModelSpec.from_hf_config(cfg).num_experts == cfg["num_experts"]
        return
    with pytest.raises(LayoutError, match=r"shared_expert_intermediate_size 16.*never be synced"):
        ModelSpec.from_hf_config(cfg)
