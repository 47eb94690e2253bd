"""A pull whose scatter stops in the same process (an error or an interrupt midway, or the
engine's pause refusing before the first write): the receiver never reports the version it
held before a torn write, and the next pull repairs and goes on to the newest version."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from kit import same_bits
from truth_kit import Rig, snapshot

from deltasync import LocalStore
from deltasync.commit import Catalog
from deltasync.errors import IntegrityError
from deltasync.receiver import store_receiver


@pytest.fixture
def rig(tmp_path):
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    for v in range(3):
        rig.publish(v)
    rig.check(rig.rec.pull())
    return rig


def _stopping_after(tensors: int, exc: BaseException):
    real = store_receiver.apply_pieces
    count = 0

    def apply(*args, **kwargs):
        nonlocal count
        if count == tensors:
            raise exc
        count += 1
        return real(*args, **kwargs)

    return apply


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_a_scatter_stopped_midway_reports_no_version_until_the_next_pull_repairs(
    rig, monkeypatch, exc
):
    rig.publish(3)
    monkeypatch.setattr(store_receiver, "apply_pieces", _stopping_after(2, exc))
    with pytest.raises(type(exc)):
        rig.rec.pull()
    monkeypatch.undo()
    assert rig.rec.dirty  # torn: neither 2 nor 3
    assert rig.rec.version is None and rig.rec.state_digest is None and rig.rec.run_id is None
    assert rig.rec.verified_version == 2
    if isinstance(exc, Exception):  # the registration says so too
        assert Catalog(rig.store).receivers()["rec"].version is None
    rig.publish(4)
    report = rig.rec.pull()  # the journal (to 3) first, then on to the head
    assert report.repaired and report.chain == (3, 4) and report.previous_version is None
    rig.check(report)
    assert Catalog(rig.store).receivers()["rec"].version == 4


@pytest.mark.timeout(60)
def test_an_interrupt_while_the_journal_is_written_leaves_no_journal_behind(rig, monkeypatch):
    # the journal's thread went on after the pull raised: its file landed afterwards, beside
    # whatever this receiver did next, naming a chain the tensors never took
    real_write = rig.rec.dir.write_journal

    def slow_write(journal):
        time.sleep(0.3)
        real_write(journal)

    class Interrupted(store_receiver.InBackground):
        def wait(self):
            if self.name == "deltasync-receiver-record":
                raise KeyboardInterrupt
            return super().wait()

    monkeypatch.setattr(rig.rec.dir, "write_journal", slow_write)
    monkeypatch.setattr(store_receiver, "InBackground", Interrupted)
    rig.publish(3)
    before = snapshot(rig.rec.tensors)
    with pytest.raises(KeyboardInterrupt):
        rig.rec.pull()
    monkeypatch.undo()
    time.sleep(0.5)  # longer than the slowed write: nothing of that pull is still running
    assert not rig.rec.dir.journal_path.exists()
    assert rig.rec.version == 2 and same_bits(rig.rec.tensors, before)
    report = rig.rec.pull()
    assert not report.repaired and report.chain == (3,)
    rig.check(report)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in the test, whatever handler the process inherited (a
    background job of a non-interactive shell, and its test workers, start with it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_while_the_journal_is_written_still_leaves_no_journal(rig, ctrl_c_raises):
    # the second SIGINT, held while the journal's write was waited out, was delivered before
    # the file was removed: the next pull replayed a chain the tensors never took
    real_write = rig.rec.dir.write_journal

    def interrupted_write(journal):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)  # the pull waits for this write (or verifies)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # held until the file is written and removed
        time.sleep(0.2)
        real_write(journal)

    rig.publish(3)
    before = snapshot(rig.rec.tensors)
    rig.rec.dir.write_journal = interrupted_write
    try:
        with pytest.raises(KeyboardInterrupt):
            rig.rec.pull()
    finally:
        del rig.rec.dir.write_journal
    time.sleep(0.5)
    assert not rig.rec.dir.journal_path.exists()
    assert rig.rec.version == 2 and same_bits(rig.rec.tensors, before)
    assert rig.rec.pull(2).version == 2  # held: nothing replayed
    rig.check(rig.rec.pull())


@pytest.mark.timeout(60)
def test_a_pause_that_refuses_before_the_first_write_leaves_nothing_to_repair(rig):
    refuse = True

    @contextlib.contextmanager
    def pause():
        if refuse:
            raise RuntimeError("the engine cancelled this update")
        yield

    rec = rig.receiver(pause=pause)
    rig.publish(3)
    before = snapshot(rec.tensors)
    with pytest.raises(RuntimeError, match="cancelled"):
        rec.pull()
    assert rec.version == 2 and not rec.dirty and same_bits(rec.tensors, before)
    assert not rec.dir.journal_path.exists()
    refuse = False
    rig.publish(4)
    report = rec.pull()
    assert not report.repaired and report.chain == (3, 4)
    rig.rec = rec
    rig.check(report)


@pytest.mark.timeout(60)
def test_a_pause_that_suppresses_an_error_midway_does_not_make_a_torn_write_a_version(
    rig, monkeypatch
):
    # an engine's hook that logs what failed inside it and resumes: the receiver went on to
    # record version 3 (state file, ack, registration) over tensors holding part of it
    class LoggingPause:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            return exc is not None  # logged by the engine, not re-raised

    rec = rig.receiver(pause=LoggingPause)
    rig.publish(3)
    monkeypatch.setattr(store_receiver, "apply_pieces", _stopping_after(2, RuntimeError("OOM")))
    with pytest.raises(IntegrityError, match="suppressed the error"):
        rec.pull()
    monkeypatch.undo()
    assert rec.dirty and rec.version is None
    assert Catalog(rig.store).receivers()[rec.config.receiver_id].version is None
    assert rec.config.receiver_id not in Catalog(rig.store).acks(3)
    report = rec.pull()  # the journal first: version 3 whole
    assert report.repaired and report.version == 3
    rig.rec = rec
    rig.check(report)
