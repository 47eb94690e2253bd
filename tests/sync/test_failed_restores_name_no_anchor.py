"""A restore that fails names its anchor no longer: the registration the failed pull leaves is
written again without it.

The pull forgot the anchor in memory only, and its last registration write (the one naming
the anchor before the fetch, or the one re-registering the version held after a refused
withdrawal) still named it, heartbeat fresh: gc kept that anchor and every version after it,
for a receiver whose restore had ended, until its heartbeat expired.
"""

from __future__ import annotations

from kit import (
    anchored_bf16,
    assert_same_bits,
    expected_shards,
    publish_edit,
    rconfig,
    zero_tensors,
)

from deltasync import names
from deltasync.commit import Catalog, collect_garbage
from deltasync.errors import ManifestError, StoreError
from deltasync.receiver import Receiver

from sync_kit import _Wrapper, scratch_store

RID = "failed"


class Link(_Wrapper):
    """The receiver's view: its next blob read fails (``fail_blob``), or its
    ``fail_registration``-th registration write from now fails before landing."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.fail_blob = False
        self.fail_registration = 0

    def get(self, key, **kwargs):
        try:
            names.parse_blob_key(key)
        except ManifestError:
            pass
        else:
            if self.fail_blob:
                self.fail_blob = False
                raise StoreError(f"injected: reading {key!r} failed")
        return self.inner.get(key, **kwargs)

    def put(self, key, data):
        if self.fail_registration and key.startswith(names.RECEIVERS_PREFIX):
            self.fail_registration -= 1
            if not self.fail_registration:
                raise StoreError(f"injected: writing {key!r} failed")
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def put_stream(self, key, chunks):
        return self.inner.put_stream(key, chunks)


def _doomed(store) -> tuple[int, ...]:
    return collect_garbage(
        store, Catalog(store), keep_versions=1, receiver_ttl_s=120, dry_run=True
    ).versions


def test_a_restore_whose_fetch_fails_leaves_no_registration_naming_its_anchor(tmp_path) -> None:
    store = scratch_store(tmp_path / "store")
    tl, rl, params, pub = anchored_bf16(store, seed=21)
    view = Link(store)
    rx = Receiver.for_layout(
        view, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "rx"), rconfig(RID)
    )
    assert rx.heartbeat()  # registered, holding nothing yet
    publish_edit(pub, params, 1, 5)
    pub.publish(2, [], params, anchor=True)
    publish_edit(pub, params, 3, 5)
    view.fail_blob = True  # the restore of anchor 2 fails in its fetch
    try:
        rx.pull()
    except StoreError:
        pass
    else:
        raise AssertionError("the fetch did not fail")
    rec = Catalog(store).receiver(RID)
    assert (rec.version, rec.restoring, rec.restoring_run_id) == (None, None, None)
    pub.publish(4, [], params, anchor=True)  # the trainer goes on
    publish_edit(pub, params, 5, 5)
    assert _doomed(store) == (0, 1, 2, 3)  # nothing pinned by anchor 2 any more
    report = rx.pull()  # and the receiver reaches the head, bit-exact
    assert report.version == 5 and report.from_anchor
    assert_same_bits(rx.tensors, expected_shards(params, tl, rl)["tp0"], "at the head")
    assert Catalog(store).receiver(RID).restoring is None


def test_a_restore_refused_before_its_first_write_leaves_no_registration_naming_its_anchor(
    tmp_path,
) -> None:
    store = scratch_store(tmp_path / "store")
    tl, rl, params, pub = anchored_bf16(store, seed=22)
    view = Link(store)
    rx = Receiver.for_layout(
        view, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "rx"), rconfig(RID)
    )
    assert rx.pull().version == 0
    held = {n: t.clone() for n, t in rx.tensors.items()}
    pub.resume(None, params)  # a new lineage: the receiver must restore its anchor 2
    pub.publish(2, [], params, anchor=True)
    publish_edit(pub, params, 3, 5)
    view.fail_registration = 2  # the write naming anchor 2 lands; the withdrawal does not
    try:
        rx.pull()
    except StoreError:
        pass
    else:
        raise AssertionError("the withdrawal was not refused")
    assert rx.version == 0
    assert_same_bits(rx.tensors, held, "nothing written")
    rec = Catalog(store).receiver(RID)
    assert (rec.version, rec.restoring, rec.restoring_run_id) == (0, None, None)
    pub.publish(4, [], params, anchor=True)
    publish_edit(pub, params, 5, 5)
    assert _doomed(store) == (0, 2, 3)  # version 0 is of the old lineage: nothing pinned
    report = rx.pull()
    assert report.version == 5 and report.from_anchor
    assert_same_bits(rx.tensors, expected_shards(params, tl, rl)["tp0"], "at the head")
    assert Catalog(store).receiver(RID).restoring is None
