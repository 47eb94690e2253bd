"""The engine-probed layout without vLLM: joining the workers' answers, the layout file, and
``VllmShard`` holding the layout it is given.

A vLLM worker answers ``probe_worker`` with ``(ShardInfo, ShardProbe)``: where its own model
class's ``load_weights`` put every canonical element. Here each rank's answer comes from
probing the vLLM-convention reference loader of that rank (the vLLM tier, tests/vllm, gets
them from real workers); a fake ``LLM`` hands them back from ``collective_rpc``.
"""

from __future__ import annotations

import pytest
import torch

from deltasync import ModelSpec, ReceiverLayout
from deltasync.engines.vllm_probe import probe_vllm_layout, probe_worker
from deltasync.engines.vllm_shard import ShardPlace, VllmShard
from deltasync.errors import ConfigError, LayoutError
from deltasync.layout import ShardInfo, VllmReferenceLoader, probe_shard
from deltasync.layout.probed import load_receiver_layout, save_receiver_layout

from engines_helpers import module_tree

LLAMA = dict(
    model_type="llama",
    vocab_size=203,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    tie_word_embeddings=True,
)


class FakeLLM:
    """``collective_rpc`` as vLLM's ``LLM`` offers it, answering with fixed worker results."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls: list = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        return list(self.answers)


def _answers(config: dict, tp: int, *, replicas: int = 1) -> list:
    spec = ModelSpec.from_hf_config(config)
    canonical = spec.canonical_shapes()
    one = [
        (
            ShardInfo(f"tp{r}", r, 0),
            probe_shard(VllmReferenceLoader(spec, tp=tp, tp_rank=r), canonical),
        )
        for r in range(tp)
    ]
    return one * replicas  # data-parallel replicas answer for the same shards


def _key(table) -> tuple:
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


@pytest.mark.parametrize("tp", [1, 2])
def test_the_workers_answers_join_into_the_vllm_convention_layout(tp):
    llm = FakeLLM(_answers(LLAMA, tp))
    layout = probe_vllm_layout(llm, LLAMA)
    assert [call[0] for call in llm.calls] == [probe_worker]
    assert (layout.engine, layout.tp, layout.ep) == ("vllm", tp, 1)
    assert [s.id for s in layout.shards()] == [f"tp{r}" for r in range(tp)]
    reference = ReceiverLayout.build(ModelSpec.from_hf_config(LLAMA), engine="vllm", tp=tp)
    assert _key(layout.table) == _key(reference.table)


def test_data_parallel_replicas_answering_for_the_same_shard_are_kept_once():
    layout = probe_vllm_layout(FakeLLM(_answers(LLAMA, 2, replicas=2)), LLAMA)
    assert [s.id for s in layout.shards()] == ["tp0", "tp1"]


def test_answers_that_miss_a_tp_rank_are_refused():
    (_, last) = _answers(LLAMA, 2)
    with pytest.raises(LayoutError, match="not a full TP=2"):
        probe_vllm_layout(FakeLLM([last]), LLAMA)


def test_a_layout_file_reads_back_for_its_model_and_is_refused_for_another(tmp_path):
    layout = probe_vllm_layout(FakeLLM(_answers(LLAMA, 2)), LLAMA)
    path = tmp_path / "layout.json"
    save_receiver_layout(path, layout)
    back = load_receiver_layout(path, ModelSpec.from_hf_config(LLAMA))
    assert (back.engine, back.tp, back.ep) == ("vllm", 2, 1)
    assert _key(back.table) == _key(layout.table)
    other = ModelSpec.from_hf_config(dict(LLAMA, num_hidden_layers=3))
    with pytest.raises(LayoutError, match="other tensors"):
        load_receiver_layout(path, other)


def test_a_vllm_shard_holds_the_layout_it_is_given_and_refuses_one_for_another_tp():
    spec = ModelSpec.from_hf_config(LLAMA)
    layout = probe_vllm_layout(FakeLLM(_answers(LLAMA, 1)), LLAMA)
    gen = torch.Generator().manual_seed(0)
    full = {
        n: torch.randn(s, generator=gen).to(torch.bfloat16)
        for n, s in spec.canonical_shapes().items()
    }
    model = module_tree(layout.split(full)["tp0"])
    shard = VllmShard(model, LLAMA, ShardPlace(tp_rank=0, tp=1), layout=layout)
    assert shard.layout is layout and shard.shard == "tp0" and shard.path == "inplace"
    params = dict(model.named_parameters())
    # the engine's own tensors are the receiver's targets: no copy
    assert set(shard.targets) == set(params)
    assert all(shard.targets[n].data_ptr() == params[n].data_ptr() for n in params)
    tp2 = probe_vllm_layout(FakeLLM(_answers(LLAMA, 2)), LLAMA)
    with pytest.raises(ConfigError, match="tp=2"):
        VllmShard(model, LLAMA, ShardPlace(tp_rank=0, tp=1), layout=tp2)
