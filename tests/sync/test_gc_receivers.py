"""``deltasync gc`` (and retention under it) forgets the registrations of receivers that are
long dead, and never those of a live or briefly paused receiver: a registration goes once its
heartbeat is older than ``--forget-receivers-after`` (a day by default), and never before it
is older than both ``--receiver-ttl`` and ``--orphan-grace``. A receiver that comes back
registers again on its next pull.

It also deletes the conditional-write probes a killed S3 client left under ``probes/`` once
they are older than the orphan grace, and never one young enough to be a probe in flight
(deleting it would let that client's second write pass, and the client would refuse the
server), nor a key there that is not a probe's name."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from deltasync import names
from deltasync.cli import main
from deltasync.commit import Catalog, ReceiverRecord, collect_garbage
from deltasync.commit.retention import PROBE_MIN_AGE_S
from deltasync.errors import StoreError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import TinyTrainer, _Wrapper, layouts, rconfig, scratch_store, zero_tensors

DAY = 86400.0


def _published_store(tmp_path, versions: int = 3):
    spec, _, rl = layouts()
    path = tmp_path / "store"
    store = scratch_store(path)
    trainer = TinyTrainer(spec, density=0.02)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=10))
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    for v in range(versions):
        if v:
            trainer.step()
        sync.step_published(v)
    return path, store, rl


def _register(store, receiver: str, age_s: float, version: int = 1) -> str:
    rec = ReceiverRecord(
        receiver=receiver, shard="tp0", version=version, updated_at=time.time() - age_s
    )
    store.put(rec.key, rec.to_json())
    return rec.key


@pytest.mark.timeout(60)
def test_gc_forgets_registrations_dead_for_a_day_and_a_dry_run_only_lists_them(tmp_path, capsys):
    path, store, _ = _published_store(tmp_path)
    dead = [_register(store, f"pod-{i}", age_s=DAY + 60) for i in range(5)]
    kept = {
        _register(store, "live", age_s=1),
        _register(store, "paused-for-an-hour", age_s=3600),
        _register(store, "skewed-clock", age_s=-5),
    }
    before = sorted(store.list(""))

    assert main(["gc", str(path), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(store.list("")) == before, "a dry run deleted something"
    assert plan["receivers"] == [f"pod-{i}" for i in range(5)]
    assert set(dead) <= set(plan["keys"]) and not kept & set(plan["keys"])

    assert main(["gc", str(path)]) == 0
    out = capsys.readouterr().out
    assert "forgot 5 registration(s) of receivers without a heartbeat for over 86400 s" in out
    assert sorted(store.list(names.RECEIVERS_PREFIX)) == sorted(kept)

    # a shorter threshold, asked for: the receiver paused for an hour goes too
    assert main(["gc", str(path), "--forget-receivers-after", "1800", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["receivers"] == ["paused-for-an-hour"]
    assert not store.exists(names.receiver_key("paused-for-an-hour"))
    assert store.exists(names.receiver_key("live"))


@pytest.mark.timeout(60)
def test_a_receiver_is_never_forgotten_before_its_ttl_and_the_orphan_grace_have_passed(
    tmp_path, capsys
):
    path, store, _ = _published_store(tmp_path)
    _register(store, "paused-past-ttl", age_s=300)  # not live (ttl 120), within the grace
    _register(store, "paused-within-ttl", age_s=100)
    argv = ["gc", str(path), "--forget-receivers-after", "1", "--json"]
    assert main([*argv, "--receiver-ttl", "120", "--orphan-grace", "600"]) == 0
    assert json.loads(capsys.readouterr().out)["receivers"] == []
    assert main([*argv, "--receiver-ttl", "120", "--orphan-grace", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["receivers"] == ["paused-past-ttl"]
    assert store.exists(names.receiver_key("paused-within-ttl"))


@pytest.mark.timeout(60)
def test_a_forgotten_receiver_registers_again_on_its_next_pull(tmp_path, capsys):
    path, store, rl = _published_store(tmp_path)
    rec = Receiver.for_layout(
        store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("sleeper")
    )
    assert rec.pull().version == 2
    key = names.receiver_key("sleeper")
    assert Catalog(store).receivers()["sleeper"].version == 2
    # it sleeps for two days: its last heartbeat is that old when gc runs
    stale = ReceiverRecord(
        receiver="sleeper", shard="tp0", version=2, updated_at=time.time() - 2 * DAY
    )
    store.put(key, stale.to_json())
    assert main(["gc", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["receivers"] == ["sleeper"]
    assert not store.exists(key)

    report = rec.pull()
    assert report.version == 2 and not report.records_pending
    back = Catalog(store).receivers()["sleeper"]
    assert back.version == 2 and time.time() - back.updated_at < 60


@pytest.mark.timeout(60)
def test_retention_keeps_every_registration_when_forgetting_is_off(tmp_path):
    _, store, _ = _published_store(tmp_path)
    key = _register(store, "ancient", age_s=365 * DAY)
    plan = collect_garbage(
        store,
        Catalog(store),
        keep_versions=1,
        receiver_ttl_s=120,
        forget_receivers_after_s=math.inf,
    )
    assert plan.receivers == () and key not in plan.keys and store.exists(key)
    plan = collect_garbage(store, Catalog(store), keep_versions=1, receiver_ttl_s=120)
    assert plan.receivers == ("ancient",) and plan.keys[-1] == key and not store.exists(key)


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_the_forget_threshold_must_be_a_positive_number_of_seconds(tmp_path, capsys, bad):
    path, _, _ = _published_store(tmp_path, versions=1)
    assert main(["gc", str(path), f"--forget-receivers-after={bad}"]) == 2
    assert "--forget-receivers-after must be a number of seconds > 0" in capsys.readouterr().err


class _ComesBackDuringDeletes:
    """A store on which receiver ``who`` registers again as the first version key is deleted
    (between retention's read of the registrations and its deletion of them)."""

    def __init__(self, inner, who: str) -> None:
        self.inner, self.who, self.done = inner, who, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key: str) -> None:
        if not self.done and key.startswith("v"):
            self.done = True
            _register(self.inner, self.who, age_s=0, version=4)
        self.inner.delete(key)


@pytest.mark.timeout(60)
def test_a_receiver_that_registers_again_while_gc_deletes_keeps_its_registration(tmp_path):
    # The plan read its day-old heartbeat; the deletions of versions before took time, and it
    # came back meanwhile: its fresh registration was deleted with the planned ones.
    _, store, _ = _published_store(tmp_path, versions=12)  # anchors at 0 and 10
    _register(store, "back", age_s=DAY + 60)
    _register(store, "gone", age_s=DAY + 60)
    racing = _ComesBackDuringDeletes(store, "back")
    plan = collect_garbage(racing, Catalog(racing), keep_versions=1, receiver_ttl_s=60)
    assert racing.done and plan.versions, "no version was deleted before the registrations"
    assert plan.receivers == ("gone",)
    assert names.receiver_key("back") not in plan.keys
    assert sorted(store.list(names.RECEIVERS_PREFIX)) == [names.receiver_key("back")]
    assert Catalog(store).receivers()["back"].version == 4


def _probe(store, path, token: str, age_s: float) -> str:
    key = names.probe_key(token)
    store.put(key, b"probe")
    at = time.time() - age_s
    os.utime(path / key, (at, at))
    return key


@pytest.mark.timeout(60)
def test_gc_deletes_probes_older_than_the_grace_and_leaves_young_and_foreign_keys(tmp_path, capsys):
    path, store, _ = _published_store(tmp_path)
    old = [_probe(store, path, f"{i:032x}", age_s=700) for i in range(3)]
    young = _probe(store, path, "f" * 32, age_s=300)  # within the grace (600 s)
    in_flight = _probe(store, path, "e" * 32, age_s=1)
    store.put("probes/not a probe", b"someone else's")

    assert main(["gc", str(path), "--dry-run", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["keys"]
    assert set(old) <= set(planned) and store.exists(old[0]), "a dry run deleted a probe"

    assert main(["gc", str(path), "--json"]) == 0
    capsys.readouterr()
    assert sorted(store.list(names.PROBES_PREFIX)) == sorted(
        [young, in_flight, "probes/not a probe"]
    )
    # an orphan grace of 0 asks for every leftover, but a probe younger than the floor may
    # be one in flight: it stays
    assert main(["gc", str(path), "--orphan-grace", "0", "--json"]) == 0
    capsys.readouterr()
    assert sorted(store.list(names.PROBES_PREFIX)) == sorted([in_flight, "probes/not a probe"])
    assert PROBE_MIN_AGE_S > 1


class _FailingDeletes(_Wrapper):
    """Deletions of the keys in ``failing`` fail (a store error past the retries)."""

    def __init__(self, inner, failing: set[str]) -> None:
        super().__init__(inner)
        self.failing = failing

    def get(self, key, **kwargs):
        return self.inner.get(key, **kwargs)

    def delete(self, key):
        if key in self.failing:
            raise StoreError(f"injected: delete {key!r} failed")
        return self.inner.delete(key)


@pytest.mark.timeout(60)
def test_a_failed_deletion_neither_stops_the_pass_nor_strands_a_committed_version(tmp_path):
    """A pass stopped at its first failed deletion, so under steady transient errors gc fell
    behind for good. It now goes on and raises at the end; a version whose manifest could not
    be deleted keeps every key its manifest names."""
    _, store, _ = _published_store(tmp_path, versions=12)  # anchors 0 and 10: 0-9 doomed
    blob_of_2 = next(k for k in store.list(names.version_prefix(2)) if k.endswith(".blob"))
    failing = {names.manifest_key(1), blob_of_2}
    flaky = _FailingDeletes(store, failing)

    with pytest.raises(
        StoreError, match=r"2 of \d+ deletions failed.*versions \[1\] keep every key"
    ):
        collect_garbage(flaky, Catalog(flaky), keep_versions=1, receiver_ttl_s=120)
    assert store.list(names.version_prefix(0)) == []  # the pass went on past both failures
    assert store.list(names.version_prefix(2)) == [blob_of_2]
    version_1 = store.list(names.version_prefix(1))
    assert names.manifest_key(1) in version_1 and any(k.endswith(".blob") for k in version_1)
    flaky.failing = set()
    collect_garbage(flaky, Catalog(flaky), keep_versions=1, receiver_ttl_s=120, orphan_grace_s=0)
    assert store.list(names.version_prefix(1)) == store.list(names.version_prefix(2)) == []
