"""A store that lies: truncated, corrupted, replayed, out-of-order, foreign-version and missing
blobs; stale or regressed LATEST; unsigned, forged and re-keyed manifests; a wrong shard
digest; two publishers racing. Each is detected with an error that says what happened, and
nothing wrong reaches the live tensors (bitwise unchanged, version unchanged, no ack)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from deltasync import names
from deltasync.commit import Manifest, blob_digest, encode_latest, sign
from deltasync.commit.model import new_run_id, run_started_ms
from deltasync.errors import (
    BaseVersionMismatchError,
    BlobMismatchError,
    CommitConflictError,
    DigestMismatchError,
    IntegrityError,
    KeyRequiredError,
    ManifestError,
    SignatureError,
    TruncatedBlobError,
    VersionError,
)
from deltasync.format import encode_blob, sparse_update
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import MissingBlobError, Receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    KEY,
    GateStore,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    scratch_store,
    zero_tensors,
)


class Rig:
    def __init__(self, tmp_path, *, key=None):
        self.spec, self.tl, self.rl = layouts()
        self.store = scratch_store(tmp_path / "store")
        self.trainer = TinyTrainer(self.spec, density=0.2)
        self.pub = Publisher(
            self.store,
            receiver_layout=self.rl,
            config=PublisherConfig(anchor_every=100, signing_key=key),
        )
        self.sync = TrainerSync(
            SnapshotTracker(self.trainer.named_parameters()), self.pub, self.trainer.params
        )
        self.rec = Receiver.for_layout(
            self.store,
            self.rl,
            "tp0",
            zero_tensors(self.rl, "tp0"),
            str(tmp_path / "rec"),
            rconfig("rec", signing_key=key),
        )
        self.states = {}

    def publish(self, version):
        if version:
            self.trainer.step()
        self.sync.step_published(version)
        self.states[version] = expected_shards(self.trainer.params, self.tl, self.rl)

    def manifest(self, version) -> Manifest:
        return Manifest.from_json(self.store.get(names.manifest_key(version)))

    def put_manifest(self, m: Manifest) -> None:
        self.store.put(names.manifest_key(m.version), m.to_json())
        self.pub.catalog.forget(m.version)  # both cache manifests, which never change... unless
        self.rec.catalog.forget(m.version)  # someone hostile rewrites the store, as here

    def blob_key(self, version, shard="tp0"):
        return self.manifest(version).blobs_for(shard)[0].key

    def assert_untouched(self, version):
        """Still bit-identical to ``version``, recorded as such, no journal, no new ack."""
        assert self.rec.version == version and not self.rec.dirty
        assert_same_bits(self.rec.tensors, self.states[version]["tp0"])
        assert not self.rec.dir.journal_path.exists()
        assert not self.store.list(names.acks_prefix(version + 1))


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    r.publish(0), r.publish(1)
    r.rec.pull()
    r.publish(2)
    return r


def _rewrite_blob(rig, key, data, *, fix_manifest):
    """Replace a blob; with ``fix_manifest`` also make the manifest vouch for it (an unsigned
    store written by someone hostile), so that the blob's own checks are what catches it."""
    rig.store.put(key, data)
    if fix_manifest:
        version = names.parse_blob_key(key)[0]
        m = rig.manifest(version)
        blobs = tuple(
            dataclasses.replace(b, size=len(data), digest=blob_digest(data)) if b.key == key else b
            for b in m.blobs
        )
        rig.put_manifest(dataclasses.replace(m, blobs=blobs))


@pytest.mark.timeout(60)
def test_a_truncated_blob_is_detected_and_nothing_is_applied(rig):
    key = rig.blob_key(2)
    _rewrite_blob(rig, key, rig.store.get(key)[:-7], fix_manifest=False)
    with pytest.raises(TruncatedBlobError, match="truncated"):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_corrupted_blob_is_detected_and_nothing_is_applied(rig):
    key = rig.blob_key(2)
    data = bytearray(rig.store.get(key))
    data[len(data) // 2] ^= 0x01
    _rewrite_blob(rig, key, bytes(data), fix_manifest=False)
    with pytest.raises(DigestMismatchError, match="corrupted"):
        rig.rec.pull()
    rig.assert_untouched(1)
    # even if the manifest is made to vouch for it, the blob's own digest catches it
    _rewrite_blob(rig, key, bytes(data), fix_manifest=True)
    with pytest.raises(DigestMismatchError):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_replayed_blob_of_an_older_version_is_refused(rig):
    old = rig.store.get(rig.blob_key(1))
    _rewrite_blob(rig, rig.blob_key(2), old, fix_manifest=False)
    with pytest.raises((TruncatedBlobError, DigestMismatchError), match="replaced by another blob"):
        rig.rec.pull()
    _rewrite_blob(rig, rig.blob_key(2), old, fix_manifest=True)
    with pytest.raises(BlobMismatchError, match="brings version 1, expected version 2"):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_an_out_of_order_blob_built_on_another_base_is_refused(rig):
    u = sparse_update("model.norm.weight", torch.ones(64, dtype=torch.bfloat16), torch.tensor([0]))
    writer = names.parse_blob_key(rig.blob_key(2))[2]
    blob = encode_blob([u], version=2, base_version=0, shard="tp0", writer=writer)
    _rewrite_blob(rig, rig.blob_key(2), blob, fix_manifest=True)
    with pytest.raises(BaseVersionMismatchError, match="applies on base version 0"):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_foreign_blob_for_another_shard_or_writer_is_refused(rig):
    _rewrite_blob(rig, rig.blob_key(2), rig.store.get(rig.blob_key(2, "tp1")), fix_manifest=True)
    with pytest.raises(BlobMismatchError, match="is for shard 'tp1'"):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_missing_blob_is_named_and_nothing_is_applied(rig):
    key = rig.blob_key(2)
    rig.store.delete(key)
    with pytest.raises(MissingBlobError, match=key.replace(".", r"\.")):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_manifest_copied_under_another_versions_key_is_refused(rig):
    rig.store.put(names.manifest_key(3), rig.store.get(names.manifest_key(2)))
    with pytest.raises(ManifestError, match="replayed or misplaced"):
        rig.rec.pull()
    rig.assert_untouched(1)


@pytest.mark.timeout(60)
def test_a_stale_latest_behind_a_committed_manifest_still_reaches_the_newest_version(rig):
    rig.store.put(names.LATEST, encode_latest(1))  # the publisher died before moving LATEST
    assert rig.rec.pull().version == 2
    assert_same_bits(rig.rec.tensors, rig.states[2]["tp0"])


@pytest.mark.timeout(60)
def test_latest_naming_an_uncommitted_version_is_treated_as_absent(rig):
    rig.store.put(names.LATEST, encode_latest(9))  # restored out of order, or a stray write
    assert rig.rec.pull().version == 2
    assert_same_bits(rig.rec.tensors, rig.states[2]["tp0"])


@pytest.mark.timeout(60)
def test_a_store_that_regressed_below_the_receiver_restores_its_newest_anchor(rig):
    rig.rec.pull()
    for key in rig.store.list("v00000002/"):
        rig.store.delete(key)
    rig.store.put(names.LATEST, encode_latest(1))
    report = rig.rec.pull()  # its v2 is on no chain of the store any more
    assert report.version == 1 and report.chain == (0, 1) and report.from_anchor
    assert_same_bits(rig.rec.tensors, rig.states[1]["tp0"])


@pytest.mark.timeout(60)
def test_a_keyed_receiver_is_not_rolled_back_by_deleting_its_runs_newest_manifests(tmp_path):
    # Deleting needs no key: deleting version 2's manifest made a receiver with the key
    # re-apply 0 -> 1 and report version 1 (any older signed version, deleting more).
    r = Rig(tmp_path, key=KEY)
    for v in range(3):
        r.publish(v)
    assert r.rec.pull().version == 2
    r.store.delete(names.manifest_key(2))
    r.store.put(names.LATEST, encode_latest(1))
    for _ in range(2):
        with pytest.raises(VersionError, match=r"holds version 2 of run .* now 1: .* It keeps"):
            r.rec.pull()
        r.assert_untouched(2)
    r.publish(3)  # the trainer's next version: a delta on the version it holds
    report = r.rec.pull()
    assert report.version == 3 and report.chain == (3,)
    assert_same_bits(r.rec.tensors, r.states[3]["tp0"])
    r.store.delete(names.manifest_key(3))
    r.rec.invalidate("the operator rolled the store back")  # follows it back on request
    assert r.rec.pull().version == 1
    assert_same_bits(r.rec.tensors, r.states[1]["tp0"])


@pytest.mark.timeout(60)
def test_a_keyed_receiver_is_not_rolled_back_to_an_older_run_by_deleting_the_newer_one(tmp_path):
    # A publisher restarted without resume() starts a new run in the same store, signed with
    # the same key. Deleting the new run's manifests (no key needed) made the receiver follow
    # the older run down: "another run" read as a store reset.
    r = Rig(tmp_path, key=KEY)
    for v in range(3):
        r.publish(v)
    old_run = r.manifest(2).run_id
    r.pub = Publisher(
        r.store, receiver_layout=r.rl, config=PublisherConfig(anchor_every=100, signing_key=KEY)
    )
    r.sync = TrainerSync(SnapshotTracker(r.trainer.named_parameters()), r.pub, r.trainer.params)
    r.publish(3), r.publish(4)
    new_run = r.manifest(4).run_id
    assert new_run != old_run and run_started_ms(new_run) > run_started_ms(old_run)
    assert r.rec.pull().version == 4
    for v in (3, 4):
        r.store.delete(names.manifest_key(v))
    r.store.delete(names.LATEST)
    with pytest.raises(VersionError, match=r"holds version 4 of run .* now 2 of run .* started"):
        r.rec.pull()
    r.assert_untouched(4)
    r.rec.invalidate("the operator rolled the store back")  # follows it back on request
    assert r.rec.pull().version == 2
    assert_same_bits(r.rec.tensors, r.states[2]["tp0"])


def test_a_new_run_starts_after_the_run_it_follows_whatever_this_clock_says():
    later = f"r{(time.time_ns() // 1_000_000) + 3_600_000:012x}-{'0' * 16}"  # an hour ahead
    fresh = new_run_id(after=later)
    assert run_started_ms(fresh) == run_started_ms(later) + 1
    assert run_started_ms(new_run_id()) <= run_started_ms(later)
    assert run_started_ms("0123456789abcdef") is None  # a run id of the releases before
    assert new_run_id(after="0123456789abcdef") != new_run_id(after="0123456789abcdef")


@pytest.mark.timeout(60)
def test_a_wrong_shard_digest_is_refused_before_any_write_and_never_reports_the_version(rig):
    m = rig.manifest(2)
    rig.put_manifest(dataclasses.replace(m, shard_digests={**m.shard_digests, "tp0": "0" * 32}))
    with pytest.raises(IntegrityError, match="Refused before any write: the tensors still hold"):
        rig.rec.pull()
    rig.assert_untouched(1)
    assert not rig.store.list(names.acks_prefix(2))
    # a later anchor (the trainer carries on) is applied: the tensors were never wrong
    rig.trainer.step()
    rig.sync.step_published(3, anchor=True)
    report = rig.rec.pull()
    assert report.chain == (3,) and report.from_anchor and not rig.rec.dirty
    assert_same_bits(rig.rec.tensors, expected_shards(rig.trainer.params, rig.tl, rig.rl)["tp0"])


@pytest.mark.timeout(60)
def test_a_receiver_with_a_key_rejects_unsigned_forged_and_foreign_key_manifests(tmp_path):
    r = Rig(tmp_path, key=KEY)
    r.publish(0), r.publish(1)
    r.rec.pull()
    r.publish(2)
    m = r.manifest(2)
    assert m.signature is not None
    altered = dataclasses.replace(m, shard_digests={**m.shard_digests, "tp0": "0" * 32})
    cases = [
        (m.unsigned(), "unsigned"),
        (altered, "does not verify"),
        (sign(m.unsigned(), b"x" * 32), "does not verify"),
    ]
    for forged, message in cases:
        r.put_manifest(forged)
        with pytest.raises(SignatureError, match=message):
            r.rec.pull()
        r.assert_untouched(1)
    r.put_manifest(m)
    assert r.rec.pull().version == 2


@pytest.mark.timeout(60)
def test_a_receiver_without_the_key_of_a_signed_store_refuses_its_manifests(tmp_path):
    # it could not tell the trainer's from unsigned ones planted beside them
    r = Rig(tmp_path, key=KEY)
    r.publish(0)
    keyless = Receiver.for_layout(
        r.store, r.rl, "tp0", zero_tensors(r.rl, "tp0"), str(tmp_path / "keyless"), rconfig("k")
    )
    with pytest.raises(KeyRequiredError, match=r"is signed, and this receiver has no signing key"):
        keyless.pull()
    assert keyless.version is None and not keyless.store.list(names.acks_prefix(0))
    assert all(not t.view(torch.int16).any() for t in keyless.tensors.values())
    assert r.rec.pull().version == 0  # with the key: taken


@pytest.mark.timeout(60)
def test_two_publishers_racing_for_one_version_one_wins_the_other_gets_commit_conflict(tmp_path):
    spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    trainers = [TinyTrainer(spec, seed=s) for s in (1, 2)]
    barrier = threading.Barrier(2, timeout=10)

    def gate(op, key):  # both reach the commit before either writes its manifest
        if op == "put_if_absent" and key.endswith("MANIFEST.json"):
            barrier.wait()

    syncs = [
        TrainerSync(
            SnapshotTracker(t.named_parameters()),
            Publisher(GateStore(store, gate), receiver_layout=rl),
            t.params,
        )
        for t in trainers
    ]
    outcome: dict[int, object] = {}

    def run(i):
        try:
            outcome[i] = syncs[i].step_published(0)[0]
        except CommitConflictError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    losers = [i for i, o in outcome.items() if isinstance(o, CommitConflictError)]
    assert len(losers) == 1 and len(outcome) == 2
    (loser,) = losers
    assert "lost the race" in str(outcome[loser])
    winner = 1 - loser
    rec = Receiver.for_layout(
        store, rl, "tp1", zero_tensors(rl, "tp1"), str(tmp_path / "r"), rconfig("r")
    )
    assert rec.pull().version == 0
    assert_same_bits(rec.tensors, expected_shards(trainers[winner].params, tl, rl)["tp1"])
    # the loser's blobs are orphans no manifest lists; gc removes them
    loser_writer = syncs[loser].publishers[0].writer
    assert any(loser_writer in k for k in store.list("v00000000/"))
    syncs[winner].publishers[0].gc()
    assert not any(loser_writer in k for k in store.list("v00000000/"))
    assert syncs[loser].baseline is None, "the loser's tracker baseline did not advance"
