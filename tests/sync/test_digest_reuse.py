"""A receiver tensor no changed parameter feeds keeps the digest its publisher computed when
it committed the base: exact while the caller's ``touched`` is true, and visibly not read."""

from __future__ import annotations

import pytest
import torch
from kit import build_model, tiny_layouts, tiny_qwen3

from deltasync import LocalStore, Publisher, PublisherConfig
from deltasync.errors import ConfigError
from deltasync.layout.digest import state_digests

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"


def _setup(tmp_path):
    _, tl, rl = tiny_layouts("vllm", tp=2)
    params = {n: p.detach() for n, p in build_model(tiny_qwen3()).named_parameters()}
    pub = Publisher(
        LocalStore(str(tmp_path)),
        receiver_layout=rl,
        trainer_layout=tl,
        config=PublisherConfig(anchor_every=1000, session="t"),
    )
    pub.publish(0, [], params, anchor=True)
    return params, pub, tl, rl


def _change(params, name: str, seed: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    p = params[name].view(-1)
    idx = torch.nonzero(torch.rand(p.numel(), generator=torch.Generator().manual_seed(seed)) < 0.2)
    idx = idx.reshape(-1)
    p[idx] += 0.01
    return name, idx, p[idx].to(torch.bfloat16)


def test_digests_of_untouched_tensors_are_reused_and_exact_while_touched_is_true(tmp_path):
    params, pub, tl, rl = _setup(tmp_path)
    truth = lambda: state_digests(params, trainer_layout=tl, receiver_layout=rl)
    pub.publish(1, [_change(params, Q, 1)], params, touched={Q})  # base: the anchor (no entries)
    assert dict(pub.catalog.manifest(1).shard_digests) == truth()
    pub.publish(2, [_change(params, Q, 2)], params, touched={Q})  # reuses every other tensor
    assert dict(pub.catalog.manifest(2).shard_digests) == truth()
    # The proof is the caller's: a norm edited behind its back keeps its old digest (so the
    # pass did not read it), and the manifest no longer equals the state.
    params[NORM].add_(1.0)
    pub.publish(3, [_change(params, Q, 3)], params, touched={Q})
    assert dict(pub.catalog.manifest(3).shard_digests) != truth()
    pub.close()


def test_without_touched_every_tensor_is_hashed(tmp_path):
    params, pub, tl, rl = _setup(tmp_path)
    pub.publish(1, [_change(params, Q, 1)], params, touched={Q})
    params[NORM].add_(1.0)  # no touched: nothing is vouched for, the norm is read again
    pub.publish(2, [_change(params, Q, 2)], params)
    assert dict(pub.catalog.manifest(2).shard_digests) == state_digests(
        params, trainer_layout=tl, receiver_layout=rl
    )
    pub.close()


def test_a_change_outside_touched_is_refused_and_nothing_commits(tmp_path):
    params, pub, _, _ = _setup(tmp_path)
    with pytest.raises(ConfigError, match="touched"):
        pub.publish(1, [_change(params, Q, 1)], params, touched={NORM})
    assert pub.committed() == 0
    pub.close()
