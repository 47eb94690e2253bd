"""The ``hf`` receiver layout and the trainer layout against real transformers 5.19 models."""

from __future__ import annotations

import json

import pytest
import torch

from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout

from layout_cases import CONFIGS, bitwise_equal

transformers = pytest.importorskip("transformers")  # the "models" extra; pinned in pyproject

MODELS = {
    "dense_tied": "Qwen3ForCausalLM",
    "dense_untied": "Qwen3ForCausalLM",
    "moe_tied": "Qwen3MoeForCausalLM",
    "moe_untied": "Qwen3MoeForCausalLM",
}


def build(config_name: str):
    cfg = dict(CONFIGS[config_name])
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[config_name])(config).to(torch.bfloat16)
    return config, model


@pytest.mark.parametrize("config_name", list(MODELS))
def test_hf_shard_has_the_names_and_shapes_of_the_models_state_dict(config_name):
    config, model = build(config_name)
    spec = ModelSpec.from_hf_config(config)  # a PretrainedConfig, not a dict
    layout = ReceiverLayout.build(spec, "hf")
    (shard,) = layout.shards()
    specs = layout.local_specs(shard.id)
    aliases = layout.aliases(shard.id)
    state = model.state_dict()
    assert set(specs) | set(aliases) == set(state)
    for name, t in state.items():
        assert specs[aliases.get(name, name)].shape == tuple(t.shape), name
        assert (
            state[aliases.get(name, name)].data_ptr() == t.data_ptr()
        )  # aliases really share storage
    # The hf shard of the model's own canonical tensors is the model's state, bitwise.
    trainer = TrainerLayout(spec)
    split = layout.split(trainer.to_canonical(state))[shard.id]
    assert all(bitwise_equal(split[n], state[n]) for n in split)


@pytest.mark.parametrize("config_name", list(MODELS))
def test_trainer_layout_lists_exactly_the_models_named_parameters(config_name):
    config, model = build(config_name)
    layout = TrainerLayout(ModelSpec.from_hf_config(config))
    assert layout.param_shapes() == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_canonical_checkpoint_loads_back_through_transformers_own_converter_bitwise(tmp_path):
    # transformers' from_pretrained turns per-expert checkpoint tensors into its fused
    # gate_up_proj / down_proj with its own conversion mapping; getting the original parameters
    # back bit for bit confirms the gate/up order and the non-transposed layout we assume.
    from safetensors.torch import save_file

    config, model = build("moe_untied")
    layout = TrainerLayout(ModelSpec.from_hf_config(config))
    with torch.no_grad():  # make gate and up distinguishable everywhere
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).to(p.dtype))
    canonical = layout.to_canonical(model.state_dict())
    save_file(
        {n: t.contiguous() for n, t in canonical.items()}, str(tmp_path / "model.safetensors")
    )
    (tmp_path / "config.json").write_text(
        json.dumps({**CONFIGS["moe_untied"], "architectures": [MODELS["moe_untied"]]})
    )
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    theirs = dict(loaded.named_parameters())
    ours = dict(model.named_parameters())
    assert theirs.keys() == ours.keys()
    for name, param in ours.items():
        assert bitwise_equal(theirs[name].detach(), param.detach()), name


@pytest.mark.parametrize(
    ("installed", "found"),
    [
        ("5.15.2", "transformers 5.15.2 is installed"),
        ("4.57.6", "transformers 4.57.6 is installed"),
    ],
)
def test_a_transformers_release_older_than_the_loader_needs_is_a_layout_error(
    monkeypatch, installed, found
) -> None:
    import sys

    from deltasync.errors import LayoutError
    from deltasync.layout.hf_model import TransformersLoader, meta_model

    model = meta_model(transformers.AutoConfig.for_model(**CONFIGS["dense_tied"]))
    # the module an import finds now (transformers swaps its own for a lazy one on import)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", installed)
    with pytest.raises(LayoutError, match=f"{found}.*5.16 or later: pip install"):
        TransformersLoader(model)


def test_transformers_missing_is_a_layout_error_naming_the_install(monkeypatch) -> None:
    import sys

    from deltasync.errors import LayoutError
    from deltasync.layout.probed import probe_engine_layout

    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    with pytest.raises(LayoutError, match=r"this needs transformers .*pip install 'transformers"):
        probe_engine_layout(CONFIGS["dense_tied"], "transformers")
