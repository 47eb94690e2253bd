"""A pull whose state dir cannot take the journal or the state file (disk full): nothing is
written without the journal, and a receiver whose scatter ended but whose state file could not
be written must not go on reporting the version before it, which the tensors no longer hold.
Either error names the version, the shard, what the tensors hold meanwhile and the remedy (it
named the file only)."""

from __future__ import annotations

import errno
import os
import re

import pytest
from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors

from deltasync import MemoryStore, Receiver, atomic, names
from deltasync.commit import ReceiverRecord
from deltasync.errors import LocalStateError
from deltasync.receiver.journal import StateDir

SHARD = "tp0"


def _no_room(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _version_1_pulled_with_a_full_state_dir(
    tmp_path, monkeypatch, record: str, *, full: bool = False
):
    """A receiver at version 0; version 1 published; its pull with ``StateDir.<record>``
    failing as on a full disk (``full``: the record write itself meets ENOSPC, and its error
    names the full disk's remedy). Returns the receiver, its tensors, version 0's and version
    1's expected tensors, and the error's text."""
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, SHARD)
    rec = Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "rec"), rconfig("rec"))
    assert rec.pull().version == 0
    v0 = rl.split(tl.to_canonical(params))[SHARD]
    publish_edit(pub, params, 1, 7)

    real = getattr(StateDir, record)

    def fails(self, obj):
        if not full:
            raise LocalStateError(f"cannot write {str(self.path)!r}: No space left on device")
        with monkeypatch.context() as m:
            m.setattr(atomic.os, "fchmod", _no_room)  # the temp file cannot be made
            real(self, obj)

    with monkeypatch.context() as m:
        m.setattr(StateDir, record, fails)
        with pytest.raises(LocalStateError) as failed:
            rec.pull()
    return rec, tensors, v0, rl.split(tl.to_canonical(params))[SHARD], str(failed.value)


def test_a_failed_state_file_write_reports_no_version_until_the_journal_is_replayed(
    tmp_path, monkeypatch
):
    # It reported version 0, not dirty (so a vLLM worker's weight_version said 0) while its
    # tensors held version 1.
    rec, tensors, _, v1, error = _version_1_pulled_with_a_full_state_dir(
        tmp_path, monkeypatch, "write_state"
    )
    assert re.search(
        r"version 1 was written to receiver shard 'tp0' but not recorded: cannot write .*"
        r"No space left on device\. It reports no version until a pull replays the journal: "
        r"free space in the state dir .* and pull again$",
        error,
    ), error
    assert_same_bits(tensors, v1, "the scatter ended")
    assert rec.dirty, "tensors at version 1, recorded version 0: it must report no version"
    assert rec.version is None and rec.verified_version == 0  # the record moves with the file
    report = rec.pull()  # the journal is replayed
    assert report.repaired and report.version == 1 and not rec.dirty
    assert_same_bits(tensors, v1)


def test_a_failed_journal_write_writes_nothing_and_names_the_version_and_the_remedy(
    tmp_path, monkeypatch
):
    rec, tensors, v0, v1, error = _version_1_pulled_with_a_full_state_dir(
        tmp_path, monkeypatch, "write_journal"
    )
    assert re.search(
        r"version 1 not taken by receiver shard 'tp0': cannot write .* No space left on "
        r"device\. Nothing was written .* free space in the state dir .* and pull again$",
        error,
    ), error
    assert_same_bits(tensors, v0, "nothing written")
    assert rec.version == 0 and not rec.dirty
    assert rec.pull().version == 1
    assert_same_bits(tensors, v1)


@pytest.mark.parametrize("full", [False, True], ids=["told", "enospc"])
@pytest.mark.parametrize("call", ["scrub", "invalidate"])
def test_tensors_known_drifted_on_a_full_state_dir_report_and_register_no_version(
    tmp_path, monkeypatch, call, full
):
    # The state file write raised first, and the receiver went on reporting and registering
    # version 0 over tensors it had just found changed; the next pulls saw nothing new.
    store = MemoryStore()
    tl, rl, params, _pub = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, SHARD)
    rec = Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "rec"), rconfig("rec"))
    assert rec.pull().version == 0
    v0 = rl.split(tl.to_canonical(params))[SHARD]
    name = sorted(tensors)[-1]
    tensors[name].view(-1)[-1] += 1  # a stray write into the live tensors

    real = StateDir.write_state

    def fails(self, obj):
        if not full:
            raise LocalStateError(f"cannot write {str(self.path)!r}: No space left on device")
        with monkeypatch.context() as m:  # the record write itself meets ENOSPC
            m.setattr(atomic.os, "fchmod", _no_room)
            real(self, obj)

    with monkeypatch.context() as m:
        m.setattr(StateDir, "write_state", fails)
        with pytest.raises(LocalStateError) as failed:
            if call == "scrub":
                rec.scrub()
            else:
                rec.invalidate("the engine reloaded its weights")
    remedy = (
        r"once there is room, pull, which restores the newest anchor"
        if full
        else r"free space in the state dir .* and pull, which restores the newest anchor"
    )
    assert re.search(
        r"its tensors no longer hold version 0\. It reports no version now and its "
        r"registration is withdrawn, but its state file could not say so .*No space left on "
        rf"device.*: {remedy}",
        str(failed.value),
    ), failed.value
    assert str(failed.value).lower().count("free space") == 1  # the remedy said once
    assert rec.dirty and rec.version is None
    assert ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version is None
    report = rec.pull()  # space freed: the newest anchor, bit for bit
    assert report.version == 0 and report.from_anchor
    assert_same_bits(tensors, v0, "restored")


@pytest.mark.parametrize("record", ["write_journal", "write_state"])
def test_a_full_disk_remedy_is_given_once(tmp_path, monkeypatch, record):
    # The record write's error names the full disk's remedy; the pull's message around it
    # said "free space in the state dir" a second time.
    rec, tensors, _, v1, error = _version_1_pulled_with_a_full_state_dir(
        tmp_path, monkeypatch, record, full=True
    )
    assert error.lower().count("free space") == 1, error
    assert re.search(
        r"filesystem is full: free space in '.*'.*once there is room, pull again$", error
    ), error
    assert rec.pull().version == 1  # room again: the journal replayed, or the version taken
    assert_same_bits(tensors, v1)
