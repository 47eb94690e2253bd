"""``deltasync pull`` is a dependable sidecar and ``deltasync inspect`` a read-only diagnostic:
pull waits for the first commit, registers only once it holds a verified version, refuses a
layout other than the store's before fetching, exits cleanly on SIGTERM and writes a file the
engine's user can read; inspect refuses what is not a store without creating anything, shows a
status with its reason per version, the layout and lineage, and survives a closed pipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from truth_kit import Rig, assert_same_bits

from deltasync import LocalStore, names
from deltasync.cli import main
from deltasync.commands.pull import default_receiver_id

REPO = Path(__file__).resolve().parents[2]


def _cli(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deltasync", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.mark.timeout(240)
def test_pull_started_before_the_first_commit_waits_registers_late_and_stops_on_sigterm(
    store_path, tmp_path
):
    store = LocalStore(store_path, durable=False)
    weights = tmp_path / "weights"
    out_file, err_file = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltasync",
                "pull",
                str(store_path),
                "--engine",
                "vllm",
                "--tp",
                "2",
                "--shard",
                "tp0",
                "--dir",
                str(weights),
                "--interval",
                "0.05",
            ],
            cwd=REPO,
            stdout=out,
            stderr=err,
            text=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "waiting for the first committed version" not in out_file.read_text():
            assert proc.poll() is None, err_file.read_text()
            assert time.monotonic() < deadline, "the sidecar never said it waits"
            time.sleep(0.05)
        time.sleep(0.5)  # a few more polls of the empty store
        assert proc.poll() is None, err_file.read_text()
        assert not store.list(names.RECEIVERS_PREFIX), "registered before holding anything"
        rig = Rig(store, tmp_path)
        rig.publish(0)
        file = weights / "tp0.safetensors"
        while not file.exists():
            assert proc.poll() is None, err_file.read_text()
            assert time.monotonic() < deadline + 60, "the sidecar never wrote the file"
            time.sleep(0.05)
        run = rig.trainer.pub.run_id
        assert_same_bits(load_file(str(file)), rig.oracle[(run, 0)]["tp0"])
        umask = os.umask(0)
        os.umask(umask)
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask
        deadline = time.monotonic() + 30
        while names.receiver_key(default_receiver_id("tp0", weights)) not in store.list(
            names.RECEIVERS_PREFIX
        ):
            assert time.monotonic() < deadline, "the sidecar never registered"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 0, err_file.read_text()
        assert "Traceback" not in err_file.read_text()
        assert "stopped by signal SIGTERM" in out_file.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("started_with", ["default", "ignored"])
def test_pull_stops_on_sigint_unless_it_was_started_with_sigint_ignored(
    store_path, tmp_path, started_with
):
    # ignored: as a script's background job starts (``deltasync pull ... &``), whose parent's
    # Ctrl-C is not meant for it; SIGTERM still stops it
    action = signal.SIG_IGN if started_with == "ignored" else signal.SIG_DFL
    LocalStore(store_path, durable=False)
    out_file = tmp_path / "out.txt"
    with open(out_file, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltasync",
                "pull",
                str(store_path),
                "--engine",
                "vllm",
                "--tp",
                "1",
                "--shard",
                "tp0",
                "--dir",
                str(tmp_path / "w"),
                "--interval",
                "0.05",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, action),
        )
    try:
        deadline = time.monotonic() + 90
        while "waiting for the first committed version" not in out_file.read_text():
            assert proc.poll() is None, out_file.read_text()
            assert time.monotonic() < deadline, "the sidecar never said it waits"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        if started_with == "default":
            assert proc.wait(timeout=30) == 0, out_file.read_text()
            assert "deltasync pull: stopped before the first commit" in out_file.read_text()
        else:
            time.sleep(1.0)  # twenty polls
            assert proc.poll() is None, out_file.read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, out_file.read_text()
            assert "deltasync pull: stopped before the first commit" in out_file.read_text()
        assert "Traceback" not in out_file.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(60)
def test_pull_refuses_another_layout_before_fetching_and_leaves_no_registration(
    store_path, tmp_path, capsys
):
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    assert (
        main(
            [
                "pull",
                str(store_path),
                "--engine",
                "vllm",
                "--tp",
                "4",
                "--shard",
                "tp0",
                "--dir",
                str(tmp_path / "w"),
                "--once",
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert "LayoutMismatchError" in err and "was published for engine vllm tp=2" in err
    assert not [k for k in store.list(names.RECEIVERS_PREFIX) if "pull" in k]
    assert not (tmp_path / "w" / "tp0.safetensors").exists()


@pytest.mark.timeout(60)
def test_pull_without_config_takes_the_specs_from_a_verified_anchor(store_path, tmp_path):
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    rig.publish(1)
    assert (
        main(
            [
                "pull",
                str(store_path),
                "--engine",
                "vllm",
                "--tp",
                "2",
                "--shard",
                "tp1",
                "--dir",
                str(tmp_path / "w"),
                "--once",
            ]
        )
        == 0
    )
    run = rig.trainer.pub.run_id
    assert_same_bits(
        load_file(str(tmp_path / "w" / "tp1.safetensors")), rig.oracle[(run, 1)]["tp1"]
    )


@pytest.mark.timeout(60)
def test_pull_without_a_key_on_a_signed_store_stops_at_once_with_2(store_path, tmp_path, capsys):
    # the operator forgot --key-file: waiting does not change it, so the sidecar ends
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path, key=b"k" * 32)
    rig.publish(0)
    argv = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    rc = main([*argv, "--dir", str(tmp_path / "w"), "--interval", "0.05", "--iterations", "20"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "KeyRequiredError" in err and "has no signing key" in err and "--key-file" in err
    assert not (tmp_path / "w" / "tp0.safetensors").exists()
    sidecar = names.receiver_key(default_receiver_id("tp0", tmp_path / "w"))
    assert sidecar not in store.list(names.RECEIVERS_PREFIX), "registered holding nothing"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["missing", "empty-dir", "checkpoint-dir"])
def test_inspect_refuses_a_path_that_is_not_a_store_and_creates_nothing(tmp_path, kind, capsys):
    path = tmp_path / "x"
    if kind == "empty-dir":
        path.mkdir()
    elif kind == "checkpoint-dir":
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"\0" * 16)
        (path / "config.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["inspect", str(path)]) != 0
    assert "not a deltasync store" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if kind == "empty-dir":
        assert not list(path.iterdir())


@pytest.mark.timeout(60)
def test_inspect_shows_status_reason_layout_lineage_and_density_from_the_manifest(
    store_path, tmp_path, capsys
):
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    for v in range(4):
        rig.publish(v)
    (b1,) = store.list("v00000001/tp0/")
    store.put(b1, store.get(b1)[:-5])  # truncated
    (b2,) = store.list("v00000002/tp1/")
    data = bytearray(store.get(b2))
    data[len(data) // 2] ^= 0xFF
    store.put(b2, bytes(data))  # corrupt, same size
    (b3,) = store.list("v00000003/tp0/")
    store.delete(b3)  # missing
    store.put("v00000009/tp0/w00000-x.blob", b"in flight")  # a version without a manifest
    assert main(["inspect", str(store_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    status = {(r["version"], r.get("shard")): r for r in info["rows"]}
    assert status[(0, "tp0")]["status"] == "ok"
    assert status[(1, "tp0")]["status"] == "truncated" and "bytes" in status[(1, "tp0")]["reason"]
    assert status[(2, "tp1")]["status"] == "corrupt" and "digest" in status[(2, "tp1")]["reason"]
    assert status[(3, "tp0")]["status"] == "missing blob"
    assert status[(9, None)]["status"] == "uncommitted"
    assert info["layout"]["engine"] == "vllm" and info["layout"]["tp"] == 2
    assert info["run_id"] == rig.trainer.pub.run_id
    row = status[(1, "tp1")]
    assert row["density"] == row["elements"] / info["layout"]["shards"]["tp1"]["numel"]
    assert 0 < row["density"] < 1 and status[(0, "tp1")]["density"] == 1.0
    # a gap: the base of version 3 disappears
    store.delete(names.manifest_key(2))
    assert main(["inspect", str(store_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {r["status"] for r in info["rows"] if r["version"] == 3 and r.get("shard") == "tp1"} == {
        "gap"
    }
    assert main(["inspect", str(store_path)]) == 0
    table = capsys.readouterr().out
    assert "layout: engine vllm tp=2" in table and "truncated:" in table


class BlobsFrom:
    """Blob reads go to ``blobs`` (another store), everything else to ``inner``."""

    def __init__(self, inner, blobs) -> None:
        self.inner, self.blobs = inner, blobs

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, **kwargs):
        store = self.blobs if key.endswith(".blob") else self.inner
        return store.get(key, **kwargs)


@pytest.mark.timeout(60)
def test_inspect_reports_a_blob_s3_would_not_return_as_unreadable_not_corrupt(
    s3_server, s3_store, tmp_path
):
    from deltasync.commands.inspect_store import collect
    from deltasync.store import RetryPolicy, S3Store

    rig = Rig(s3_store, tmp_path)
    rig.publish(0)
    # the blobs' reads fail as an unreachable endpoint (or a refused one) fails them
    down = S3Store(
        s3_store.bucket,
        s3_store.prefix,
        config=s3_server.config(
            endpoint_url="http://127.0.0.1:9", retry=RetryPolicy(max_attempts=1)
        ),
    )
    info = collect(BlobsFrom(s3_store, down), last=0, signing_key=None)
    statuses = {(r["version"], r["shard"]): r for r in info["rows"]}
    assert {r["status"] for r in statuses.values()} == {"unreadable"}, statuses
    assert "StoreError" in statuses[(0, "tp0")]["reason"]
    info = collect(s3_store, last=0, signing_key=None)
    assert {r["status"] for r in info["rows"]} == {"ok"}


@pytest.mark.timeout(60)
def test_inspect_does_not_die_on_a_closed_pipe(store_path, tmp_path):
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    for v in range(3):
        rig.publish(v)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before the first line (`| head -0`)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync", "inspect", str(store_path), "--last", "0"],
        cwd=REPO,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_demo_refuses_a_used_store_instead_of_reporting_a_false_mismatch(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "LATEST").write_text('{"version":3}')
    assert main(["demo", "--steps", "1", "--small", "--store", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "is not empty" in err and "MISMATCH" not in err


@pytest.mark.timeout(90)
def test_pull_backs_off_a_damaged_store_with_one_line_and_recovers_when_it_is_repaired(
    store_path, tmp_path, capsys
):
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    rig.publish(1)
    key = names.manifest_key(1)
    good = store.get(key)
    store.put(key, good[:20])
    args = [
        "pull",
        str(store_path),
        "--engine",
        "vllm",
        "--tp",
        "2",
        "--shard",
        "tp0",
        "--dir",
        str(tmp_path / "w"),
        "--interval",
        "0.01",
    ]
    assert main([*args, "--iterations", "4"]) == 1  # every pull failed: a script sees it
    err = capsys.readouterr().err
    assert err.count("retrying with backoff") == 1 and "ManifestError" in err, err
    assert "stopped after 4 pull(s), the last 4 of them failed (ManifestError" in err, err
    store.put(key, good)
    assert main([*args, "--iterations", "1"]) == 0
    run = rig.trainer.pub.run_id
    assert_same_bits(
        load_file(str(tmp_path / "w" / "tp0.safetensors")), rig.oracle[(run, 1)]["tp0"]
    )


@pytest.mark.timeout(120)
def test_a_running_pull_rewrites_its_file_when_it_is_edited_behind_it(store_path, tmp_path):
    # Only a restart or the next version restored it: until then the engine reloaded a file
    # that was not the version its metadata and the acks named.
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    rig = Rig(LocalStore(store_path, durable=False), tmp_path)
    rig.publish(0)
    rig.publish(1)
    weights = tmp_path / "weights"
    file = weights / "tp0.safetensors"
    argv = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    proc = _cli(*argv, "--dir", str(weights), "--interval", "0.05")
    want = rig.oracle[(rig.trainer.pub.run_id, 1)]["tp0"]
    try:
        deadline = time.monotonic() + 60
        while not (file.exists() and load_file(str(file)).keys() == want.keys()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        tensors = load_file(str(file))
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
        first = sorted(tensors)[0]
        tensors[first].view(torch.int16).view(-1)[0] ^= 1  # metadata kept: still "version 1"
        save_file(tensors, str(file), metadata=meta)
        while True:
            got = load_file(str(file))
            if all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "never rewritten"
            time.sleep(0.05)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "edited, replaced or removed behind the sidecar; rewritten with version 1" in out, err


_SLOW_WRITE = """
import sys, time
from deltasync.atomic import write_atomic

def chunks():
    yield b"x" * 4096
    print("writing", flush=True)
    time.sleep(600)  # killed here, its temp file half written
    yield b"y"

write_atomic(sys.argv[1], chunks())
"""


def _killed_mid_write(path: Path) -> Path:
    """Write ``path`` atomically in a child process and SIGKILL it mid-write: the temp file it
    leaves (a real kill's leftover), dated an hour back."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITE, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.kill()
        child.wait()
    (left,) = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-")]
    old = time.time() - 3600
    os.utime(left, (old, old))
    return left


def test_pull_removes_what_killed_writes_left_and_keeps_a_write_in_progress(store_path, tmp_path):
    # every kill mid-write left a temp file (a whole shard file's, in --dir) that nothing
    # removed: a crash-looping sidecar filled its disk
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    out = tmp_path / "w"
    state = out / ".tp1.deltasync"
    state.mkdir(parents=True)
    left = [
        _killed_mid_write(out / "tp1.safetensors"),
        _killed_mid_write(state / names.STATE_FILE),
        _killed_mid_write(state / names.JOURNAL_FILE),
    ]
    in_progress = out / ".tp1.safetensors.tmp-0123456789abcdef"  # fresh: another writer's
    in_progress.write_bytes(b"x")
    args = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp1"]
    assert main([*args, "--dir", str(out), "--once"]) == 0
    assert not any(p.exists() for p in left), [p.name for p in left if p.exists()]
    assert in_progress.exists()
    assert_same_bits(
        load_file(str(out / "tp1.safetensors")), rig.oracle[(rig.trainer.pub.run_id, 0)]["tp1"]
    )


def _registered(store, file: Path):
    """The registration of the sidecar writing ``file`` (under its default id)."""
    from deltasync.commit import Catalog

    return Catalog(store).receiver(default_receiver_id("tp0", file.parent))


def _holds(file: Path, want) -> bool:
    import torch

    try:
        got = load_file(str(file))
    except Exception:  # missing, or being replaced
        return False
    return got.keys() == want.keys() and all(
        torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want
    )


def _wait(predicate, proc, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _remove_under(proc, directory: Path) -> None:
    """``rm -rf directory`` behind a running sidecar (stopped meanwhile: a walk racing its
    writes would fail, not the sidecar)."""
    import shutil

    os.kill(proc.pid, signal.SIGSTOP)
    try:
        shutil.rmtree(directory)
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def _pulling_at_version_1(store_path, tmp_path):
    """Versions 0 and 1 published, and a sidecar of shard tp0 running (polling every 50 ms):
    the store, the rig, the shard file's path and the sidecar's process."""
    store = LocalStore(store_path, durable=False)
    rig = Rig(store, tmp_path)
    rig.publish(0)
    rig.publish(1)
    file = tmp_path / "weights" / "tp0.safetensors"
    argv = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
    return store, rig, file, _cli(*argv, "--dir", str(file.parent), "--interval", "0.05")


@pytest.mark.timeout(180)
def test_a_running_pull_whose_file_cannot_be_rewritten_withdraws_its_registration(
    store_path, tmp_path
):
    # The file was damaged behind the sidecar and every rewrite failed (a full disk): each
    # retry heartbeat "holds version 1" while the file held garbage, and the error said the
    # file "still holds what it held".
    import resource

    store, rig, file, proc = _pulling_at_version_1(store_path, tmp_path)
    want = rig.oracle[(rig.trainer.pub.run_id, 1)]["tp0"]
    try:
        _wait(lambda: (r := _registered(store, file)) is not None and r.version == 1, proc, "v1")
        os.kill(proc.pid, signal.SIGSTOP)
        with open(file, "r+b") as f:  # damaged in place
            f.seek(-256, os.SEEK_END)
            f.write(b"\x7f" * 256)
        hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (16384, hard))  # no room for it
        os.kill(proc.pid, signal.SIGCONT)
        _wait(
            lambda: _registered(store, file) is None, proc, "the registration was never withdrawn"
        )
        time.sleep(1.0)  # retries meanwhile: none registers again
        assert _registered(store, file) is None and not _holds(file, want)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        _wait(lambda: _holds(file, want), proc, "never rewritten once the disk had room")
        _wait(lambda: (r := _registered(store, file)) is not None and r.version == 1, proc, "again")
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "no longer holds version 1" in err and "registration is withdrawn" in err, err
    assert err.count("no longer holds version 1") == 1, err  # one line per change of state
    assert "rewritten with version 1" in out, out


@pytest.mark.timeout(180)
def test_a_running_pull_remakes_its_removed_directory_and_takes_the_next_version(
    store_path, tmp_path
):
    # After rm -rf of --dir every write failed (the file and the state dir were made only at
    # start), so the file never came back and no later version was taken until a restart.

    store, rig, file, proc = _pulling_at_version_1(store_path, tmp_path)
    run = rig.trainer.pub.run_id
    weights = file.parent
    try:
        _wait(lambda: _holds(file, rig.oracle[(run, 1)]["tp0"]), proc, "v1")
        _remove_under(proc, weights)
        _wait(lambda: _holds(file, rig.oracle[(run, 1)]["tp0"]), proc, "never remade")
        rig.publish(2)
        _wait(lambda: _holds(file, rig.oracle[(run, 2)]["tp0"]), proc, "v2 never taken")
        _wait(lambda: (r := _registered(store, file)) is not None and r.version == 2, proc, "v2")
        assert (weights / ".tp0.deltasync" / names.STATE_FILE).is_file()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


@pytest.mark.timeout(180)
def test_a_second_sidecar_on_the_same_file_is_refused_naming_the_first(store_path, tmp_path):
    # Two sidecars on one --dir and shard rewrote the file in turn, and each replayed the
    # other's journal as a crash's.

    _, rig, file, proc = _pulling_at_version_1(store_path, tmp_path)
    want = rig.oracle[(rig.trainer.pub.run_id, 1)]["tp0"]
    try:
        _wait(lambda: _holds(file, want), proc, "v1")
        argv = ["pull", str(store_path), "--engine", "vllm", "--tp", "2", "--shard", "tp0"]
        argv += ["--dir", str(file.parent)]
        second = _cli(*argv, "--once")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert f"in use by another process (pid {proc.pid})" in err, err
        assert "Stop the other sidecar, or pass another --dir" in err, err
        assert _holds(file, want) and proc.poll() is None
        # --dir removed behind the first: it remakes it and holds it again, so a second one
        # is still refused (the lock had gone with the old directory)
        _remove_under(proc, file.parent)
        lock = file.parent / f".{file.stem}.deltasync" / names.LOCK_FILE
        _wait(lambda: _holds(file, want) and lock.exists(), proc, "never remade")
        second = _cli(*argv, "--once")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and f"(pid {proc.pid})" in err, err
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
