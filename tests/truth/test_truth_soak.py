"""Soak: hundreds of versions with every fault of this suite interleaved at random (failing and
lost-reply store writes, blobs damaged in transit, receivers crashing mid-apply, an edited shard
digest and a damaged manifest later repaired, a dangling LATEST, a failing ack, a publisher
restarted with and without a verified baseline, the store wiped and the trainer restarted with
other data and renumbered, the store restored from an older copy). After EVERY report that names
a version, the receiver's live tensors equal a dense split of the trainer's BF16 weights of that
version of that lineage, bitwise; a dirty receiver reports no version."""

from __future__ import annotations

import copy
import dataclasses
import os
import random

import pytest
from truth_kit import (
    Trainer,
    assert_same_bits,
    expected_shards,
    rconfig,
    tiny_layouts,
    wipe,
    zero_tensors,
)

from deltasync import MemoryStore, names
from deltasync.commit import Manifest, encode_latest
from deltasync.errors import DeltaSyncError
from deltasync.layout.digest import shard_digests
from deltasync.receiver import Receiver

VERSIONS = int(os.environ.get("TRUTH_SOAK_VERSIONS", "200"))


class Crash(Exception):
    """Raised inside the scatter: the receiver object is dropped as if its process died."""


class Faulty:
    """A store wrapper whose failures a test switches on per call."""

    def __init__(self, inner, rng) -> None:
        self.inner, self.rng = inner, rng
        self.p = 0.0
        self.injected = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _roll(self) -> bool:
        if self.p and self.rng.random() < self.p:
            self.injected += 1
            return True
        return False

    def get(self, key, *args, **kwargs):
        from deltasync.errors import StoreError

        if self._roll():
            raise StoreError(f"injected: read of {key!r} failed")
        data = self.inner.get(key, *args, **kwargs)
        if key.endswith(".blob") and len(data) > 8 and self._roll():
            return data[:-1]
        return data

    def put(self, key, data, *args, **kwargs):
        from deltasync.errors import StoreError

        if self._roll():
            raise StoreError(f"injected: put of {key!r} failed")
        self.inner.put(key, data, *args, **kwargs)
        if self._roll():
            raise StoreError(f"injected: put of {key!r} landed, reply lost")

    def put_if_absent(self, key, data, *args, **kwargs):
        from deltasync.errors import StoreError

        if self._roll():
            raise StoreError(f"injected: put_if_absent of {key!r} failed")
        self.inner.put_if_absent(key, data, *args, **kwargs)
        if self._roll():
            raise StoreError(f"injected: put_if_absent of {key!r} landed, reply lost")

    def put_stream(self, key, chunks, *args, **kwargs):
        data = b"".join(bytes(c) for c in chunks)
        self.put(key, data)
        return len(data)


class Watched:
    """One receiver that may crash mid-apply and is rebuilt on the same tensors and state."""

    def __init__(self, store, rl, shard, tmp, rng) -> None:
        self.store, self.rl, self.shard, self.rng = store, rl, shard, rng
        self.dir = str(tmp / f"rx-{shard}")
        self.tensors = zero_tensors(rl, shard)
        self.p_crash = 0.0
        self.rec: Receiver | None = None
        self.checks = self.crashes = 0

    def _hook(self, name):
        if self.p_crash and self.rng.random() < self.p_crash:
            self.crashes += 1
            raise Crash(name)

    def pull(self):
        if self.rec is None:
            self.rec = Receiver.for_layout(
                self.store,
                self.rl,
                self.shard,
                self.tensors,
                self.dir,
                rconfig(f"rx-{self.shard}"),
                on_tensor_written=self._hook,
            )
        return self.rec.pull()


# (published versions, fault, the draw that makes it): forced from there until it happened
FORCED = (
    (20, "edited-digest", 0.02),
    (30, "damaged-manifest", 0.06),
    (40, "snapshot-taken", 0.135),
    (50, "dangling-latest", 0.10),
    (60, "restored-older-copy", 0.145),
    (80, "publisher-restarted", 0.16),
    (100, "wiped-and-renumbered", 0.12),
)


@pytest.mark.timeout(300)
def test_hundreds_of_versions_with_every_fault_interleaved_never_report_a_wrong_version(tmp_path):
    seed = int(os.environ.get("TRUTH_SOAK_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    spec, tl, rl = tiny_layouts()
    inner = MemoryStore()
    store = Faulty(inner, rng)
    oracle: dict[tuple[str, int], dict] = {}
    trainer = Trainer(store, rl, tl, spec, seed=seed % 997, anchor_every=25)
    receivers = [Watched(store, rl, s, tmp_path, rng) for s in ("tp0", "tp1")]
    version, published, reports = 0, 0, 0
    faults: dict[str, int] = {}
    repairs: list = []  # (key, good bytes) to put back after the next pulls
    snapshot_store: dict[str, bytes] | None = None
    checkpoint = None

    def fault(name):
        faults[name] = faults.get(name, 0) + 1

    step = False
    while published < VERSIONS:
        if step:
            trainer.model.step()
        expected = expected_shards(trainer.model.params, tl, rl)
        store.p = 0.02 if rng.random() < 0.3 else 0.0
        try:
            trainer.sync.step_published(version)
            published += 1
        except DeltaSyncError:
            fault("publish-failed")
        store.p = 0.0
        # Whatever the publish reported (a lost reply may hide a commit), the oracle of a
        # committed version is the state whose digests its manifest lists.
        try:
            m = Manifest.from_json(inner.get(names.manifest_key(version)))
        except DeltaSyncError:
            m = None
        if m is not None and dict(m.shard_digests) == shard_digests(expected):
            oracle[(m.run_id, version)] = expected
        step = True
        store.p = 0.0
        version = trainer.sync.next_version() if rng.random() < 0.9 else version + 1
        # --- store-side faults, between publish and pulls --------------------------------
        r = rng.random()
        # Every kind at least once, whatever the seed: each is forced from its point on until
        # it has happened (a seed whose draws skipped one failed the coverage check below).
        for at, kind, value in FORCED:
            if published >= at and not faults.get(kind):
                r = value
                break
        head = inner.list("")
        newest = trainer.pub.committed()
        damaged = {key for key, _ in repairs}
        if newest is not None and names.manifest_key(newest) in damaged and r < 0.08:
            pass  # already damaged: repaired below
        elif newest is not None and r < 0.04:
            key = names.manifest_key(newest)
            good = inner.get(key)
            m = Manifest.from_json(good)
            edited = dataclasses.replace(m, shard_digests={s: "0" * 32 for s in m.shard_digests})
            inner.put(key, edited.to_json())
            repairs.append((key, good))
            fault("edited-digest")
        elif newest is not None and r < 0.08:
            key = names.manifest_key(newest)
            good = inner.get(key)
            inner.put(key, good[: len(good) // 2])
            repairs.append((key, good))
            fault("damaged-manifest")
        elif newest is not None and r < 0.11:
            inner.put(names.LATEST, encode_latest(newest + 50))
            fault("dangling-latest")
        elif r < 0.125:
            wipe(inner)
            trainer = Trainer(store, rl, tl, spec, seed=rng.randrange(10**6), anchor_every=25)
            version, step = rng.randrange(0, 5), False
            fault("wiped-and-renumbered")
        elif r < 0.14:
            snapshot_store = {k: inner.get(k) for k in head}
            checkpoint = (trainer.pub.committed(), copy.deepcopy(trainer.model))
            fault("snapshot-taken")
        elif snapshot_store is not None and checkpoint is not None and r < 0.15:
            wipe(inner)
            for k, data in snapshot_store.items():
                inner.put(k, data)
            at, model = checkpoint
            model.gen.manual_seed(rng.randrange(10**6))  # its data differs from here on
            trainer = Trainer(store, rl, tl, spec, model=model, anchor_every=25)
            trainer.sync.resume(at)
            version, step = trainer.sync.next_version(), True
            snapshot_store = checkpoint = None
            fault("restored-older-copy")
        elif r < 0.17:
            model = trainer.model
            trainer = Trainer(store, rl, tl, spec, model=model, anchor_every=25)
            if rng.random() < 0.7:
                trainer.sync.resume(trainer.pub.committed())
            fault("publisher-restarted")
        # --- pulls -------------------------------------------------------------------------
        for w in receivers:
            w.p_crash = 0.003
            store.p = 0.01 if rng.random() < 0.3 else 0.0
            try:
                report = w.pull()
            except (DeltaSyncError, Crash):
                if not isinstance(w.rec, Receiver) or rng.random() < 0.5:
                    w.rec = None
                continue
            finally:
                store.p = 0.0
            reports += 1
            if report.version is None:
                assert report.dirty or w.rec.version is None
                continue
            assert_same_bits(
                w.tensors,
                oracle[(report.run_id, report.version)][w.shard],
                f"seed {seed}: {w.shard} v{report.version}",
            )
            w.checks += 1
        if repairs and rng.random() < 0.5:
            for key, good in repairs:
                inner.put(key, good)
            repairs.clear()
    # faults off, damage repaired: every receiver converges on the newest version
    for key, good in repairs:
        inner.put(key, good)
    store.p = 0.0
    if trainer.pub.committed() is not None:
        trainer.pub.repair_latest()
    trainer.publish(trainer.sync.next_version(), oracle)
    for w in receivers:
        w.p_crash = 0.0
        w.rec = None
        report = w.pull()
        assert report.version == trainer.pub.committed()
        assert_same_bits(w.tensors, oracle[(report.run_id, report.version)][w.shard], "final")
    assert sum(w.checks for w in receivers) >= VERSIONS
    for kind in (
        "edited-digest",
        "damaged-manifest",
        "dangling-latest",
        "wiped-and-renumbered",
        "restored-older-copy",
        "publisher-restarted",
        "publish-failed",
    ):
        assert faults.get(kind), f"seed {seed}: no {kind} fault happened"
    assert store.injected and sum(w.crashes for w in receivers), f"seed {seed}: no crash"
    print(
        f"seed {seed}: {published} published, {reports} reports, faults {faults}, "
        f"store faults {store.injected}, crashes {[w.crashes for w in receivers]}"
    )
