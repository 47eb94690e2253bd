"""A receiver whose state dir is on a full filesystem: every record it cannot write (the state
file, the journal, the lock's pid) is a LocalStateError naming the file and the remedy (free
space there), also where no caller wraps it: a receiver restarted on that dir after a pull
that could not record its version (it said only "No space left on device"). It refuses
clearly, reports no version it does not hold, and once space is freed comes up and pulls bit
for bit. On a real tmpfs where this machine lets the test mount one, else through writes
refused for room at fsync."""

from __future__ import annotations

import errno
import os

import pytest
from kit import anchored_bf16, assert_same_bits, fill_up, mounted_tmpfs, publish_edit, zero_tensors

from deltasync import MemoryStore, Receiver, ReceiverConfig
from deltasync.errors import LocalStateError
from deltasync.receiver.journal import LocalState, StateDir

SHARD = "tp0"
REMEDY = r"its filesystem is full: free space in '.*', then try again"


def _receiver(store, rl, path, tensors) -> Receiver:
    return Receiver.for_layout(
        store, rl, SHARD, tensors, str(path), ReceiverConfig(receiver_id="r")
    )


def test_a_receiver_restarted_on_a_full_state_dir_refuses_naming_the_remedy_then_recovers(
    tmp_path,
):
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=5)
    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        rec = _receiver(store, rl, mnt / "rec", zero_tensors(rl, SHARD))
        assert rec.pull().version == 0
        publish_edit(pub, params, 1, 9)
        v1 = rl.split(tl.to_canonical(params))[SHARD]
        fill_up(mnt, leave=4096)  # room for the journal, none for the state file
        with pytest.raises(LocalStateError, match=r"version 1 was written .* but not recorded"):
            rec.pull()
        assert rec.version is None  # it holds version 1, recorded 0: it reports neither
        rec.close()
        # A restart (the engine's fresh weights) on the still-full dir: the journal cannot be
        # replayed onto them, and the state file cannot say so.
        with pytest.raises(LocalStateError, match=rf"state\.json': No space left.*{REMEDY}"):
            _receiver(store, rl, mnt / "rec", zero_tensors(rl, SHARD))
        os.unlink(mnt / "FILLER")
        tensors = zero_tensors(rl, SHARD)
        rec = _receiver(store, rl, mnt / "rec", tensors)
        # its start repairs from the newest anchor: it comes up at the version it now holds
        assert rec.version == 1 and not rec.dirty
        assert_same_bits(tensors, v1, "repaired at the start")
        assert rec.pull().version == 1
        assert_same_bits(tensors, v1, "restored once space was freed")
        rec.close()


def test_a_lock_on_a_full_filesystem_names_the_remedy(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        (mnt / "rec").mkdir()
        fill_up(mnt)
        with pytest.raises(LocalStateError, match=rf"cannot write the lock .*{REMEDY}"):
            StateDir(mnt / "rec").lock("receiver 'r'")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_records_refused_for_room_name_the_file_and_the_remedy(tmp_path, monkeypatch, code):
    state_dir = StateDir(tmp_path / "rec")
    state_dir.ensure()
    state = LocalState(receiver="r", shard=SHARD, version=None, state_digest=None)

    def full(*args):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(LocalStateError, match=rf"state\.json'.*{REMEDY}"):
            state_dir.write_state(state)
    assert state_dir.read_state() is None and os.listdir(tmp_path / "rec") == []
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", full)
        with pytest.raises(LocalStateError, match=rf"cannot write the lock .*{REMEDY}"):
            StateDir(tmp_path / "rec2").lock("receiver 'r'")
