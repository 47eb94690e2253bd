"""Real processes killed with SIGKILL: a publisher mid-blob, after its blobs before the
manifest, after the manifest before LATEST; a receiver in the middle of its apply, in the
middle of a chain, right after an anchor restore, and with its journaled versions gone.
Receivers never observe a partial version, and everything converges bit-exactly."""

from __future__ import annotations

import logging
import multiprocessing as mp
import random

import pytest

from deltasync import names
from deltasync.commit import Catalog, ReceiverRecord
from deltasync.errors import LayoutMismatchError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import (
    MissingBlobError,
    Receiver,
    StateDir,
    mapped_shard_tensors,
)
from deltasync.trainer import SnapshotTracker

from crash_kit import (
    expected_states,
    is_blob_of,
    publisher_child,
    receiver_child,
    replay_version,
)
from sync_kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    fork_child,
    kill,
    layouts,
    rconfig,
    same_bits,
    scratch_store,
    zero_tensors,
)

VERSIONS = 7
SEED = 3


def _kill_point(kind: str, k: int):
    if kind == "mid-blob":
        blob = is_blob_of(k)
        return lambda op, key, inner: op == "mid-stream" and blob(key)
    if kind == "after-blobs-before-manifest":
        return lambda op, key, inner: op == "put_if_absent" and key == names.manifest_key(k)
    if kind == "after-manifest-before-latest":
        return lambda op, key, inner: (
            op == "put" and key == names.LATEST and inner.exists(names.manifest_key(k))
        )
    raise ValueError(kind)


@pytest.fixture(scope="module")
def states():
    return expected_states(VERSIONS, SEED)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "kind", ["mid-blob", "after-blobs-before-manifest", "after-manifest-before-latest"]
)
def test_a_publisher_killed_anywhere_never_exposes_a_partial_version_and_a_restart_converges(
    kind, states, tmp_path
):
    rng = random.Random()
    k = rng.randint(1, VERSIONS - 2)
    anchor_every = rng.choice([3, 100])
    where = f"kill point {kind} at version {k}, anchor_every={anchor_every}"
    path = tmp_path / "store"
    make_store = lambda: scratch_store(path)
    _, _, rl = layouts()
    receivers = {
        s: Receiver.for_layout(
            scratch_store(path), rl, s, zero_tensors(rl, s), str(tmp_path / s), rconfig(f"r-{s}")
        )
        for s in ("tp0", "tp1")
    }

    frozen = mp.get_context("fork").Event()
    child = fork_child(
        publisher_child, make_store, VERSIONS, _kill_point(kind, k), frozen, SEED, anchor_every
    )
    assert frozen.wait(60), f"{where}: the publisher never reached its kill point"
    committed = k if kind == "after-manifest-before-latest" else k - 1
    for shard, rec in receivers.items():  # while the publisher hangs there, and after it died
        assert rec.pull().version == committed, where
        assert_same_bits(rec.tensors, states[committed][shard], where)
    kill(child)
    for shard, rec in receivers.items():
        assert rec.pull().version == committed, where
        assert_same_bits(rec.tensors, states[committed][shard], where)

    restarted = fork_child(publisher_child, make_store, VERSIONS, None, frozen, SEED, anchor_every)
    restarted.join(60)
    assert restarted.exitcode == 0, f"{where}: the restarted publisher failed"
    store = scratch_store(path)
    catalog = Catalog(store)
    assert catalog.read_latest() == VERSIONS - 1
    for shard, rec in receivers.items():
        assert rec.pull().version == VERSIONS - 1, where
        assert_same_bits(rec.tensors, states[VERSIONS - 1][shard], where)
    for v in catalog.versions():  # every committed version, rebuilt from the store
        for shard in ("tp0", "tp1"):
            assert same_bits(replay_version(store, shard, v), states[v][shard]), f"{where}: v{v}"
    # the dead attempt's leftovers are never listed by a manifest, and gc removes them
    pub = Publisher(store, receiver_layout=rl)
    pub.gc()
    for v in catalog.versions():
        listed = {b.key for b in catalog.manifest(v).blobs}
        blobs = {key for key in store.list(names.version_prefix(v)) if key.endswith(".blob")}
        assert blobs == listed, f"{where}: v{v} keeps unlisted blobs {blobs - listed}"


def _receiver_rig(anchor_every, tmp_path, shard="tp0"):
    spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    trainer = TinyTrainer(spec, density=0.3)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=anchor_every))
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    states = {}

    def publish(v, anchor=False):
        if v:
            trainer.step()
        sync.step_published(v, anchor=anchor)
        states[v] = expected_shards(trainer.params, tl, rl)[shard]

    return store, rl, publish, states


def _kill_receiver_mid_apply(tmp_path, stop_after, shard="tp0"):
    file, state_dir = tmp_path / f"{shard}.bin", tmp_path / "victim-state"
    frozen = mp.get_context("fork").Event()
    store = tmp_path / "store"
    child = fork_child(receiver_child, store, shard, file, state_dir, stop_after, frozen)
    assert frozen.wait(60), "the receiver never reached the pause"
    kill(child)
    return file, state_dir


def _reopen(store, rl, tmp_path, shard="tp0"):
    file, state_dir = tmp_path / f"{shard}.bin", tmp_path / "victim-state"
    return Receiver.for_layout(
        store,
        rl,
        shard,
        mapped_shard_tensors(file, rl.local_specs(shard)),
        str(state_dir),
        rconfig("victim"),
    )


@pytest.mark.timeout(60)
def test_a_receiver_killed_mid_apply_repairs_on_restart_and_ends_bit_identical(tmp_path):
    store, rl, publish, states = _receiver_rig(100, tmp_path)
    publish(0), publish(1)
    assert _reopen(store, rl, tmp_path).pull().version == 1
    publish(2)
    file, state_dir = _kill_receiver_mid_apply(tmp_path, stop_after=7)
    journal = StateDir(state_dir).read_journal()
    assert journal is not None and journal.target == 2 and journal.from_version == 1
    assert StateDir(state_dir).read_state().version == 1
    torn = mapped_shard_tensors(file, rl.local_specs("tp0"))
    assert not same_bits(torn, states[1]) and not same_bits(torn, states[2]), "not torn?"
    registered = RecordedRegistrations(store)
    rec = _reopen(registered, rl, tmp_path)
    assert rec.last_repair is not None and rec.last_repair.repaired
    assert rec.version == 2 and not rec.dir.journal_path.exists()
    assert_same_bits(rec.tensors, states[2])
    assert Catalog(store).acks(2)["victim"].state_digest == rec.state_digest
    # torn while the repair ran: registered as holding nothing (at the start, and again by
    # the replay before its first write), then as holding version 2
    assert registered.versions == [None, None, 2]


class RecordedRegistrations:
    """A store that records the version of every receiver registration written to it."""

    def __init__(self, inner) -> None:
        self.inner, self.versions = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data):
        if key.startswith(names.RECEIVERS_PREFIX):
            self.versions.append(ReceiverRecord.from_json(data).version)
        return self.inner.put(key, data)


@pytest.mark.timeout(60)
def test_a_receiver_killed_in_the_middle_of_a_chain_replays_the_whole_chain(tmp_path):
    store, rl, publish, states = _receiver_rig(100, tmp_path)
    publish(0), publish(1)
    _reopen(store, rl, tmp_path).pull()
    for v in range(2, 8):
        publish(v)
    _, state_dir = _kill_receiver_mid_apply(tmp_path, stop_after=10)
    assert [s.version for s in StateDir(state_dir).read_journal().steps] == [2, 3, 4, 5, 6, 7]
    rec = _reopen(store, rl, tmp_path)
    assert rec.last_repair.chain == (2, 3, 4, 5, 6, 7) and rec.version == 7
    assert_same_bits(rec.tensors, states[7])


@pytest.mark.timeout(60)
def test_a_receiver_killed_right_after_an_anchor_restore_replays_from_the_anchor(tmp_path):
    store, rl, publish, states = _receiver_rig(8, tmp_path)
    publish(0), publish(1)
    _reopen(store, rl, tmp_path).pull()
    for v in range(2, 10):
        publish(v)
    n = len(rl.local_specs("tp0"))
    file, state_dir = _kill_receiver_mid_apply(tmp_path, stop_after=n)  # every tensor written
    journal = StateDir(state_dir).read_journal()
    assert [s.version for s in journal.steps] == [8, 9] and journal.steps[0].kind == "anchor"
    assert same_bits(mapped_shard_tensors(file, rl.local_specs("tp0")), states[9])
    assert StateDir(state_dir).read_state().version == 1, "version 9 was never recorded"
    rec = _reopen(store, rl, tmp_path)
    assert rec.last_repair.chain == (8, 9) and rec.version == 9
    assert_same_bits(rec.tensors, states[9])


@pytest.mark.timeout(60)
def test_a_receiver_whose_journaled_versions_are_gone_restores_the_newest_anchor(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="deltasync.receiver.store_receiver")
    store, rl, publish, states = _receiver_rig(100, tmp_path)
    publish(0), publish(1)
    _reopen(store, rl, tmp_path).pull()
    for v in range(2, 6):
        publish(v)
    _, state_dir = _kill_receiver_mid_apply(tmp_path, stop_after=5)
    store.delete(Catalog(store).manifest(4).blobs_for("tp0")[0].key)  # lost while it was down
    with pytest.raises(MissingBlobError, match="version 4 blob"):
        _reopen(store, rl, tmp_path)  # only the old anchor's chain, through the gap: not yet
    assert StateDir(state_dir).read_state().dirty, "the torn tensors are recorded as such"
    publish(6, anchor=True)
    rec = _reopen(store, rl, tmp_path)
    assert rec.dirty and rec.version is None and rec.verified_version == 1
    report = rec.pull()
    assert report.chain == (6,) and report.from_anchor and not rec.dirty
    assert_same_bits(rec.tensors, states[6])
    # and straight from the journal: the constructor's repair falls back to the anchor itself
    rec.close()  # its process ends; another one is killed mid-apply on that state dir
    publish(7), publish(8)
    _kill_receiver_mid_apply(tmp_path, stop_after=3)
    store.delete(Catalog(store).manifest(7).blobs_for("tp0")[0].key)
    publish(9, anchor=True)
    rec = _reopen(store, rl, tmp_path)
    assert rec.last_repair.chain == (9,) and rec.last_repair.from_anchor and rec.version == 9
    assert_same_bits(rec.tensors, states[9])
    # an operator can see why: the journal could not be replayed, an anchor was restored
    said = [r.getMessage() for r in caplog.records]
    assert any("cannot be replayed" in m and "restoring the newest anchor" in m for m in said)
    assert any("restoring anchor 9" in m and "state is dirty" in m for m in said)


@pytest.mark.timeout(60)
def test_a_killed_receiver_whose_store_now_holds_another_layout_gets_a_typed_refusal(tmp_path):
    # Killed mid-apply (its journal stays); meanwhile the store is wiped and refilled by a
    # new run published for TP=1, which has no shard tp1. Every restart must end in a typed
    # error naming the layouts, never a raw KeyError from the journal's replay.
    store, rl, publish, _ = _receiver_rig(100, tmp_path, shard="tp1")
    publish(0), publish(1)
    _reopen(store, rl, tmp_path, shard="tp1").pull()
    publish(2)
    _kill_receiver_mid_apply(tmp_path, stop_after=3, shard="tp1")
    for key in store.list(""):
        store.delete(key)
    spec, _, other = layouts(tp=1)
    trainer = TinyTrainer(spec, density=0.3)
    sync = TrainerSync(
        SnapshotTracker(trainer.named_parameters()),
        Publisher(store, receiver_layout=other),
        trainer.params,
    )
    for v in range(4):  # its version 2 is not the journaled one, and defines no tp1
        if v:
            trainer.step()
        sync.step_published(v)
    with pytest.raises(LayoutMismatchError, match="tp=1"):
        _reopen(store, rl, tmp_path, shard="tp1")  # the journal cannot be replayed
    rec = _reopen(store, rl, tmp_path, shard="tp1")  # recorded dirty, the journal dropped
    assert rec.dirty and StateDir(tmp_path / "victim-state").read_journal() is None
    with pytest.raises(LayoutMismatchError, match="tp=1"):
        rec.pull()
