"""The layout probe: learned tables equal the hand-written ones; transforming loaders are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deltasync.errors import LayoutError, LayoutProbeError
from deltasync.layout import ModelSpec, ShardInfo
from deltasync.layout.hf_model import build_hf_table
from deltasync.layout.probe import (
    ProbeConfig,
    check_bits,
    decode_payload,
    pass_values,
    probe_shard,
)
from deltasync.layout.probed import (
    ProbeCache,
    assemble_table,
    layout_from_json,
    layout_to_json,
    load_layout,
    probe_key,
)
from deltasync.layout.reference_loader import VllmReferenceLoader
from deltasync.layout.vllm_rules import build_vllm_table, pad_vocab, vllm_shards

from layout_cases import CASES, CONFIGS, bitwise_equal, random_state

PROBE_CASES = [c for c in CASES if c[1] <= 4]


def table_key(table):
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


def probe_vllm_reference(spec, tp, ep, config=None):
    probes = {
        sid: probe_shard(
            VllmReferenceLoader(spec, tp=tp, tp_rank=t, ep=ep, ep_rank=e),
            spec.canonical_shapes(),
            config=config,
        )
        for sid, t, e in vllm_shards(spec, tp, ep)
    }
    return assemble_table(spec.canonical_shapes(), probes), probes


@pytest.mark.parametrize("name,tp,ep", PROBE_CASES)
def test_probed_vllm_tables_equal_the_hand_written_rules_element_for_element(name, tp, ep):
    spec = ModelSpec.from_hf_config(CONFIGS[name])
    probed, _ = probe_vllm_reference(spec, tp, ep)
    hand = build_vllm_table(spec, tp, ep)
    assert table_key(probed) == table_key(hand)
    # Element for element: the same state split by both tables is the same, bit for bit.
    state = random_state(spec, seed=tp * 10 + ep)
    a, b = probed.split(state), hand.split(state)
    assert a.keys() == b.keys()
    for sid in a:
        assert a[sid].keys() == b[sid].keys()
        assert all(bitwise_equal(a[sid][n], b[sid][n]) for n in a[sid]), sid
    merged = probed.merge(a)
    assert all(bitwise_equal(merged[n], state[n]) for n in state)


def test_small_rounds_learn_the_same_table_as_one_round():
    spec = ModelSpec.from_hf_config(CONFIGS["moe_untied"])
    small, probes = probe_vllm_reference(spec, 2, 4, ProbeConfig(round_elements=500))
    big, _ = probe_vllm_reference(spec, 2, 4)
    assert table_key(small) == table_key(big)
    assert all(p.passes > 3 for p in probes.values())  # several rounds really ran


def test_other_ep_ranks_experts_are_dropped_and_vocab_padding_is_recognised():
    spec = ModelSpec.from_hf_config(CONFIGS["moe_untied"])  # 6 experts, EP 4: 2,2,1,1
    _, probes = probe_vllm_reference(spec, 4, 4)
    canon = spec.canonical_shapes()
    layer = 1  # decoder_sparse_step 2: layer 1 is sparse
    for sid, t, e in vllm_shards(spec, 4, 4):
        held = {
            int(n.split(".")[5])
            for n in probes[sid].placements
            if n.startswith(f"model.layers.{layer}.mlp.experts.")
        }
        assert held == {0: {0, 1}, 1: {2, 3}, 2: {4}, 3: {5}}[e]
        per_rank = pad_vocab(spec.vocab_size) // 4
        real = max(0, min(spec.vocab_size - t * per_rank, per_rank))
        dropped = probes[sid].dropped(canon)
        # rank 3's vocabulary rows are all padding: it holds no embedding or lm_head row
        assert len(dropped) == 3 * (6 - len(held)) + (2 if real == 0 else 0)
        assert probes[sid].padding["model.embed_tokens.weight"] == (per_rank - real) * 16
        assert probes[sid].padding[f"model.layers.{layer}.self_attn.qkv_proj.weight"] == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_probing_the_transformers_model_learns_the_hf_table(name):
    transformers = pytest.importorskip("transformers")
    from deltasync.layout.hf_model import TransformersLoader, checkpoint_shapes, empty_model

    config = transformers.AutoConfig.for_model(**CONFIGS[name])
    spec = ModelSpec.from_hf_config(config)
    model = empty_model(config)
    assert checkpoint_shapes(model) == spec.canonical_shapes()
    probe = probe_shard(TransformersLoader(model), spec.canonical_shapes())
    probed = assemble_table(spec.canonical_shapes(), {"tp0": probe})
    assert table_key(probed) == table_key(build_hf_table(spec))


# ---------------------------------------------------------------------- refusals


class Transforming(VllmReferenceLoader):
    """The reference loader, with one checkpoint tensor's values changed on the way in."""

    def __init__(self, spec, target: str, fn, **kw):
        super().__init__(spec, **kw)
        self.target, self.fn = target, fn

    def load_weights(self, weights):
        return super().load_weights((n, self.fn(w) if n == self.target else w) for n, w in weights)


def _byteswap(w):
    b = w.contiguous().view(torch.uint8).reshape(-1, 2).flip(1)
    return b.reshape(-1).view(torch.bfloat16).reshape(w.shape)


def _fp8(w):
    return w.to(torch.float8_e4m3fn).to(torch.bfloat16)


TRANSFORMS = {
    "scale by 2": lambda w: w * 2,
    "add one (a folded norm offset)": lambda w: w + 1,
    "fp8 round trip": _fp8,
    "byte swap": _byteswap,
    "negate": lambda w: -w,
    "sum of rows": lambda w: w + w.roll(1, 0),
}


@pytest.mark.parametrize("kind", list(TRANSFORMS))
@pytest.mark.parametrize("target", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"])
def test_a_value_transforming_loader_is_refused_for_that_tensor_only(kind, target):
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    loader = Transforming(spec, target, TRANSFORMS[kind], tp=2, tp_rank=1)
    with pytest.raises(LayoutProbeError) as err:
        probe_shard(loader, spec.canonical_shapes())
    assert set(err.value.refused) == {target}
    assert target in str(err.value)


def test_a_transposing_loader_is_refused_as_not_expressible_in_blocks():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_untied"])
    target = "model.layers.0.self_attn.o_proj.weight"  # (48, 128) at TP 1

    def transpose_square(w):
        out = w.clone()
        out[:, :48] = w[:, :48].t()
        return out

    loader = Transforming(spec, target, transpose_square)
    with pytest.raises(LayoutProbeError) as err:
        probe_shard(loader, spec.canonical_shapes(), config=ProbeConfig(max_blocks_per_tensor=64))
    assert set(err.value.refused) == {target}


def test_a_loader_that_drops_a_tensor_everywhere_is_an_error_naming_it():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    target = "model.layers.0.mlp.up_proj.weight"

    class Dropping(VllmReferenceLoader):
        def load_weights(self, weights):
            return super().load_weights((n, w) for n, w in weights if n != target)

    probes = {
        sid: probe_shard(Dropping(spec, tp=2, tp_rank=t), spec.canonical_shapes())
        for sid, t, _ in vllm_shards(spec, 2, 1)
    }
    with pytest.raises(LayoutProbeError) as err:
        assemble_table(spec.canonical_shapes(), probes)
    assert set(err.value.refused) == {target}


def test_a_float32_parameter_is_refused():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    loader = VllmReferenceLoader(spec)
    loader._params["model.norm.weight"] = torch.zeros(32, dtype=torch.float32)
    with pytest.raises(LayoutProbeError) as err:
        probe_shard(loader, spec.canonical_shapes())
    assert set(err.value.refused) == {"model.norm.weight"}
    assert "float32" in str(err.value)


def test_probe_values_are_exact_bf16_integers_and_check_patterns_are_finite_and_distinct():
    ids = torch.arange(0, 1 << 28, 1 << 9, dtype=torch.int64)
    for k in range(2):
        v = pass_values(ids, k)
        assert bool((v.float() == v.float().round()).all()) and bool((v != 0).all())
        assert bool((v.float().to(torch.bfloat16).view(torch.int16) == v.view(torch.int16)).all())
        payload = decode_payload(v.view(torch.int16))
        assert torch.equal(payload.to(torch.int64), (ids >> (14 * k)) & (2**14 - 1))
    assert torch.equal(
        decode_payload(torch.zeros(3, dtype=torch.int16)), torch.full((3,), -1, dtype=torch.int32)
    )
    ids = torch.arange(0, 1 << 16, dtype=torch.int64)
    bits = check_bits(ids)
    vals = bits.view(torch.bfloat16).float()
    assert bool(torch.isfinite(vals).all()) and bool((vals != 0).all())
    assert torch.unique(bits).numel() == 1 << 13  # sign, 32 exponents, 7 significand bits
    assert float((bits[1:] != bits[:-1]).float().mean()) > 0.99  # neighbours differ
    assert not bool(
        ((bits.view(torch.bfloat16).float() * 2).to(torch.bfloat16).view(torch.int16) == bits).any()
    )


# ---------------------------------------------------------------------- JSON and cache


def test_a_probed_layout_survives_json_and_the_cache_probes_once(tmp_path):
    spec = ModelSpec.from_hf_config(CONFIGS["moe_tied"])
    shards = [ShardInfo(sid, t, e) for sid, t, e in vllm_shards(spec, 2, 2)]
    key = probe_key(CONFIGS["moe_tied"], "vllm-reference", {"tp": 2, "ep": 2})
    calls = []

    def run():
        calls.append(1)
        return probe_vllm_reference(spec, 2, 2)[0], shards

    cache = ProbeCache(tmp_path)
    t1, s1 = cache.get_or_probe(key, run)
    t2, s2 = cache.get_or_probe(key, run)
    assert len(calls) == 1 and s1 == s2 == shards
    assert table_key(t1) == table_key(t2) == table_key(build_vllm_table(spec, 2, 2))
    doc = json.loads(json.dumps(layout_to_json(t1, shards, key)))
    t3, _s3, k3 = layout_from_json(doc)
    assert table_key(t3) == table_key(t1) and k3 == key
    other = probe_key(CONFIGS["moe_tied"], "vllm-reference", {"tp": 2, "ep": 1})
    assert cache.get(other) is None


def test_a_corrupted_layout_file_is_a_layout_error():
    from deltasync.errors import LayoutError

    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    table = build_vllm_table(spec, 2, 1)
    doc = layout_to_json(table, [ShardInfo("tp0", 0, 0), ShardInfo("tp1", 1, 0)])
    bad = json.loads(json.dumps(doc))
    bad["placements"]["model.norm.weight"][0][6] = 999  # rows beyond the tensor
    with pytest.raises(LayoutError):
        layout_from_json(bad)
    bad = json.loads(json.dumps(doc))
    del bad["placements"]["model.norm.weight"]
    with pytest.raises(LayoutError, match=r"model.norm.weight"):
        layout_from_json(bad)
    # a dimension no tensor can have: loaded, it crashed a split with torch's TypeError
    bad = json.loads(json.dumps(doc))
    bad["locals"]["tp0"]["model.norm.weight"] = [2**63]
    with pytest.raises(LayoutError, match=r"locals\['tp0'\]\['model.norm.weight'\].*2\^62"):
        layout_from_json(bad)
    # a shard listed twice: loaded, a split wrote both files, then crashed with a KeyError
    bad = json.loads(json.dumps(doc))
    bad["shards"].append(dict(bad["shards"][0]))
    with pytest.raises(LayoutError, match=r"\['tp0'\] more than once"):
        layout_from_json(bad)


def test_a_damaged_layout_file_names_the_file_and_a_damaged_cache_entry_is_probed_again(
    tmp_path, caplog
):
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    shards = [ShardInfo("tp0", 0, 0), ShardInfo("tp1", 1, 0)]
    key = probe_key(CONFIGS["dense_tied"], "vllm-reference", {"tp": 2, "ep": 1})
    doc = layout_to_json(build_vllm_table(spec, 2, 1), shards, key)
    doc["placements"]["model.norm.weight"][0][6] = 999  # rows beyond the tensor
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(LayoutError, match=rf"^layout file {re.escape(repr(str(path)))}: "):
        load_layout(path)

    cache = ProbeCache(tmp_path / "cache")
    entry = cache.path(key)
    entry.parent.mkdir()
    entry.write_text(json.dumps(doc))  # a damaged entry under the right name
    calls = []

    def run():
        calls.append(1)
        return build_vllm_table(spec, 2, 1), shards

    with caplog.at_level("WARNING", logger="deltasync.layout.probed"):
        table, got = cache.get_or_probe(key, run)
    assert calls == [1] and got == shards
    assert table_key(table) == table_key(build_vllm_table(spec, 2, 1))
    assert str(entry) in caplog.text and "probing again" in caplog.text
    cache.get_or_probe(key, run)  # the entry was replaced: a hit
    assert calls == [1]


def test_a_probe_cache_under_home_is_the_users_not_a_tilde_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cache = ProbeCache("~/.cache/deltasync/layouts")
    assert cache.root == tmp_path / "home" / ".cache" / "deltasync" / "layouts"
    assert not (tmp_path / "~").exists()


def test_ep_ranks_past_the_experts_hold_empty_expert_tensors_when_probed_too():
    # The probe left out the 0-row w13/w2 of EP ranks without experts, which the rules (and
    # vLLM) hold: a receiver on a probed layout refused a publisher on the rules.
    cfg = dict(CONFIGS["moe_tied"], num_experts=3, num_experts_per_tok=2)
    spec = ModelSpec.from_hf_config(cfg)
    probed, _ = probe_vllm_reference(spec, 1, 4)
    hand = build_vllm_table(spec, 1, 4)
    assert probed.dst_shapes == hand.dst_shapes
    assert table_key(probed) == table_key(hand)


@pytest.mark.parametrize(
    "change, tp, message",
    [
        (dict(model_type="qwen3", attention_bias=True), 2, "o_proj has no bias"),
        (dict(num_experts=6, num_experts_per_tok=2), 8, "greater than the number of experts"),
        (dict(mlp_only_layers=[0, 1, 2]), 1, "without a sparse layer"),
    ],
)
def test_the_reference_loader_refuses_what_vllm_refuses_to_build(change, tp, message):
    # It laid these out (a layout file a publisher then wrote versions for) while the rules,
    # and vLLM, refuse them.
    base = CONFIGS["dense_tied"] if change.get("model_type") == "qwen3" else CONFIGS["moe_tied"]
    spec = ModelSpec.from_hf_config(dict(base, **change))
    with pytest.raises(LayoutError, match=message):
        VllmReferenceLoader(spec, tp=tp)
    with pytest.raises(LayoutError, match=message):
        build_vllm_table(spec, tp, 1)
