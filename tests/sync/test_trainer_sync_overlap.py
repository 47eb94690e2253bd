"""TrainerSync(overlap=True): the trainer waits for detection only.

``step_published`` returns once the changes are captured; the commit runs in the background;
the next optimizer step waits for it; the baseline advances only when a version commits; a
version that fails is carried into the next one (never lost) and its error is raised at the
next call, naming it. A store whose manifest write is held at a gate makes "not yet committed"
a state the test controls, not a race it hopes to win."""

from __future__ import annotations

import threading

import pytest
import torch

from deltasync import names
from deltasync.errors import ConfigError, PublishFailedError, StoreError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.publish.trainer_sync import PendingVersion, merge_carry
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import AdamWTracker

from sync_kit import (
    GateStore,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    zero_tensors,
)

pytestmark = pytest.mark.timeout(120)


class ManifestGate:
    """Holds the manifest write of ``version`` until ``release()``; ``fail`` makes it raise."""

    def __init__(self, version: int, *, fail: bool = False) -> None:
        self.key = names.manifest_key(version)
        self.fail = fail
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, op: str, key: str) -> None:
        if key != self.key:
            return
        self.reached.set()
        if self.fail:
            self.fail = False  # once: the retry gets through
            raise StoreError(f"injected: the manifest write of {key!r} failed")
        assert self._open.wait(60), "the test never released the gate"

    def release(self) -> None:
        self._open.set()


def _setup(tmp_path, gate, *, density=0.05, seed=0):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=density, seed=seed)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = GateStore(MemoryStore(), gate)
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    sync = TrainerSync(tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt)
    receivers = {
        s.id: Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(f"rx-{s.id}")
        )
        for s in rl.shards()
    }
    return trainer, tracker, sync, pub, receivers, (tl, rl)


def _assert_receivers_exact(receivers, trainer, layouts_, version):
    tl, rl = layouts_
    expected = expected_shards(trainer.params, tl, rl)
    for shard, rx in receivers.items():
        rx.pull()
        assert rx.version == version
        assert_same_bits(rx.tensors, expected[shard], f"v{version} {shard}")


def test_step_published_returns_before_the_commit_and_the_baseline_waits_for_it(tmp_path):
    gate = ManifestGate(1)
    trainer, _, sync, pub, receivers, lay = _setup(tmp_path, gate)
    sync.step_published(0, anchor=True)
    sync.wait()
    trainer.step()
    pending = sync.step_published(1)
    assert isinstance(pending, PendingVersion) and pending.version == 1
    assert gate.reached.wait(30)  # the background got to the commit ...
    assert not pending.done()  # ... and is held there, while the caller already runs on
    assert sync.baseline == 0 and pub.committed() == 0  # joint commit: nothing advanced yet
    gate.release()
    (report,) = sync.wait()
    assert report.version == 1 and report.kind == "delta"
    assert sync.baseline == 1 and pub.committed() == 1
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_the_next_optimizer_step_waits_for_the_version_in_flight(tmp_path):
    gate = ManifestGate(1)
    trainer, _, sync, pub, _, _ = _setup(tmp_path, gate)
    sync.step_published(0, anchor=True)
    sync.wait()
    trainer.step()
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    pending = sync.step_published(1)
    assert gate.reached.wait(30)
    stepped = threading.Event()

    def next_step():
        trainer.step()  # the tracker's optimizer: its pre-step hook is the barrier
        stepped.set()

    t = threading.Thread(target=next_step)
    t.start()
    assert not stepped.wait(0.5), "the optimizer stepped while version 1 was in flight"
    # the params the background hashes are untouched while it runs
    assert all(
        torch.equal(before[n].view(torch.int32), p.detach().view(torch.int32))
        for n, p in trainer.params.items()
    )
    gate.release()
    t.join(30)
    assert stepped.is_set() and pending.done() and pub.committed() == 1
    sync.close()


def test_a_failed_version_is_carried_into_the_next_and_its_error_names_it(tmp_path):
    gate = ManifestGate(2, fail=True)
    trainer, _tracker, sync, pub, receivers, lay = _setup(tmp_path, gate, density=0.02)
    sync.step_published(0, anchor=True)
    sync.wait()
    trainer.step()
    sync.step_published(1)
    trainer.step()  # waits for version 1 (committed)
    sync.step_published(2)  # its manifest write fails in the background
    carried = {n: i.clone() for n, i in sync._carry.items()}
    trainer.step()  # a different random mask: elements changed only at step 2 exist
    with pytest.raises(PublishFailedError, match="version 2 did not commit") as err:
        sync.step_published(3)
    assert err.value.version == 2 and isinstance(err.value.__cause__, StoreError)
    assert pub.committed() == 1 and sync.baseline == 1  # the baseline did not move
    # the carry is the failed version's positions, O(changed), int32 (every tensor < 2^31)
    assert sync._carry.keys() == carried.keys()
    for n, idx in sync._carry.items():
        assert idx.dtype == torch.int32 and torch.equal(idx, carried[n])
    assert sum(i.numel() for i in sync._carry.values()) < 0.2 * sum(
        p.numel() for p in trainer.params.values()
    )
    (report,) = sync.step_published(3).result()  # the retry: version 3 = steps 2 and 3
    sync.wait()
    assert report.kind == "delta" and report.base_version == 1
    _assert_receivers_exact(receivers, trainer, lay, 3)  # nothing of step 2 was lost
    assert sync._carry == {}
    sync.close()


def test_close_raises_the_error_of_the_version_in_flight(tmp_path):
    gate = ManifestGate(1, fail=True)
    trainer, _, sync, _, _, _ = _setup(tmp_path, gate)
    sync.step_published(0, anchor=True)
    trainer.step()  # the barrier settles nothing: version 0 committed
    sync.step_published(1)
    with pytest.raises(PublishFailedError, match="version 1"):
        sync.close()


def test_merged_carry_rereads_current_values_at_the_union_of_positions():
    params = {"a": torch.randn(10), "b": torch.randn(4), "c": torch.randn(3)}
    fresh = [
        ("a", torch.tensor([1, 5]), params["a"][[1, 5]].to(torch.bfloat16)),
        ("c", torch.tensor([0]), torch.zeros(1, dtype=torch.bfloat16)),
    ]
    carry = {"a": torch.tensor([0, 5, 9], dtype=torch.int32), "b": torch.tensor([2])}
    out = list(merge_carry(fresh, carry, params))
    assert [n for n, _, _ in out] == ["a", "b", "c"]
    (_, ia, va), (_, ib, vb), (_, ic, vc) = out
    assert ia.tolist() == [0, 1, 5, 9] and ia.dtype == torch.int64
    assert torch.equal(
        va.view(torch.int16), params["a"][[0, 1, 5, 9]].to(torch.bfloat16).view(torch.int16)
    )
    assert ib.tolist() == [2] and torch.equal(
        vb.view(torch.int16), params["b"][[2]].to(torch.bfloat16).view(torch.int16)
    )
    assert ic.tolist() == [0] and vc.view(torch.int16).tolist() == [0]  # not carried: as given
    with pytest.raises(ConfigError, match="not in params"):
        list(
            merge_carry(
                [("zz", torch.tensor([0]), torch.zeros(1, dtype=torch.bfloat16))], {}, params
            )
        )


def test_overlap_without_the_optimizer_is_refused_naming_it():
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    pub = Publisher(MemoryStore(), receiver_layout=rl, trainer_layout=tl)
    with pytest.raises(ConfigError, match=r"TrainerSync.optimizer"):
        TrainerSync(tracker, pub, trainer.params, overlap=True)
