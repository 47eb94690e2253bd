"""Sparse routing: canonical changes → receiver shards, applied through the real codec."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import LayoutError
from deltasync.format import TensorUpdate, apply_updates, decode_blob, encode_blob
from deltasync.layout import Block, LayoutTable, ModelSpec, Placement, ReceiverLayout

from layout_cases import CASES, CONFIGS, bitwise_equal, random_config, random_state


def change_some(full: dict[str, torch.Tensor], seed: int, fraction: float):
    """New state differing from ``full`` at a random subset (first and last elements always in
    play); returns (new state, {name: (sorted indices, new values)})."""
    g = torch.Generator().manual_seed(seed)
    new, changes = {}, {}
    for name, t in full.items():
        n = t.numel()
        mask = torch.rand(n, generator=g) < fraction
        if n > 2 and torch.rand(1, generator=g).item() < 0.5:
            mask[0] = mask[-1] = True
        idx = torch.nonzero(mask).squeeze(1)
        flat = t.reshape(-1).clone()
        flat.view(torch.int16)[idx] ^= 1  # flip the lowest mantissa bit: a different bf16 value
        new[name] = flat.reshape(t.shape)
        if idx.numel():
            changes[name] = (idx, flat[idx])
    return new, changes


def apply_through_codec(layout: ReceiverLayout, routed, targets_by_shard) -> int:
    written = 0
    for shard, per_local in routed.items():
        updates = [
            TensorUpdate(
                name=local,
                shape=tuple(targets_by_shard[shard][local].shape),
                dtype=torch.bfloat16,
                indices=idx,
                values=vals,
            )
            for local, (idx, vals) in sorted(per_local.items())
        ]
        blob = encode_blob(updates, version=2, base_version=1, shard=shard, writer="w00000")
        decoded = decode_blob(
            blob, expected=layout.local_specs(shard), version=2, base_version=1, shard=shard
        )
        written += apply_updates(decoded.updates, targets_by_shard[shard])
    return written


def _run(layout: ReceiverLayout, spec: ModelSpec, seed: int, fraction: float) -> None:
    old = random_state(spec, seed)
    new, changes = change_some(old, seed + 1, fraction)
    live = layout.split(old)
    routed = layout.route_changes(changes)
    apply_through_codec(layout, routed, live)
    expected = layout.split(new)
    for shard, tensors in expected.items():
        for name, t in tensors.items():
            assert bitwise_equal(live[shard][name], t), (shard, name)
    # Exactly the routed elements differ from the old shards: nothing outside the change set moved.
    before = layout.split(old)
    moved = sum(
        int((live[s][n].view(torch.int16) != before[s][n].view(torch.int16)).sum())
        for s in live
        for n in live[s]
    )
    assert moved == sum(idx.numel() for per in routed.values() for idx, _ in per.values())


@pytest.mark.parametrize(("config", "tp", "ep"), CASES)
def test_routed_deltas_through_the_codec_turn_split_old_into_split_new(config, tp, ep):
    spec = ModelSpec.from_hf_config(CONFIGS[config])
    _run(ReceiverLayout.build(spec, "vllm", tp, ep), spec, seed=tp + 5 * ep, fraction=0.03)


@pytest.mark.parametrize("seed", range(8))
def test_routed_deltas_reach_random_configs_exactly(seed):
    cfg, tp, ep = random_config(seed)
    spec = ModelSpec.from_hf_config(cfg)
    _run(ReceiverLayout.build(spec, "vllm", tp, ep), spec, seed=seed, fraction=0.1)
    _run(ReceiverLayout.build(spec, "hf"), spec, seed=seed, fraction=0.1)


def test_route_positions_index_the_input_and_local_indices_are_sorted():
    spec = ModelSpec.from_hf_config(CONFIGS["moe_tied"])
    layout = ReceiverLayout.build(spec, "vllm", 2, 1)
    full = random_state(spec, seed=11)
    shards = layout.split(full)
    g = torch.Generator().manual_seed(0)
    for name, t in full.items():
        idx = torch.nonzero(torch.rand(t.numel(), generator=g) < 0.2).squeeze(1)
        for shard, per_local in layout.route(name, idx).items():
            for local, (local_idx, pos) in per_local.items():
                assert local_idx.dtype == torch.int64 and pos.dtype == torch.int64
                assert bool((local_idx[1:] > local_idx[:-1]).all())
                src = t.reshape(-1)[idx[pos]]
                dst = shards[shard][local].reshape(-1)[local_idx]
                assert bitwise_equal(src, dst), (name, shard, local)


def test_route_values_and_route_changes_agree_with_route():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    layout = ReceiverLayout.build(spec, "vllm", 4)
    old = random_state(spec, seed=12)
    _, changes = change_some(old, 13, 0.1)
    merged = layout.route_changes(changes)
    pieces: dict = {}
    for name, (idx, vals) in changes.items():
        by_route = layout.route(name, idx)
        by_values = layout.route_values(name, idx, vals)
        assert by_route.keys() == by_values.keys()
        for shard in by_route:
            for local, (li, pos) in by_route[shard].items():
                vi, vv = by_values[shard][local]
                assert torch.equal(li, vi) and bitwise_equal(vals[pos], vv)
                pieces.setdefault((shard, local), []).append((li, vv))
    for (shard, local), parts in pieces.items():
        idx = torch.cat([p[0] for p in parts])
        vals = torch.cat([p[1] for p in parts])
        order = torch.argsort(idx)
        mi, mv = merged[shard][local]
        assert torch.equal(mi, idx[order]) and bitwise_equal(mv, vals[order])


def test_a_change_to_a_replicated_element_reaches_every_shard_that_holds_it():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])  # 2 kv heads, TP 8: each held by 4 ranks
    layout = ReceiverLayout.build(spec, "vllm", 8)
    norm = layout.route("model.layers.1.input_layernorm.weight", torch.tensor([3]))
    assert sorted(norm) == [f"tp{r}" for r in range(8)]
    head_dim, hidden = 8, 32
    second_kv_head = layout.route(
        "model.layers.0.self_attn.k_proj.weight", torch.tensor([head_dim * hidden])
    )
    assert sorted(second_kv_head) == ["tp4", "tp5", "tp6", "tp7"]
    q_rows = 8 // 8 * head_dim  # one q head per rank, then one k head
    for per in second_kv_head.values():
        assert per["model.layers.0.self_attn.qkv_proj.weight"][0].tolist() == [q_rows * hidden]
    moe = ModelSpec.from_hf_config(CONFIGS["moe_tied"])
    ep_layout = ReceiverLayout.build(
        moe, "vllm", 2, 4
    )  # attention TP rank r is held by ep r and r+2
    o = ep_layout.route("model.layers.2.self_attn.o_proj.weight", torch.tensor([0, 63]))
    assert sorted(o) == ["tp0-ep0", "tp0-ep2", "tp1-ep1", "tp1-ep3"]


def test_route_of_no_indices_returns_no_shards():
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(CONFIGS["dense_tied"]), "vllm", 2)
    assert layout.route("model.norm.weight", torch.empty(0, dtype=torch.int64)) == {}
    assert layout.route_changes({}) == {}


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([3, 2], "sorted"),
        ([2, 2], "sorted"),
        ([-1, 2], "outside"),
        ([0, 32], "outside"),
    ],
)
def test_route_rejects_unsorted_duplicate_or_out_of_range_indices(indices, message):
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(CONFIGS["dense_tied"]), "vllm", 2)
    with pytest.raises(LayoutError, match=message):
        layout.route("model.norm.weight", torch.tensor(indices))


def test_route_rejects_unknown_tensors_and_float_indices():
    layout = ReceiverLayout.build(ModelSpec.from_hf_config(CONFIGS["dense_tied"]), "vllm", 2)
    with pytest.raises(LayoutError, match="not in this layout"):
        layout.route("lm_head.weight", torch.tensor([0]))  # tied: not a canonical tensor
    with pytest.raises(LayoutError, match="integers"):
        layout.route("model.norm.weight", torch.tensor([0.0]))


def test_indices_beyond_2_to_the_31_route_exactly_in_int64():
    # A 2^20 x 2^12 tensor (2^32 elements, never allocated) split by rows over two shards and by
    # columns over two more: local indices must not wrap.
    rows, cols = 1 << 20, 1 << 12
    half = rows // 2
    table = LayoutTable(
        src_shapes={"w": (rows, cols)},
        dst_shapes={
            "a": {"w": (half, cols)},
            "b": {"w": (half, cols // 2), "w2": (half, cols // 2)},
        },
        placements={
            "w": [
                Placement(
                    "a", "w", Block(src_cols=cols, dst_cols=cols, src_row=0, dst_row=0, rows=half)
                ),
                Placement(
                    "b",
                    "w",
                    Block(
                        src_cols=cols,
                        dst_cols=cols // 2,
                        src_row=half,
                        dst_row=0,
                        rows=half,
                        src_col=0,
                        dst_col=0,
                        cols=cols // 2,
                    ),
                ),
                Placement(
                    "b",
                    "w2",
                    Block(
                        src_cols=cols,
                        dst_cols=cols // 2,
                        src_row=half,
                        dst_row=0,
                        rows=half,
                        src_col=cols // 2,
                        dst_col=0,
                        cols=cols // 2,
                    ),
                ),
            ]
        },
    )
    last = rows * cols - 1
    idx = torch.tensor(
        [5, half * cols - 1, half * cols + 7, last - cols // 2, last], dtype=torch.int64
    )
    out = table.route("w", idx)
    assert out["a"]["w"][0].tolist() == [5, half * cols - 1]
    assert out["b"]["w"][0].tolist() == [7, (half - 1) * (cols // 2) + cols // 2 - 1]
    assert out["b"]["w2"][0].tolist() == [(half - 1) * (cols // 2) + cols // 2 - 1]
    assert out["b"]["w2"][1].tolist() == [4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gpu tier needs a CUDA device")
def test_routing_cuda_indices_gives_the_cpu_result_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA device")
    spec = ModelSpec.from_hf_config(CONFIGS["moe_untied"])
    layout = ReceiverLayout.build(spec, "vllm", 2, 1)
    _, changes = change_some(random_state(spec, seed=41), 42, 0.2)
    on_gpu = {n: (i.cuda(), v.cuda()) for n, (i, v) in changes.items()}
    cpu = layout.route_changes(changes)
    gpu = layout.route_changes(on_gpu)
    assert cpu.keys() == gpu.keys()
    for shard, per in cpu.items():
        for local, (idx, vals) in per.items():
            gi, gv = gpu[shard][local]
            assert gi.is_cuda and torch.equal(gi.cpu(), idx) and bitwise_equal(gv.cpu(), vals)
    for name, (idx, _) in changes.items():
        for shard, per in layout.route(name, on_gpu[name][0]).items():
            for local, (li, pos) in per.items():
                ref_li, ref_pos = layout.route(name, idx)[shard][local]
                assert torch.equal(li.cpu(), ref_li) and torch.equal(pos.cpu(), ref_pos)
