"""Trainer parameters and FSDP2 dim-0 shards → canonical coordinates, with no collective."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import LayoutError
from deltasync.layout import ModelSpec, TrainerLayout, fsdp_dim0_rows

from layout_cases import CONFIGS, bitwise_equal, random_state

MOE_5 = dict(CONFIGS["moe_untied"], num_experts=5, decoder_sparse_step=1)  # dim 0 of 5 over 4 ranks


def test_fsdp_rows_match_torch_chunk_with_empty_trailing_ranks():
    for dim0 in (1, 2, 5, 7, 16, 17):
        t = torch.arange(dim0)
        for world in (1, 2, 3, 4):
            chunks = list(torch.chunk(t, world))  # what fully_shard cuts; missing chunks are empty
            chunks += [t[:0]] * (world - len(chunks))
            for rank in range(world):
                start, stop = fsdp_dim0_rows(dim0, rank, world)
                assert t[start:stop].tolist() == chunks[rank].tolist(), (dim0, world, rank)
    with pytest.raises(LayoutError):
        fsdp_dim0_rows(4, 4, 4)


@pytest.mark.parametrize("config", [CONFIGS["dense_tied"], MOE_5])
def test_fsdp_shards_on_one_to_four_ranks_give_the_same_canonical_changes_as_one_rank(config):
    spec = ModelSpec.from_hf_config(config)
    layout = TrainerLayout(spec)
    canon = random_state(spec, seed=21)
    params = layout.from_canonical(canon)
    g = torch.Generator().manual_seed(22)
    for name, full in params.items():
        changed = torch.rand(full.shape, generator=g) < 0.15
        idx = torch.nonzero(changed.reshape(-1)).squeeze(1)
        vals = full.reshape(-1)[idx]
        one = layout.route_values(name, idx, vals)
        # One rank: every canonical index carries the canonical tensor's own value there.
        for cname, (cidx, cvals) in one.items():
            assert bool((cidx[1:] > cidx[:-1]).all())
            assert bitwise_equal(canon[cname].reshape(-1)[cidx], cvals)
        assert sum(i.numel() for i, _ in one.values()) == idx.numel()
        for world in (2, 3, 4):
            got: dict[str, list] = {}
            for rank in range(world):
                start, stop = fsdp_dim0_rows(full.shape[0], rank, world)
                shard = full[start:stop]  # what this rank holds; its own flat coordinates
                assert tuple(shard.shape) == layout.shard_shape(name, rank, world)
                local = torch.nonzero(changed[start:stop].reshape(-1)).squeeze(1)
                for cname, (cidx, cvals) in layout.route_values(
                    name, local, shard.reshape(-1)[local], rank=rank, world_size=world
                ).items():
                    got.setdefault(cname, []).append((cidx, cvals))
            assert got.keys() == one.keys(), (name, world)
            for cname, parts in got.items():
                cidx = torch.cat([p[0] for p in parts])
                cvals = torch.cat([p[1] for p in parts])
                order = torch.argsort(cidx)
                assert torch.equal(cidx[order], one[cname][0]) and bitwise_equal(
                    cvals[order], one[cname][1]
                )


def test_route_positions_point_into_the_ranks_own_indices():
    spec = ModelSpec.from_hf_config(MOE_5)
    layout = TrainerLayout(spec)
    name = "model.layers.0.mlp.experts.gate_up_proj"  # (5, 16, 16); rank 1 of 2 holds experts 3, 4
    local = torch.tensor([0, 8 * 16, 16 * 16 + 3], dtype=torch.int64)
    out = layout.route(name, local, rank=1, world_size=2)
    assert out["model.layers.0.mlp.experts.3.gate_proj.weight"][0].tolist() == [0]
    assert out["model.layers.0.mlp.experts.3.up_proj.weight"][0].tolist() == [0]
    assert out["model.layers.0.mlp.experts.4.gate_proj.weight"][0].tolist() == [3]
    assert out["model.layers.0.mlp.experts.4.gate_proj.weight"][1].tolist() == [2]


def test_indices_outside_the_ranks_shard_are_a_layout_error():
    layout = TrainerLayout(ModelSpec.from_hf_config(MOE_5))
    name = "model.layers.0.mlp.experts.down_proj"  # (5, 16, 8): rank 3 of 4 holds nothing
    with pytest.raises(LayoutError, match="rank 3"):
        layout.route(name, torch.tensor([0]), rank=3, world_size=4)
    assert layout.route(name, torch.empty(0, dtype=torch.int64), rank=3, world_size=4) == {}
    with pytest.raises(LayoutError, match="integers"):
        layout.route(name, torch.tensor([0.0]))
    with pytest.raises(LayoutError, match="not a parameter"):
        layout.route("model.layers.0.mlp.experts.0.gate_proj.weight", torch.tensor([0]))


def test_to_canonical_and_from_canonical_are_inverse_bitwise():
    for cfg in (CONFIGS["dense_untied"], CONFIGS["moe_tied"]):
        spec = ModelSpec.from_hf_config(cfg)
        layout = TrainerLayout(spec)
        canon = random_state(spec, seed=23)
        params = layout.from_canonical(canon)
        assert {n: tuple(t.shape) for n, t in params.items()} == layout.param_shapes()
        back = layout.to_canonical(params)
        assert back.keys() == canon.keys() and all(bitwise_equal(back[n], canon[n]) for n in canon)


def test_tied_lm_head_routes_to_embed_tokens_and_must_equal_it_in_a_state_dict():
    spec = ModelSpec.from_hf_config(CONFIGS["dense_tied"])
    layout = TrainerLayout(spec)
    out = layout.route("lm_head.weight", torch.tensor([1, 40]))
    assert list(out) == ["model.embed_tokens.weight"] and out["model.embed_tokens.weight"][
        0
    ].tolist() == [1, 40]
    params = layout.from_canonical(random_state(spec, seed=24))
    state = {**params, "lm_head.weight": params["model.embed_tokens.weight"]}
    assert "lm_head.weight" not in layout.to_canonical(state)
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"].view(torch.int16)[0, 0] ^= 1
    with pytest.raises(LayoutError, match="tied"):
        layout.to_canonical(state)
