"""Batched groups: consecutive parameter groups routed one by one into one segment give
exactly the updates of routing them together (same records, same order, same bits), with
int32 indices while they wait for the encoder, and the same blob bytes."""

from __future__ import annotations

import pytest
import torch
from kit import bits_equal, build_model, tiny_layouts, tiny_qwen3

from deltasync.format import encode_blob
from deltasync.layout.routing import gather_bf16, row_pieces, shard_updates, stream_rank
from deltasync.publish.segments import GroupRouter
from deltasync.trainer.positions import Positions


class Segments:
    """A fake ShardStreams: records each ``add``."""

    def __init__(self) -> None:
        self.added: list[dict] = []

    def add(self, updates) -> None:
        self.added.append({s: list(ups) for s, ups in updates.items() if ups})


@pytest.mark.parametrize("batch_elements", [1 << 30, 1])
def test_groups_routed_one_by_one_give_the_updates_of_routing_them_together(
    batch_elements,
) -> None:
    _, tl, rl = tiny_layouts("vllm", tp=2)
    params = {n: p.detach() for n, p in build_model(tiny_qwen3()).named_parameters()}
    g = torch.Generator().manual_seed(11)
    changed = {
        n: torch.nonzero(torch.rand(p.numel(), generator=g) < 0.2).reshape(-1)
        for n, p in params.items()
        # the vocab-parallel embedding and lm_head go out in pieces, their own segments
        if row_pieces(n, trainer_layout=tl, receiver_layout=rl) is None
    }
    router = GroupRouter(trainer_layout=tl, receiver_layout=rl)
    segs = Segments()
    stream = [(n, Positions.of(idx), None) for n, idx in changed.items()]
    router.stream(segs, stream, params, prefetch=0, batch_elements=batch_elements)
    values = {n: gather_bf16(n, params[n], idx) for n, idx in changed.items()}
    whole = shard_updates(changed, params, trainer_layout=tl, receiver_layout=rl, values=values)
    if batch_elements > 1:  # everything in one segment: exactly one routing of it all
        assert len(segs.added) == 1
    got: dict[str, list] = {}
    for added in segs.added:
        for shard, ups in added.items():
            got.setdefault(shard, []).extend(ups)
    for shard, ups in whole.items():
        # one routing lists a shard's tensors in its local order; a segment lists them in the
        # parameters' order, the one every blob of the publisher follows
        rank = stream_rank(rl, shard)
        ups = sorted(ups, key=lambda u, rank=rank: rank[u.name])
        mine = got.get(shard, [])
        if batch_elements == 1:  # a segment per group, in params order: compare by name
            order = {u.name: i for i, u in enumerate(ups)}
            mine = sorted(mine, key=lambda u: order[u.name])
        assert [u.name for u in mine] == [u.name for u in ups], shard
        for a, b in zip(mine, ups, strict=True):
            assert a.indices.dtype == torch.int32  # every tiny tensor is below 2^31 elements
            assert torch.equal(a.indices.long(), b.indices)
            assert bits_equal(a.values, b.values)
        if batch_elements > 1:
            head = dict(version=2, base_version=1, shard=shard, writer="w0")
            assert encode_blob(mine, **head) == encode_blob(ups, **head)
