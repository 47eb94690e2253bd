"""Writer part digests: the pieces of every writer tile each receiver shard exactly once, and a
writer's digest from its own dim-0 rows equals the receiver's digest of its live tensors."""

from __future__ import annotations

import pytest
import torch

from deltasync.format import TensorUpdate, apply_updates
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout, fsdp_dim0_rows
from deltasync.layout.part_digests import iter_pieces, receiver_part_digests, writer_part_digests

CONFIG = dict(
    model_type="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=251,
    tie_word_embeddings=False,
)
SPEC = ModelSpec.from_hf_config(CONFIG)
TRAINER = TrainerLayout(SPEC)


@pytest.mark.parametrize(("tp", "writers"), [(1, 2), (2, 2), (2, 3), (4, 3)])
def test_every_writers_pieces_cover_each_element_a_writer_owns_exactly_once(
    tp: int, writers: int
) -> None:
    layout = ReceiverLayout.build(SPEC, "vllm", tp=tp)
    hits = {
        (s, n): torch.zeros(spec.shape, dtype=torch.int32).reshape(-1)
        for s in (i.id for i in layout.shards())
        for n, spec in layout.local_specs(s).items()
    }
    for p in iter_pieces(layout, writers):
        t = hits[(p.shard, p.local)]
        shape = layout.local_specs(p.shard)[p.local].shape
        cols = shape[-1] if len(shape) > 1 else 1
        view = t.view(-1, cols)
        view[p.local_row : p.local_row + p.rows, p.local_col : p.local_col + p.cols] += 1
    for (shard, name), t in hits.items():
        assert int(t.max()) <= 1, (shard, name)
        if "embed" not in name and "lm_head" not in name:  # vocabulary padding is nobody's
            assert int(t.min()) == 1, (shard, name)


@pytest.mark.parametrize(("tp", "writers"), [(2, 2), (2, 3)])
def test_a_writers_part_digest_equals_the_receivers_after_an_exact_split(
    tp: int, writers: int
) -> None:
    layout = ReceiverLayout.build(SPEC, "vllm", tp=tp)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in TRAINER.param_shapes().items()}
    shards = layout.split(TRAINER.to_canonical({n: p.to(torch.bfloat16) for n, p in full.items()}))
    for k in range(writers):
        mine = {}
        for n, p in full.items():
            start, stop = fsdp_dim0_rows(p.shape[0], k, writers)
            mine[n] = p[start:stop]
        sent = writer_part_digests(
            mine, trainer_layout=TRAINER, receiver_layout=layout, index=k, count=writers
        )
        for shard, tensors in shards.items():
            got = receiver_part_digests(tensors, layout=layout, shard=shard, count=writers)
            assert got[k] == sent[shard]
    # one flipped bit in writer 1's part changes writer 1's digest only
    shard = "tp0"
    tensors = {n: t.clone() for n, t in shards[shard].items()}
    before = receiver_part_digests(tensors, layout=layout, shard=shard, count=writers)
    name = "model.layers.1.mlp.down_proj.weight"
    rows = tensors[name].shape[0]
    tensors[name].view(torch.int16)[rows - 1, 0] ^= 1  # the last row: the last writer's
    after = receiver_part_digests(tensors, layout=layout, shard=shard, count=writers)
    changed = [k for k in range(writers) if before[k] != after[k]]
    assert changed == [writers - 1]


@pytest.mark.parametrize("dense", [False, True])
def test_the_part_digests_before_a_write_equal_those_after_it_and_the_tensors_stay_untouched(
    dense: bool,
) -> None:
    layout = ReceiverLayout.build(SPEC, "vllm", tp=2)
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=g) for n, s in TRAINER.param_shapes().items()}
    shard = "tp1"
    tensors = layout.split(
        TRAINER.to_canonical({n: p.to(torch.bfloat16) for n, p in full.items()})
    )[shard]
    updates = []
    for i, (name, t) in enumerate(tensors.items()):
        if i % 3 == 2:
            continue  # some tensors get no update
        n = t.numel()
        if dense and i % 3 == 1:
            idx = None
            vals = torch.randn(n, generator=g).to(torch.bfloat16)
        else:  # a sparse few, the first and last elements included (chunk edges)
            picked = torch.randperm(n, generator=g)[: max(1, n // 50)]
            idx = torch.unique(torch.cat([picked, torch.tensor([0, n - 1])]))
            vals = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
        updates.append(
            TensorUpdate(name=name, shape=tuple(t.shape), dtype=t.dtype, indices=idx, values=vals)
        )
    live = {n: t.clone() for n, t in tensors.items()}
    predicted = receiver_part_digests(live, layout=layout, shard=shard, count=3, updates=updates)
    assert all(
        torch.equal(live[n].view(torch.int16), t.view(torch.int16)) for n, t in tensors.items()
    )
    apply_updates(updates, live)
    after = receiver_part_digests(live, layout=layout, shard=shard, count=3)
    assert predicted == after
    assert predicted != receiver_part_digests(tensors, layout=layout, shard=shard, count=3)
