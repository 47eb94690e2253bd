"""Test kit for tests/truth: a trainer publishing to a store and receivers on it, plus fakes.

``Rig`` holds the tiny Qwen3 layouts, a store, a trainer with its TrainerSync and remembers
the oracle (a dense split of the trainer's BF16 weights) of every version it published, keyed
by (run id, version): after a lineage restarts, the same number names another state.
"""

from __future__ import annotations

import torch
from kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    rconfig,
    tiny_layouts,
    zero_tensors,
)

from deltasync import Publisher, PublisherConfig, Receiver, TrainerSync
from deltasync.errors import StoreError
from deltasync.trainer import SnapshotTracker


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


class Trainer:
    """One trainer process's worth of state: params, tracker, publisher, sync."""

    def __init__(self, store, rl, tl, spec, *, seed=0, anchor_every=100, key=None, model=None):
        self.tl, self.rl = tl, rl
        self.model = model or TinyTrainer(spec, seed=seed, density=0.2)
        self.pub = Publisher(
            store,
            receiver_layout=rl,
            config=PublisherConfig(anchor_every=anchor_every, signing_key=key),
        )
        self.sync = TrainerSync(
            SnapshotTracker(self.model.named_parameters()), self.pub, self.model.params
        )

    def publish(self, version, oracle: dict, *, step=True, anchor=False):
        if step:
            self.model.step()
        report = self.sync.step_published(version, anchor=anchor)[0]
        run = self.pub.run_id
        oracle[(run, version)] = expected_shards(self.model.params, self.tl, self.rl)
        return report


class Rig:
    def __init__(self, store, tmp_path, *, shard="tp0", key=None, seed=0):
        self.spec, self.tl, self.rl = tiny_layouts()
        self.store, self.tmp, self.shard, self.key = store, tmp_path, shard, key
        self.oracle: dict[tuple[str, int], dict] = {}
        self.trainer = Trainer(store, self.rl, self.tl, self.spec, seed=seed, key=key)
        self.tensors = zero_tensors(self.rl, shard)
        self.rec = self.receiver()

    def receiver(self, store=None, **kwargs) -> Receiver:
        return Receiver.for_layout(
            store or self.store,
            self.rl,
            self.shard,
            self.tensors,
            str(self.tmp / "rec"),
            rconfig("rec", signing_key=self.key),
            **kwargs,
        )

    def publish(self, version, **kwargs):
        first = not self.oracle
        return self.trainer.publish(version, self.oracle, step=not first, **kwargs)

    def expected(self, report) -> dict:
        return self.oracle[(report.run_id, report.version)][self.shard]

    def check(self, report) -> None:
        """A report that names a version names exactly the tensors held, bitwise."""
        assert report.version is not None and not report.dirty
        assert_same_bits(self.rec.tensors, self.expected(report), f"v{report.version}")


class CountingStore:
    """Wraps a store and records every key read."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reads: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, *args, **kwargs):
        self.reads.append(key)
        return self.inner.get(key, *args, **kwargs)


class FailingPuts:
    """Wraps a store; puts of keys matching ``fail(key)`` raise StoreError while armed."""

    def __init__(self, inner, fail) -> None:
        self.inner, self.fail, self.armed = inner, fail, True
        self.failed: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, *args, **kwargs):
        if self.armed and self.fail(key):
            self.failed.append(key)
            raise StoreError(f"injected: put of {key!r} failed")
        return self.inner.put(key, data, *args, **kwargs)


def wipe(store) -> None:
    """The store loses its history (bucket recreated, prefix wiped)."""
    for key in store.list(""):
        store.delete(key)
