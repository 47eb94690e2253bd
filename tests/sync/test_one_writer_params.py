"""A one-writer publisher's params are the whole model: the shard digests are computed from
them. A parameter of the wrong shape (a tensor-parallel trainer's shard) or a missing one is
refused with a ConfigError naming it and the remedy, before anything is written, on a delta as
on an anchor; as several writers' shards are checked against their rank's dim-0 rows."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import ConfigError
from deltasync.publish import Publisher, PublisherConfig

from sync_kit import layouts, scratch_store

Q = "model.layers.0.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"


def _params(tl) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}


def _tp_row_shard(params):
    """A Megatron-style TP rank's rows of q_proj in place of the whole parameter."""
    return {**params, Q: params[Q][: params[Q].shape[0] // 2]}


def _without_embed(params):
    return {n: p for n, p in params.items() if n != EMBED}


CASES = [
    pytest.param(_tp_row_shard, rf"{Q!r} is \(\d+, \d+\) here, but the model's is", id="tp-shard"),
    pytest.param(_without_embed, rf"params have no \[{EMBED!r}\]", id="missing"),
]


@pytest.mark.parametrize("bad, match", CASES)
def test_a_one_writer_delta_with_a_wrong_or_missing_parameter_is_refused_before_any_write(
    tmp_path, bad, match
):
    _spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    params = _params(tl)
    pub.publish(0, [], params, anchor=True)
    before = sorted(store.list(""))
    idx = torch.tensor([0, 5])
    ps = bad(params)
    change = (Q, idx, ps[Q].reshape(-1)[idx].to(torch.bfloat16))
    with pytest.raises(ConfigError, match=match) as err:
        pub.publish(1, [change], ps)
    assert "Nothing was written" in str(err.value)
    assert sorted(store.list("")) == before
    assert pub.committed() == 0
    assert pub.publish(1, [change], params).kind == "delta"  # the whole params go on


@pytest.mark.parametrize("bad, match", CASES)
def test_a_one_writer_anchor_with_a_wrong_or_missing_parameter_is_refused_before_any_write(
    tmp_path, bad, match
):
    _spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    with pytest.raises(ConfigError, match=match):
        pub.publish(0, [], bad(_params(tl)), anchor=True)
    assert store.list("") == []


@pytest.mark.parametrize("bad, match", CASES)
def test_a_resume_with_a_wrong_or_missing_parameter_is_refused_by_name(tmp_path, bad, match):
    # resume() hashed what it was given: a bare KeyError for a missing parameter, and a
    # rank's shard hashed as if it were the whole parameter.
    _spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    params = _params(tl)
    Publisher(store, receiver_layout=rl, config=PublisherConfig()).publish(0, [], params)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    with pytest.raises(ConfigError, match=match):
        pub.resume(0, bad(params))
    assert pub.resume(0, params) is True


def test_a_meta_parameter_is_refused_by_name_before_any_write(tmp_path):
    # torch's untyped NotImplementedError ("Cannot copy out of meta tensor") escaped before
    _spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    params = _params(tl)
    params[Q] = params[Q].to("meta")
    with pytest.raises(ConfigError, match=rf"param {Q!r} is on the meta device"):
        pub.publish(0, [], params, anchor=True)
    assert store.list("") == []


@pytest.mark.parametrize("layout", [None, "vllm", {"tp": 2}], ids=["none", "str", "dict"])
def test_a_publisher_given_something_else_than_a_receiver_layout_is_refused(tmp_path, layout):
    # an untyped AttributeError ("'NoneType' object has no attribute 'spec'") before
    with pytest.raises(ConfigError, match="receiver_layout must be a ReceiverLayout"):
        Publisher(scratch_store(tmp_path / "store"), receiver_layout=layout)
    _spec, _tl, rl = layouts()
    with pytest.raises(ConfigError, match="trainer_layout must be a TrainerLayout"):
        Publisher(scratch_store(tmp_path / "store"), receiver_layout=rl, trainer_layout=rl)
