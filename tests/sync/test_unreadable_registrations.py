"""A receiver's registration the store would not return (an outage, a throttled prefix) is not
taken for no registration by a reader that acts on every live receiver.

Counted as absent, it let gc delete the versions a live receiver still needed, bounded
staleness publish past a receiver far behind, an ack wait count the ack of a receiver that
had since withdrawn it (or leave that receiver out of the default list), and a receiver whose
withdrawal before its scatter failed scatter anyway: killed midway, it left a fresh
registration naming the version before over tensors that hold no version.
"""

from __future__ import annotations

import pytest
from kit import anchored_bf16, publish_edit, rconfig, zero_tensors

from deltasync import names
from deltasync.commit import Catalog, collect_garbage
from deltasync.errors import AckTimeoutError, DeltaSyncError, StalenessTimeoutError, StoreError
from deltasync.layout.digest import state_digest
from deltasync.publish import Publisher, PublisherConfig
from deltasync.receiver import Receiver

from sync_kit import _Wrapper, scratch_store

RID = "live"


class Registrations(_Wrapper):
    """While ``down``, reads (and with ``writes`` also writes) of the receivers' registrations
    fail; every other key answers."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.down = self.writes = False

    def _check(self, key: str) -> None:
        if self.down and key.startswith(names.RECEIVERS_PREFIX):
            raise StoreError(f"injected: {key!r} could not be read (an outage)")

    def get(self, key, **kwargs):
        self._check(key)
        return self.inner.get(key, **kwargs)

    def put(self, key, data):
        if self.writes:
            self._check(key)
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def put_stream(self, key, chunks):
        return self.inner.put_stream(key, chunks)


@pytest.fixture
def run(tmp_path):
    """Anchor 0 and delta 1 pulled by a live receiver, behind a store whose registrations
    can be taken down."""
    store = Registrations(scratch_store(tmp_path / "store"))
    _, rl, params, pub = anchored_bf16(store, seed=3)
    publish_edit(pub, params, 1, 5)
    tensors = zero_tensors(rl, "tp0")
    rx = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "rx"), rconfig(RID))
    assert rx.pull().version == 1
    return store, rl, params, pub, rx


def _committed(store, versions) -> list[int]:
    return [v for v in versions if store.exists(names.manifest_key(v))]


def test_gc_deletes_nothing_while_a_registration_cannot_be_read(run):
    store, _, params, pub, rx = run
    for v in range(2, 7):
        if v == 4:
            pub.publish(4, [], params, anchor=True)
        else:
            publish_edit(pub, params, v, 5)
    store.down = True
    with pytest.raises(StoreError, match=rf"registrations of receivers \['{RID}'\]"):
        collect_garbage(store, Catalog(store), keep_versions=2, receiver_ttl_s=120)
    assert _committed(store, range(7)) == list(range(7))
    store.down = False
    # every version after the live receiver's is kept (taken for absent, 2 and 3 went)
    plan = collect_garbage(store, Catalog(store), keep_versions=2, receiver_ttl_s=120)
    assert plan.versions == (0, 1)
    assert rx.pull().version == 6
    assert rx.state_digest == state_digest(rx.tensors)


def test_bounded_staleness_waits_for_a_receiver_it_cannot_read(run):
    store, rl, params, _, _ = run
    pub = Publisher(
        store,
        receiver_layout=rl,
        config=PublisherConfig(max_staleness=1, staleness_timeout_s=0.3, anchor_every=1000),
    )
    pub.resume(1, params)
    publish_edit(pub, params, 2, 5)  # the receiver at 1 is one behind: allowed
    store.down = True
    with pytest.raises(StalenessTimeoutError, match=RID):
        publish_edit(pub, params, 3, 5)
    assert not store.exists(names.manifest_key(3))


def test_the_ack_wait_neither_counts_nor_leaves_out_a_receiver_it_cannot_read(run):
    store, _, _, pub, _ = run
    store.down = True
    with pytest.raises(AckTimeoutError, match=rf"registrations of\s+receivers \['{RID}'\]"):
        pub.wait_for_acks(1, timeout=0.3)  # the default list: every live receiver
    # named, its ack of 1 is not taken while the registration that may withdraw it is unread
    with pytest.raises(AckTimeoutError, match=RID):
        pub.wait_for_acks(1, [RID], timeout=0.3)
    store.down = False
    assert set(pub.wait_for_acks(1, timeout=5)) == {RID}


def test_a_receiver_that_cannot_withdraw_or_read_its_registration_writes_nothing(run):
    """Withdrawing the registration before the first write failed, and reading it back failed
    too: a crash in the scatter would have left it naming version 1, heartbeat fresh, over
    torn tensors. The pull refuses before any write; once the store answers it takes the
    version."""
    store, _, params, pub, rx = run
    before = state_digest(rx.tensors)
    publish_edit(pub, params, 2, 5)
    store.down = store.writes = True
    with pytest.raises(DeltaSyncError):
        rx.pull()
    assert state_digest(rx.tensors) == before
    store.down = store.writes = False
    assert rx.pull().version == 2
    assert rx.state_digest == state_digest(rx.tensors)


def test_a_resume_that_cannot_read_the_registrations_does_not_continue_the_run(run):
    """The registrations are where a resume finds that a store restored from an older copy
    had gone on past the checkpoint's version: unread, the next version is an anchor of a new
    run rather than a delta under a number that may already name another state."""
    store, rl, params, _, _ = run
    publisher = Publisher(store, receiver_layout=rl)
    store.down = True
    assert publisher.resume(1, params) is False
    store.down = False
    assert publisher.resume(1, params) is True


def test_live_receivers_lists_a_registration_it_cannot_read_where_asked(run):
    store, _, _, pub, _ = run
    assert set(pub.live_receivers()) == {RID}
    store.down = True
    unreadable: list[str] = []
    assert pub.live_receivers(unreadable=unreadable) == {} and unreadable == [RID]
    assert pub.live_receivers() == {}  # informational: left out, with a warning


def test_waits_end_at_their_timeout_not_a_polling_interval_later(run):
    import time

    store, rl, params, _, _ = run
    pub = Publisher(
        store,
        receiver_layout=rl,
        config=PublisherConfig(poll_interval_s=30.0, max_staleness=0, staleness_timeout_s=0.3),
    )
    pub.resume(1, params)
    publish_edit(
        pub,
        params,
        2,
        5,
    )
    t0 = time.monotonic()
    with pytest.raises(AckTimeoutError, match=RID):
        pub.wait_for_acks(2, timeout=0.3)
    store.down = True  # the default list waits for the registration to read
    with pytest.raises(AckTimeoutError, match=RID):
        pub.wait_for_acks(2, timeout=0.3)
    with pytest.raises(StalenessTimeoutError, match=RID):
        publish_edit(pub, params, 3, 5)
    assert time.monotonic() - t0 < 20  # three waits of 0.3 s, not of a 30 s poll each
