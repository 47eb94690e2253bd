"""What an overlapped in-cluster version holds while its blobs are built: a batch of parameter
groups is routed one group at a time, and the routed updates wait for their segment with int32
indices; the updates (and so the blobs) are the ones routing the batch at once gives."""

from __future__ import annotations

import pytest
import torch
from kit import (
    SyntheticTrainer,
    bits,
    one_torch_thread,  # noqa: F401 - an autouse fixture: pytest finds it by name here
    tiny_layouts,
)

import deltasync.cluster.capture as capture
from deltasync.cluster.capture import capture_positions, route_positions, streamed_blobs
from deltasync.format import encode_blob
from deltasync.layout.groups import param_groups
from deltasync.trainer import AdamWTracker

SPEC, TRAINER, RECEIVERS = tiny_layouts(engine="vllm", tp=2)
WHERE = {"trainer_layout": TRAINER, "receiver_layout": RECEIVERS}


def _captured():
    """The tiny Qwen3's params after one more AdamW step at an RL learning rate, and that
    step's captured positions."""
    trainer = SyntheticTrainer.gaussian(TRAINER.param_shapes(), seed=5, lr=3e-6)
    tracker = AdamWTracker(trainer.opt, trainer.named)
    for v in range(3):
        trainer.step(v)
    tracker.clear()
    trainer.step(3)
    params = trainer.params()
    caps = capture_positions(tracker, {}, params)
    assert caps.positions is not None
    return params, caps.positions


def test_a_batch_of_several_groups_is_routed_one_group_at_a_time_into_the_same_blob(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params, positions = _captured()
    whole = route_positions(positions, params, **WHERE)  # before streamed_blobs packs them
    group_of = {
        name: g
        for g, group in enumerate(param_groups(list(params), **WHERE))
        for name in group.params
    }
    calls: list[list[str]] = []

    def spy(batch, *args, **kwargs):
        calls.append(list(batch))
        return route_positions(batch, *args, **kwargs)

    monkeypatch.setattr(capture, "route_positions", spy)
    shards = [s.id for s in RECEIVERS.shards()]
    blobs, _ = streamed_blobs(
        positions,
        params,
        shards=shards,
        **WHERE,
        version=4,
        base_version=3,
        writer="w00000",
        batch_elements=1 << 30,  # every group in one batch: one segment per shard
    )
    assert len({group_of[n] for n in positions}) > 1  # the batch spans several groups
    assert calls and all(len({group_of[n] for n in names}) == 1 for names in calls)
    assert sorted(n for names in calls for n in names) == sorted(positions)
    for shard in shards:  # the bytes of the batch routed at once, written as one segment
        one = encode_blob(
            whole[shard],
            version=4,
            base_version=3,
            shard=shard,
            writer="w00000",
            open_segments=True,
        )
        assert bytes(blobs[shard]) == one


def test_routed_updates_wait_for_their_segment_with_int32_indices() -> None:
    params, positions = _captured()
    whole = route_positions(positions, params, **WHERE)
    group_of = {
        name: g
        for g, group in enumerate(param_groups(list(params), **WHERE))
        for name in group.params
    }
    by_group = capture.route_by_group(positions, params, group_of=group_of, **WHERE)
    assert by_group.keys() == whole.keys()
    for shard, ups in whole.items():
        got = by_group[shard]
        assert [u.name for u in got] == [u.name for u in ups]
        for g, u in zip(got, ups, strict=True):
            assert u.indices.dtype == torch.int64 and g.indices.dtype == torch.int32
            assert torch.equal(g.indices.long(), u.indices)
            assert torch.equal(bits(g.values), bits(u.values))
