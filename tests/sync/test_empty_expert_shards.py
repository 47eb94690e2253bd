"""Expert parallelism wider than the expert count: vLLM EP=4 over 2 experts leaves EP ranks 2
and 3 without experts (their ``w13_weight``/``w2_weight`` have 0 rows). Every writer of an
anchor sends a record for such a tensor (nothing of its own reaches it), which the encoder
writes dense (it names all 0 elements); the receivers take these records as the disjoint,
empty records they are, on the store path and on the in-cluster path."""

from __future__ import annotations

import threading

import pytest
import torch

from deltasync import ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender, RolePlan
from deltasync.commit import Catalog
from deltasync.layout import fsdp_dim0_rows
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    TINY,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    rconfig,
    scratch_store,
    zero_tensors,
)

WORLD = 2
W13 = "model.layers.0.mlp.experts.w13_weight"


def _layouts() -> tuple[ModelSpec, TrainerLayout, ReceiverLayout]:
    cfg = {
        **TINY,
        "model_type": "qwen3_moe",
        "num_experts": 2,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 1,
        "mlp_only_layers": [1],
    }
    spec = ModelSpec.from_hf_config(cfg)
    rl = ReceiverLayout.build(spec, "vllm", tp=1, ep=4)
    assert rl.local_specs("tp0-ep3")[W13].shape[0] == 0  # no expert on EP ranks 2 and 3
    assert rl.local_specs("tp0-ep0")[W13].shape[0] == 1
    return spec, TrainerLayout(spec), rl


def _local(params: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s FSDP dim-0 rows of every param: views that follow the optimizer."""
    out = {}
    for name, p in params.items():
        start, stop = fsdp_dim0_rows(p.shape[0], rank, WORLD)
        out[name] = p.detach()[start:stop]
    return out


def _everyone(call) -> list:
    out: list = [None] * WORLD

    def run(rank: int) -> None:
        try:
            out[rank] = call(rank)
        except Exception as exc:  # a writer's failure is asserted on by the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.timeout(120)
def test_two_writers_anchors_and_deltas_reach_ep_shards_holding_no_experts_bit_exact(tmp_path):
    spec, tl, rl = _layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = [], []
    for rank in range(WORLD):
        trainer = TinyTrainer(spec, seed=7, density=0.1)  # the same training on every rank
        local = _local(trainer.params, rank)
        config = PublisherConfig(
            writer_rank=rank, num_writers=WORLD, session="s1", anchor_every=3, poll_interval_s=0.02
        )
        pub = Publisher(store, receiver_layout=rl, config=config)
        full = trainer.params if rank == 0 else None
        syncs.append(TrainerSync(SnapshotTracker(local.items()), pub, local, full_state=full))
        trainers.append(trainer)

    def receiver(shard: str, name: str) -> Receiver:
        live = zero_tensors(rl, shard)
        for t in live.values():
            t.fill_(1.0)  # stale bits: an anchor defines every element
        return Receiver.for_layout(store, rl, shard, live, str(tmp_path / name), rconfig(name))

    receivers = [receiver(s.id, s.id) for s in rl.shards()]
    late = receiver("tp0-ep3", "late")  # pulls once, at the end: a chain from the last anchor
    for version in range(5):
        if version:
            for t in trainers:
                t.step()
        reports = _everyone(lambda r, v=version: syncs[r].step_published(v))
        assert not any(isinstance(x, Exception) for x in reports), reports
        want = expected_shards(trainers[0].params, tl, rl)
        for rec in receivers:
            assert rec.pull().version == version, rec.shard
            assert_same_bits(rec.tensors, want[rec.shard], f"{rec.shard} v{version}")
    kinds = [Catalog(store).manifest(v).kind for v in range(5)]
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta"]
    assert late.pull().chain == (3, 4)
    assert_same_bits(late.tensors, want["tp0-ep3"], "late tp0-ep3")


def test_two_cluster_writers_anchor_reaches_ep_shards_holding_no_experts_bit_exact():
    _spec, tl, rl = _layouts()
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) * 0.05 for n, s in tl.param_shapes().items()}
    plan = RolePlan.contiguous(
        num_writers=WORLD, shards=[s.id for s in rl.shards()], replicas=1, dp_mode="direct"
    )
    config = ClusterConfig()
    senders = []
    for w in plan.writers:
        mine = _local(full, w.index)
        senders.append(
            ClusterSender(
                SnapshotTracker(mine.items()),
                mine,
                plan=plan,
                rank=w.rank,
                trainer_layout=tl,
                receiver_layout=rl,
                version=None,
                config=config,
                full_state=full,
            )
        )
    receivers = {}
    for r in plan.receivers:
        live = zero_tensors(rl, r.shard)
        for t in live.values():
            t.fill_(1.0)  # stale bits: the anchor defines every element
        receivers[r.rank] = ClusterReceiver(
            live, plan=plan, rank=r.rank, layout=rl, version=None, config=config
        )
    inbox: dict[int, dict[int, bytes]] = {rank: {} for rank in receivers}
    for s in senders:
        out = s.payloads_for_version(0, anchor=True)
        for dst, payload in out.payloads.items():
            inbox[dst][s.rank] = payload
    want = expected_shards(full, tl, rl)
    for rank, rec in receivers.items():
        rec.apply_payload(inbox[rank])
        assert_same_bits(rec.tensors, want[rec.shard], rec.shard)
