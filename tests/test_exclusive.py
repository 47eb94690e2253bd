"""``deltasync.exclusive``: a file held for one process, and what lets it go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit import tiny_layouts, told_in_another_process

from deltasync.cluster import ClusterReceiver, RolePlan
from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.errors import ConfigError, LocalStateError
from deltasync.exclusive import FileHold

SRC = Path(__file__).resolve().parents[1] / "src"

# A holder dropped inside a reference cycle is freed by the cyclic collector, which may start
# on any allocation: here, for each offset d, on the d-th one after a new FileHold began, so one
# lands inside its guarded section, where the dropped holder's finalizer then runs.
_COLLECTED_INSIDE = r"""
import gc, os, sys
from deltasync.exclusive import FileHold

class Owner:  # a receiver in a reference cycle (bound callbacks, threads)
    def __init__(self, path):
        self.hold = FileHold(path, what="state dir", owner="old", remedy="r")
        self.me = self

for d in range(40):
    gc.collect()
    old = Owner(os.path.join(sys.argv[1], f"old{d}.lock"))
    gc.collect(0)
    del old
    gc.set_threshold(1, gc.get_count()[1] + d)
    new = FileHold(os.path.join(sys.argv[1], f"new{d}.lock"), what="journal", owner="new", remedy="r")
    gc.set_threshold(700, 10, 10)
    new.release()
print("finished")
"""


@pytest.mark.timeout(120)
def test_a_holder_collected_inside_another_holders_construction_does_not_hang(tmp_path):
    # the finalizer took the guard its own thread held: the process hung for good, silently
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run(
        [sys.executable, "-c", _COLLECTED_INSIDE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr


def test_retaking_a_file_that_was_not_replaced_keeps_the_lock(tmp_path):
    # closing a second descriptor of the locked file would drop the process's lock on it
    first = FileHold(tmp_path / "lock", what="dir", owner="a", remedy="r")
    second = FileHold(tmp_path / "lock", what="dir", owner="b", remedy="r")
    first.retake()
    second.retake()
    assert "in use by another process" in told_in_another_process(
        "from deltasync.exclusive import FileHold",
        "FileHold(path, what='dir', owner='other', remedy='r')",
        tmp_path / "lock",
    )
    first.release()
    second.release()
    assert not first.held and not second.held


@pytest.mark.timeout(60)
def test_a_child_forked_while_another_thread_holds_the_guard_can_hold_files(tmp_path):
    import threading

    import deltasync.exclusive as exclusive

    taken, leave = threading.Event(), threading.Event()

    def holding() -> None:
        with exclusive._HELD_GUARD:
            taken.set()
            leave.wait(30)

    thread = threading.Thread(target=holding)
    thread.start()
    assert taken.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the thread holding the guard does not exist here
            code = 1
            try:
                FileHold(tmp_path / "child.lock", what="dir", owner="child", remedy="r")
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        leave.set()
        thread.join(30)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_journal_that_fails_to_open_holds_nothing(tmp_path):
    # the hold stayed with the half-built journal while its error was referenced: the repaired
    # journal's replacement process was refused, naming a process with no receiver
    path = tmp_path / "journal.json"
    path.write_text("{not json")
    with pytest.raises(LocalStateError, match="not valid JSON") as failed:
        ClusterJournal(version=None, path=path)
    path.unlink()
    assert failed.value is not None  # still referenced, as a launcher's last error would be
    told = told_in_another_process(
        "from deltasync.cluster.cluster_journal import ClusterJournal",
        "ClusterJournal(version=None, path=path)",
        path,
    )
    assert told.strip() == "opened"


def test_a_journal_reached_through_a_symlink_is_held_as_the_file_itself(tmp_path):
    (tmp_path / "shared").mkdir()
    real = tmp_path / "shared" / "journal-rank1.json"
    (tmp_path / "rank1").mkdir()
    link = tmp_path / "rank1" / "journal.json"
    link.symlink_to(real)
    journal = ClusterJournal(version=None, path=link)
    told = told_in_another_process(
        "from deltasync.cluster.cluster_journal import ClusterJournal",
        "ClusterJournal(version=None, path=path)",
        real,
    )
    assert "in use by another process" in told
    journal.close()


def test_a_closed_cluster_receiver_refuses_every_call_and_writes_nothing(tmp_path):
    # close() let the journal go to a replacement process, and the old receiver went on
    # writing it
    _, _, layout = tiny_layouts(engine="vllm", tp=2)
    plan = RolePlan.contiguous(num_writers=1, shards=[s.id for s in layout.shards()])
    role = plan.receiver(1)
    tensors = {
        n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(role.shard).items()
    }
    path = tmp_path / "journal.json"
    receiver = ClusterReceiver(
        tensors, plan=plan, rank=1, layout=layout, version=None, journal_path=str(path)
    )
    receiver.close()
    record = path.read_bytes()
    for call in (receiver.sync, receiver.receive, lambda: receiver.apply_payload({})):
        with pytest.raises(ConfigError, match=r"after close\(\).*Nothing was written"):
            call()
    receiver.close()  # again: nothing to let go
    assert path.read_bytes() == record
    with pytest.raises(LocalStateError, match="was closed"):
        receiver.journal.begin(0, -1)
    assert path.read_bytes() == record


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path):
    # the pid stamp truncated and wrote whatever the link named (as root: any file)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "lock").symlink_to(victim)
    with pytest.raises(LocalStateError, match="symbolic link") as refused:
        FileHold(tmp_path / "state" / "lock", what="state dir", owner="rx", remedy="r")
    assert "state/lock" in str(refused.value)
    assert victim.read_text() == "precious"


@pytest.mark.timeout(30)
def test_a_lock_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "lock"
    os.mkfifo(fifo)
    with pytest.raises(LocalStateError, match="not a regular file"):
        FileHold(fifo, what="state dir", owner="rx", remedy="r")


def test_a_lock_link_to_a_file_this_process_holds_is_refused_too(tmp_path):
    # the registry is keyed by the real path: the link was taken for a second holder of the
    # file it names, never opened, so the refusal above never ran
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    held = FileHold(tmp_path / "a" / "lock", what="state dir a", owner="rx-a", remedy="r")
    (tmp_path / "b" / "lock").symlink_to(tmp_path / "a" / "lock")
    with pytest.raises(LocalStateError, match="symbolic link"):
        FileHold(tmp_path / "b" / "lock", what="state dir b", owner="rx-b", remedy="r")
    held.release()
