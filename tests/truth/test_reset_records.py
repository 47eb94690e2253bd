"""After a store reset the version numbers repeat with other states. A receiver that still
holds the old lineage's version writes nothing the new lineage reads as its own: no ack of a
version whose digest it does not hold, and a registration naming its lineage, which the
trainer's ack wait, its bounded staleness and its retention all read as "nothing of mine".
Once the receiver has pulled the new lineage, every one of them counts it again."""

from __future__ import annotations

import pytest
import torch
from truth_kit import FailingPuts, Rig, Trainer, wipe

from deltasync import LocalStore
from deltasync.commit import Catalog
from deltasync.commit.catalog import wait_for_acks, wait_for_staleness
from deltasync.errors import AckTimeoutError, IntegrityError, StalenessTimeoutError

WAIT = dict(timeout_s=0.3, poll_s=0.02)


@pytest.fixture
def rig(tmp_path):
    return Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)


def _new_lineage(rig, versions: int) -> str:
    """Publish ``versions`` versions of a new lineage (other data) on the wiped store."""
    rig.trainer = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=7)
    for v in range(versions):
        rig.trainer.publish(v, rig.oracle, step=v > 0)
    return rig.trainer.pub.run_id


def _holds_old_v4(rig) -> str:
    for v in range(5):
        rig.publish(v)
    report = rig.rec.pull()
    rig.check(report)
    assert report.version == 4
    return report.run_id


@pytest.mark.timeout(60)
def test_a_receiver_restarted_after_a_reset_acks_nothing_of_the_new_lineage(rig):
    old_run = _holds_old_v4(rig)
    wipe(rig.store)
    new_run = _new_lineage(rig, 5)
    catalog = Catalog(rig.store)

    restarted = rig.receiver()  # verify_on_open: its tensors hash to its old v4
    assert restarted.version == 4 and restarted.run_id == old_run
    assert catalog.acks(4) == {}  # the new v4 is another state: its ack is not owed
    record = catalog.receivers()["rec"]
    assert (record.version, record.run_id) == (4, old_run)
    assert record.version_in(new_run) is None
    for version in (4, 3):  # neither its v4 nor "v4 or later" for an earlier one
        with pytest.raises(AckTimeoutError, match="rec"):
            wait_for_acks(catalog, version, ["rec"], **WAIT)

    report = restarted.pull()
    assert report.from_anchor and report.run_id == new_run
    rig.rec = restarted
    rig.check(report)
    ack = catalog.acks(4)["rec"]
    assert ack.run_id == new_run
    assert ack.state_digest == catalog.manifest(4).shard_digests[rig.shard]
    assert wait_for_acks(catalog, 4, ["rec"], **WAIT) == {"rec": ack}
    assert wait_for_acks(catalog, 3, ["rec"], **WAIT) == {"rec": None}


@pytest.mark.timeout(60)
def test_a_registration_on_a_wiped_store_is_behind_every_version_of_the_new_lineage(rig):
    old_run = _holds_old_v4(rig)
    wipe(rig.store)
    assert rig.rec.pull().version == 4  # nothing committed yet: it still holds its v4
    catalog = Catalog(rig.store)
    assert catalog.receivers()["rec"].run_id == old_run

    _new_lineage(rig, 3)
    with pytest.raises(AckTimeoutError, match="rec"):
        wait_for_acks(catalog, 2, ["rec"], **WAIT)
    with pytest.raises(StalenessTimeoutError, match="rec"):  # holds nothing of this lineage
        wait_for_staleness(catalog, 2, max_staleness=1, ttl_s=60, **WAIT)
    # retention sees a receiver that needs the newest anchor, not one at a "v4" ahead of it
    plan = rig.trainer.pub.gc()
    assert plan.versions == ()

    rig.check(rig.rec.pull())
    assert catalog.receivers()["rec"].version_in(rig.trainer.pub.run_id) == 2
    assert wait_for_staleness(catalog, 2, max_staleness=0, ttl_s=60, **WAIT) < WAIT["timeout_s"]


@pytest.mark.timeout(60)
def test_a_receiver_that_went_dirty_is_not_counted_as_holding_what_it_acked(tmp_path):
    # It acked version 0, then drifted (a stray write found by its scrub): its registration
    # now says it holds no version, and the joint commit must not count the old ack.
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    rig.publish(0)
    rig.check(rig.rec.pull())
    next(iter(rig.rec.tensors.values())).view(-1).view(torch.int16).__ixor__(1)
    assert rig.rec.scrub() is False and rig.rec.dirty
    catalog = Catalog(rig.store)
    assert "rec" in catalog.acks(0) and catalog.receivers()["rec"].version is None
    with pytest.raises(AckTimeoutError, match=r"receivers \['rec'\]"):
        wait_for_acks(catalog, 0, ["rec"], timeout_s=0.3, poll_s=0.05)


@pytest.mark.timeout(60)
def test_an_ack_still_owed_is_dropped_when_the_receiver_goes_dirty(tmp_path):
    # Its ack of version 0 could not be written (an outage); then its tensors drifted and
    # the next pull refused version 1 at verify: the owed ack must never be written now.
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    failing = FailingPuts(store, lambda key: key.startswith("acks/"))
    rec = rig.receiver(store=failing)
    assert rec.pull().records_pending
    next(iter(rec.tensors.values())).view(-1).view(torch.int16).__ixor__(1)
    rig.publish(1)
    failing.armed = False  # the store is back
    with pytest.raises(IntegrityError):
        rec.pull()
    assert rec.dirty and "rec" not in Catalog(store).acks(0)


@pytest.mark.timeout(60)
def test_a_rerun_that_reaches_the_same_state_after_a_reset_counts_the_receiver_again(rig):
    # A deterministic re-run on the wiped store publishes the same states under a new run id:
    # the receiver's v4 is the new v4 bit for bit. Recorded under the old run, it counted as
    # holding nothing of the new one, and a bounded-staleness trainer waited for it for good.
    old_run = _holds_old_v4(rig)
    wipe(rig.store)
    rig.trainer = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=0)  # the Rig's seed
    for v in range(5):
        rig.trainer.publish(v, rig.oracle, step=v > 0)
    new_run = rig.trainer.pub.run_id
    assert new_run != old_run
    catalog = Catalog(rig.store)
    assert catalog.manifest(4).shard_digests[rig.shard] == rig.rec.state_digest
    report = rig.rec.pull()
    assert not report.changed and report.version == 4 and report.run_id == new_run
    rig.check(report)
    assert catalog.receivers()["rec"].version_in(new_run) == 4
    assert catalog.acks(4)["rec"].run_id == new_run
    assert wait_for_staleness(catalog, 4, max_staleness=0, ttl_s=60, **WAIT) < WAIT["timeout_s"]
