"""The ``deltasync pull`` sidecar (a real subprocess) on a store that two FSDP writers publish
WITHOUT the full state (each shard's digest a parts digest): with ``--config`` it pulls an anchor
and every delta bit-exactly and refuses a version whose parts digest its chain does not reach,
with nothing written; without ``--config`` (the store records the model's fingerprint, not its
config, so there is no layout to check a parts digest with) it refuses at once, naming the flag,
before anything is fetched or written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_parts_digests import _published, _ranks, _TamperedMarker

from deltasync import names
from deltasync.commit import Catalog

from sync_kit import TINY, assert_same_bits, expected_shards, layouts, scratch_store

REPO = Path(__file__).resolve().parents[2]


def _pull(store_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    return subprocess.run(
        [sys.executable, "-m", "deltasync", *argv, "--dir", str(out), "--once", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_the_sidecar_pulls_every_parts_digest_version_exactly_and_refuses_a_wrong_part(tmp_path):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    tampered = _TamperedMarker(store, 4, "w00001-s1", "tp0")  # writer 1 states a wrong part
    syncs, trainers = _ranks([store, tampered], 2, anchor_every=3)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "weights"
    file = out / "tp0.safetensors"
    for v in range(4):  # anchor 0, deltas 1 and 2, anchor 3: one pull per version
        if v:
            for t in trainers:
                t.step()
        _published(syncs, v)
        r = _pull(tmp_path / "store", out, "--config", str(config))
        assert r.returncode == 0, r.stderr
        assert f"applied [{v}]" in r.stdout, r.stdout
        assert_same_bits(load_file(str(file)), expected_shards(trainers[0].params, tl, rl)["tp0"])
    held, stat = load_file(str(file)), file.stat()

    for t in trainers:
        t.step()
    _published(syncs, 4)  # committed: the committer cannot tell a wrong part digest
    r = _pull(tmp_path / "store", out, "--config", str(config))
    assert r.returncode != 0
    assert "IntegrityError" in r.stderr and "versions [4]" in r.stderr, r.stderr
    assert "Refused before any write" in r.stderr, r.stderr
    assert file.stat().st_mtime_ns == stat.st_mtime_ns  # the file is not rewritten
    assert_same_bits(load_file(str(file)), held)


@pytest.mark.timeout(120)
def test_the_sidecar_without_config_refuses_a_parts_digest_by_flag_before_fetching(tmp_path):
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, 2)
    _published(syncs, 0)
    out = tmp_path / "weights"
    # tp0's blobs gone: a sidecar that fetched anything of the shard would fail on them
    blobs = [k for k in store.list("") if k.endswith(".blob") and "/tp0/" in k]
    assert len(blobs) == 2  # one per writer
    for k in blobs:
        (tmp_path / "store" / k).unlink()
    r = _pull(tmp_path / "store", out)
    assert r.returncode == 2, r.stderr
    assert "version 0 lists a parts digest of shard 'tp0'" in r.stderr, r.stderr
    assert "Pass --config" in r.stderr and "for_layout" not in r.stderr, r.stderr
    assert not (out / "tp0.safetensors").exists()
    assert not [k for k in store.list(names.RECEIVERS_PREFIX) if "pull" in k]


@pytest.mark.timeout(240)
def test_a_running_sidecar_without_config_stops_by_flag_when_a_parts_digest_version_appears(
    tmp_path,
):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2, full_state_for=(0, 1))  # whole-state digests
    _published(syncs, 0)
    out = tmp_path / "weights"
    file = out / "tp0.safetensors"
    argv = ["pull", str(tmp_path / "store"), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync", *argv, "--dir", str(out), "--interval", "0.05"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        deadline = time.monotonic() + 120
        while not file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the sidecar never wrote version 0"
            time.sleep(0.05)
        held = load_file(str(file))
        assert_same_bits(held, expected_shards(trainers[0].params, tl, rl)["tp0"])
        # the job restarted without the full state (not resumed: it publishes an anchor),
        # so version 1 lists parts digests
        again, replay = _ranks([store] * 2, 2, session="s2")
        for t in replay:
            t.step()
        _published(again, 1)
        assert Catalog(store).manifest(1).shard_digests["tp0"].startswith("w2:")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "version 1 lists a parts digest" in err and "restart it with --config" in err, err
    assert_same_bits(load_file(str(file)), held)  # nothing written
