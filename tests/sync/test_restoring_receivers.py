"""A receiver restoring an anchor is not starved by a trainer that anchors while it fetches.

Retention kept, for a receiver holding no version, only the newest anchor's chain: a slow
fetch of anchor A, during which the trainer published a newer anchor and ran gc, lost A
mid-fetch (MissingBlobError), and the next pull started over from the newer anchor, which went
the same way, for as long as the trainer anchored faster than the receiver fetched. The
registration now names the anchor being restored (``ReceiverRecord.restoring``), and
retention keeps it and the versions after it while that registration is live.
"""

from __future__ import annotations

import time

from kit import (
    anchored_bf16,
    assert_same_bits,
    expected_shards,
    publish_edit,
    rconfig,
    zero_tensors,
)

from deltasync import names
from deltasync.commit import Catalog, ReceiverRecord, collect_garbage
from deltasync.errors import ManifestError
from deltasync.receiver import Receiver

from sync_kit import _Wrapper, scratch_store

RID = "slow"


class SlowLink(_Wrapper):
    """The receiver's view of the store: its next blob read first runs ``during`` (what the
    trainer does while a slow link carries that blob)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.during = None

    def get(self, key, **kwargs):
        try:
            names.parse_blob_key(key)
        except ManifestError:
            pass
        else:
            during, self.during = self.during, None
            if during is not None:
                during()
        return self.inner.get(key, **kwargs)

    def put(self, key, data):
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def put_stream(self, key, chunks):
        return self.inner.put_stream(key, chunks)


def _committed(store, versions) -> list[int]:
    return [v for v in versions if store.exists(names.manifest_key(v))]


def test_a_slow_receiver_restoring_an_anchor_keeps_it_while_the_trainer_anchors_and_collects(
    tmp_path,
) -> None:
    store = scratch_store(tmp_path / "store")
    tl, rl, params, pub = anchored_bf16(store, seed=11)
    view = SlowLink(store)
    rx = Receiver.for_layout(
        view, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "rx"), rconfig(RID)
    )
    head = 0
    seen: list[ReceiverRecord | None] = []

    def trainer() -> None:  # during the receiver's fetch: a delta, an anchor, gc
        nonlocal head
        seen.append(Catalog(store).receiver(RID))
        publish_edit(pub, params, head + 1, 5)
        pub.publish(head + 2, [], params, anchor=True)
        head += 2
        pub.gc()  # keep_versions=2: the anchor being fetched is neither of the newest two

    for _ in range(3):  # each pull restores the anchor that was newest as it began
        view.during = trainer
        report = rx.pull()
        assert report.from_anchor and report.chain == (head - 2,)
        # the registration named that anchor while it was fetched, and none once it held it
        assert (seen[-1].restoring, seen[-1].restoring_run_id) == (head - 2, report.run_id)
        # beside the version it still holds, which acks and bounded staleness go by
        assert seen[-1].version == (None if head == 2 else head - 4)
        after = Catalog(store).receiver(RID)
        assert after.version == head - 2 and after.restoring is None
    assert _committed(store, range(head + 1)) == [head - 3, head - 2, head - 1, head]
    # the trainer stops anchoring: the receiver reaches the head, bit-exact
    report = rx.pull()
    assert report.version == head and not report.dirty
    assert_same_bits(rx.tensors, expected_shards(params, tl, rl)["tp0"], "at the head")


def test_an_expired_registration_no_longer_keeps_the_anchor_it_was_restoring(tmp_path) -> None:
    store = scratch_store(tmp_path / "store")
    _, _, params, pub = anchored_bf16(store, seed=12)
    for v in range(1, 7):
        if v % 2 == 0:
            pub.publish(v, [], params, anchor=True)
        else:
            publish_edit(pub, params, v, 5)
    run_id = Catalog(store).manifest(6).run_id

    def register(updated_at: float, run: str = run_id) -> None:
        rec = ReceiverRecord(
            receiver=RID,
            shard="tp0",
            version=None,
            updated_at=updated_at,
            restoring=2,
            restoring_run_id=run,
        )
        store.put(rec.key, rec.to_json())

    def deletable() -> tuple[int, ...]:
        return collect_garbage(
            store, Catalog(store), keep_versions=2, receiver_ttl_s=120, dry_run=True
        ).versions

    register(time.time())  # live: anchor 2 and every version after it stay
    assert deletable() == (0, 1)
    register(time.time(), "r1-another")  # an anchor of another lineage keeps nothing here
    assert deletable() == (0, 1, 2, 3, 4)
    register(time.time() - 121)  # its heartbeat expired: the newest anchor's chain only
    assert deletable() == (0, 1, 2, 3, 4)
    register(time.time())
    collect_garbage(store, Catalog(store), keep_versions=2, receiver_ttl_s=120)
    assert _committed(store, range(7)) == [2, 3, 4, 5, 6]


class CtrlCOnRegistration(_Wrapper):
    """Its next registration write, once ``armed``, raises KeyboardInterrupt (a Ctrl-C)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.armed = False

    def get(self, key, **kwargs):
        return self.inner.get(key, **kwargs)

    def put(self, key, data):
        if self.armed and key.startswith("receivers/"):
            self.armed = False
            raise KeyboardInterrupt
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def put_stream(self, key, chunks):
        return self.inner.put_stream(key, chunks)


def test_a_ctrl_c_while_registering_the_anchor_to_restore_leaves_no_later_heartbeat_naming_it(
    tmp_path,
) -> None:
    store = scratch_store(tmp_path / "store")
    tl, rl, params, pub = anchored_bf16(store, seed=13)
    view = CtrlCOnRegistration(store)
    rx = Receiver.for_layout(
        view, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "rx"), rconfig(RID)
    )
    view.armed = True  # the write naming anchor 0, before its fetch
    try:
        rx.pull()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the registration write was not interrupted")
    assert rx.heartbeat()  # the engine's heartbeat thread, later on
    rec = Catalog(store).receiver(RID)
    assert rec.version is None and rec.restoring is None
    for v in range(1, 5):
        if v % 2 == 0:
            pub.publish(v, [], params, anchor=True)
        else:
            publish_edit(pub, params, v, 5)
    doomed = collect_garbage(
        store, Catalog(store), keep_versions=2, receiver_ttl_s=120, dry_run=True
    ).versions
    assert doomed == (0, 1, 2)  # the newest anchor's chain only: nothing pinned by anchor 0
    report = rx.pull()  # and the receiver still reaches the head, bit-exact
    assert report.version == 4 and rec.restoring is None
    assert_same_bits(rx.tensors, expected_shards(params, tl, rl)["tp0"], "at the head")
    assert Catalog(store).receiver(RID).restoring is None
