"""``LATEST`` self-repair, caches that follow verification and errors that name the file:
a dangling ``LATEST`` is treated as absent (publisher and receivers carry on, the publisher's
repair lowers it), a damaged then repaired manifest heals on the next pull, and parse or
repair errors name the key, the version and the journaled versions."""

from __future__ import annotations

import pytest
from truth_kit import Rig, assert_same_bits, snapshot, wipe

from deltasync import LocalStore, Publisher, names
from deltasync.commit import decode_latest, encode_latest
from deltasync.errors import (
    ManifestError,
    OutcomeUnknownError,
    StoreError,
    TruncatedBlobError,
    VersionError,
)


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


def _version_2_without_a_verdict(store, tmp_path) -> Rig:
    """Versions 0 and 1 published on ``store``; version 2's publish ends without a verdict."""
    rig = Rig(store, tmp_path)
    rig.publish(0)
    rig.publish(1)
    with pytest.raises(OutcomeUnknownError):
        rig.publish(2)
    return rig


class _Outage:
    """A store whose manifest write of version 2 ends without a verdict (never applied) and
    whose LATEST writes fail while ``latest_down`` is set."""

    def __init__(self, inner) -> None:
        self.inner, self.latest_down = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key == names.manifest_key(2):
            raise OutcomeUnknownError(f"injected: the reply to the write of {key!r} was lost")
        return self.inner.put_if_absent(key, data)

    def put(self, key, data):
        if self.latest_down and key == names.LATEST:
            raise StoreError(f"injected: put of {key!r} failed")
        return self.inner.put(key, data)


@pytest.mark.timeout(60)
def test_past_a_skipped_number_and_a_stale_latest_the_publisher_continues_on_its_own_commit(
    tmp_path,
):
    # v2 is never committed (its number is skipped), v3 commits but LATEST stays at 1: a probe
    # from LATEST stops at the gap. The publisher committed v3 itself: v4 is a delta on it in
    # the same lineage, not an anchor of a new one.
    store = _Outage(LocalStore(tmp_path / "store", durable=False))
    rig = _version_2_without_a_verdict(store, tmp_path)
    store.latest_down = True
    assert rig.trainer.sync.next_version() == 3
    assert rig.publish(3).base_version == 1
    assert decode_latest(store.get(names.LATEST)) == 1
    store.latest_down = False
    run = rig.trainer.pub.run_id
    report = rig.publish(4)
    assert (report.kind, report.base_version, rig.trainer.pub.run_id) == ("delta", 3, run)
    pulled = rig.rec.pull()
    assert pulled.version == 4 and pulled.chain[-2:] == (3, 4)
    rig.check(pulled)


class _LostReply:
    """A store whose manifest write of version 2 gets no verdict and is applied late: just
    after the publisher read the key back and found nothing (a landed one read back is
    committed at once)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.held: bytes | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key != names.manifest_key(2):
            return self.inner.put_if_absent(key, data)
        self.held = bytes(data)
        raise OutcomeUnknownError(f"injected: the reply to the write of {key!r} was lost")

    def get(self, key, **kwargs):
        try:
            return self.inner.get(key, **kwargs)
        finally:
            if key == names.manifest_key(2) and self.held is not None:
                self.inner.put_if_absent(key, self.held)  # the late server applies it now
                self.held = None


class _AppliedThenFailed:
    """A store that breaks its contract once: the manifest write of version 2 is applied, then
    fails as if nothing was stored (a plain StoreError)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        self.inner.put_if_absent(key, data)
        if key == names.manifest_key(2):
            raise StoreError(f"injected: the write of {key!r} failed after it was applied")


@pytest.mark.timeout(60)
def test_a_manifest_that_landed_before_its_write_failed_is_committed_not_reused(tmp_path):
    # Receivers can pull version 2 the moment its manifest lands; had the publisher taken
    # the failure at its word, it would publish another state as version 2 (or 3 on top of
    # a v1 baseline the receivers no longer hold).
    rig = Rig(_AppliedThenFailed(LocalStore(tmp_path / "store", durable=False)), tmp_path)
    for v in (0, 1):
        rig.publish(v)
    report = rig.publish(2)
    assert report.version == 2
    assert rig.trainer.pub.committed() == 2 and rig.trainer.sync.next_version() == 3
    assert decode_latest(rig.store.get(names.LATEST)) == 2
    pulled = rig.rec.pull()
    assert pulled.version == 2
    rig.check(pulled)
    assert rig.publish(3).base_version == 2
    rig.check(rig.rec.pull())


@pytest.mark.timeout(60)
def test_an_own_attempt_that_landed_after_all_is_the_base_of_the_next_delta(tmp_path):
    # v2's manifest landed, but the publisher got no verdict: v2 is committed with its own
    # writer and lineage. v3 is a delta on v2 in the same lineage, not an anchor of a new one:
    # the changes kept since v1, with the params v2 sent whole (an element v2 changed may be
    # back at its v1 bits by v3, where the receivers hold v2's)
    rig = _version_2_without_a_verdict(
        _LostReply(LocalStore(tmp_path / "store", durable=False)), tmp_path
    )
    run = rig.trainer.pub.run_id
    assert rig.trainer.pub.committed() == 2 and rig.trainer.sync.next_version() == 3
    report = rig.publish(3)
    assert (report.kind, report.base_version, rig.trainer.pub.run_id) == ("delta", 2, run)
    pulled = rig.rec.pull()
    assert pulled.version == 3
    rig.check(pulled)
