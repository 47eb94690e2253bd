"""Families without hand-written tables, end to end through probed layouts.

For Llama (tied and untied, with attention and MLP biases), Qwen2.5 (q/k/v biases, tied),
Mistral and Gemma (tied, head_dim != hidden/heads): the trainer layout is probed from the
real transformers class, the receiver layout from the vLLM-convention reference loader at
TP 2; a transformers trainer with AdamW publishes every step to a local store, and every
receiver shard's tensors equal, bit for bit, what the engine's own loader writes from that
version's dense BF16 checkpoint (the loader is the oracle, not the probed table).
"""

from __future__ import annotations

import pytest
import torch

from deltasync import (
    AdamWTracker,
    LocalStore,
    ModelSpec,
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    TrainerLayout,
    TrainerSync,
)
from deltasync.layout.probed import probe_receiver_layout
from deltasync.layout.reference_loader import VllmReferenceLoader

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=157,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama_tied": dict(BASE, model_type="llama", tie_word_embeddings=True),
    "llama_untied_biases": dict(
        BASE, model_type="llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True
    ),
    "qwen2_5": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(BASE, model_type="mistral", tie_word_embeddings=False, head_dim=16),
    "gemma": dict(BASE, model_type="gemma", head_dim=16, num_key_value_heads=1),
}
TP = 2
VERSIONS = 4


def _table_key(table):
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_without_hand_written_tables_syncs_bit_exactly_through_probed_layouts(
    family, tmp_path
):
    from deltasync.layout.hf_model import checkpoint_shapes, meta_model

    cfg = FAMILIES[family]
    config = transformers.AutoConfig.for_model(**cfg)
    spec = ModelSpec.from_hf_config(config)
    assert checkpoint_shapes(meta_model(config)) == spec.canonical_shapes()

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)  # fp32 masters
    trainer_layout = TrainerLayout.from_transformers(model)
    assert _table_key(trainer_layout._forward) == _table_key(TrainerLayout(spec)._forward)
    layout = probe_receiver_layout(
        spec,
        lambda t, e: VllmReferenceLoader(spec, tp=TP, tp_rank=t),
        engine="vllm-reference",
        tp=TP,
    )
    store = LocalStore(tmp_path / "store", durable=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = AdamWTracker(opt, model.named_parameters())
    params = dict(model.named_parameters())
    pub = Publisher(
        store,
        receiver_layout=layout,
        trainer_layout=trainer_layout,
        config=PublisherConfig(anchor_every=3),
    )
    sync = TrainerSync(tracker, [pub], params)
    receivers = {
        s.id: Receiver.for_layout(
            store,
            layout,
            s.id,
            {n: torch.zeros(v.shape, dtype=v.dtype) for n, v in layout.local_specs(s.id).items()},
            str(tmp_path / s.id),
            ReceiverConfig(receiver_id=f"r-{s.id}", durable=False),
        )
        for s in layout.shards()
    }
    gen = torch.Generator().manual_seed(1)
    changed = 0
    for version in range(VERSIONS):
        if version:
            ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=gen)
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        reports = sync.step_published(version)
        changed += reports[0].kind == "delta"
        bf16 = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        canonical = trainer_layout.to_canonical(bf16)
        for s in layout.shards():
            report = receivers[s.id].pull()
            assert report.version == version
            oracle = VllmReferenceLoader(spec, tp=TP, tp_rank=s.tp_rank)
            oracle.load_weights(canonical.items())
            want = dict(oracle.named_parameters())
            got = receivers[s.id].tensors
            assert got.keys() == want.keys()
            bad = [n for n in want if not _bits_equal(got[n], want[n])]
            assert not bad, f"{family} v{version} {s.id}: {bad[:4]}"
    assert changed >= 2  # real deltas were synced, not only anchors


@pytest.mark.parametrize("family", ["llama_untied_biases", "gemma"])
def test_the_vllm_layout_of_a_family_without_rules_is_the_probed_reference_loader(family):
    from deltasync.errors import LayoutError
    from deltasync.layout import ReceiverLayout
    from deltasync.layout.vllm_rules import build_vllm_table

    spec = ModelSpec.from_hf_config(FAMILIES[family])
    built = ReceiverLayout.build(spec, "vllm", tp=2)
    probed = probe_receiver_layout(
        spec, lambda t, e: VllmReferenceLoader(spec, tp=2, tp_rank=t), engine="x", tp=2
    )
    assert _table_key(built.table) == _table_key(probed.table)
    assert [s.id for s in built.shards()] == ["tp0", "tp1"]
    with pytest.raises(LayoutError, match="hand-written vLLM rules"):
        build_vllm_table(spec, 2, 1)
    with pytest.raises(LayoutError, match="num_attention_heads"):
        ReceiverLayout.build(spec, "vllm", tp=8)


@pytest.mark.parametrize("name", ["moe_tied", "dense_untied"])
def test_the_trainer_layout_probed_from_transformers_equals_the_hand_written_one(name):
    from layout_cases import CONFIGS

    config = transformers.AutoConfig.for_model(**CONFIGS[name])
    spec = ModelSpec.from_hf_config(config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    probed = TrainerLayout.from_transformers(model)
    assert _table_key(probed._forward) == _table_key(TrainerLayout(spec)._forward)
    assert probed.aliases() == TrainerLayout(spec).aliases()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # the model was not touched
