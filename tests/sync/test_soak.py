"""Soak: hundreds of versions through a store that fails at random (writes that never land,
writes whose reply is lost, failed reads, blobs damaged in transit) with receivers that crash
at random in the middle of their apply. Fault-free auditor receivers land on every committed
version in turn and check it bit-exactly; the faulty ones must never hold a wrong state, and
everyone converges at the end."""

from __future__ import annotations

import contextlib
import random

import pytest

from deltasync.errors import DeltaSyncError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import AdamWTracker

from sync_kit import (
    FaultyStore,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    zero_tensors,
)

COMMITTED_TARGET = 200


class SimulatedCrash(Exception):
    """Raised from inside the apply: the receiver object is dropped as if its process died."""


class FlakyReceiver:
    """A receiver that crashes mid-apply now and then and is rebuilt on the same tensors and
    state dir (its repair must finish the torn apply)."""

    def __init__(self, store, rl, shard, state_dir, rng, p_crash):
        self.args = (store, rl, shard, state_dir)
        self.tensors = zero_tensors(rl, shard)
        self.rng, self.p_crash = rng, p_crash
        self.rec = None
        self.crashes = self.repairs = 0

    def _hook(self, name):
        if self.rng.random() < self.p_crash:
            self.crashes += 1
            raise SimulatedCrash(name)

    def pull(self):
        store, rl, shard, state_dir = self.args
        if self.rec is None:
            self.rec = Receiver.for_layout(
                store,
                rl,
                shard,
                self.tensors,
                state_dir,
                rconfig(f"flaky-{shard}"),
                on_tensor_written=self._hook,
            )
            if self.rec.last_repair is not None:
                self.repairs += 1
        return self.rec.pull()


@pytest.mark.timeout(150)
def test_hundreds_of_versions_with_random_faults_stay_bit_exact(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    spec, tl, rl = layouts()
    inner = MemoryStore()
    faulty = FaultyStore(inner, p=0.02, seed=seed)
    trainer = TinyTrainer(spec, seed=seed % 1000, lr=1e-3, density=0.02)
    pub = Publisher(faulty, receiver_layout=rl, config=PublisherConfig(anchor_every=25))
    sync = TrainerSync(AdamWTracker(trainer.opt, trainer.named_parameters()), pub, trainer.params)
    auditors = {
        s: Receiver.for_layout(
            inner, rl, s, zero_tensors(rl, s), str(tmp_path / f"audit-{s}"), rconfig(f"audit-{s}")
        )
        for s in ("tp0", "tp1")
    }
    flaky = [
        FlakyReceiver(faulty, rl, s, str(tmp_path / f"flaky-{s}"), rng, p_crash=0.004)
        for s in ("tp0", "tp1")
    ]
    expected: dict[int, dict] = {}
    audited: set[int] = set()
    failed_publishes = flaky_checks = 0
    version = 0
    while len(audited) < COMMITTED_TARGET:
        if version:
            trainer.step()
        expected[version] = expected_shards(trainer.params, tl, rl)
        for _ in range(rng.choice([1, 1, 3])):  # sometimes retry the same version
            try:
                sync.step_published(version)
                break
            except DeltaSyncError:
                failed_publishes += 1
        for shard, auditor in auditors.items():
            before = auditor.version
            report = auditor.pull()
            if report.version != before:  # one publish commits at most one version
                audited.add(report.version)
                assert_same_bits(
                    auditor.tensors,
                    expected[report.version][shard],
                    f"seed {seed}: auditor {shard} v{report.version}",
                )
        for f in flaky:
            try:
                report = f.pull()
            except (DeltaSyncError, SimulatedCrash):
                if not isinstance(f.rec, Receiver) or rng.random() < 0.5:
                    f.rec = None  # the process "died": rebuild from the state dir next time
                continue
            if report.version is not None:
                assert_same_bits(
                    f.tensors,
                    expected[report.version][f.rec.shard],
                    f"seed {seed}: flaky v{report.version}",
                )
                flaky_checks += 1
        if version % 20 == 19:
            with contextlib.suppress(DeltaSyncError):
                pub.gc()
        version += 1
    assert len(audited) >= COMMITTED_TARGET
    assert failed_publishes > 0 and sum(faulty.injected.values()) > 0, "no faults were injected"
    assert sum(f.crashes for f in flaky) > 0, f"seed {seed}: no receiver crashed mid-apply"
    # stop the faults: everyone converges on the newest version, bit-exactly
    faulty.enabled = False
    for f in flaky:
        f._hook = lambda name: None
        f.rec = None
        f.pull()
    newest = pub.committed()
    for f in flaky:
        assert f.rec.version == newest and not f.rec.dirty
        assert_same_bits(f.tensors, expected[newest][f.rec.shard], f"seed {seed}: final")
    print(
        f"seed {seed}: {version} versions attempted, {len(audited)} committed and audited, "
        f"{failed_publishes} failed publishes, faults {faulty.injected}, receiver crashes "
        f"{[f.crashes for f in flaky]}, flaky checks {flaky_checks}"
    )
