"""A receiver's state directory is its own: a link another user planted where it goes is
refused (its target untouched), as is a directory another user owns (a link this user made is
followed); one of ours that group or others may read or write is made private; a record file
that is a link is never read through."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from kit import TinyTrainer, tiny_layouts

from deltasync import LocalStore, Publisher, PublisherConfig, SnapshotTracker, TrainerSync
from deltasync.errors import LocalStateError
from deltasync.receiver import StateDir
from deltasync.receiver.journal import Journal


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "journal.json").write_text("someone else's\n")
    return victim


def _plant(link, target) -> None:
    """A link at ``link`` made by another user (as root: given away)."""
    link.symlink_to(target)
    if os.geteuid() != 0:
        pytest.skip("only root can give a link to another user here")
    os.lchown(link, 54321, 54321)


def test_a_link_another_user_planted_at_the_state_dir_is_refused_and_its_target_untouched(
    tmp_path,
):
    victim = _victim(tmp_path)
    planted = tmp_path / "state"
    _plant(planted, victim)
    with pytest.raises(LocalStateError, match=r"'.*state' is a symbolic link of uid 54321"):
        StateDir(planted)
    assert sorted(os.listdir(victim)) == ["journal.json"]


def test_a_link_this_user_made_to_a_dir_of_its_own_is_followed(tmp_path):
    elsewhere = tmp_path / "volume" / "state"
    elsewhere.mkdir(parents=True, mode=0o700)
    (tmp_path / "state").symlink_to(elsewhere)
    StateDir(tmp_path / "state").write_journal(_journal())
    assert os.listdir(elsewhere) == ["journal.json"]


def _journal() -> Journal:
    return Journal(receiver="r", shard="tp0", from_version=None, steps=())


def test_a_link_swapped_in_for_the_state_dir_after_it_was_opened_is_refused(tmp_path):
    state = StateDir(tmp_path / "state")
    victim = _victim(tmp_path)
    os.rename(tmp_path / "state", tmp_path / "moved")
    _plant(tmp_path / "state", victim)
    with pytest.raises(LocalStateError, match=r"is a symbolic link of uid 54321"):
        state.write_journal(_journal())
    assert sorted(os.listdir(victim)) == ["journal.json"]


def test_a_file_where_the_state_dir_goes_is_refused(tmp_path):
    (tmp_path / "state").write_text("x")
    with pytest.raises(LocalStateError, match=r"is not a directory"):
        StateDir(tmp_path / "state")


def test_a_state_dir_another_user_owns_is_refused(tmp_path):
    theirs = tmp_path / "state"
    theirs.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user here")
    os.chown(theirs, 54321, 54321)
    with pytest.raises(LocalStateError, match=r"owned by uid 54321, not by this process's user"):
        StateDir(theirs)


def test_our_state_dir_made_under_a_loose_umask_is_made_private(tmp_path):
    ours = tmp_path / "state"
    ours.mkdir()
    os.chmod(ours, 0o775)
    StateDir(ours)
    assert stat.S_IMODE(os.lstat(ours).st_mode) == 0o700
    os.chmod(ours, 0o555)  # read-only on purpose: only the group and other bits go
    StateDir(ours)
    assert stat.S_IMODE(os.lstat(ours).st_mode) == 0o500
    os.chmod(ours, 0o700)


def test_a_record_that_is_a_link_is_never_read_through(tmp_path):
    state = StateDir(tmp_path / "state")
    outside = tmp_path / "outside.json"
    outside.write_text('{"anything": 1}')
    state.state_path.symlink_to(outside)
    with pytest.raises(LocalStateError, match=r"state\.json' is a symbolic link, so not a"):
        state.read_state()


@pytest.mark.timeout(120)
def test_the_pull_sidecar_refuses_a_link_planted_at_its_state_dir(tmp_path):
    # the sidecar wrote its lock and state file into the link's target and removed the
    # journal it found there; without --receiver-id it took that target's receiver id
    spec, _tl, rl = tiny_layouts()
    store = LocalStore(tmp_path / "store", durable=False)
    trainer = TinyTrainer(spec, density=0.2)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig())
    TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params).step_published(0)
    victim = _victim(tmp_path)
    out = tmp_path / "weights"
    out.mkdir()
    _plant(out / ".tp0.deltasync", victim)
    argv = ["pull", str(tmp_path / "store"), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    done = subprocess.run(
        [sys.executable, "-m", "deltasync", *argv, "--dir", str(out), "--once"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 2, done.stderr
    assert "is a symbolic link of uid 54321" in done.stderr, done.stderr
    assert sorted(os.listdir(victim)) == ["journal.json"]
    assert not (out / "tp0.safetensors").exists()
