"""A receiver records its verified version three ways once the scatter has ended (the local
state file, the ack, the registration, written at once), and drops its journal only once the
state file is durable. A failed ack or heartbeat (the S3 server killed between the scatter
and the ack, a receiver SIGKILLed right there) or a state file write killed or failed never
leaves the tensors at one version and the state at another: the journal is replayed to the
version the tensors hold, and a dirty receiver never reports a version."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import uuid

import pytest
import torch
from kit import told_in_another_process
from truth_kit import FailingPuts, Rig, assert_same_bits, rconfig, wipe

from deltasync import LocalStore, Receiver, names
from deltasync.commit import AckRecord, ReceiverRecord
from deltasync.errors import ConfigError, LocalStateError
from deltasync.receiver import StateDir, mapped_shard_tensors
from deltasync.store import RetryPolicy, S3Store


class StopBeforeAck:
    """Store wrapper: the first put of an ack key runs ``hook`` first (e.g. stops the server)."""

    def __init__(self, inner, hook) -> None:
        self.inner, self.hook = inner, hook

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, *args, **kwargs):
        if key.startswith("acks/") and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self.inner.put(key, data, *args, **kwargs)


@contextlib.contextmanager
def _server_killed_before_the_ack(s3_server, s3_session_store, tmp_path):
    """A receiver pulls version 0 and the S3 server dies after its scatter, before its ack.
    Yields ``(rig, its store, the publisher's store, the first pull's report)``; the server
    is running again afterwards."""
    prefix = f"truth-{uuid.uuid4().hex[:8]}"
    pub_store = s3_session_store.with_prefix(prefix)
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.02, deadline_s=0.5)
    rx_s3 = S3Store(s3_session_store.bucket, prefix, config=s3_server.config(retry=retry))
    try:
        rig = Rig(pub_store, tmp_path)
        rig.publish(0)
        rig.rec = rig.receiver(StopBeforeAck(rx_s3, s3_server.stop))
        report = rig.rec.pull()
        assert not s3_server.running
        yield rig, rx_s3, pub_store, report
    finally:
        if not s3_server.running:
            s3_server.start()
        rx_s3.close()


@pytest.mark.timeout(90)
def test_the_s3_server_killed_between_scatter_and_ack_leaves_a_verified_version_and_the_ack_follows(
    s3_server, s3_session_store, tmp_path
):
    with _server_killed_before_the_ack(s3_server, s3_session_store, tmp_path) as (
        rig,
        _,
        pub_store,
        report,
    ):
        rig.check(report)
        assert report.version == 0 and report.records_pending
        state = StateDir(tmp_path / "rec").read_state()
        assert state.version == 0 and not state.dirty, "the verified version is recorded locally"
        assert not (tmp_path / "rec" / names.JOURNAL_FILE).exists()
        s3_server.start()
        assert not pub_store.exists(names.ack_key(0, "rec"))
        report = rig.rec.pull()  # nothing new: the owed ack and registration are written now
        assert report.version == 0 and not report.records_pending and not report.chain
        ack = AckRecord.from_json(pub_store.get(names.ack_key(0, "rec")))
        assert ack.state_digest == rig.rec.state_digest
        rig.publish(1)
        rig.check(rig.rec.pull())


@pytest.mark.timeout(90)
def test_a_receiver_restarted_while_s3_is_down_still_owes_the_ack_it_could_not_write(
    s3_server, s3_session_store, tmp_path
):
    # The server dies between the scatter and the ack, and the receiver restarts before it is
    # back: it cannot tell yet whether its version is committed as held, so the ack stays
    # owed (it was dropped, and a trainer waiting for it timed out although it held the
    # version) and goes out with the first pull that reads the store.
    with _server_killed_before_the_ack(s3_server, s3_session_store, tmp_path) as (
        rig,
        rx_s3,
        pub_store,
        report,
    ):
        assert report.records_pending
        rig.rec = rig.receiver(rx_s3)  # the process restarts; the server is still down
        assert rig.rec.version == 0 and not rig.rec.dirty
        s3_server.start()
        report = rig.rec.pull()
        assert report.version == 0 and not report.chain and not report.records_pending
        assert AckRecord.from_json(pub_store.get(names.ack_key(0, "rec"))).version == 0
        assert rig.trainer.pub.wait_for_acks(0, ["rec"], timeout=5)


def _receiver_child(store_path, state_dir, mapped, ready, hang_in):
    from truth_kit import tiny_layouts

    _, _, rl = tiny_layouts()
    tensors = mapped_shard_tensors(mapped, rl.local_specs("tp0"))

    def hang():
        open(ready, "w").close()
        time.sleep(600)  # the parent SIGKILLs us here, after the scatter

    def at_put(key):
        if hang_in == "ack" and key.startswith("acks/"):
            # the state file is written beside the ack: killed once it is durable
            while (st := StateDir(state_dir).read_state()) is None or st.version != 0:
                time.sleep(0.005)
            hang()

    if hang_in == "state":
        real = StateDir.write_state

        def write_state(self, state):
            if state.version == 0:
                hang()
            real(self, state)

        StateDir.write_state = write_state  # type: ignore[method-assign]
    store = FailingHook(LocalStore(store_path, durable=False), at_put)
    Receiver.for_layout(store, rl, "tp0", tensors, state_dir, rconfig("rec")).pull()


class FailingHook:
    def __init__(self, inner, hook) -> None:
        self.inner, self.hook = inner, hook

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, *args, **kwargs):
        self.hook(key)
        return self.inner.put(key, data, *args, **kwargs)


def _kill_after_scatter(tmp_path, hang_in):
    """Publish version 0, run a receiver's first pull in a child, SIGKILLed where ``hang_in``
    ("ack": the ack's put, once the state file is durable; "state": the state file's write)
    hangs; the store, the rig and the mapped tensors it scattered into."""
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    mapped = tmp_path / "tp0.bin"
    ready = tmp_path / "ready"
    proc = mp.get_context("fork").Process(
        target=_receiver_child,
        args=(str(tmp_path / "store"), str(tmp_path / "killed"), str(mapped), str(ready), hang_in),
        daemon=True,
    )
    proc.start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.is_alive() and time.monotonic() < deadline, f"the child never hung in {hang_in}"
        time.sleep(0.01)
    proc.kill()
    proc.join(10)
    assert proc.exitcode == -9
    return store, rig, mapped_shard_tensors(mapped, rig.rl.local_specs("tp0"), create=False)


@pytest.mark.timeout(90)
def test_a_receiver_sigkilled_between_scatter_and_ack_restarts_at_the_verified_version(tmp_path):
    store, rig, tensors = _kill_after_scatter(tmp_path, "ack")
    assert not store.exists(names.ack_key(0, "rec"))
    rec = Receiver.for_layout(
        store, rig.rl, "tp0", tensors, str(tmp_path / "killed"), rconfig("rec")
    )
    assert rec.version == 0 and not rec.dirty and rec.last_repair is None
    assert_same_bits(tensors, rig.oracle[(rig.trainer.pub.run_id, 0)]["tp0"])
    # the restarted receiver owes the ack of what it verifiably holds, and writes it
    assert AckRecord.from_json(store.get(names.ack_key(0, "rec"))).version == 0
    assert rig.trainer.pub.wait_for_acks(0, ["rec"], timeout=5)


@pytest.mark.timeout(90)
def test_a_receiver_sigkilled_while_its_state_file_is_written_replays_its_journal(tmp_path):
    # Killed before the state file is durable (the ack, written beside it, may be out): the
    # journal is still there, and the restart replays it to the version the tensors hold.
    store, rig, tensors = _kill_after_scatter(tmp_path, "state")
    assert StateDir(tmp_path / "killed").read_state() is None
    assert StateDir(tmp_path / "killed").read_journal() is not None
    if store.exists(names.ack_key(0, "rec")):  # it states what the tensors hold
        assert_same_bits(tensors, rig.oracle[(rig.trainer.pub.run_id, 0)]["tp0"])
    rec = Receiver.for_layout(
        store, rig.rl, "tp0", tensors, str(tmp_path / "killed"), rconfig("rec")
    )
    repaired = rec.last_repair
    assert repaired is not None and repaired.repaired and repaired.version == 0
    assert rec.version == 0 and not rec.dirty
    assert StateDir(tmp_path / "killed").read_journal() is None
    assert_same_bits(tensors, rig.oracle[(rig.trainer.pub.run_id, 0)]["tp0"])
    assert AckRecord.from_json(store.get(names.ack_key(0, "rec"))).version == 0
    assert ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version == 0


@pytest.mark.parametrize(
    ("method", "error", "recorded"),
    [
        # the state file cannot be written: the recorded version stays where it was
        ("write_state", "No space left on device", 0),
        # it was written, the journal's removal then fails: the version moved with the file
        ("clear_journal", "Read-only file system", 1),
    ],
)
def test_a_failed_local_record_raises_keeps_the_journal_and_the_next_pull_replays_it(
    tmp_path, monkeypatch, method, error, recorded
):
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    rig.publish(0)
    rig.check(rig.rec.pull())
    rig.publish(1)

    def fails(self, *args):
        raise LocalStateError(f"cannot write {str(self.path)!r}: {error}")

    with monkeypatch.context() as m:
        m.setattr(StateDir, method, fails)
        with pytest.raises(LocalStateError, match=error):
            rig.rec.pull()
    assert rig.rec.verified_version == recorded, "the recorded version moves with the file"
    if method == "write_state":  # the tensors hold 1, the record says 0: no version reported
        assert rig.rec.dirty and rig.rec.version is None
    else:
        assert not rig.rec.dirty and rig.rec.version == 1
    state = StateDir(tmp_path / "rec").read_state()
    assert state is not None and state.version == recorded
    assert StateDir(tmp_path / "rec").read_journal() is not None
    report = rig.rec.pull()  # the journal left behind is replayed
    assert report.repaired and report.version == 1
    rig.check(report)
    assert StateDir(tmp_path / "rec").read_state().version == 1
    assert StateDir(tmp_path / "rec").read_journal() is None
    rec = ReceiverRecord.from_json(rig.rec.store.get(names.receiver_key("rec")))
    assert rec.version == 1


@pytest.mark.timeout(60)
def test_a_failed_heartbeat_never_turns_a_verified_apply_into_an_error(tmp_path):
    inner = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(inner, tmp_path)
    rig.publish(0)
    flaky = FailingPuts(inner, lambda key: key.startswith(("receivers/", "acks/")))
    rig.rec = rig.receiver(flaky)
    report = rig.rec.pull()
    rig.check(report)
    assert report.records_pending and flaky.failed
    flaky.armed = False
    rig.publish(1)
    report = rig.rec.pull()
    rig.check(report)
    assert not report.records_pending
    rec = ReceiverRecord.from_json(inner.get(names.receiver_key("rec")))
    assert rec.version == 1


@pytest.mark.timeout(60)
def test_a_dirty_receiver_reports_no_version_until_an_anchor_restores_it(tmp_path):
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    rig.check(rig.rec.pull())
    next(iter(rig.tensors.values())).view(-1)[0] += 1  # the tensors no longer hold version 0
    wipe(store)  # and the store has nothing to restore from
    rig.rec = rig.receiver()
    assert rig.rec.dirty
    report = rig.rec.pull()
    assert report.version is None and report.dirty and report.run_id is None
    assert ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version is None
    from truth_kit import Trainer

    rig.trainer = Trainer(store, rig.rl, rig.tl, rig.spec, seed=7)
    rig.trainer.publish(0, rig.oracle, step=False)
    report = rig.rec.pull()
    assert report.from_anchor and not report.dirty
    rig.check(report)


def _journal_of_pulling_1_back(rig: Rig, state_dir: StateDir, monkeypatch) -> None:
    """Versions 0 and 1 pulled; the journal of the pull of 1, removed once its state file
    was written, written back as a power cut can bring it back (its removal is not fsynced)."""
    rig.publish(0)
    rig.check(rig.rec.pull())
    rig.publish(1)
    journals: list = []
    real_clear = StateDir.clear_journal

    def keep_a_copy(self) -> None:
        journals.append(self.read_journal())
        real_clear(self)

    monkeypatch.setattr(StateDir, "clear_journal", keep_a_copy)
    report = rig.rec.pull()
    monkeypatch.undo()
    rig.check(report)
    assert report.version == 1 and journals and journals[-1] is not None
    state_dir.write_journal(journals[-1])  # the removal "did not reach the disk"


def test_a_journal_whose_removal_was_lost_is_replayed_to_the_same_verified_version(
    tmp_path, monkeypatch
):
    # The journal is removed without an fsync after the state file recorded the version: a
    # power cut can bring it back. The next receiver on the state dir replays it, harmlessly.
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    state_dir = StateDir(str(tmp_path / "rec"))
    _journal_of_pulling_1_back(rig, state_dir, monkeypatch)
    rig.rec = rig.receiver()
    repaired = rig.rec.last_repair
    assert repaired is not None and repaired.repaired and repaired.version == 1
    rig.check(repaired)
    assert rig.rec.version == 1 and state_dir.read_journal() is None
    rig.publish(2)
    rig.check(rig.rec.pull())


def test_a_journal_over_tensors_a_power_cut_tore_is_refused_by_the_verify_and_an_anchor_restores(
    tmp_path, monkeypatch
):
    # A power cut brings back the journal of the last pull, but not the tensors it described:
    # a mapped file's pages hold whatever the kernel had written back. The replay's verify
    # finds a base that does not hash to the journaled version and restores the anchor.
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    state_dir = StateDir(str(tmp_path / "rec"))
    _journal_of_pulling_1_back(rig, state_dir, monkeypatch)
    torn = next(iter(rig.tensors.values())).view(-1)
    torn.view(torch.int16)[:512] ^= 1  # writes that never reached the disk
    rig.rec = rig.receiver()
    repaired = rig.rec.last_repair
    assert repaired is not None and repaired.repaired and repaired.from_anchor
    assert repaired.version == 1 and not rig.rec.dirty
    rig.check(repaired)  # bit-identical to version 1 again
    assert state_dir.read_journal() is None


def test_a_state_dir_path_with_a_nul_byte_is_a_local_state_error(tmp_path) -> None:
    # it was a bare ValueError from mkdir
    with pytest.raises(LocalStateError, match="cannot create receiver state dir"):
        StateDir(f"{tmp_path}/state\x00x")


def _holding_child(store_path, state_dir, ready):
    from truth_kit import tiny_layouts

    _, _, rl = tiny_layouts()
    tensors = {n: torch.zeros(sp.shape, dtype=sp.dtype) for n, sp in rl.local_specs("tp0").items()}
    rec = Receiver.for_layout(
        LocalStore(store_path, durable=False), rl, "tp0", tensors, state_dir, rconfig("rec")
    )
    rec.pull()
    open(ready, "w").close()
    time.sleep(600)  # killed by the parent


@pytest.mark.timeout(90)
def test_a_second_process_cannot_open_a_state_dir_a_live_receiver_holds(tmp_path):
    # Two engine replicas given one receiver id and state dir: each replayed the other's
    # journal as a crash's and overwrote its state file.
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    ready = tmp_path / "ready"
    proc = mp.get_context("fork").Process(
        target=_holding_child,
        args=(str(tmp_path / "store"), str(tmp_path / "replica"), str(ready)),
        daemon=True,
    )
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        state = (tmp_path / "replica" / names.STATE_FILE).read_bytes()
        with pytest.raises(LocalStateError, match=rf"in use by another process \(pid {proc.pid}\)"):
            _replica(rig, tmp_path, rig.tensors)
        assert (tmp_path / "replica" / names.STATE_FILE).read_bytes() == state
    finally:
        proc.kill()
        proc.join(10)
    rec = _replica(rig, tmp_path, {n: t.clone() for n, t in rig.tensors.items()})
    assert rec.pull().version == 0  # its holder is gone
    assert _replica(rig, tmp_path, rec.tensors).version == 0  # reopened in one process


def _replica(rig, tmp_path, tensors) -> Receiver:
    return Receiver.for_layout(
        rig.store, rig.rl, "tp0", tensors, str(tmp_path / "replica"), rconfig("rec")
    )


def _lock_elsewhere(state_dir) -> str:
    """What another process is told when it asks for ``state_dir``'s lock."""
    return told_in_another_process(
        "from deltasync.receiver import StateDir",
        "StateDir(path).lock('another receiver')",
        state_dir,
    )


@pytest.mark.timeout(90)
def test_a_state_dir_removed_behind_a_receiver_is_held_again_when_it_is_remade(tmp_path):
    # The lock went with the removed directory's lock file while the receiver went on
    # writing its records into the remade one: a second process was let in.
    import shutil

    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    assert rig.rec.pull().version == 0
    assert "in use by another process" in _lock_elsewhere(tmp_path / "rec")
    shutil.rmtree(tmp_path / "rec")
    rig.publish(1)
    assert rig.rec.pull().version == 1
    assert f"(pid {os.getpid()})" in _lock_elsewhere(tmp_path / "rec")
    rig.rec.close()
    assert _lock_elsewhere(tmp_path / "rec").strip() == "opened"
    # closed: its records would go into a directory another process may hold now
    state = (tmp_path / "rec" / names.STATE_FILE).read_bytes()
    rig.publish(2)
    for call in (rig.rec.pull, rig.rec.scrub, rig.rec.invalidate):
        with pytest.raises(ConfigError, match=r"after close\(\)"):
            call()
    assert (tmp_path / "rec" / names.STATE_FILE).read_bytes() == state


def test_a_lock_that_cannot_be_stamped_is_a_local_state_error_and_leaves_no_descriptor(
    tmp_path, monkeypatch
):
    # a full disk: a bare OSError, and the locked descriptor was left open and untracked
    def full(*args):
        raise OSError(28, "No space left on device")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(LocalStateError, match=r"cannot write the lock .* No space left"):
        StateDir(tmp_path / "rec").lock("receiver 'r'")
    assert len(os.listdir("/proc/self/fd")) == before
