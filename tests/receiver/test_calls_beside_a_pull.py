"""Calls on a receiver while its pull scatters: the tensors are torn then (the pull withdrew
the registration before its first write), so the receiver reports no version meanwhile and
nothing may register the version before it or touch the records the pull is about to write,
from another thread or from the pull's own callbacks."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import pytest
import torch
from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors

from deltasync import MemoryStore, Receiver, names
from deltasync.commit import ReceiverRecord
from deltasync.errors import ConfigError, LocalStateError, StoreError
from deltasync.receiver import StateDir, store_receiver

SHARD = "tp0"


def _registered(store) -> int | None:
    return ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version


def _anchored():
    """A store with version 0 published: the store, the layouts, the params, the publisher
    and a receiver shard's (zero) tensors."""
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=3)
    return store, tl, rl, params, pub, zero_tensors(rl, SHARD)


def _receiver(store, rl, tensors, tmp_path, config=None, **kwargs) -> Receiver:
    """The receiver "rec" of shard tp0 on ``tensors``, its state dir under ``tmp_path``."""
    config = config or rconfig("rec")
    return Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "rec"), config, **kwargs)


def _from_another_thread(call):
    """``call()`` on a thread of its own: what it returned or raised."""
    out = {}

    def run():
        try:
            out["returned"] = call()
        except Exception as exc:  # judged by the test
            out["raised"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    return out


@pytest.mark.timeout(60)
def test_a_heartbeat_and_a_deregister_mid_scatter_leave_the_registration_withdrawn(tmp_path):
    # The heartbeat re-registered version 0 over the torn tensors (a kill then left a torn
    # receiver counted as holding it for the whole TTL).
    store, tl, rl, params, pub, tensors = _anchored()
    seen = []

    def mid_scatter(_name):
        if seen:
            return
        seen.append(_registered(store))
        seen.append(_from_another_thread(lambda: rec.heartbeat()))
        seen.append(_from_another_thread(lambda: rec.deregister()))
        seen.append((rec.version, rec.dirty, rec.heartbeat()))  # this thread: the callback's
        seen.append(_registered(store))

    rec = _receiver(store, rl, tensors, tmp_path, on_tensor_written=mid_scatter)
    assert rec.pull().version == 0
    seen.clear()
    assert _registered(store) == 0
    publish_edit(pub, params, 1, 7)
    assert rec.pull().version == 1
    before, beat, dereg, here, after = seen
    assert before is None and after is None, seen
    assert here == (None, True, False), here  # torn: no version, and nothing registered
    assert beat == {"returned": False}, beat
    assert isinstance(dereg.get("raised"), ConfigError), dereg
    assert "while another thread's pull" in str(dereg["raised"])
    assert _registered(store) == 1
    assert rec.heartbeat() is True  # no call beside it: written
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


class _SlowRegistrations:
    """A store whose registration writes wait for ``release`` once ``entered`` is set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.hold = False
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data):
        if self.hold and key == names.receiver_key("rec"):
            self.entered.set()
            assert self.release.wait(30)
        return self.inner.put(key, data)


@pytest.mark.timeout(60)
def test_a_pull_beside_a_heartbeat_in_flight_waits_for_it_and_one_beside_a_scrub_is_written(
    tmp_path, monkeypatch
):
    # A heartbeat must not make a pull from another thread fail (a ConfigError, which a
    # sidecar takes for a permanent fault), nor be lost beside a call that registers nothing
    # (a scrub that finds the tensors intact).
    inner, tl, rl, params, pub, tensors = _anchored()
    store = _SlowRegistrations(inner)
    rec = _receiver(store, rl, tensors, tmp_path)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    store.hold = True
    beat = threading.Thread(target=rec.heartbeat)
    beat.start()
    assert store.entered.wait(30)  # the heartbeat's write is in flight
    store.hold = False
    threading.Timer(0.3, store.release.set).start()
    pulled = _from_another_thread(lambda: rec.pull())
    beat.join(30)
    assert pulled.get("returned") is not None and pulled["returned"].version == 1, pulled
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])

    inner.delete(names.receiver_key("rec"))  # (gone, as after a gc of a long silence)
    seen = []
    digest = store_receiver.state_digest

    def hashing(tensors):  # the scrub's read, with a heartbeat from another thread inside it
        seen.append(_from_another_thread(lambda: rec.heartbeat()))
        return digest(tensors)

    monkeypatch.setattr(store_receiver, "state_digest", hashing)
    assert rec.scrub() is True  # intact: the scrub itself registers nothing
    assert seen == [{"returned": True}], seen
    assert _registered(inner) == 1


@pytest.mark.timeout(60)
def test_a_heartbeat_while_a_pull_fetches_is_written(tmp_path, monkeypatch):
    # The tensors hold the version before all along the fetch: a heartbeat then (an engine's
    # keepalive beside a fetch longer than receiver_ttl_s) must keep the receiver live, else
    # retention takes it for dead and deletes the chain it is fetching. It wrote nothing.
    store, tl, rl, params, pub, tensors = _anchored()
    rec = _receiver(store, rl, tensors, tmp_path)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    store.delete(names.receiver_key("rec"))  # (as after a gc: only a heartbeat writes it back)
    fetch = store_receiver.open_version
    seen = []

    def fetching(*args, **kwargs):
        seen.append(_from_another_thread(lambda: rec.heartbeat()))
        seen.append(_registered(store))
        return fetch(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "open_version", fetching)
    assert rec.pull().version == 1
    assert seen == [{"returned": True}, 0], seen
    assert _registered(store) == 1
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("every", [0.05, 0.0])
def test_a_long_fetch_refreshes_the_registration_on_its_own(tmp_path, monkeypatch, every):
    # A fetch longer than the receivers' TTL (a large anchor over a slow link) left the
    # registration as old as the pull before it: retention took the receiver for dead and
    # could delete the chain it was fetching, every time.
    store, tl, rl, params, pub, tensors = _anchored()
    rec = _receiver(store, rl, tensors, tmp_path, replace(rconfig("rec"), fetch_heartbeat_s=every))
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    store.delete(names.receiver_key("rec"))
    monkeypatch.setattr(store_receiver, "FETCH_HEARTBEAT_MIN_BYTES", 0)  # this one is large
    fetch = store_receiver.open_version
    seen = []

    def slow(*args, **kwargs):
        deadline = threading.Event()
        deadline.wait(0.4)  # the fetch takes 8 beats
        seen.append(_registered(store) if store.exists(names.receiver_key("rec")) else None)
        return fetch(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "open_version", slow)
    threads = threading.active_count()
    assert rec.pull().version == 1
    assert seen == ([0] if every else [None])
    assert threading.active_count() == threads  # the beat's thread ended with the fetch
    assert _registered(store) == 1
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


@pytest.mark.timeout(60)
def test_a_heartbeat_between_the_withdrawal_and_the_first_write_writes_nothing(tmp_path):
    # The tensors still hold version 0 there, but the pull withdrew the registration for the
    # scatter about to start: a heartbeat naming version 0 then outlives a kill mid-scatter.
    store, tl, rl, params, pub, tensors = _anchored()
    seen = []

    @contextlib.contextmanager
    def pause():  # entered after the withdrawal, right before the first write
        seen.append((_registered(store), _from_another_thread(lambda: rec.heartbeat())))
        seen.append(_registered(store))
        yield

    rec = _receiver(store, rl, tensors, tmp_path, pause=pause)
    assert rec.pull().version == 0
    seen.clear()
    publish_edit(pub, params, 1, 7)
    assert rec.pull().version == 1
    assert seen == [(None, {"returned": False}), None], seen
    assert _registered(store) == 1 and rec.heartbeat() is True
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


@pytest.mark.timeout(60)
def test_a_heartbeat_while_the_new_version_is_recorded_never_names_the_one_before(
    tmp_path, monkeypatch
):
    # After the scatter the receiver reports the version before until the new state file is
    # written; a heartbeat then wrote version 0 over the pull's registration of version 1.
    store, _, rl, params, pub, tensors = _anchored()
    rec = _receiver(store, rl, tensors, tmp_path)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    write_state = StateDir.write_state
    seen = []

    def slow(self, state):
        if state.version == 1 and not seen:
            seen.append(_from_another_thread(lambda: rec.heartbeat()))
        return write_state(self, state)

    monkeypatch.setattr(StateDir, "write_state", slow)
    assert rec.pull().version == 1
    assert seen == [{"returned": False}], seen
    assert _registered(store) == 1
    assert rec.heartbeat() is True and _registered(store) == 1


@pytest.mark.timeout(60)
def test_a_pull_interrupted_before_its_first_write_leaves_heartbeats_working(tmp_path):
    # The withdrawal outlived an interrupt: every heartbeat after it wrote nothing, and the
    # receiver, holding version 0 intact, went stale in the store.
    store, _, rl, params, pub, tensors = _anchored()
    interrupt = []

    @contextlib.contextmanager
    def pause():
        if interrupt:
            raise KeyboardInterrupt
        yield

    rec = _receiver(store, rl, tensors, tmp_path, pause=pause)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    interrupt.append(True)
    with pytest.raises(KeyboardInterrupt):
        rec.pull()
    assert rec.version == 0
    assert rec.heartbeat() is True and _registered(store) == 0


@pytest.mark.timeout(60)
def test_deregister_and_close_come_after_a_heartbeat_in_flight(tmp_path):
    # A heartbeat in flight landed after deregister() returned (the registration back) or
    # after close() (over the records of a receiver that may hold the state dir by then).
    inner, _tl, rl, _params, _pub, tensors = _anchored()
    store = _SlowRegistrations(inner)
    rec = _receiver(store, rl, tensors, tmp_path)
    assert rec.pull().version == 0
    for end in (rec.deregister, rec.close):
        store.hold, store.release = True, threading.Event()
        store.entered.clear()
        beat = threading.Thread(target=rec.heartbeat)
        beat.start()
        assert store.entered.wait(30)  # the heartbeat's write is in flight
        store.hold = False
        threading.Timer(0.3, store.release.set).start()
        end()
        beat.join(30)
        if end == rec.deregister:
            assert not inner.exists(names.receiver_key("rec"))  # not brought back
    assert _registered(inner) == 0  # the last heartbeat landed before close returned


@pytest.mark.timeout(60)
def test_an_interrupt_after_the_scatter_leaves_no_version_claimed(tmp_path, monkeypatch):
    # The receiver went back to reporting version 0 at the end of the scatter; interrupted
    # in the hash after it (verify_after_write), a heartbeat then registered version 0 over
    # tensors that held version 1.
    store, tl, rl, params, pub, tensors = _anchored()
    config = replace(rconfig("rec"), verify_after_write=True)
    rec = _receiver(store, rl, tensors, tmp_path, config)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    digest = store_receiver.state_digest

    def interrupted(live):
        monkeypatch.setattr(store_receiver, "state_digest", digest)
        raise KeyboardInterrupt

    monkeypatch.setattr(store_receiver, "state_digest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rec.pull()
    assert rec.version is None and rec.dirty
    rec.heartbeat()
    assert _registered(store) is None  # never version 0 over version 1's tensors
    report = rec.pull()  # the journal, replayed
    assert report.version == 1 and report.repaired
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


@pytest.mark.timeout(60)
def test_a_replay_in_a_running_process_withdraws_the_registration_before_it_writes(
    tmp_path, monkeypatch
):
    # A failed state file write leaves the journal and a registration of version 1 (which the
    # tensors hold); the next pull replays the journal (an anchor: every element rewritten)
    # under that registration, and a kill mid-replay left a torn receiver counted as current.
    store, tl, rl, params, pub, tensors = _anchored()
    at_write = []

    def first_write(_name):
        if not at_write:
            at_write.append(_registered(store))

    rec = _receiver(store, rl, tensors, tmp_path, on_tensor_written=first_write)
    publish_edit(pub, params, 1, 7)

    def full(self, _state):
        raise LocalStateError(f"cannot write {str(self.path)!r}: No space left on device")

    with monkeypatch.context() as m:
        m.setattr(StateDir, "write_state", full)
        with pytest.raises(LocalStateError):
            rec.pull()
    at_write.clear()
    report = rec.pull()
    assert report.repaired and report.version == 1
    assert at_write == [None], at_write  # withdrawn before the replay's first write
    assert _registered(store) == 1
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])


class _RegistrationWrites:
    """``mode``: None (the store's own answer), "lost reply" (a registration naming a
    version lands, then fails: its reply lost) or "refused" (every registration write)."""

    def __init__(self, inner) -> None:
        self.inner, self.mode = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, *args, **kwargs):
        if key == names.receiver_key("rec") and self.mode == "refused":
            raise StoreError("the registration write was refused")
        out = self.inner.put(key, data, *args, **kwargs)
        landed = key == names.receiver_key("rec") and self.mode == "lost reply"
        if landed and ReceiverRecord.from_json(data).version is not None:
            raise StoreError("the connection was reset after the write landed")
        return out


@pytest.mark.timeout(60)
def test_a_registration_whose_reply_was_lost_still_stops_a_write_it_cannot_withdraw(tmp_path):
    # a write that landed and then failed was taken as never written: the next pull, whose
    # withdrawal the store refused, wrote while the store named the version before
    inner, _tl, rl, params, pub, tensors = _anchored()
    store = _RegistrationWrites(inner)
    rec = _receiver(store, rl, tensors, tmp_path)
    assert rec.pull().version == 0 and _registered(inner) == 0
    publish_edit(pub, params, 1, 7)
    store.mode = "lost reply"
    assert rec.pull().version == 1 and _registered(inner) == 1
    publish_edit(pub, params, 2, 9)
    store.mode = "refused"
    before = {n: t.clone() for n, t in tensors.items()}
    with pytest.raises(StoreError, match="could not be withdrawn before the first write"):
        rec.pull()
    assert rec.version == 1 and all(torch.equal(tensors[n], t) for n, t in before.items())
    store.mode = None
    assert rec.pull().version == 2 and _registered(inner) == 2


@pytest.mark.timeout(60)
def test_flush_records_inside_a_pull_writes_nothing(tmp_path):
    # called from the engine's progress callback after the withdrawal, it registered the
    # version before again: the first write ran while the store named it
    store, _tl, rl, params, pub, tensors = _anchored()
    seen = []

    def on_tensor(_name):
        if not seen:
            seen.append((rec.flush_records(), _registered(store)))

    rec = _receiver(store, rl, tensors, tmp_path, on_tensor_written=on_tensor)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    assert rec.pull().version == 1
    assert seen == [(False, None)]  # withdrawn, and left so
    assert rec.flush_records() and _registered(store) == 1


@pytest.mark.timeout(60)
def test_a_keepalive_during_a_crash_repairs_fetch_names_no_version(tmp_path, monkeypatch):
    # A receiver restarted on a journal (killed mid-scatter) replays it; the replay's fetch is
    # outside the held heartbeats, and the keepalive of a large fetch registered the state
    # file's version (the one before the crash) over torn tensors.
    store, tl, rl, params, pub, tensors = _anchored()
    armed = []

    def killed_mid_scatter(_name):
        if armed:
            armed.clear()
            raise RuntimeError("killed mid-scatter")

    config = replace(rconfig("rec"), fetch_heartbeat_s=0.05)
    rec = _receiver(store, rl, tensors, tmp_path, config, on_tensor_written=killed_mid_scatter)
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    armed.append(True)
    with pytest.raises(RuntimeError):
        rec.pull()
    rec.close()
    monkeypatch.setattr(store_receiver, "FETCH_HEARTBEAT_MIN_BYTES", 0)  # this one is large
    fetch = store_receiver.open_version
    seen = []

    def slow(*args, **kwargs):
        threading.Event().wait(0.4)  # the fetch takes 8 beats
        seen.append(_registered(store))
        return fetch(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "open_version", slow)
    restarted = _receiver(store, rl, tensors, tmp_path, config)
    assert restarted.last_repair is not None and restarted.last_repair.version == 1
    assert seen == [None], seen  # live, naming no version, until the replay is recorded
    assert _registered(store) == 1
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])
