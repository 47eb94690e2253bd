"""``LATEST`` self-repair, caches that follow verification and errors that name the file:
a dangling ``LATEST`` is treated as absent (publisher and receivers carry on, the publisher's
repair lowers it), a damaged then repaired manifest heals on the next pull, and parse or
repair errors name the key, the version and the journaled versions."""

from __future__ import annotations

import pytest
from truth_kit import Rig, assert_same_bits, snapshot, wipe

from deltasync import LocalStore, Publisher, names
from deltasync.commit import decode_latest, encode_latest
from deltasync.errors import ManifestError, TruncatedBlobError, VersionError


@pytest.fixture
def rig(tmp_path):
    r = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    r.publish(0)
    r.publish(1)
    return r


@pytest.mark.timeout(60)
def test_a_dangling_latest_wedges_neither_the_publisher_nor_the_receivers(rig):
    rig.store.put(names.LATEST, encode_latest(9))  # a store restored out of order
    assert rig.trainer.pub.committed() == 1
    report = rig.rec.pull()
    assert report.version == 1
    rig.check(report)
    restarted = Publisher(rig.store, receiver_layout=rig.rl)  # its repair lowers LATEST
    assert decode_latest(rig.store.get(names.LATEST)) == 1
    assert restarted.committed() == 1
    rig.store.put(names.LATEST, encode_latest(9))
    rig.publish(2)  # the running publisher carries on
    assert decode_latest(rig.store.get(names.LATEST)) == 2
    rig.check(rig.rec.pull())


@pytest.mark.timeout(60)
def test_a_damaged_then_repaired_manifest_heals_on_the_next_pull(rig):
    rig.check(rig.rec.pull())
    rig.publish(2)
    key = names.manifest_key(2)
    good = rig.store.get(key)
    rig.store.put(key, good[: len(good) // 2])
    with pytest.raises(ManifestError) as err:
        rig.rec.pull()
    assert key in str(err.value) and "version 2" in str(err.value)
    assert rig.rec.version == 1
    rig.store.put(key, good)
    rig.check(rig.rec.pull())


@pytest.mark.timeout(60)
def test_a_damaged_blob_repaired_in_the_store_heals_on_the_next_pull(rig):
    rig.check(rig.rec.pull())
    rig.publish(2)
    (blob,) = [k for k in rig.store.list("v00000002/tp0/")]
    good = rig.store.get(blob)
    rig.store.put(blob, good[:-3])
    with pytest.raises(TruncatedBlobError, match=blob):
        rig.rec.pull()
    rig.store.put(blob, good)
    rig.check(rig.rec.pull())


class Crash(Exception):
    pass


@pytest.mark.timeout(60)
def test_a_repair_whose_journal_cannot_be_replayed_lists_the_journaled_versions(rig):
    def crash(name):
        raise Crash(name)

    rig.rec = rig.receiver(on_tensor_written=crash)
    with pytest.raises(Crash):
        rig.rec.pull()
    wipe(rig.store)
    with pytest.raises(VersionError, match=r"journaled versions \[0, 1\]"):
        rig.receiver()


@pytest.mark.timeout(60)
def test_a_garbage_latest_is_treated_as_absent_and_overwritten_by_the_next_commit(rig):
    rig.store.put(names.LATEST, b"\xff not json")
    report = rig.rec.pull()
    assert report.version == 1
    rig.check(report)
    rig.publish(2)
    assert decode_latest(rig.store.get(names.LATEST)) == 2
    rig.check(rig.rec.pull())


def test_a_pull_to_a_given_version_takes_exactly_it_or_refuses_before_any_write(rig, tmp_path):
    for v in (2, 3):
        rig.publish(v)
    report = rig.rec.pull(version=2)  # not the newest: exactly it, as an engine asked
    assert report.version == 2
    rig.check(report)
    before = snapshot(rig.rec.tensors)
    with pytest.raises(VersionError, match="version 9 is not committed"):
        rig.rec.pull(version=9)
    with pytest.raises(VersionError, match="holds version 2, newer than the version 1"):
        rig.rec.pull(version=1)
    assert_same_bits(rig.rec.tensors, before, "refused pulls")
    assert rig.rec.version == 2
    rig.check(rig.rec.pull())  # and on to the newest
