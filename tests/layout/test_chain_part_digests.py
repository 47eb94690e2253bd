"""``layout.part_digests.chain_part_digests``: a shard's part digests as a chain of versions
will leave it, whatever order the chain lists its tensors in, and with a bounded hold (tensors
listed ahead of their turn dropped and read again in another pass) the same digests."""

from __future__ import annotations

import random

import pytest
import torch
from kit import tiny_spec

from deltasync.format import TensorPieces, TensorUpdate
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.part_digests import chain_part_digests, receiver_part_digests

SPEC = tiny_spec(intermediate_size=96)  # test_writer_digests.py's model
LAYOUT = ReceiverLayout.build(SPEC, "vllm", tp=2)
SHARD = "tp1"


def _state_and_updates(seed: int):
    g = torch.Generator().manual_seed(seed)
    tl = TrainerLayout(SPEC)
    full = {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}
    tensors = LAYOUT.split(tl.to_canonical({n: p.to(torch.bfloat16) for n, p in full.items()}))[
        SHARD
    ]
    updates = []
    for i, (name, t) in enumerate(tensors.items()):
        if i % 4 == 3:
            continue  # listed by no version
        n = t.numel()
        idx = torch.unique(torch.randperm(n, generator=g)[: max(1, n // 20)])
        vals = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
        updates.append(
            TensorUpdate(name=name, shape=tuple(t.shape), dtype=t.dtype, indices=idx, values=vals)
        )
    return tensors, updates


def _chain(updates, order):
    by_name = {u.name: u for u in updates}
    return [
        TensorPieces(
            name=n,
            shape=tuple(by_name[n].shape),
            dtype=by_name[n].dtype,
            from_zero=False,
            pieces=(by_name[n],),
        )
        for n in order
    ]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("count", [2, 3])
def test_the_digests_after_a_chain_in_any_order_and_any_hold_equal_those_after_the_write(
    seed: int, count: int
) -> None:
    tensors, updates = _state_and_updates(seed)
    names = [u.name for u in updates]
    random.Random(seed).shuffle(names)  # the chain lists its tensors in another order
    live = {n: t.clone() for n, t in tensors.items()}
    want = receiver_part_digests(live, layout=LAYOUT, shard=SHARD, count=count, updates=updates)
    reads = []

    def again():
        reads.append(1)
        return iter(_chain(updates, names))

    kw = dict(listed=set(names), layout=LAYOUT, shard=SHARD, count=count)
    held_all = chain_part_digests(live, iter(_chain(updates, names)), **kw)
    bounded = chain_part_digests(live, iter(_chain(updates, names)), again=again, max_held=0, **kw)
    assert held_all == bounded == want
    assert reads  # a shuffled chain with nothing held is read again
    assert all(
        torch.equal(live[n].view(torch.int16), t.view(torch.int16)) for n, t in tensors.items()
    )
