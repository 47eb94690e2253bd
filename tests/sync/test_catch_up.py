"""Lagging receivers: catching up through the delta chain and through an anchor; retention
that never deletes what a live receiver needs; joint commit (acks) and bounded staleness."""

from __future__ import annotations

import time

import pytest

from deltasync import names
from deltasync.commit import ReceiverRecord
from deltasync.publish import (
    AckTimeoutError,
    Publisher,
    PublisherConfig,
    StalenessTimeoutError,
    TrainerSync,
)
from deltasync.receiver import Receiver
from deltasync.trainer import AdamWTracker

from sync_kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    scratch_store,
    zero_tensors,
)


class Rig:
    def __init__(self, tmp_path, **pub_config):
        self.spec, self.tl, self.rl = layouts()
        self.store = scratch_store(tmp_path / "store")
        self.trainer = TinyTrainer(self.spec)
        tracker = AdamWTracker(self.trainer.opt, self.trainer.named_parameters())
        config = PublisherConfig(**pub_config)
        self.pub = Publisher(self.store, receiver_layout=self.rl, config=config)
        self.sync = TrainerSync(tracker, self.pub, self.trainer.params)
        self.tmp = tmp_path
        self.states = {}

    def receiver(self, rid, shard="tp0"):
        return Receiver.for_layout(
            self.store,
            self.rl,
            shard,
            zero_tensors(self.rl, shard),
            str(self.tmp / rid),
            rconfig(rid),
        )

    def publish(self, version):
        if version:
            self.trainer.step()
        report = self.sync.step_published(version)[0]
        self.states[version] = expected_shards(self.trainer.params, self.tl, self.rl)
        return report


@pytest.mark.timeout(60)
def test_a_receiver_seven_versions_behind_catches_up_through_the_delta_chain(tmp_path):
    rig = Rig(tmp_path, anchor_every=100)
    lagging, follower = rig.receiver("lag"), rig.receiver("follow")
    for v in range(11):
        rig.publish(v)
        follower.pull()
        if v == 3:
            assert lagging.pull().version == 3
    report = lagging.pull()
    assert report.chain == (4, 5, 6, 7, 8, 9, 10) and not report.from_anchor
    assert report.previous_version == 3 and report.version == 10
    assert_same_bits(lagging.tensors, rig.states[10]["tp0"])
    assert report.pause_s > 0 and report.total_s > report.pause_s
    # folding the chain writes each element once, never more than the seven deltas sent
    assert report.elements_written > 0


@pytest.mark.timeout(60)
def test_a_receiver_seven_versions_behind_catches_up_through_an_anchor(tmp_path):
    rig = Rig(tmp_path, anchor_every=8)
    lagging = rig.receiver("lag", "tp1")
    for v in range(10):
        rig.publish(v)
        if v == 2:
            lagging.pull()
    report = lagging.pull()
    assert report.chain == (8, 9) and report.from_anchor
    assert_same_bits(lagging.tensors, rig.states[9]["tp1"])


@pytest.mark.timeout(60)
def test_gc_keeps_every_version_a_live_receiver_still_needs_and_drops_the_rest(tmp_path):
    rig = Rig(tmp_path, anchor_every=4, keep_versions=1)
    lagging, follower = rig.receiver("lag"), rig.receiver("follow")
    for v in range(8):
        rig.publish(v)
        follower.pull()
        if v == 2:
            lagging.pull()
        rig.pub.gc()
    kept = rig.pub.catalog.versions()
    assert kept == [3, 4, 5, 6, 7], "the lagging receiver holds 2: everything after it stays"
    assert lagging.pull().chain == (4, 5, 6, 7)  # the anchor on the way comes first
    assert_same_bits(lagging.tensors, rig.states[7]["tp0"])
    rig.pub.gc()
    assert rig.pub.catalog.versions() == [4, 5, 6, 7], "a fresh receiver needs anchor 4 and on"
    # a fresh receiver can still start: an anchor is published on demand, older versions go
    rig.trainer.step()
    rig.sync.step_published(8, anchor=True)
    rig.states[8] = expected_shards(rig.trainer.params, rig.tl, rig.rl)
    lagging.pull(), follower.pull()
    rig.pub.gc()
    assert rig.pub.catalog.versions() == [8]
    fresh = rig.receiver("fresh", "tp1")
    assert fresh.pull().chain == (8,)
    assert_same_bits(fresh.tensors, rig.states[8]["tp1"])


@pytest.mark.timeout(60)
def test_a_dead_receivers_versions_are_collected_and_it_recovers_from_the_newest_anchor(tmp_path):
    rig = Rig(tmp_path, anchor_every=5, keep_versions=1, receiver_ttl_s=0.5)
    dead = rig.receiver("dead")
    rig.publish(0)
    dead.pull()
    time.sleep(0.6)  # its heartbeat expires: retention no longer waits for it
    for v in range(1, 8):
        rig.publish(v)
        rig.pub.gc()
    assert rig.pub.catalog.versions() == [5, 6, 7]
    report = dead.pull()
    assert report.chain == (5, 6, 7) and report.from_anchor
    assert_same_bits(dead.tensors, rig.states[7]["tp0"])


@pytest.mark.timeout(60)
def test_wait_for_acks_returns_once_all_named_receivers_hold_the_version_else_names_them(tmp_path):
    rig = Rig(tmp_path)
    a, b = rig.receiver("a"), rig.receiver("b", "tp1")
    rig.publish(0)
    a.pull()
    with pytest.raises(AckTimeoutError, match=r"\['b'\]"):
        rig.pub.wait_for_acks(0, ["a", "b"], timeout=0.2)
    b.pull()
    acks = rig.pub.wait_for_acks(0, ["a", "b"], timeout=2)
    assert {r: ack.shard for r, ack in acks.items()} == {"a": "tp0", "b": "tp1"}
    # a receiver that jumped over a version through a chain counts as holding it
    rig.publish(1), rig.publish(2)
    a.pull()
    assert rig.pub.wait_for_acks(1, ["a"], timeout=2) == {"a": None}


@pytest.mark.timeout(60)
def test_bounded_staleness_blocks_publishing_while_a_live_receiver_lags_too_far(tmp_path):
    rig = Rig(tmp_path, max_staleness=1, staleness_timeout_s=0.3)
    slow = rig.receiver("slow")
    rig.publish(0)
    rig.publish(1)  # slow holds nothing (-1): 0 - (-1) = 1 <= 1
    with pytest.raises(StalenessTimeoutError, match="slow"):
        rig.publish(2)  # committed 1, slow behind by 2
    assert rig.pub.committed() == 1
    slow.pull()
    rig.sync.step_published(2)  # the tracker kept its bits: the retry sends everything since 1
    slow.pull()
    assert_same_bits(slow.tensors, expected_shards(rig.trainer.params, rig.tl, rig.rl)["tp0"])
    # a receiver whose heartbeat expired no longer holds the trainer back
    record = ReceiverRecord(receiver="gone", shard="tp0", version=0, updated_at=time.time() - 999)
    rig.store.put(names.receiver_key("gone"), record.to_json())
    rig.publish(3)


@pytest.mark.timeout(60)
def test_an_ack_that_lands_after_its_version_was_collected_goes_with_the_next_gc(tmp_path):
    # A receiver writes its ack beside its registration: a gc that read the registration first
    # collects the version, and the ack lands under a version nothing lists any more.
    rig = Rig(tmp_path, anchor_every=2, keep_versions=1)
    follower = rig.receiver("follow")
    for v in range(5):
        rig.publish(v)
        follower.pull()
        rig.pub.gc()
    assert rig.pub.catalog.versions() == [4]
    from deltasync.commit import AckRecord

    stray = AckRecord(
        version=1, receiver="follow", shard="tp0", state_digest="0" * 32, created_at=time.time()
    )
    rig.store.put(stray.key, stray.to_json())
    keep = rig.store.list(names.acks_prefix(4))
    plan = rig.pub.gc()
    assert stray.key in plan.keys and not rig.store.exists(stray.key)
    assert rig.store.list("acks/") == keep  # the kept version's acks stay


def _retention_after_a_newer_anchor(rig) -> None:
    """Versions 2 and 3 deleted, as retention deletes them once anchor 4 (and 5) committed."""
    for v in (0, 1, 2, 3):
        for key in rig.store.list(f"v{v:08d}/"):
            rig.store.delete(key)


@pytest.mark.timeout(60)
def test_a_chain_deleted_after_the_head_was_read_is_taken_from_the_newer_anchor(
    tmp_path, monkeypatch
):
    # The receiver read head 3, then retention deleted 2 and 3 (a newer anchor 4 and 5 had
    # committed): the walk back from 3 found a gap and the pull raised VersionError asking
    # for an anchor that was already there.
    rig = Rig(tmp_path, anchor_every=100)
    rx = rig.receiver("rx")
    for v in range(4):
        rig.publish(v)
        if v == 1:
            assert rx.pull().version == 1
    stale = rx.catalog.head()
    assert stale.version == 3
    rig.trainer.step()
    rig.sync.step_published(4, anchor=True)
    rig.publish(5)
    _retention_after_a_newer_anchor(rig)
    head = type(rx.catalog).head
    calls = []

    def first_stale(catalog, *args, **kwargs):
        calls.append(1)
        return stale if len(calls) == 1 else head(catalog, *args, **kwargs)

    monkeypatch.setattr(type(rx.catalog), "head", first_stale)
    report = rx.pull()
    assert report.version == 5 and report.from_anchor and report.chain == (4, 5)
    assert_same_bits(rx.tensors, rig.states[5]["tp0"])


@pytest.mark.timeout(60)
def test_a_head_manifest_deleted_after_latest_was_read_is_followed_by_the_newest(
    tmp_path, monkeypatch
):
    rig = Rig(tmp_path, anchor_every=100)
    for v in range(4):
        rig.publish(v)
    rig.trainer.step()
    rig.sync.step_published(4, anchor=True)
    rig.publish(5)
    catalog = rig.receiver("rx").catalog
    _retention_after_a_newer_anchor(rig)
    latest = type(catalog).latest
    answers = iter([3])  # LATEST read while 3 was the newest; then the store as it is

    def first_stale(cat, *args, **kwargs):
        return next(answers, None) or latest(cat, *args, **kwargs)

    monkeypatch.setattr(type(catalog), "latest", first_stale)
    assert catalog.head().version == 5
