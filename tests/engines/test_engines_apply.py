"""Engine adapters after real AdamW deltas: every live tensor equals a dense split, bitwise."""

from __future__ import annotations

import pytest
import torch

from deltasync.engines import EngineAdapter, HFEngine, TensorDictEngine, TPQwen3Engine
from deltasync.errors import ApplyError, ConfigError
from deltasync.format import TensorUpdate
from deltasync.layout import ReceiverLayout

from engines_helpers import (
    TrackedHFTrainer,
    bits_equal,
    shard_updates,
    through_the_wire,
    tiny_hf_config,
)


def _assert_equal_to_split(engine: EngineAdapter, expected: dict[str, torch.Tensor]) -> None:
    params = engine.params()
    assert set(params) == set(expected)
    for name, t in expected.items():
        assert bits_equal(params[name], t), name


@pytest.mark.parametrize("tie", [False, True])
def test_hf_and_tp_engines_equal_the_dense_split_after_five_applied_deltas(tie):
    cfg = tiny_hf_config(tie=tie)
    trainer = TrackedHFTrainer(cfg)
    hf_layout = ReceiverLayout.build(trainer.spec, engine="hf")
    tp_layout = ReceiverLayout.build(trainer.spec, engine="vllm", tp=2)
    start = trainer.canonical_bf16()
    hf = HFEngine.from_config(cfg, hf_layout.split(start)["tp0"], version=0)
    tpe = TPQwen3Engine.from_canonical(cfg, start, tp=2, version=0)
    written = 0
    for version in range(1, 6):
        trainer.step()
        changes = trainer.canonical_changes()
        hf_updates, tp_updates = (
            shard_updates(changes, hf_layout),
            shard_updates(changes, tp_layout),
        )
        written += hf.apply(through_the_wire(hf_updates["tp0"], hf_layout, "tp0", version))
        hf.version = version
        for shard, ups in tp_updates.items():
            tpe.rank(shard).apply(through_the_wire(ups, tp_layout, shard, version))
            tpe.rank(shard).version = version
    assert written > 0
    now = trainer.canonical_bf16()
    assert any(not bits_equal(now[n], start[n]) for n in now)  # the weights did move
    _assert_equal_to_split(hf, hf_layout.split(now)["tp0"])
    for shard, tensors in tp_layout.split(now).items():
        _assert_equal_to_split(tpe.rank(shard), tensors)
    # The live tensors are what the model computes with: HF's own forward sees the deltas.
    ids = torch.randint(0, cfg["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    fresh = HFEngine.from_config(cfg, hf_layout.split(now)["tp0"], version=5)
    assert torch.equal(hf.logits(ids).view(torch.int16), fresh.logits(ids).view(torch.int16))
    assert tpe.version == 5


def test_engines_satisfy_the_adapter_protocol():
    cfg = tiny_hf_config()
    tpe = TPQwen3Engine.from_canonical(cfg, TrackedHFTrainer(cfg).canonical_bf16(), tp=2)
    assert isinstance(HFEngine.from_config(cfg), EngineAdapter)
    assert isinstance(tpe.rank("tp1"), EngineAdapter)


def test_an_update_for_an_unknown_tensor_writes_nothing_to_any_tensor():
    engine = TensorDictEngine({"a": torch.zeros(4, dtype=torch.bfloat16)})
    good = TensorUpdate(
        name="a",
        shape=(4,),
        dtype=torch.bfloat16,
        indices=torch.tensor([1]),
        values=torch.ones(1, dtype=torch.bfloat16),
    )
    bad = TensorUpdate(
        name="b",
        shape=(4,),
        dtype=torch.bfloat16,
        indices=torch.tensor([1]),
        values=torch.ones(1, dtype=torch.bfloat16),
    )
    with pytest.raises(ApplyError, match="no target"):
        engine.apply([good, bad])
    assert torch.count_nonzero(engine.params()["a"]) == 0


def test_hf_engine_refuses_weights_of_another_shape_before_writing():
    cfg = tiny_hf_config()
    hf = HFEngine.from_config(cfg)
    before = {n: t.clone() for n, t in hf.params().items()}
    weights = {n: torch.ones_like(t) for n, t in hf.params().items()}
    weights["model.norm.weight"] = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ApplyError, match=r"model.norm.weight"):
        hf.load(weights, version=1)
    assert all(bits_equal(hf.params()[n], before[n]) for n in before)
    assert hf.version == -1


def test_tp_engine_refuses_shards_that_do_not_match_the_layout():
    cfg = tiny_hf_config()
    good = ReceiverLayout.build(TrackedHFTrainer(cfg).spec, engine="vllm", tp=2).split(
        TrackedHFTrainer(cfg).canonical_bf16()
    )
    good["tp1"].pop("model.norm.weight")
    from deltasync.engines import Qwen3Arch
    from deltasync.layout import ModelSpec

    with pytest.raises(ConfigError, match="missing"):
        TPQwen3Engine(
            ModelSpec.from_hf_config(cfg), Qwen3Arch.from_hf_config(cfg), tp=2, shards=good
        )
