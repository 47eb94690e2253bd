"""An S3 store whose listing lags behind its writes (an eventually consistent S3-compatible
store): a version whose manifest the listing does not show yet is not taken for an abandoned
attempt, so gc never deletes the blobs of a committed version, and a publisher starting then
does not lower LATEST."""

from __future__ import annotations

import pytest

from deltasync import names
from deltasync.errors import StoreError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    zero_tensors,
)


class LaggingListing:
    """A store whose ``list`` answers from a snapshot taken by ``freeze()`` (until ``thaw``),
    as a lagging index would; reads and writes of keys go through."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.frozen: list[str] | None = None
        self.freeze_before_commit = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, prefix=""):
        if self.frozen is None:
            return self.inner.list(prefix)
        return [k for k in self.frozen if k.startswith(prefix)]

    def put_if_absent(self, key, data):
        if self.freeze_before_commit:  # blobs and marker are stored, the manifest is next
            self.freeze_before_commit = False
            self.frozen = self.inner.list("")
        return self.inner.put_if_absent(key, data)


@pytest.mark.timeout(60)
def test_gc_on_a_lagging_listing_keeps_the_blobs_of_a_version_committed_meanwhile(
    s3_store, tmp_path
):
    spec, tl, rl = layouts()
    store = LaggingListing(s3_store)
    trainer = TinyTrainer(spec)
    config = PublisherConfig(anchor_every=100, keep_versions=1)
    pub = Publisher(store, receiver_layout=rl, config=config)
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    rec = Receiver.for_layout(
        s3_store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    sync.step_published(0)
    trainer.step()
    sync.step_published(1)
    assert rec.pull().version == 1
    store.freeze_before_commit = True
    trainer.step()
    sync.step_published(2)
    trainer.step()
    sync.step_published(3)
    assert names.manifest_key(2) not in store.list("v")  # the listing has not caught up
    pub.gc()
    blobs = [b.key for b in pub.catalog.manifest(2, fresh=True).blobs]
    assert blobs and all(s3_store.exists(k) for k in blobs), "a committed version lost blobs"
    assert rec.pull().chain == (2, 3)
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp0"])


def _committed_past_the_listing(store, spec, rl, version: int):
    """A trainer and its publisher that committed version 0, then ``version`` with the listing
    frozen before its manifest (it shows version 0's only)."""
    trainer = TinyTrainer(spec)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    sync.step_published(0)
    trainer.step()
    store.freeze_before_commit = True
    sync.step_published(version)
    return trainer, pub


@pytest.mark.timeout(60)
def test_a_publisher_started_on_a_lagging_listing_keeps_latest(s3_store, tmp_path):
    spec, tl, rl = layouts()
    store = LaggingListing(s3_store)
    trainer, pub = _committed_past_the_listing(store, spec, rl, 1)
    assert names.manifest_key(1) not in store.list("v")
    restarted = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    assert restarted.committed() == 1
    assert pub.catalog.read_latest() == 1, "a lagging listing lowered LATEST"
    rec = Receiver.for_layout(
        s3_store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    assert rec.pull().version == 1
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp0"])


@pytest.mark.timeout(60)
def test_a_receiver_does_not_go_back_on_a_lagging_listing_and_an_unreadable_latest(
    s3_store, tmp_path
):
    spec, tl, rl = layouts()
    store = LaggingListing(s3_store)
    trainer = TinyTrainer(spec)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    rec = Receiver.for_layout(
        store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    sync.step_published(0)
    trainer.step()
    store.freeze_before_commit = True  # the listing will show version 0's manifest only
    sync.step_published(1)
    assert rec.pull().version == 1
    s3_store.put(names.LATEST, b"\xff not a LATEST record")  # unreadable: treated as absent
    assert rec.catalog.head().version == 0  # the store's view lags behind the receiver
    report = rec.pull()
    assert report.version == 1 and report.chain == (), "the receiver went back to version 0"
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp0"])


class _LatestUnreadable(LaggingListing):
    """A lagging listing whose reads of LATEST fail (a timed-out GET) while ``failing``."""

    failing = False

    def get(self, key, **kwargs):
        if self.failing and key == names.LATEST:
            raise StoreError(f"injected: the read of {key!r} timed out")
        return self.inner.get(key, **kwargs)


@pytest.mark.timeout(60)
def test_a_publisher_started_while_latest_cannot_be_read_does_not_lower_it(s3_store):
    # Unknown is not absent: with LATEST unreadable and the listing behind, the listing's
    # newest is below the committed version 2 (number 1 never committed): LATEST stays
    spec, _, rl = layouts()
    store = _LatestUnreadable(s3_store)
    _, pub = _committed_past_the_listing(store, spec, rl, 2)  # 1 retired (failed)
    assert pub.catalog.read_latest() == 2
    store.failing = True
    Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    store.failing = False
    assert pub.catalog.read_latest() == 2, "LATEST was lowered below a committed version"
    restarted = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    assert restarted.committed() == 2 and restarted.next_version() == 3
