"""Local files are private where they should be: a receiver's state directory, state file and
journal are its owner's alone, whatever the umask; atomic writes take an exact mode."""

from __future__ import annotations

import os
import stat

from kit import TinyTrainer, rconfig, tiny_layouts, zero_tensors

from deltasync import (
    MemoryStore,
    Publisher,
    PublisherConfig,
    Receiver,
    SnapshotTracker,
    TrainerSync,
)
from deltasync.atomic import write_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_receivers_state_dir_and_records_are_private_whatever_the_umask(tmp_path):
    spec, _tl, rl = tiny_layouts()
    store = MemoryStore()
    trainer = TinyTrainer(spec)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params).step_published(0)
    zeros = zero_tensors(rl, "tp0")
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        rec = Receiver.for_layout(
            store,
            rl,
            "tp0",
            zeros,
            str(tmp_path / "state"),
            rconfig("r"),
        )
        assert rec.pull().version == 0
    finally:
        os.umask(old)
    assert _mode(tmp_path / "state") == 0o700
    files = [p for p in (tmp_path / "state").iterdir() if p.is_file()]
    assert files, "the receiver recorded its state"
    for p in files:
        assert _mode(p) == 0o600, p.name
    pub.close()


def test_write_atomic_sets_the_exact_mode_asked_for(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "shared", b"x", mode=0o644)
        write_atomic(tmp_path / "private", b"x", mode=0o600)
        write_atomic(tmp_path / "made", lambda p: p.write_bytes(b"x"), mode=0o640)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "shared") == 0o644
    assert _mode(tmp_path / "private") == 0o600
    assert _mode(tmp_path / "made") == 0o640


def test_the_process_umask_is_read_without_being_changed(monkeypatch):
    from deltasync.atomic import process_umask

    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        assert os.umask(0o027) == 0o027  # still set: nothing widened it meanwhile
        # without /proc (another OS): set and restored
        monkeypatch.setattr("deltasync.atomic.Path.read_text", _no_proc)
        assert process_umask() == 0o027
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)


def _no_proc(self, *args, **kwargs):
    raise FileNotFoundError(str(self))
