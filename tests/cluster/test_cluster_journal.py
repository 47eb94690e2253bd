"""The in-cluster receiver journal: what it accepts, and that it survives a restart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deltasync.cluster import AnchorRequiredError
from deltasync.cluster.cluster_journal import ClusterJournal, JournalState
from deltasync.errors import BaseVersionMismatchError, ConfigError, VersionError
from deltasync.receiver import LocalStateError


def test_a_fresh_receiver_accepts_only_an_anchor() -> None:
    j = ClusterJournal(version=None)
    j.accepts(version=0, base=-1, where="t")
    with pytest.raises(AnchorRequiredError, match="holds no verified version"):
        j.accepts(version=1, base=0, where="t")


def test_a_delta_on_another_base_is_refused_as_a_base_mismatch() -> None:
    j = ClusterJournal(version=4)
    j.accepts(version=5, base=4, where="t")
    with pytest.raises(BaseVersionMismatchError, match="holds version 4"):
        j.accepts(version=6, base=5, where="t")


def test_a_version_number_it_committed_is_never_taken_again_even_as_an_anchor() -> None:
    j = ClusterJournal(version=4)
    for version, base in ((4, -1), (3, -1), (4, 3)):
        with pytest.raises(VersionError, match="committed version 4"):
            j.accepts(version=version, base=base, where="t")
    j.accepts(version=5, base=-1, where="t")


def test_an_uncommitted_apply_still_accepts_the_retry_on_the_same_base() -> None:
    j = ClusterJournal(version=4)
    j.begin(5, 4)
    assert j.state == JournalState(committed=4, applying=(5, 4))
    j.accepts(version=5, base=4, where="t")  # the retry converges: see the module docstring
    j.commit(5)
    assert j.state == JournalState(committed=5)


def test_a_dirty_receiver_accepts_only_an_anchor_until_one_commits() -> None:
    j = ClusterJournal(version=4)
    j.begin(5, 4)
    j.mark_dirty()
    with pytest.raises(AnchorRequiredError, match="is dirty"):
        j.accepts(version=5, base=4, where="t")
    j.accepts(version=5, base=-1, where="t")
    j.begin(5, -1)
    assert j.state.dirty  # still dirty until the anchor is committed
    j.commit(5)
    assert j.state == JournalState(committed=5)


def test_the_journal_file_survives_a_restart_and_wins_over_the_given_version(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.json"
    j = ClusterJournal(version=2, path=path)
    j.begin(3, 2)
    again = ClusterJournal(version=0, path=path)  # a restarted receiver
    assert again.state == JournalState(committed=2, applying=(3, 2))
    assert not list(tmp_path.glob(".*tmp*"))  # written through a renamed temporary file


def test_a_damaged_journal_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.json"
    path.write_text('{"committed": "two"}')
    with pytest.raises(LocalStateError, match="not a deltasync cluster journal"):
        ClusterJournal(version=None, path=path)


@pytest.mark.parametrize(
    "record",
    [
        {"committed": 2**64, "applying": None, "dirty": False},
        {"committed": 10**8, "applying": None, "dirty": False},
        {"committed": 2, "applying": [3, 2], "dirty": False, "window": 2**64},
        {"committed": 2, "applying": [3, 2], "dirty": False, "window": -1},
    ],
)
def test_a_journal_naming_a_version_or_window_out_of_range_is_refused(
    tmp_path: Path, record
) -> None:
    # taken as written: the receiver's preflight row then raised a bare OverflowError on
    # this rank alone, and every other rank waited out its timeout
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(record))
    with pytest.raises(LocalStateError, match=r"journal\.json' is not a deltasync cluster"):
        ClusterJournal(version=None, path=path)


@pytest.mark.parametrize("version", [2**64, 10**8, -1])
def test_a_version_no_key_can_name_is_refused_when_the_journal_is_built(version) -> None:
    with pytest.raises(ConfigError, match=rf"0\.\.99999999, got {version}"):
        ClusterJournal(version=version)


@pytest.mark.parametrize(
    ("committed", "applying"),
    [
        (2, [-5, -7]),  # no version is negative
        (2, [3, 1]),  # a delta on a base other than the committed version
        (2, [2, -1]),  # an anchor at a number already committed
        (None, [3, 2]),  # a delta on a base never committed
        (2, [3, 2, 1]),
        (2, [3.0, 2]),
        (2, [2**64, 2]),  # no int64 holds it (the preflight row crashed on it)
    ],
)
def test_an_apply_no_receiver_could_have_begun_is_refused(
    tmp_path: Path, committed, applying
) -> None:
    # such a record was taken as written: a retry "on the same base" of an apply that was
    # never possible
    path = tmp_path / "journal.json"
    record = {"committed": committed, "applying": applying, "dirty": False}
    path.write_text(json.dumps(record))
    with pytest.raises(LocalStateError, match="not a deltasync cluster journal"):
        ClusterJournal(version=None, path=path)
    record["applying"] = [3, -1] if committed is None else [committed + 1, committed]
    path.write_text(json.dumps(record))
    assert ClusterJournal(version=None, path=path).state.applying == tuple(record["applying"])


def test_a_commit_records_the_digests_verified_for_that_version_and_only_those(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.json"
    j = ClusterJournal(version=None, path=path)
    assert not j.reopened
    j.begin(0, -1)
    j.verified(0, digest="d0")
    j.commit(0)
    assert j.state == JournalState(committed=0, digest="d0")
    j.begin(1, 0)
    j.verified(1, digest=None, part_digests=("p0", "p1"))
    j.commit(1)
    assert j.state == JournalState(committed=1, part_digests=("p0", "p1"))
    j.begin(2, 1)
    j.verified(2, digest=None)  # sent without digests: unknown again
    j.commit(2)
    assert j.state == JournalState(committed=2)
    j.verified(3, digest="d3")
    j.begin(3, 2)  # a new apply forgets what an earlier one noted
    j.commit(3)
    assert j.state.digest is None
    j.begin(4, 3)
    j.verified(4, digest="d4")
    j.commit(4)
    again = ClusterJournal(version=None, path=path)
    assert again.reopened and again.state == JournalState(committed=4, digest="d4")


def test_a_journal_without_digest_fields_reads_as_unknown_digests(tmp_path: Path) -> None:
    path = tmp_path / "journal.json"
    path.write_text('{"applying":null,"committed":3,"dirty":false}')  # before windows, digests
    state = ClusterJournal(version=None, path=path).state
    assert state == JournalState(committed=3) and not state.checkable
    path.write_text('{"applying":null,"committed":3,"dirty":false,"digest":7}')
    with pytest.raises(LocalStateError, match="not a deltasync cluster journal"):
        ClusterJournal(version=None, path=path)


def test_a_dirty_mark_the_disk_refuses_still_leaves_no_version_in_memory(tmp_path: Path) -> None:
    # The file was written first: when it failed (a full disk, a directory gone) the journal
    # went on reporting version 3 over tensors the receiver had just found changed.
    directory = tmp_path / "jdir"
    directory.mkdir()
    journal = ClusterJournal(version=None, path=directory / "journal.json", owner="test")
    journal.begin(3, base=-1)
    journal.commit(3)
    shutil.rmtree(directory)  # the journal and its lock
    directory.write_text("a file where the journal's directory was: every write fails")
    with pytest.raises(LocalStateError):
        journal.mark_dirty()
    assert journal.state.dirty and journal.state.applying is None
    journal.close()
