"""A receiver that reopens an existing journal file (a replacement process): it resumes at the
journal's version only when its tensors hash to the digest recorded with that version; fresh
tensors, or a version recorded without a digest, are anchor-only, refused before any write."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from kit import bits
from test_cluster_single_process import World

from deltasync.atomic import write_record
from deltasync.cluster import AnchorRequiredError, ClusterReceiver
from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.layout.digest import state_digest
from deltasync.layout.part_digests import receiver_part_digests


def _with_journals(world: World, tmp_path: Path) -> dict[int, Path]:
    """Give every receiver of ``world`` (holding nothing yet) a journal file."""
    paths = {rank: tmp_path / f"journal-{rank}.json" for rank in world.receivers}
    for rank, rec in list(world.receivers.items()):
        world.receivers[rank] = _reopen(rec, rec.tensors, paths[rank])
    return paths


def _reopen(old: ClusterReceiver, tensors: dict[str, torch.Tensor], path: Path) -> ClusterReceiver:
    """A replacement of ``old`` over ``tensors`` and the journal file ``path``."""
    return ClusterReceiver(
        tensors,
        plan=old.plan,
        rank=old.rank,
        layout=old.layout,
        version=None,
        config=old.config,
        journal_path=str(path),
    )


def _at_version_1(tmp_path: Path, **world: object) -> tuple[World, dict[int, Path]]:
    w = World(**world)
    paths = _with_journals(w, tmp_path)
    w.sync(0, anchor=True)
    w.step()
    w.sync(1)
    assert w.mismatches() == []
    return w, paths


def _refuses_a_delta_then_takes_an_anchor(world: World, rank: int, version: int) -> None:
    """The next delta is refused on ``rank`` before any write; an anchor then makes every
    receiver bit-exact, at ``version``."""
    world.step()
    inbox = world.payloads(version)
    rec = world.receivers[rank]
    before = {n: bits(t).clone() for n, t in rec.tensors.items()}
    with pytest.raises(AnchorRequiredError, match="dirty"):
        rec.apply_payload(inbox[rank])
    assert all(torch.equal(bits(t), before[n]) for n, t in rec.tensors.items())
    world.sync(version, anchor=True)
    assert world.mismatches() == []
    assert {r.version for r in world.receivers.values()} == {version}
    assert not rec.journal.state.dirty


@pytest.mark.parametrize("digest_every", [1, 0, 4])
def test_a_replacement_with_fresh_tensors_and_the_journal_holds_no_version_until_an_anchor(
    tmp_path: Path, digest_every: int, caplog: pytest.LogCaptureFixture
) -> None:
    world, paths = _at_version_1(tmp_path, digest_every=digest_every)
    old = world.receivers[1]
    fresh = {n: torch.zeros_like(t) for n, t in old.tensors.items()}  # the engine reloaded
    with caplog.at_level(logging.WARNING, logger="deltasync.cluster.cluster_receiver"):
        new = _reopen(old, fresh, paths[1])
    assert new.version is None and new.journal.state.dirty
    assert str(paths[1]) in caplog.text and "names version 1" in caplog.text
    # durably: a second replacement reads the dirty journal
    assert ClusterJournal(version=None, path=paths[1]).state.dirty
    world.receivers[1] = new
    _refuses_a_delta_then_takes_an_anchor(world, 1, 2)
    world.step()
    world.sync(3)  # and deltas apply again after the anchor
    assert world.mismatches() == [] and new.version == 3


@pytest.mark.parametrize("survivor", ["same", "copy"])
def test_a_replacement_whose_tensors_survived_resumes_at_the_journals_version(
    tmp_path: Path, survivor: str
) -> None:
    world, paths = _at_version_1(tmp_path, digest_every=1)
    old = world.receivers[1]
    assert old.journal.state.digest == state_digest(old.tensors)
    tensors = old.tensors if survivor == "same" else {n: t.clone() for n, t in old.tensors.items()}
    new = _reopen(old, tensors, paths[1])
    assert new.version == 1 and not new.journal.state.dirty
    world.receivers[1] = new
    world.step()
    world.sync(2)
    assert world.mismatches() == [] and new.version == 2


def test_part_digests_are_recorded_and_checked_on_reopen(tmp_path: Path) -> None:
    # Several writers without the full state: each sends its part digest, none the state digest.
    world, paths = _at_version_1(tmp_path, writers=2, digest_every=1, full_state=False)
    old = world.receivers[2]
    parts = receiver_part_digests(old.tensors, layout=old.layout, shard=old.shard, count=2)
    state = old.journal.state
    assert state.digest is None and state.part_digests == (parts[0], parts[1])
    survived = _reopen(old, {n: t.clone() for n, t in old.tensors.items()}, paths[2])
    assert survived.version == 1
    drifted = {n: t.clone() for n, t in old.tensors.items()}
    drifted["model.layers.1.mlp.down_proj.weight"].view(torch.int16)[-1, 0] ^= 1  # writer 1's
    new = _reopen(old, drifted, paths[2])
    assert new.version is None and new.journal.state.dirty
    world.receivers[2] = new
    _refuses_a_delta_then_takes_an_anchor(world, 2, 2)


def test_a_journal_written_before_digests_existed_is_read_and_cannot_vouch_for_the_tensors(
    tmp_path: Path,
) -> None:
    world, paths = _at_version_1(tmp_path, digest_every=1)
    old = world.receivers[1]
    old_format = {"committed": 1, "applying": None, "dirty": False, "window": 0}
    write_record(paths[1], old_format)
    new = _reopen(old, old.tensors, paths[1])  # even the very tensors: nothing to check them by
    assert new.version is None and new.journal.state.dirty
    write_record(paths[1], old_format)
    journal = ClusterJournal(version=None, path=paths[1])
    assert journal.state.committed == 1 and journal.state.digest is None
    assert journal.state.part_digests is None and not journal.state.dirty
    journal.mark_dirty()
    world.receivers[1] = new
    _refuses_a_delta_then_takes_an_anchor(world, 1, 2)


@pytest.mark.parametrize("digest_every", [0, 4])
def test_a_version_committed_without_a_digest_cannot_be_verified_on_reopen(
    tmp_path: Path, digest_every: int
) -> None:
    world, paths = _at_version_1(tmp_path, digest_every=digest_every)  # v1 carries no digest
    old = world.receivers[1]
    on_disk = json.loads(paths[1].read_text())
    new = _reopen(old, old.tensors, paths[1])  # the tensors survived, but nothing proves it
    assert new.version is None and new.journal.state.dirty
    assert on_disk["committed"] == 1 and on_disk["digest"] is None
    world.receivers[1] = new
    _refuses_a_delta_then_takes_an_anchor(world, 1, 2)


def test_the_digest_always_describes_the_committed_version(tmp_path: Path) -> None:
    world = World(digest_every=2)
    paths = _with_journals(world, tmp_path)
    world.sync(0, anchor=True)
    for version in range(1, 5):
        world.step()
        world.sync(version)
        for rec in world.receivers.values():
            expected = state_digest(rec.tensors) if version % 2 == 0 else None
            assert rec.journal.state.digest == expected, version
    old = world.receivers[1]
    new = _reopen(old, old.tensors, paths[1])  # v4 carried a digest again: resumes
    assert new.version == 4


def test_a_reopened_apply_keeps_its_retry_only_while_the_tensors_still_hold_the_base(
    tmp_path: Path,
) -> None:
    world, paths = _at_version_1(tmp_path, digest_every=1)
    world.step()
    inbox = world.payloads(2)
    old = world.receivers[1]
    old.journal.begin(2, 1)  # killed after the apply's record, before its first write
    untouched = _reopen(old, old.tensors, paths[1])
    assert untouched.journal.state.applying == (2, 1) and not untouched.journal.state.dirty
    other = tmp_path / "fresh.json"
    other.write_bytes(paths[1].read_bytes())
    fresh = _reopen(old, {n: torch.zeros_like(t) for n, t in old.tensors.items()}, other)
    assert fresh.version is None and fresh.journal.state.dirty  # not the base: anchor
    # killed after the scatter, before the commit: the attempt's values cannot be told from
    # values the base never had, so the survivor needs an anchor too
    old.apply_payload(inbox[1])
    assert old.journal.state.applying == (2, 1) and old.journal.state.digest is not None
    written = _reopen(old, old.tensors, paths[1])
    assert written.version is None and written.journal.state.dirty
    world.receivers[1] = written
    world.sync(2, anchor=True)
    assert world.mismatches() == []
