"""A manifest write that ends without a verdict on S3: the client gave up (a timeout past the
retries), yet the server may still apply the request later. The publisher never reuses that
version number for another state, and retention (the publisher's, or ``deltasync gc`` from
outside) keeps that attempt's keys while it may still land, so a late manifest always finds the
blobs it names, and every receiver holds exactly the version it reports."""

from __future__ import annotations

import pytest

from deltasync import names
from deltasync.commit import Catalog, collect_garbage
from deltasync.errors import CommitConflictError, OutcomeUnknownError, StoreError, VersionError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import SnapshotTracker

from crash_kit import replay_version
from sync_kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    zero_tensors,
)


class LateManifest:
    """An S3 store on which the first write of one version's manifest times out on the client
    while the server holds the request: ``land()`` applies it, as a late server would; with
    ``land_before_blobs`` the next blob write of that version applies it first."""

    def __init__(self, inner, version: int) -> None:
        self.inner, self.key = inner, names.manifest_key(version)
        self.prefix = self.key.rsplit("/", 1)[0] + "/"
        self.held: bytes | None = None
        self.done = False
        self.land_before_blobs = False
        self.fail_latest = False  # the next LATEST write fails (an outage that goes on)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def land(self) -> None:
        if self.held is not None:
            self.inner.put_if_absent(self.key, self.held)
            self.held = None

    def put_if_absent(self, key, data):
        if key == self.key and not self.done:
            self.done, self.held = True, bytes(data)
            raise OutcomeUnknownError(
                f"put_if_absent {key!r}: read timed out (the request was sent)"
            )
        return self.inner.put_if_absent(key, data)

    def _before_write(self, key) -> None:
        if self.land_before_blobs and key.startswith(self.prefix) and key != self.key:
            self.land_before_blobs = False
            self.land()

    def put(self, key, data):
        if key == names.LATEST and self.fail_latest:
            self.fail_latest = False
            raise StoreError("put 'LATEST': connection reset (injected)")
        self._before_write(key)
        return self.inner.put(key, data)

    def put_stream(self, key, chunks):
        self._before_write(key)
        return self.inner.put_stream(key, chunks)


class Rig:
    """A trainer at version 1 with a receiver there, whose version 2 manifest write just
    ended without a verdict (``attempt``: the receiver shard that manifest names)."""

    def __init__(self, s3_store, tmp_path) -> None:
        spec, self.tl, self.rl = layouts()
        self.store = LateManifest(s3_store, 2)
        self.trainer = TinyTrainer(spec)
        config = PublisherConfig(anchor_every=100)
        self.pub = Publisher(self.store, receiver_layout=self.rl, config=config)
        self.sync = TrainerSync(
            SnapshotTracker(self.trainer.named_parameters()), self.pub, self.trainer.params
        )
        self.rec = Receiver.for_layout(
            s3_store,
            self.rl,
            "tp0",
            zero_tensors(self.rl, "tp0"),
            str(tmp_path / "r"),
            rconfig("r"),
        )
        self.sync.step_published(0)
        self.trainer.step()
        self.sync.step_published(1)
        assert self.rec.pull().version == 1
        self.trainer.step()
        self.attempt = self.expected()
        with pytest.raises(OutcomeUnknownError, match="timed out"):
            self.sync.step_published(2)

    def expected(self):
        return expected_shards(self.trainer.params, self.tl, self.rl)["tp0"]


@pytest.mark.timeout(90)
def test_a_manifest_that_lands_late_finds_its_own_blobs(s3_store, tmp_path):
    rig = Rig(s3_store, tmp_path)
    rig.trainer.step()  # the retry would carry another state under the same number
    rig.store.land_before_blobs = True  # the late manifest lands just as a retry's blobs would
    with pytest.raises(VersionError, match="without a verdict"):
        rig.sync.step_published(2)
    assert rig.store.held is not None, "the refused retry wrote a blob of version 2"
    rig.store.land()
    assert rig.rec.pull().version == 2
    assert_same_bits(rig.rec.tensors, rig.attempt)
    assert rig.sync.next_version() == 3
    rig.sync.step_published(3)  # its own attempt, landed: a delta on it (its params whole)
    assert (rig.pub.catalog.manifest(3).kind, rig.pub.catalog.manifest(3).base_version) == (
        "delta",
        2,
    )
    assert rig.rec.pull().version == 3
    assert_same_bits(rig.rec.tensors, rig.expected())


@pytest.mark.timeout(90)
def test_a_manifest_that_never_lands_leaves_a_gap(s3_store, tmp_path):
    rig = Rig(s3_store, tmp_path)
    rig.trainer.step()
    with pytest.raises(VersionError, match="next_version"):
        rig.sync.step_published(2)
    assert rig.sync.next_version() == 3
    rig.sync.step_published(3)  # relative to version 1, the changes of the failed attempt kept
    assert rig.pub.catalog.manifest(3).base_version == 1
    assert rig.rec.pull().version == 3
    assert_same_bits(rig.rec.tensors, rig.expected())
    assert not s3_store.exists(names.manifest_key(2))
    held = sorted(s3_store.list(names.version_prefix(2)))
    assert held, "version 2's attempt stored its blobs and marker"
    rig.pub.gc()  # the manifest may still land and name them: kept
    assert sorted(s3_store.list(names.version_prefix(2))) == held


@pytest.mark.timeout(90)
def test_gc_from_outside_keeps_the_blobs_a_late_manifest_names(s3_store, tmp_path):
    rig = Rig(s3_store, tmp_path)
    rig.trainer.step()
    rig.sync.step_published(3)  # a gap at 2; its manifest is still in flight
    held = sorted(s3_store.list(names.version_prefix(2)))
    catalog = Catalog(s3_store)
    # `deltasync gc` from another host knows nothing of the publisher's lost reply: the
    # attempt's age, from the server's clock, is what keeps it
    plan = collect_garbage(s3_store, catalog, keep_versions=2, receiver_ttl_s=120.0)
    assert plan.deferred == (2,) and not set(held) & set(plan.keys)
    assert sorted(s3_store.list(names.version_prefix(2))) == held
    without_grace = collect_garbage(
        s3_store, catalog, keep_versions=2, receiver_ttl_s=120.0, orphan_grace_s=0, dry_run=True
    )
    assert set(held) <= set(without_grace.keys)  # what the grace saved

    rig.store.land()  # the late manifest names blobs that are all still there
    assert_same_bits(replay_version(s3_store, "tp0", 2), rig.attempt)


def test_an_attempt_is_kept_on_a_store_that_cannot_say_when_it_was_written():
    store = MemoryStore()
    blind = Blind(store)
    spec, _, rl = layouts()
    trainer = TinyTrainer(spec)
    sync = TrainerSync(
        SnapshotTracker(trainer.named_parameters()),
        Publisher(store, receiver_layout=rl),
        trainer.params,
    )
    sync.step_published(0)
    attempt = names.blob_key(1, "tp0", "w00000-lost")
    store.put(attempt, b"blob")
    trainer.step()
    sync.step_published(2)
    plan = collect_garbage(blind, Catalog(blind), keep_versions=1, receiver_ttl_s=120.0)
    assert plan.deferred == (1,) and store.exists(attempt)
    plan = collect_garbage(
        blind, Catalog(blind), keep_versions=1, receiver_ttl_s=120.0, orphan_grace_s=0
    )
    assert attempt in plan.keys and not store.exists(attempt)


class Blind:
    """A store without ``modified`` (a user's own backend)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        if name == "modified":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.timeout(90)
def test_a_late_manifest_already_in_the_store_is_compared_not_overwritten(s3_store, tmp_path):
    rig = Rig(s3_store, tmp_path)
    rig.store.land()
    rig.trainer.step()
    with pytest.raises(CommitConflictError, match="different state"):
        rig.sync.step_published(2)  # its number holds another state: refused, nothing written
    assert rig.rec.pull().version == 2
    assert_same_bits(rig.rec.tensors, rig.attempt)


@pytest.mark.timeout(90)
def test_a_committed_version_behind_a_gap_and_a_stale_latest_is_never_overwritten(
    s3_store, tmp_path
):
    rig = Rig(s3_store, tmp_path)  # version 2's manifest never lands: a gap
    rig.trainer.step()
    rig.store.fail_latest = True
    rig.sync.step_published(3)  # committed; LATEST still names 1, and 2 has no manifest
    assert rig.pub.catalog.read_latest() == 1 and rig.pub.committed() == 1
    assert rig.sync.next_version() == 4, "the number of a version this publisher committed"
    blobs = {b.key: s3_store.get(b.key) for b in rig.pub.catalog.manifest(3).blobs}
    rig.trainer.step()
    with pytest.raises(CommitConflictError, match="already committed"):
        rig.sync.step_published(3)  # asked for anyway: compared, nothing written
    assert {k: s3_store.get(k) for k in blobs} == blobs
    rig.sync.step_published(4)
    assert rig.rec.pull().version == 4
    assert_same_bits(rig.rec.tensors, rig.expected())


class LostReply:
    """A store on which the manifest write of ``version`` lands, and then its reply is lost
    (``OutcomeUnknownError`` as S3Store raises for a timed-out conditional PUT); with
    ``lands=False`` it is lost before it lands and never does."""

    def __init__(self, inner, version: int, *, lands: bool) -> None:
        self.inner, self.key, self.lands = inner, names.manifest_key(version), lands

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key != self.key:
            return self.inner.put_if_absent(key, data)
        self.key = None
        if self.lands:
            self.inner.put_if_absent(key, data)
        raise OutcomeUnknownError(f"injected: the reply to the PUT of {key!r} was lost")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lands", [True, False])
def test_a_manifest_write_without_a_verdict_is_read_back_before_it_is_called_failed(
    tmp_path, lands
):
    # It landed, yet TrainerSync said "version 1 did not commit" and kept its baseline at 0,
    # so the restart recipe (checkpoint the baseline) lost the lineage.
    from deltasync import LocalStore
    from deltasync.errors import PublishFailedError
    from deltasync.trainer import AdamWTracker

    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec)
    inner = LocalStore(tmp_path / "store", durable=False)
    pub = Publisher(LostReply(inner, 1, lands=lands), receiver_layout=rl)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    sync = TrainerSync(tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt)
    sync.step_published(0)
    sync.wait()
    trainer.step()
    sync.step_published(1, anchor=True)  # on the publish thread: the failure is raised later
    rec = Receiver.for_layout(
        inner, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    if lands:
        assert sync.wait() is not None and sync.baseline == 1
        assert rec.pull().version == 1
        assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp0"])
        return
    with pytest.raises(PublishFailedError, match="no verdict on its manifest write") as info:
        sync.wait()
    assert info.value.committed is None and info.value.version == 1
    assert isinstance(info.value.__cause__, OutcomeUnknownError)
    assert sync.baseline == 0 and sync.next_version() == 2
    trainer.step()
    sync.step_published(2)
    sync.wait()
    assert rec.pull().version == 2
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp0"])
