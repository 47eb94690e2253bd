"""Lineage: a version is known by its run id and base digest as well as its number. A store
that lost its history (wiped, restored from an older copy) and a trainer restarted from a
checkpoint with different data never make a receiver treat a new v5 as its old v5, or scatter
a new v6 onto its old v5; a restarted publisher continues with a delta only on a baseline it
verified against the store, and publishes an anchor of a new lineage otherwise."""

from __future__ import annotations

import copy
import shutil
import uuid

import pytest
from truth_kit import Rig, Trainer, wipe

from deltasync import LocalStore, names
from deltasync.commit import Catalog
from deltasync.commit.catalog import wait_for_acks
from deltasync.errors import AckTimeoutError


@pytest.fixture
def rig(tmp_path):
    return Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)


@pytest.fixture(params=["local", "s3"])
def any_rig(request, tmp_path):
    if request.param == "local":
        return Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    s3 = request.getfixturevalue("s3_session_store")
    return Rig(s3.with_prefix(f"lineage-{uuid.uuid4().hex[:8]}"), tmp_path)


@pytest.mark.timeout(120)
def test_a_wiped_store_and_a_renumbering_trainer_with_other_data_never_fool_a_receiver(any_rig):
    rig = any_rig
    for v in range(6):
        rig.publish(v)
    rig.check(rig.rec.pull())
    assert rig.rec.version == 5
    old_run = rig.rec.run_id
    wipe(rig.store)
    # the trainer restarts from an older checkpoint (other data) and renumbers from 4
    rig.trainer = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=11)
    first = rig.trainer.publish(4, rig.oracle, step=False)
    assert first.kind == "anchor"
    rig.trainer.publish(5, rig.oracle)
    report = rig.rec.pull()  # the new v5 is not the old v5
    assert report.chain == (4, 5) and report.from_anchor and report.run_id != old_run
    rig.check(report)
    rig.trainer.publish(6, rig.oracle)
    report = rig.rec.pull()
    assert report.chain == (6,) and not report.from_anchor
    rig.check(report)


@pytest.mark.timeout(90)
def test_a_new_v6_is_never_scattered_onto_the_old_v5(rig, tmp_path):
    for v in range(6):
        rig.publish(v)
    rig.check(rig.rec.pull())
    wipe(rig.store)
    rig.trainer = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=12)
    for v in (4, 5, 6):
        rig.trainer.publish(v, rig.oracle, step=v > 4)
    report = rig.rec.pull()
    assert report.chain == (4, 5, 6) and report.from_anchor
    rig.check(report)


@pytest.mark.timeout(90)
def test_a_store_restored_from_an_older_copy_is_followed_back_to_its_anchor(rig, tmp_path):
    for v in range(3):
        rig.publish(v)
    store_copy = tmp_path / "store-at-v2"
    shutil.copytree(tmp_path / "store", store_copy)
    checkpoint = copy.deepcopy(rig.trainer.model)  # the trainer's checkpoint at v2
    for v in range(3, 6):
        rig.publish(v)
    rig.check(rig.rec.pull())
    assert rig.rec.version == 5
    shutil.rmtree(tmp_path / "store")
    shutil.copytree(store_copy, tmp_path / "store")
    # the trainer restarts from its v2 checkpoint, and its data now differs
    checkpoint.gen.manual_seed(999)
    restarted = Trainer(rig.store, rig.rl, rig.tl, rig.spec, model=checkpoint)
    assert restarted.sync.resume(2) and restarted.sync.next_version() == 3
    assert restarted.publish(3, rig.oracle).kind == "delta"
    report = rig.rec.pull()  # held v5 is not on the restored chain: back to its anchor
    assert report.chain == (0, 1, 2, 3) and report.from_anchor
    rig.check(report)


@pytest.mark.parametrize("left", ["registration and acks", "acks"])
@pytest.mark.timeout(120)
def test_a_checkpoint_resumed_where_the_runs_later_versions_were_lost_starts_a_new_run(
    tmp_path, left
):
    # Only the version keys were restored from an older copy: the receiver's registration
    # (version 4 of the run) and its acks of 3 and 4 stayed. Continuing the run from 2 would
    # give 3 and 4 to other states under the same run id: a trainer would count the receiver
    # at the old 4 as holding the new 3.
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    for v in range(3):
        rig.publish(v)
        rig.check(rig.rec.pull())
    checkpoint = copy.deepcopy(rig.trainer.model)
    for v in range(3, 5):
        rig.publish(v)
        rig.check(rig.rec.pull())
    run = rig.trainer.pub.run_id
    for v in (3, 4):
        for key in rig.store.list(names.version_prefix(v)):
            rig.store.delete(key)
    rig.store.delete("LATEST")
    if left == "acks":
        rig.rec.deregister()
    restarted = Trainer(rig.store, rig.rl, rig.tl, rig.spec, model=checkpoint)
    assert not restarted.sync.resume(2) and restarted.sync.next_version() == 3
    report = restarted.publish(3, rig.oracle)
    assert report.kind == "anchor" and restarted.pub.run_id != run
    with pytest.raises(AckTimeoutError, match="rec"):
        wait_for_acks(Catalog(rig.store), 3, ["rec"], timeout_s=0.3, poll_s=0.02)
    report = rig.rec.pull()
    assert report.chain == (3,) and report.from_anchor
    rig.check(report)


@pytest.mark.timeout(90)
def test_a_checkpoint_resumed_behind_versions_the_store_still_holds_is_verified(tmp_path):
    # The ordinary restart: the trainer committed 3 and 4 after its checkpoint at 2 and died;
    # a receiver is registered at 4. resume(2) said False ("restored from an older copy")
    # although the store holds 3 and 4. It is True; the next version is an anchor (a new
    # lineage: its base is not 2), and the receiver takes it exactly.
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    for v in range(3):
        rig.publish(v)
    checkpoint = copy.deepcopy(rig.trainer.model)
    for v in range(3, 5):
        rig.publish(v)
    rig.check(rig.rec.pull())
    assert Catalog(rig.store).receivers()["rec"].version == 4
    restarted = Trainer(rig.store, rig.rl, rig.tl, rig.spec, model=checkpoint)
    assert restarted.sync.resume(2) and restarted.sync.next_version() == 5
    report = restarted.publish(5, rig.oracle)
    assert report.kind == "anchor"
    pulled = rig.rec.pull()
    assert pulled.chain == (5,) and pulled.from_anchor
    rig.check(pulled)


@pytest.mark.timeout(90)
def test_a_restarted_publisher_continues_with_a_delta_only_after_resume_verified_its_baseline(rig):
    for v in range(3):
        rig.publish(v)
    rig.check(rig.rec.pull())
    run = rig.trainer.pub.run_id
    model = rig.trainer.model
    # restart: a new publisher and tracker on the same (checkpointed) params
    restarted = Trainer.__new__(Trainer)
    restarted.tl, restarted.rl, restarted.model = rig.tl, rig.rl, model
    from deltasync import Publisher, PublisherConfig, TrainerSync
    from deltasync.trainer import SnapshotTracker

    restarted.pub = Publisher(
        rig.store, receiver_layout=rig.rl, config=PublisherConfig(anchor_every=100)
    )
    restarted.sync = TrainerSync(
        SnapshotTracker(model.named_parameters()), restarted.pub, model.params
    )
    assert restarted.sync.resume(2)
    assert restarted.sync.next_version() == 3
    report = restarted.publish(3, rig.oracle)
    assert report.kind == "delta" and restarted.pub.run_id == run
    rep = rig.rec.pull()
    assert rep.chain == (3,)
    rig.check(rep)
    rig.trainer = restarted


@pytest.mark.timeout(90)
def test_a_publisher_restarted_from_a_checkpoint_with_other_data_publishes_a_new_lineage(rig):
    for v in range(3):
        rig.publish(v)
    rig.check(rig.rec.pull())
    run = rig.trainer.pub.run_id
    other = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=5)  # not the stored v2
    assert not other.sync.resume(2)
    report = other.publish(other.sync.next_version(), rig.oracle)
    assert report.kind == "anchor" and other.pub.run_id != run
    rep = rig.rec.pull()
    assert rep.chain == (3,) and rep.from_anchor
    rig.check(rep)
    # without resume(), a restarted publisher never risks a delta on a foreign base either
    fresh = Trainer(rig.store, rig.rl, rig.tl, rig.spec, seed=5)
    fresh.sync.baseline = 3
    assert fresh.publish(4, rig.oracle).kind == "anchor"
    rig.check(rig.rec.pull())


@pytest.mark.timeout(90)
def test_a_publisher_resuming_on_a_damaged_manifest_publishes_an_anchor_instead_of_raising(rig):
    from deltasync import names

    for v in range(3):
        rig.publish(v)
    rig.check(rig.rec.pull())
    key = names.manifest_key(2)
    good = rig.store.get(key)
    rig.store.put(key, good[: len(good) // 2])  # a torn or tampered copy of v2's manifest
    restarted = Trainer(rig.store, rig.rl, rig.tl, rig.spec, model=rig.trainer.model)
    assert not restarted.sync.resume(2)
    report = restarted.publish(restarted.sync.next_version(), rig.oracle)
    assert report.kind == "anchor"
    # the report says why: not "requested", which nobody did
    assert "manifest is unreadable" in report.anchor_reason and key in report.anchor_reason
    rig.check(rig.rec.pull())
