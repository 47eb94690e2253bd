"""The command line: ``deltasync inspect`` shows versions, kinds, bytes, density and acks;
``deltasync gc`` deletes what retention allows (and with ``--dry-run`` only says so);
``deltasync pull`` keeps ``DIR/<shard>.safetensors`` equal to the dense split of the newest
version, bootstrapping from an anchor and then applying deltas across restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from deltasync import names
from deltasync.cli import main
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    TINY,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    scratch_store,
    zero_tensors,
)


class Rig:
    def __init__(self, tmp_path, signing_key=None):
        self.spec, self.tl, self.rl = layouts()
        self.path = tmp_path / "store"
        self.store = scratch_store(self.path)
        self.trainer = TinyTrainer(self.spec, density=0.02)
        config = PublisherConfig(anchor_every=3, signing_key=signing_key)
        pub = Publisher(self.store, receiver_layout=self.rl, config=config)
        self.sync = TrainerSync(
            SnapshotTracker(self.trainer.named_parameters()), pub, self.trainer.params
        )
        self.version = -1

    def publish(self, n=1):
        for _ in range(n):
            self.version += 1
            if self.version:
                self.trainer.step()
            self.sync.step_published(self.version)
        return expected_shards(self.trainer.params, self.tl, self.rl)


@pytest.mark.timeout(60)
def test_inspect_lists_versions_kinds_bytes_density_and_acks(tmp_path, capsys):
    rig = Rig(tmp_path)
    rec = Receiver.for_layout(
        rig.store,
        rig.rl,
        "tp1",
        zero_tensors(rig.rl, "tp1"),
        str(tmp_path / "r"),
        rconfig("watcher"),
    )
    rig.publish(3)
    rec.pull()
    rig.publish(1)
    assert main(["inspect", str(rig.path)]) == 0
    out = capsys.readouterr().out
    assert "LATEST=3" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("0", "anchor", "-", "tp0"),
        ("0", "anchor", "-", "tp1"),
        ("1", "delta", "0", "tp0"),
        ("1", "delta", "0", "tp1"),
        ("2", "delta", "1", "tp0"),
        ("2", "delta", "1", "tp1"),
        ("3", "anchor", "-", "tp0"),
        ("3", "anchor", "-", "tp1"),
    ]
    assert rows[5][-1] == "watcher" and rows[4][-1] == "-"  # acked by the tp1 receiver only
    assert {r[-2] for r in rows} == {"ok"}, "every blob present, sized and digested as listed"
    assert rows[0][-3] == "100.00%", "an anchor sends every element"
    assert "watcher" in out.split("receivers:")[1]

    assert main(["inspect", str(rig.path), "--json", "--last", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["shard"]) for r in info["rows"]] == [
        (2, "tp0"),
        (2, "tp1"),
        (3, "tp0"),
        (3, "tp1"),
    ]
    delta = info["rows"][0]
    numel = sum(
        s.shape[0] * (s.shape[1] if len(s.shape) > 1 else 1)
        for s in rig.rl.local_specs("tp0").values()
    )
    assert 0 < delta["density"] < 1 and delta["density"] == delta["elements"] / numel
    assert delta["bytes"] > 0

    # an ack naming another state than the manifest's is not counted: listed apart
    from deltasync.commit import AckRecord

    ack = AckRecord.from_json(rig.store.get(names.ack_key(2, "watcher")))
    other = replace(ack, state_digest="0" * len(ack.state_digest))
    rig.store.put(names.ack_key(2, "watcher"), other.to_json())
    assert main(["inspect", str(rig.path), "--json", "--last", "2"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][1]
    assert (row["shard"], row["acks"], row["acks_wrong_digest"]) == ("tp1", [], ["watcher"])
    assert main(["inspect", str(rig.path), "--last", "2"]) == 0
    assert "- (another state digest: watcher)" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_gc_deletes_what_retention_allows_and_a_dry_run_nothing(tmp_path, capsys):
    rig = Rig(tmp_path)  # anchors at 0 and 3
    expected = rig.publish(6)
    abandoned = names.blob_key(1, "tp0", "w-lost")  # a losing attempt's blob
    rig.store.put(abandoned, b"x")
    before = sorted(rig.store.list(""))

    assert main(["gc", str(rig.path), "--keep", "2", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(rig.store.list("")) == before, "a dry run deleted something"
    assert plan["dry_run"] and plan["committed"] == 5 and plan["versions"] == [0, 1, 2]
    assert abandoned in plan["keys"] and plan["keys"][0] == names.manifest_key(0)

    assert main(["gc", str(rig.path), "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"deleted {len(plan['keys'])} key(s); versions removed whole: 0, 1, 2")
    assert sorted(rig.store.list("")) == sorted(set(before) - set(plan["keys"]))
    rec = Receiver.for_layout(
        rig.store, rig.rl, "tp0", zero_tensors(rig.rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    assert rec.pull().version == 5  # from the anchor at 3, which gc kept with its chain
    assert_same_bits(rec.tensors, expected["tp0"])

    assert main(["gc", str(rig.path), "--keep", "0"]) == 2  # refused, as a typed error
    assert "--keep must be >= 1" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["gc", str(tmp_path / "empty")]) == 2
    assert "not a deltasync store" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_gc_keeps_an_attempt_that_never_committed_until_it_is_older_than_the_grace(
    tmp_path, capsys
):
    rig = Rig(tmp_path)
    rig.publish(3)  # versions 0-2
    # a writer's attempt at version 3 that has no manifest yet: its manifest write may still
    # be in flight (a reply lost past the retries), so its blobs may yet be named
    attempt = [names.blob_key(3, "tp0", "w00000-lost"), names.blob_key(3, "tp1", "w00000-lost")]
    for key in attempt:
        rig.store.put(key, b"blob")
    rig.trainer.step()
    rig.version = 4
    rig.sync.step_published(4)  # committed past it: a gap at 3

    assert main(["gc", str(rig.path), "--keep", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["deferred"] == [3] and not set(attempt) & set(plan["keys"])
    assert all(rig.store.exists(k) for k in attempt)
    assert main(["gc", str(rig.path), "--keep", "2"]) == 0
    assert "younger than 600 s: version(s) 3" in capsys.readouterr().out

    assert main(["gc", str(rig.path), "--orphan-grace", "0", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["deferred"] == [] and set(attempt) <= set(plan["keys"])

    old = time.time() - 601  # the attempt's keys, written past the default grace
    for key in attempt:
        os.utime(rig.path / key, (old, old))
    assert main(["gc", str(rig.path), "--keep", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["deferred"] == [] and set(attempt) <= set(plan["keys"])
    assert not any(rig.store.exists(k) for k in attempt)

    assert main(["gc", str(rig.path), "--orphan-grace", "-1"]) == 2
    assert "--orphan-grace must be a finite number of seconds >= 0" in capsys.readouterr().err


def _pull(rig, tmp_path, *extra):
    return main(
        [
            "pull",
            str(rig.path),
            "--engine",
            "vllm",
            "--tp",
            "2",
            "--shard",
            "tp1",
            "--dir",
            str(tmp_path / "weights"),
            *extra,
        ]
    )


@pytest.mark.timeout(60)
def test_pull_keeps_a_safetensors_file_equal_to_the_split_across_restarts(tmp_path, capsys):
    rig = Rig(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    want = rig.publish(2)  # anchor 0, delta 1
    assert _pull(rig, tmp_path, "--config", str(config), "--once") == 0
    file = tmp_path / "weights" / "tp1.safetensors"
    assert_same_bits(load_file(str(file)), want["tp1"])
    with safe_open(str(file), framework="pt") as f:
        assert f.metadata()["deltasync_version"] == "1"
    assert "applied [0, 1]" in capsys.readouterr().out

    want = rig.publish(1)  # a restarted sidecar continues from the file with a delta
    assert _pull(rig, tmp_path, "--once") == 0  # no --config: specs from the newest anchor
    assert "applied [2]" in capsys.readouterr().out
    assert_same_bits(load_file(str(file)), want["tp1"])

    want = rig.publish(2)  # a loop of two pulls picks up versions 3 (anchor) and 4
    assert _pull(rig, tmp_path, "--interval", "0.01", "--iterations", "2") == 0
    assert_same_bits(load_file(str(file)), want["tp1"])

    # a file edited behind the sidecar's back no longer matches its digest: restored
    tensors = load_file(str(file))
    next(iter(tensors.values())).view(-1)[0] += 1
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, str(file), metadata=meta)
    capsys.readouterr()
    assert _pull(rig, tmp_path, "--once") == 0
    assert "restoring an anchor" in capsys.readouterr().out
    assert_same_bits(load_file(str(file)), want["tp1"])


@pytest.mark.timeout(60)
def test_gc_that_verifies_no_committed_version_says_so_instead_of_collecting_nothing(
    tmp_path, capsys
):
    # With the wrong key nothing verifies, so retention deletes no version, ever: gc exited 0
    # reporting LATEST as committed, and a store silently stopped being collected.
    signing, wrong = b"k" * 32, b"w" * 32
    rig = Rig(tmp_path, signing_key=signing)
    rig.publish(6)
    keys = {}
    for name, key in (("right", signing), ("wrong", wrong)):
        keys[name] = tmp_path / name
        keys[name].write_bytes(key)
        keys[name].chmod(0o600)
    before = sorted(rig.store.list(""))
    gc = ["gc", str(rig.path), "--keep", "1"]
    assert main([*gc, "--key-file", str(keys["wrong"])]) == 2
    err = capsys.readouterr().err
    assert "SignatureError" in err and "LATEST names version 5" in err and "--key-file" in err
    assert sorted(rig.store.list("")) == before
    assert main([*gc, "--key-file", str(keys["right"]), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["committed"] == 5 and plan["versions"] == [0, 1, 2]
    # a key file that cannot be read is named before the store is opened
    assert main(["gc", str(tmp_path / "nowhere"), "--key-file", str(tmp_path / "nokey")]) == 2
    assert "key file" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_gc_beside_a_trainers_first_commit_is_no_signature_error(tmp_path, capsys, monkeypatch):
    # gc planned while the store held version 0's blobs and no manifest (nothing to delete),
    # the trainer committed version 0, and gc, reading LATEST again, reported a store where
    # nothing verifies (SignatureError, rc 2) though version 0 verifies.
    import deltasync.commit as commit

    rig = Rig(tmp_path)
    rig.publish(1)
    manifest = rig.store.get(names.manifest_key(0))
    latest = rig.store.get(names.LATEST)
    rig.store.delete(names.manifest_key(0))
    rig.store.delete(names.LATEST)  # the blobs of version 0, its manifest not written yet
    collect = commit.collect_garbage

    def then_the_commit_lands(*args, **kwargs):
        plan = collect(*args, **kwargs)
        rig.store.put_if_absent(names.manifest_key(0), manifest)
        rig.store.put(names.LATEST, latest)
        return plan

    monkeypatch.setattr(commit, "collect_garbage", then_the_commit_lands)
    assert main(["gc", str(rig.path), "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["committed"] is None and plan["keys"] == []
    assert rig.store.exists(names.manifest_key(0))


@pytest.mark.timeout(60)
def test_gc_without_the_key_of_a_signed_store_refuses_and_deletes_nothing(tmp_path, capsys):
    # Without a key every manifest that parses counted: an unsigned anchor planted as the
    # newest by anyone with write access made gc delete the versions keyed receivers needed.
    from dataclasses import replace

    from deltasync.commit import Catalog

    signing = b"k" * 32
    rig = Rig(tmp_path, signing_key=signing)
    rig.publish(6)
    real = Catalog(rig.store, signing_key=signing).manifest(5)
    forged = replace(
        real.unsigned(),
        version=50,
        blobs=(),
        run_id="ffffffffffffffff",
        kind="anchor",
        base_version=None,
        base_digests={},
    )
    rig.store.put(names.manifest_key(50), forged.to_json())
    rig.store.put(names.LATEST, json.dumps({"version": 50}).encode())
    before = sorted(rig.store.list(""))
    assert main(["gc", str(rig.path), "--keep", "1"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "signed manifests (version 5)" in err, err
    assert "--key-file" in err and "Nothing was deleted" in err
    assert sorted(rig.store.list("")) == before
    key_file = tmp_path / "key"
    key_file.write_bytes(signing)
    key_file.chmod(0o600)
    argv = ["gc", str(rig.path), "--keep", "1", "--key-file", str(key_file), "--dry-run"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["committed"] == 5 and names.manifest_key(50) not in plan["keys"]
    # a store that was never signed is collected without a key, as before
    plain = Rig(tmp_path / "plain")
    plain.publish(4)
    assert main(["gc", str(plain.path), "--keep", "1", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["committed"] == 3


def _inspected(path, capsys, *args: str) -> dict:
    """``deltasync inspect PATH --json *args``'s rows by (version, shard)."""
    assert main(["inspect", str(path), "--json", *args]) == 0
    return {(r["version"], r.get("shard")): r for r in json.loads(capsys.readouterr().out)["rows"]}


@pytest.mark.timeout(60)
def test_inspect_calls_a_delta_on_an_unreadable_base_manifest_a_gap(tmp_path, capsys):
    # the delta was "ok" while no receiver below it could apply it: its base's manifest
    # did not parse (only a base without any manifest was a gap)
    rig = Rig(tmp_path)
    rig.publish(3)  # 0 anchor, 1 and 2 deltas
    rig.store.put(names.manifest_key(1), b"{not json")

    for last in ((), ("--last", "1")):  # the base among the rows shown, and below them
        rows = _inspected(rig.path, capsys, *last)
        assert {rows[(2, s)]["status"] for s in ("tp0", "tp1")} == {"gap"}
        assert "base version 1's manifest does not verify or read" in rows[(2, "tp0")]["reason"]
    rows = _inspected(rig.path, capsys)
    assert rows[(1, None)]["status"] == "unreadable"
    assert {rows[(0, s)]["status"] for s in ("tp0", "tp1")} == {"ok"}


@pytest.mark.timeout(60)
def test_inspect_calls_a_delta_whose_base_the_store_did_not_return_unreadable(
    tmp_path, capsys, monkeypatch
):
    # a connection reset on the base's manifest made every delta above it a "gap", as if
    # receivers below it had to restore an anchor, where nothing was known either way
    from deltasync.commit.model import ManifestLimits
    from deltasync.errors import StoreError
    from deltasync.store import LocalStore

    rig = Rig(tmp_path)
    rig.publish(3)  # 0 anchor, 1 and 2 deltas
    real_get = LocalStore.get

    def get(store, key, **kwargs):
        if key == names.manifest_key(1):
            raise StoreError("the connection was reset")
        return real_get(store, key, **kwargs)

    monkeypatch.setattr(LocalStore, "get", get)
    for last in ((), ("--last", "1")):  # the base among the rows shown, and below them
        rows = _inspected(rig.path, capsys, *last)
        assert {rows[(2, s)]["status"] for s in ("tp0", "tp1")} == {"unreadable"}
        reason = rows[(2, "tp0")]["reason"]
        assert "base version 1's manifest could not be read" in reason
        assert "the connection was reset" in reason
    assert rows.get((1, None)) is None  # --last 1: only version 2 shown
    rows = _inspected(rig.path, capsys)
    assert rows[(1, None)]["status"] == "unreadable"
    # a base the store returned as too large to be a manifest does not parse: still a gap
    monkeypatch.setattr(LocalStore, "get", real_get)
    with open(rig.path / names.manifest_key(1), "r+b") as f:  # sparse: no disk cost
        f.truncate(ManifestLimits().max_manifest_bytes + 1024)
    rows = _inspected(rig.path, capsys)
    assert {rows[(2, s)]["status"] for s in ("tp0", "tp1")} == {"gap"}


@pytest.mark.timeout(60)
def test_inspect_with_a_key_names_as_committed_only_what_verifies_with_it(tmp_path, capsys):
    # With the wrong key every row said "bad signature" while the header still read
    # "newest committed=5": the version a receiver given that key would never take.
    signing = b"k" * 32
    rig = Rig(tmp_path, signing_key=signing)
    rig.publish(6)
    keys = {}
    for name, key in (("right", signing), ("wrong", b"w" * 32)):
        keys[name] = tmp_path / name
        keys[name].write_bytes(key)
        keys[name].chmod(0o600)

    def inspect(key: str, rc: int = 0) -> dict:
        assert main(["inspect", str(rig.path), "--json", "--key-file", str(keys[key])]) == rc
        return json.loads(capsys.readouterr().out)

    # nothing verifies with the key: everything printed, and rc 3 tells a script so
    info = inspect("wrong", rc=3)
    assert {r["status"] for r in info["rows"]} == {"bad signature"}
    assert info["newest_committed"] is None and info["newest_listed"] == 5
    assert main(["inspect", str(rig.path), "--key-file", str(keys["wrong"])]) == 3
    table = capsys.readouterr().out
    assert "newest committed=None" in table and "no manifest verifies with this key" in table
    assert inspect("right")["newest_committed"] == 5
    # the newest manifest rewritten without the key: the newest that verifies is named
    manifest = names.manifest_key(5)
    rig.store.put(manifest, rig.store.get(manifest).replace(b'"kind"', b'"kind" ', 1))
    info = inspect("right")
    assert info["newest_committed"] == 4 and info["newest_listed"] == 5
    assert main(["inspect", str(rig.path), "--key-file", str(keys["right"])]) == 0
    assert "the newest that verifies with this key is version 4" in capsys.readouterr().out
    assert main(["inspect", str(rig.path), "--json"]) == 0  # without a key: what is listed
    assert json.loads(capsys.readouterr().out)["newest_committed"] == 5


def _with_the_reader_gone(*args: str) -> subprocess.CompletedProcess:
    """``deltasync args`` with its stdout a pipe whose reader left at once (``| head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "deltasync", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.timeout(240)
def test_gc_and_the_sidecar_outlive_a_log_reader_that_went_away(tmp_path):
    rig = Rig(tmp_path)
    rig.publish(6)
    before = set(rig.store.list(""))
    for extra in (["--json"], []):  # the plan's line, then the listing
        done = _with_the_reader_gone("gc", str(rig.path), "--keep", "2", *extra)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert set(rig.store.list("")) < before  # collected, whatever became of the listing
    weights = tmp_path / "weights"
    done = _with_the_reader_gone(
        "pull", str(rig.path), "--engine", "vllm", "--tp", "2", "--shard", "tp1",
        "--dir", str(weights), "--once",
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert (weights / "tp1.safetensors").exists()


@pytest.mark.timeout(60)
def test_pull_with_another_models_config_is_refused_before_it_writes_anything(tmp_path, capsys):
    rig = Rig(tmp_path)
    rig.publish(2)
    config = tmp_path / "other.json"
    config.write_text(json.dumps({**TINY, "num_hidden_layers": TINY["num_hidden_layers"] + 1}))
    assert _pull(rig, tmp_path, "--config", str(config), "--once") == 2
    err = capsys.readouterr().err
    assert "LayoutMismatchError" in err and "Nothing was fetched or written" in err, err
    assert not (tmp_path / "weights").exists()  # no --dir, no state file: as it says


def test_inspect_shows_the_anchor_a_receiver_is_restoring(tmp_path, capsys):
    from deltasync.commit import Catalog, ReceiverRecord

    rig = Rig(tmp_path)
    rig.publish(1)
    run_id = Catalog(rig.store).manifest(0).run_id
    rec = ReceiverRecord(
        receiver="slow",
        shard="tp0",
        version=None,
        updated_at=time.time(),
        restoring=0,
        restoring_run_id=run_id,
    )
    rig.store.put(rec.key, rec.to_json(None))
    assert main(["inspect", str(rig.path)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "slow" in x]
    assert "restoring anchor 0" in line
    assert main(["inspect", str(rig.path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["receivers"]
    assert [(r["receiver"], r["restoring"]) for r in listed] == [("slow", 0)]
