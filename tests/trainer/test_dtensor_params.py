"""Where a tracked parameter's local tensor sits, derived from the tensor itself; who writes.

Single process: a one-rank gloo group for real DTensors (the two-rank FSDP2 cases, uneven
and empty shards, run under torchrun in tests/fsdp)."""

from __future__ import annotations

import pytest
import torch
from kit import one_rank_mesh

from deltasync import AdamWTracker, SnapshotTracker
from deltasync.errors import ConfigError
from deltasync.trainer import LocalShard, publish_role
from deltasync.trainer.params import chunk_rows, watch


@pytest.fixture(scope="module")
def mesh():
    with one_rank_mesh() as m:
        yield m


def test_chunk_rows_are_torch_chunk_rows_for_every_rank_including_empty_ones():
    for dim0 in range(0, 23):
        for world in range(1, 9):
            parts = torch.arange(dim0).chunk(world) if dim0 else ()
            for rank in range(world):
                start, stop = chunk_rows(dim0, rank, world)
                want = parts[rank] if rank < len(parts) else torch.empty(0, dtype=torch.int64)
                assert stop - start == want.numel(), (dim0, world, rank)
                if want.numel():
                    assert start == int(want[0])


def test_plain_params_are_whole_and_their_local_tensor_is_the_param():
    p = torch.nn.Parameter(torch.randn(6, 4))
    w = watch([("p", p)])["p"]
    assert w.shard == LocalShard(global_shape=(6, 4), row_start=0, row_stop=6)
    assert w.shard.is_whole and w.shard.offset == 0 and w.shard.local_numel == 24
    assert w.local().data_ptr() == p.data_ptr()


def test_bad_named_params_are_refused_naming_the_param():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ConfigError, match="'p' appears twice"):
        watch([("p", p), ("p", p)])
    with pytest.raises(ConfigError, match=r"'i' has dtype torch.int64"):
        watch([("i", torch.arange(3))])
    with pytest.raises(ConfigError, match="'m' is on the meta device"):
        watch([("m", torch.zeros(3, device="meta"))])
    with pytest.raises(ConfigError, match=r"\(name, tensor\) pairs"):
        watch([p])


def test_dtensor_shard0_and_replicate_placements_are_mapped(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    s = torch.nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]))
    r = torch.nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
    got = watch([("s", s), ("r", r)])
    assert got["s"].shard == LocalShard(
        global_shape=(5, 3), row_start=0, row_stop=5, rank=0, world_size=1
    )
    assert got["r"].shard.replicas == 1 and got["r"].shard.is_whole
    assert type(got["s"].local()) is torch.Tensor and got["s"].local().shape == (5, 3)


def test_partial_and_tensor_parallel_placements_are_refused_at_construction(mesh):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    tp = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    with pytest.raises(
        ConfigError, match=r"'layers.0.o_proj.weight' has DTensor placement Shard\(dim=1\)"
    ):
        AdamWTracker(torch.optim.AdamW([tp]), [("layers.0.o_proj.weight", tp)])
    part = torch.nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Partial()]))
    with pytest.raises(ConfigError, match=r"'bias' has DTensor placement Partial"):
        SnapshotTracker([("bias", part)])


def test_a_dtensor_tracker_detects_on_the_local_tensor_and_misses_nothing(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(
        distribute_tensor(torch.randn(40, 30, generator=g) * 0.02, mesh, [Shard(0)])
    )
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1)
    tracker, truth = AdamWTracker(opt, [("w", p)], strict=True), SnapshotTracker([("w", p)])
    for _step in range(3):
        p.grad = distribute_tensor(torch.randn(40, 30, generator=g), mesh, [Shard(0)])
        opt.step()
        (idx, vals), want = tracker.changed_values()["w"], truth.changed()["w"]
        assert bool(torch.isin(want, idx).all()) and want.numel() > 0
        local = p.to_local().reshape(-1)[idx].to(torch.bfloat16)
        assert torch.equal(vals.view(torch.int16), local.view(torch.int16))
        tracker.clear(), truth.clear()


def test_publish_role_one_writer_for_replicated_state_every_shard_rank_for_sharded():
    whole = {"a": LocalShard(global_shape=(4,), row_start=0, row_stop=4)}
    assert publish_role(whole).writes and publish_role(whole).num_writers == 1
    assert not publish_role(whole, dp_rank=1).writes  # DDP rank 1: rank 0 writes
    sharded = {
        "a": LocalShard(global_shape=(5, 2), row_start=3, row_stop=5, rank=1, world_size=2),
        "b": LocalShard(global_shape=(3,), row_start=2, row_stop=3, rank=1, world_size=2),
    }
    role = publish_role(sharded)
    assert role.writes and (role.writer_rank, role.num_writers) == (1, 2)
    hsdp = {
        n: LocalShard(**{**s.__dict__, "replica": 1, "replicas": 2}) for n, s in sharded.items()
    }
    assert not publish_role(hsdp).writes  # replica 1 of the shard holds replica 0's bits
    mixed = {
        **sharded,
        "c": LocalShard(global_shape=(8,), row_start=0, row_stop=2, rank=0, world_size=4),
    }
    with pytest.raises(ValueError, match="different mesh coordinates"):
        publish_role(mixed)
    # fully_shard on the layers only: the root's params stay whole beside sharded ones
    partial = {**sharded, "embed": LocalShard(global_shape=(8, 2), row_start=0, row_stop=8)}
    with pytest.raises(ConfigError, match=r"1 param\(s\) are not sharded \('embed'\)"):
        publish_role(partial)


@pytest.mark.parametrize("through", ["dtensor", "local"])
def test_a_write_through_the_dtensor_while_a_version_reads_its_local_shard_is_refused(
    mesh, through
):
    # An overlapped sender reads the local shards (tracker.local_params()); an in-place op on
    # the DTensor moves the DTensor's counter only, not the local shard's.
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltasync.errors import ParamsEditedError
    from deltasync.trainer.params import ReadWindow

    p = torch.nn.Parameter(distribute_tensor(torch.randn(40, 30) * 0.02, mesh, [Shard(0)]))
    opt = torch.optim.AdamW([p], lr=1e-4)
    tracker = AdamWTracker(opt, [("w", p)], strict=True)
    params = tracker.local_params()
    window = ReadWindow(params, 4, window="test", tracker=tracker)
    with torch.no_grad():
        (p if through == "dtensor" else p.to_local()).mul_(0.5)
    with pytest.raises(ParamsEditedError, match=r"version 4 .*'w'"):
        window.refuse_if_written(params)
    tracker.close()


def test_another_optimizers_dtensor_params_are_located_without_to_local_at_each_step(
    mesh, monkeypatch
):
    # the hooks around another optimizer's step locate its parameters the tracker was not
    # given (a critic's: may they write a tracked one?); through to_local() that cost ~5 us
    # a parameter twice a step (~9 ms a step for a critic of 1000 FSDP2 parameters)
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    actor = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))]
    critic = [
        torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])) for _ in range(8)
    ]
    actor_opt = torch.optim.AdamW(actor, lr=1e-3)
    critic_opt = torch.optim.AdamW(critic, lr=1e-3)
    tracker = AdamWTracker(actor_opt, [("a", actor[0])])
    critic_opt.step()  # no gradients: its hooks run, nothing is written
    calls = []
    to_local = DTensor.to_local
    monkeypatch.setattr(DTensor, "to_local", lambda *a, **k: calls.append(1) or to_local(*a, **k))
    for _ in range(3):
        critic_opt.step()
    assert calls == []
    tracker.close()


def test_gather_bf16_gives_each_whole_param_in_bf16_and_nothing_where_not_kept(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltasync.trainer import gather_bf16

    full = torch.randn(5, 3)
    s = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    plain = torch.nn.Parameter(torch.randn(4))
    named = [("s", s), ("plain", plain)]
    got = gather_bf16(named)()
    assert list(got) == ["s", "plain"]
    for name, want in (("s", full), ("plain", plain.detach())):
        t = got[name]
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.shape == want.shape
        assert torch.equal(t.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), name
    assert gather_bf16(named, keep=False)() == {}
    with pytest.raises(ConfigError, match="given none"):
        gather_bf16([])
    with pytest.raises(ConfigError, match=r"\['s'\] more than once"):
        gather_bf16([("s", s), ("s", s)])


def test_shard_digests_of_a_bf16_gather_equal_those_of_the_fp32_masters():
    # the cast is elementwise: casting each shard before the gather hashes the same bits
    from kit import tiny_layouts

    from deltasync.layout.digest import state_digests
    from deltasync.trainer import gather_bf16

    _, tl, rl = tiny_layouts()
    gen = torch.Generator().manual_seed(5)
    masters = {n: torch.randn(s, generator=gen) * 0.02 for n, s in tl.param_shapes().items()}
    gathered = gather_bf16(masters.items())()
    assert all(t.dtype == torch.bfloat16 for t in gathered.values())
    want = state_digests(masters, trainer_layout=tl, receiver_layout=rl)
    assert state_digests(gathered, trainer_layout=tl, receiver_layout=rl) == want
