"""Device tier: a trainer whose params and AdamW state live on a CUDA device publishes
through the streaming path (tracker.iter_changes() -> groups -> segments) to a store, and CPU
receivers end bit-identical to a dense split of the trainer's BF16 weights.

Deselected by default (``-m 'not gpu'``); run with ``pytest -m gpu`` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import AdamWTracker

from sync_kit import TinyTrainer, assert_same_bits, expected_shards, layouts, rconfig, zero_tensors

pytestmark = pytest.mark.gpu


def test_a_cuda_trainer_streams_versions_that_cpu_receivers_apply_bit_exactly(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("the gpu tier needs a CUDA device")
    spec, tl, rl = layouts(tp=2)
    trainer = TinyTrainer(spec, lr=1e-3, density=0.1, device="cuda")
    tracker = AdamWTracker(trainer.opt, list(trainer.params.items()))
    store = MemoryStore()
    pub = Publisher(
        store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(anchor_every=4)
    )
    sync = TrainerSync(tracker, pub, trainer.params)
    receivers = {
        s.id: Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(f"rx-{s.id}")
        )
        for s in rl.shards()
    }
    sync.step_published(0, anchor=True)
    for version in range(1, 6):
        trainer.step()
        (report,) = sync.step_published(version)
        assert report.kind == ("anchor" if version % 4 == 0 else "delta")
        cpu = {n: p.detach().cpu() for n, p in trainer.params.items()}
        expected = expected_shards(cpu, tl, rl)
        for shard, rx in receivers.items():
            rx.pull()
            assert rx.version == version
            assert_same_bits(rx.tensors, expected[shard], f"v{version} {shard}")
