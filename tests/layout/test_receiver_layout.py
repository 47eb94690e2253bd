"""Receiver layouts: dense split/merge, the vLLM conventions, shards, and what is refused."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import LayoutError
from deltasync.layout import ModelSpec, ReceiverLayout

from layout_cases import CASES, CONFIGS, bitwise_equal, random_config, random_state
from layout_vllm_reference import reference_vllm_shard


@pytest.mark.parametrize(("config", "tp", "ep"), CASES)
def test_merge_of_split_gives_back_every_canonical_tensor_bitwise(config, tp, ep):
    spec = ModelSpec.from_hf_config(CONFIGS[config])
    layout = ReceiverLayout.build(spec, "vllm", tp, ep)
    full = random_state(spec, seed=tp * 10 + ep)
    merged = layout.merge(layout.split(full))
    assert merged.keys() == full.keys()
    for name in full:
        assert bitwise_equal(merged[name], full[name]), name


@pytest.mark.parametrize("seed", range(8))
def test_merge_of_split_holds_for_random_configs(seed):
    cfg, tp, ep = random_config(seed)
    spec = ModelSpec.from_hf_config(cfg)
    for engine, t, e in (("vllm", tp, ep), ("hf", 1, 1)):
        layout = ReceiverLayout.build(spec, engine, t, e)
        full = random_state(spec, seed)
        merged = layout.merge(layout.split(full))
        assert all(bitwise_equal(merged[n], full[n]) for n in full), (cfg, engine, t, e)


@pytest.mark.parametrize(("config", "tp", "ep"), CASES)
def test_vllm_shards_equal_an_independent_restatement_of_vllms_loaders(config, tp, ep):
    spec = ModelSpec.from_hf_config(CONFIGS[config])
    layout = ReceiverLayout.build(spec, "vllm", tp, ep)
    full = random_state(spec, seed=7)
    shards = layout.split(full)
    for info in layout.shards():
        ref = reference_vllm_shard(full, spec, tp, ep, info.tp_rank, info.ep_rank)
        got = shards[info.id]
        assert got.keys() == ref.keys(), info
        for name in ref:
            assert bitwise_equal(got[name], ref[name]), (info, name)
        specs = layout.local_specs(info.id)
        assert {n: (s.shape, s.dtype) for n, s in specs.items()} == {
            n: (tuple(t.shape), torch.bfloat16) for n, t in got.items()
        }


def test_shard_ids_name_tp_rank_and_ep_rank_when_expert_parallelism_is_on():
    moe = ModelSpec.from_hf_config(CONFIGS["moe_tied"])
    ids = [(s.id, s.tp_rank, s.ep_rank) for s in ReceiverLayout.build(moe, "vllm", 2, 4).shards()]
    assert ids == [("tp0-ep0", 0, 0), ("tp1-ep1", 1, 1), ("tp0-ep2", 0, 2), ("tp1-ep3", 1, 3)]
    ids = [(s.id, s.tp_rank, s.ep_rank) for s in ReceiverLayout.build(moe, "vllm", 4, 1).shards()]
    assert ids == [("tp0", 0, 0), ("tp1", 1, 0), ("tp2", 2, 0), ("tp3", 3, 0)]
    assert [s.id for s in ReceiverLayout.build(moe, "hf").shards()] == ["tp0"]


def test_experts_are_placed_contiguously_with_the_first_ranks_taking_the_remainder():
    spec = ModelSpec.from_hf_config(CONFIGS["moe_untied"])  # 6 experts over 4 EP ranks: 2, 2, 1, 1
    layout = ReceiverLayout.build(spec, "vllm", 1, 4)
    counts = [
        layout.local_specs(s.id)["model.layers.1.mlp.experts.w13_weight"].shape[0]
        for s in layout.shards()
    ]
    assert counts == [2, 2, 1, 1]
    routed = layout.route("model.layers.1.mlp.experts.4.up_proj.weight", torch.tensor([0]))
    assert list(routed) == ["tp0-ep2"]
    # expert 4 is local expert 0 of ep rank 2; up rows start after its 8 gate rows (width 16).
    assert routed["tp0-ep2"]["model.layers.1.mlp.experts.w13_weight"][0].tolist() == [8 * 16]


def test_vocab_padding_rows_are_zero_after_split_and_ignored_by_merge():
    spec = ModelSpec.from_hf_config(
        CONFIGS["moe_untied"]
    )  # vocab 77 -> padded 128, 32 rows per TP rank
    layout = ReceiverLayout.build(spec, "vllm", 4, 1)
    full = random_state(spec, seed=3)
    shards = layout.split(full)
    assert tuple(shards["tp2"]["lm_head.weight"].shape) == (32, 16)
    assert bitwise_equal(shards["tp2"]["lm_head.weight"][:13], full["lm_head.weight"][64:77])
    assert not shards["tp2"]["lm_head.weight"][13:].view(torch.int16).any()
    assert not shards["tp3"]["model.embed_tokens.weight"].view(torch.int16).any()
    shards["tp3"]["model.embed_tokens.weight"].fill_(
        1.0
    )  # padding only: nothing canonical lives there
    assert bitwise_equal(
        layout.merge(shards)["model.embed_tokens.weight"], full["model.embed_tokens.weight"]
    )


def test_tied_embeddings_give_one_tensor_and_lm_head_only_as_an_alias():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    assert "lm_head.weight" not in spec.canonical_shapes()
    for engine, tp in (("hf", 1), ("vllm", 2)):
        layout = ReceiverLayout.build(spec, engine, tp)
        for s in layout.shards():
            assert "lm_head.weight" not in layout.local_specs(s.id)
            assert layout.aliases(s.id) == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = ReceiverLayout.build(ModelSpec.from_hf_config(CONFIGS["dense_untied"]), "vllm", 2)
    assert untied.aliases("tp0") == {} and "lm_head.weight" in untied.local_specs("tp0")


def test_merge_accepts_a_tied_alias_only_if_it_equals_its_target():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    layout = ReceiverLayout.build(spec, "hf")
    shards = layout.split(random_state(spec, seed=1))
    emb = shards["tp0"]["model.embed_tokens.weight"]
    shards["tp0"]["lm_head.weight"] = emb
    layout.merge(shards)
    shards["tp0"]["lm_head.weight"] = emb.clone()
    shards["tp0"]["lm_head.weight"].view(torch.int16)[0, 0] ^= 1
    with pytest.raises(LayoutError, match="tied"):
        layout.merge(shards)


def test_merge_rejects_replicated_copies_that_disagree_by_one_bit():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])  # 2 kv heads over TP 4: each held twice
    layout = ReceiverLayout.build(spec, "vllm", 4)
    shards = layout.split(random_state(spec, seed=2))
    shards["tp3"]["model.layers.0.self_attn.qkv_proj.weight"].view(torch.int16)[-1, -1] ^= (
        1  # a v-head row
    )
    with pytest.raises(LayoutError, match="disagree"):
        layout.merge(shards)
    shards = layout.split(random_state(spec, seed=2))
    shards["tp1"]["model.norm.weight"].view(torch.int16)[0] ^= 1
    with pytest.raises(LayoutError, match=r"model.norm.weight"):
        layout.merge(shards)


def test_merge_and_split_reject_missing_and_unexpected_tensors():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_untied"])
    layout = ReceiverLayout.build(spec, "vllm", 2)
    full = random_state(spec, seed=4)
    shards = layout.split(full)
    del shards["tp1"]["model.norm.weight"]
    with pytest.raises(LayoutError, match=r"tp1/model.norm.weight"):
        layout.merge(shards)
    shards = layout.split(full)
    shards["tp0"]["model.extra.weight"] = torch.zeros(1, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="unexpected"):
        layout.merge(shards)
    with pytest.raises(LayoutError, match="missing"):
        layout.split({k: v for k, v in full.items() if k != "lm_head.weight"})
    with pytest.raises(LayoutError, match="expected"):
        layout.split({**full, "model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)})


@pytest.mark.parametrize(
    ("config", "engine", "tp", "ep", "message"),
    [
        ("dense_tied", "vllm", 3, 1, "num_attention_heads"),
        ("dense_untied", "vllm", 16, 1, "num_attention_heads"),
        ("moe_tied", "vllm", 2, 3, "multiple of tp"),
        ("dense_tied", "vllm", 1, 2, "needs a MoE model"),
        ("moe_untied", "vllm", 8, 1, "num_attention_heads"),
        ("dense_tied", "hf", 2, 1, "one shard"),
        ("dense_tied", "sglang", 1, 1, "unknown engine"),
        ("dense_tied", "vllm", 0, 1, "positive"),
    ],
)
def test_parallel_sizes_vllm_would_refuse_raise_a_layout_error(config, engine, tp, ep, message):
    spec = ModelSpec.from_hf_config(CONFIGS[config])
    with pytest.raises(LayoutError, match=message):
        ReceiverLayout.build(spec, engine, tp, ep)


def test_kv_heads_that_neither_divide_nor_are_divided_by_tp_are_refused():
    cfg = dict(CONFIGS["dense_untied"], num_attention_heads=12, num_key_value_heads=6)
    with pytest.raises(LayoutError, match="num_key_value_heads"):
        ReceiverLayout.build(ModelSpec.from_hf_config(cfg), "vllm", 4)


def test_attention_bias_is_refused_by_vllm_but_laid_out_by_hf():
    spec = ModelSpec.from_hf_config(dict(CONFIGS["dense_tied"], attention_bias=True))
    with pytest.raises(LayoutError, match="bias"):
        ReceiverLayout.build(spec, "vllm", 1)
    layout = ReceiverLayout.build(spec, "hf")
    assert layout.local_specs("tp0")["model.layers.0.self_attn.o_proj.bias"].shape == (32,)
    full = random_state(spec, seed=5)
    assert all(bitwise_equal(layout.merge(layout.split(full))[n], full[n]) for n in full)


def test_unknown_shard_id_is_a_layout_error():
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(CONFIGS["dense_tied"]), "vllm", 2)
    with pytest.raises(LayoutError, match="tp7"):
        layout.local_specs("tp7")
