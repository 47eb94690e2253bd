"""Bad input to the command line is refused with a typed error naming the argument or file and
the remedy (rc 2, one ``deltasync: error:`` line, no traceback), and before anything is
written; a damaged ``DIR/<shard>.safetensors`` (the sidecar's own file) is replaced from the
newest anchor instead of killing the sidecar.

- ``pull``: ``--interval`` must be finite, > 0 and at most a day, ``--iterations`` >= 0; a
  missing store is never created (refused with ``--once``, waited for in a loop); the key file,
  the receiver id, ``--config`` and ``--dir`` are checked before the store or ``--dir`` is
  touched.
- ``pull`` over a truncated, garbage or symlinked file, or one whose deltasync metadata is out
  of range: a warning naming it, then the newest version; a directory in its place is refused.
- config and layout files (``--config``, ``--layout``): only a regular UTF-8 JSON file under a
  size cap is read: a binary file, deep nesting, a device (``/dev/zero``) or a FIFO is refused
  without reading it whole or hanging.
- ``layout probe --out``/``--cache`` in a place that cannot hold them: a LayoutError naming it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kit import fill_up, mounted_tmpfs
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltasync import LocalStore, names
from deltasync.cli import main
from deltasync.commands.pull import default_receiver_id
from deltasync.commit import Catalog
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.trainer import SnapshotTracker

from sync_kit import TINY, TinyTrainer, assert_same_bits, expected_shards, layouts, scratch_store

REPO = Path(__file__).resolve().parents[2]
SHARD = "tp1"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store holding versions 0..2 (tp=2 vLLM layout) and the newest version's shards."""
    root = tmp_path_factory.mktemp("published")
    spec, tl, rl = layouts()
    store = scratch_store(root / "store")
    trainer = TinyTrainer(spec, density=0.02)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=3))
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    for version in range(3):
        if version:
            trainer.step()
        sync.step_published(version)
    return root / "store", expected_shards(trainer.params, tl, rl)


@pytest.fixture
def work(tmp_path, published):
    """tmp_path with its own copy of the store (pulls register and ack in it)."""
    shutil.copytree(published[0], tmp_path / "store")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "afile").write_text("not a directory\n")
    return tmp_path


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` (links not followed): kind, size and mtime."""
    found = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            st = os.lstat(p)
            found[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return found


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the real CLI entry point; an untyped exception escapes main (and fails the test)."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def _refused(capsys, root: Path, *argv: str, names: str, error: str = "ConfigError") -> str:
    """The command exits 2 with one typed error line naming ``names``, and writes nothing."""
    before = _tree(root)
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2, out + err
    assert err.startswith(f"deltasync: error: {error}: ") and err.count("\n") == 1, err
    assert names in err, err
    assert _tree(root) == before, "a refused command wrote something"
    return err


def _pull(work: Path, *extra: str, store: Path | None = None) -> list[str]:
    store = work / "store" if store is None else store
    return ["pull", str(store), "--tp", "2", "--shard", SHARD, *extra]


def _subprocess(*argv: str, cwd: Path, timeout: float, max_memory: int | None = None):
    """The CLI in a fresh interpreter (for inputs that hang or exhaust memory when mishandled),
    with a wall-clock timeout and optionally an address-space cap."""

    def limit() -> None:
        if max_memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))

    return subprocess.run(
        [sys.executable, "-m", "deltasync", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        check=False,
    )


# ---------------------------------------------------------------------- 4: --interval, --iterations


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--interval", "nan"),  # passed `<= 0`: a busy loop on the store
        ("--interval", "inf"),  # OverflowError in Event.wait, after the file was written
        ("--interval", "1e9"),  # 31 years between pulls: a unit typo
        ("--iterations", "-1"),  # silently "never stop"
    ],
)
def test_pull_refuses_an_interval_or_iterations_out_of_range_before_writing(
    work, capsys, flag, value
):
    _refused(
        capsys, work, *_pull(work, "--dir", str(work / "out"), "--once", flag, value), names=flag
    )


# ---------------------------------------------------------------------- 5: nothing before checks


@pytest.mark.timeout(60)
def test_pull_once_refuses_a_missing_store_without_creating_it(work, capsys):
    missing = work / "nostore"
    argv = _pull(work, "--dir", str(work / "out"), "--once", store=missing)
    _refused(capsys, work, *argv, names=str(missing))
    assert not missing.exists()


@pytest.mark.timeout(60)
def test_s3_flags_with_a_url_that_is_not_s3_are_refused_before_a_pull_loop_waits(work, capsys):
    # `s3:/bucket` (one slash short) is a relative local path: the loop waited for it forever
    argv = _pull(work, "--dir", str(work / "out"), "--s3-endpoint", "http://127.0.0.1:9")
    argv[1] = "s3:/bucket/run"
    _refused(capsys, work, *argv, names="--s3-endpoint only apply to an s3:// store URL")
    assert not (work / "s3:").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["inspect", "gc", "pull --once", "pull"])
def test_a_store_path_too_long_to_look_at_is_refused_not_a_traceback(work, capsys, command):
    # Path.is_dir() lets ENAMETOOLONG through; os.path.lexists() says False, so a pull loop
    # would wait for the path forever
    store = work / ("s" * 300) / "store"
    if command.startswith("pull"):
        argv = _pull(work, "--dir", str(work / "out"), *command.split()[1:], store=store)
        err = _refused(capsys, work, *argv, names=str(store))
    else:  # inspect and gc print their errors as "deltasync COMMAND: ..."
        before = _tree(work)
        rc, out, err = _cli(capsys, command, str(store))
        assert rc == 2 and err.startswith(f"deltasync {command}: {str(store)!r}"), out + err
        assert _tree(work) == before
    assert "cannot be a store directory (File name too long)" in err, err


@pytest.mark.timeout(60)
def test_pull_reads_the_key_file_before_opening_the_store(work, capsys):
    missing = work / "nostore"  # a loop would wait for it: the key is refused first
    argv = _pull(
        work, "--dir", str(work / "out"), "--key-file", str(work / "no-key"), store=missing
    )
    _refused(capsys, work, *argv, names=str(work / "no-key"))
    assert not missing.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["pull", "inspect", "gc"])
def test_an_empty_key_file_path_is_refused_not_taken_for_no_key(work, capsys, command):
    # an unset variable in a script (--key-file "$KEY_FILE") must not turn checking off
    store = str(work / "store")
    argv = {
        "pull": _pull(work, "--dir", str(work / "out"), "--once", "--key-file", ""),
        "inspect": ["inspect", store, "--key-file", ""],
        "gc": ["gc", store, "--key-file", ""],
    }[command]
    _refused(capsys, work, *argv, names="--key-file is empty")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--receiver-id", "bad id", "'bad id'"),
        ("--receiver-id", "../up", "'../up'"),
        ("--shard", "../tp1", "'../tp1'"),
        # an unset variable in a script: it silently became the default id, and --tp/--ep 0
        # waited on a store that has no commit yet
        ("--receiver-id", "", "--receiver-id is empty"),
        ("--tp", "0", "--tp must be >= 1"),
        ("--ep", "-1", "--ep must be >= 1"),
    ],
)
def test_pull_checks_the_receiver_id_and_shard_before_writing_state(
    work, capsys, flag, value, named
):
    # a later --shard overrides _pull's
    argv = _pull(work, flag, value, "--dir", str(work / "out"), "--once")
    _refused(capsys, work, *argv, names=named)
    assert not (work / "out").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_pull_refuses_a_dir_that_is_a_file(work, capsys, where):
    _refused(
        capsys,
        work,
        *_pull(work, "--dir", str(work / where), "--once"),
        names=f"--dir {str(work / where)!r}",
    )


@pytest.mark.timeout(60)
def test_pull_reads_config_before_touching_the_store_or_dir(work, capsys):
    binary = work / "binary"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    _refused(
        capsys,
        work,
        *_pull(work, "--dir", str(work / "out"), "--once", "--config", str(binary)),
        names=f"--config {str(binary)!r}",
    )


@pytest.mark.timeout(120)
def test_pull_loop_waits_for_a_missing_store_without_creating_it(tmp_path):
    missing = tmp_path / "nostore"
    out_file, err_file = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltasync",
                "pull",
                str(missing),
                "--tp",
                "2",
                "--shard",
                SHARD,
                "--dir",
                str(tmp_path / "out"),
                "--interval",
                "0.05",
            ],
            cwd=REPO,
            stdout=out,
            stderr=err,
            text=True,
        )
    try:
        deadline = time.monotonic() + 90
        while "waiting for the store directory" not in out_file.read_text():
            assert proc.poll() is None, out_file.read_text() + err_file.read_text()
            assert time.monotonic() < deadline, "the sidecar never said it waits"
            time.sleep(0.05)
        time.sleep(0.3)  # a few more polls
        assert not missing.exists() and not (tmp_path / "out").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, err_file.read_text()
        assert "Traceback" not in err_file.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not missing.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- 6: a damaged shard file


def _damage(path: Path, how: str, other: Path) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "garbage":
        path.write_text("garbage\n")
    elif how == "symlink":
        path.unlink()
        path.symlink_to(other)
    else:  # metadata written by hand: int() accepts it, the state file does not
        tensors = load_file(str(path))
        meta = {"deltasync_version": "1", "deltasync_state_digest": "0" * 32}
        meta.update(json.loads(how))
        save_file(tensors, str(path), metadata=meta)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "garbage",
        "symlink",
        '{"deltasync_version": "-5", "deltasync_state_digest": "zz"}',
        '{"deltasync_version": "999999999999"}',
        '{"deltasync_run_id": "../x"}',
    ],
)
def test_pull_replaces_a_damaged_shard_file_from_the_newest_anchor(work, published, capsys, how):
    out = work / "out"
    file = out / f"{SHARD}.safetensors"
    assert _cli(capsys, *_pull(work, "--dir", str(out), "--once"))[0] == 0
    other = work / "other.txt"  # what a symlink points to: never written through
    other.write_text("someone else's file\n")
    _damage(file, how, other)

    rc, stdout, err = _cli(capsys, *_pull(work, "--dir", str(out), "--once"))
    assert rc == 0, stdout + err
    assert str(file) in err and "replacing it from the newest anchor" in err, err
    assert "applied [0, 1, 2]" in stdout, "restored from the anchor, not continued"
    assert file.is_file() and not file.is_symlink()
    assert_same_bits(load_file(str(file)), published[1][SHARD])
    with safe_open(str(file), framework="pt") as f:
        assert f.metadata()["deltasync_version"] == "2"
    assert other.read_text() == "someone else's file\n"
    rc, stdout, err = _cli(capsys, *_pull(work, "--dir", str(out), "--once"))
    assert rc == 0 and "(from 2, applied [])" in stdout, stdout + err  # continued from the file


@pytest.mark.timeout(60)
def test_pull_refuses_a_directory_in_place_of_the_shard_file(work, capsys):
    out = work / "out"
    (out / f"{SHARD}.safetensors").mkdir(parents=True)
    err = _refused(
        capsys,
        work,
        *_pull(work, "--dir", str(out), "--once"),
        names=str(out / f"{SHARD}.safetensors"),
    )
    assert "remove it" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", ["names", "shapes", "dtypes"])
def test_pull_refuses_a_file_of_another_shard_or_model_and_writes_nothing(
    work, published, capsys, other
):
    # Other shapes were refused only by the receiver, after the sidecar had written its state
    # directory beside the file.

    out = work / "out"
    out.mkdir()
    file = out / f"{SHARD}.safetensors"
    tensors = {n: t.clone() for n, t in published[1][SHARD].items()}
    first = sorted(tensors)[0]
    if other == "names":
        tensors["model.extra.weight"] = tensors[first].clone()
    elif other == "shapes":
        tensors[first] = tensors[first].reshape(-1)[:-1].clone()
    else:
        tensors[first] = tensors[first].float()
    save_file(tensors, str(file))
    err = _refused(capsys, work, *_pull(work, "--dir", str(out), "--once"), names=str(file))
    assert "another shard or model" in err and "Nothing was written" in err


@pytest.mark.timeout(60)
def test_pull_registers_a_version_its_file_claims_only_once_the_store_confirms_it(
    work, published, capsys
):
    # The file's metadata named version 99 (its tensors hashing to the digest beside it), and
    # "holds version 99" was registered at start, before the store was asked; a pull that
    # then failed left it there.
    out = work / "out"
    assert _cli(capsys, *_pull(work, "--dir", str(out), "--once"))[0] == 0
    file = out / f"{SHARD}.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(str(file)), str(file), metadata={**meta, "deltasync_version": "99"})
    store = LocalStore(work / "store")
    store.delete(names.receiver_key(default_receiver_id(SHARD, out)))
    for key in store.list("v"):  # nothing this shard could be restored from
        if f"/{SHARD}/" in key:
            store.delete(key)
    config = str(work / "config.json")  # the specs from it: the shard's blobs are gone
    rc, _, err = _cli(capsys, *_pull(work, "--dir", str(out), "--once", "--config", config))
    assert rc == 2 and "MissingBlobError" in err, err
    assert not store.exists(names.receiver_key(default_receiver_id(SHARD, out)))


@pytest.mark.timeout(120)
def test_replicas_of_one_shard_register_and_ack_under_their_own_default_ids(
    work, published, capsys
):
    # Every sidecar of a shard defaulted to pull-<shard>: replicas overwrote each other's
    # registration and acks, and a lagging one was hidden behind another's heartbeat.
    first, second = work / "replica-a", work / "replica-b"
    for out in (first, second, first):  # the first again: a restart keeps its id
        assert _cli(capsys, *_pull(work, "--dir", str(out), "--once"))[0] == 0
    ids = {default_receiver_id(SHARD, first), default_receiver_id(SHARD, second)}
    assert len(ids) == 2 and all(i.startswith(f"pull-{SHARD}-") for i in ids)
    # the id recorded in --dir: another container on the same volume takes over its own
    assert default_receiver_id(SHARD, first) == default_receiver_id(SHARD, first)
    catalog = Catalog(LocalStore(work / "store"))
    held = {r: (rec.shard, rec.version) for r, rec in catalog.receivers().items()}
    newest = catalog.head().version
    assert held == dict.fromkeys(ids, (SHARD, newest))
    assert set(catalog.acks(newest)) == ids
    assert default_receiver_id(SHARD, str(first) + "/") == default_receiver_id(SHARD, first)


@pytest.mark.timeout(60)
def test_a_sidecar_that_ran_under_the_former_default_id_keeps_it(work, published, capsys):
    # a new id at the upgrade would leave the old registration counted as a lagging receiver
    out = work / "out"
    argv = _pull(work, "--dir", str(out), "--once")
    assert _cli(capsys, *argv, "--receiver-id", f"pull-{SHARD}")[0] == 0
    assert default_receiver_id(SHARD, out) == f"pull-{SHARD}"
    assert _cli(capsys, *argv)[0] == 0
    receivers = Catalog(LocalStore(work / "store")).receivers()
    assert list(receivers) == [f"pull-{SHARD}"]


@pytest.mark.timeout(60)
def test_pull_refuses_another_shards_file_and_registers_nothing(work, published, capsys):
    # TP ranks' files have the same names and shapes: tp1's file at tp0's place hashed to its
    # own metadata, and "pull-tp0 holds version 1" was registered before the store was asked.
    other = "tp1" if SHARD != "tp1" else "tp0"
    source = work / "other"
    assert _cli(capsys, *_pull(work, "--dir", str(source), "--once", "--shard", other))[0] == 0
    out = work / "out"
    out.mkdir()
    shutil.copy(source / f"{other}.safetensors", out / f"{SHARD}.safetensors")
    registered = LocalStore(work / "store").list(names.RECEIVERS_PREFIX)
    err = _refused(
        capsys, work, *_pull(work, "--dir", str(out), "--once"), names=f"holds shard {other!r}"
    )
    assert "another sidecar's file" in err
    assert LocalStore(work / "store").list(names.RECEIVERS_PREFIX) == registered


# ---------------------------------------------------------------------- 7: config and layout files


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["binary", "deep", "huge"])
def test_config_file_that_is_not_a_small_utf8_json_file_is_a_layout_error(work, capsys, kind):
    bad = work / f"{kind}.json"
    if kind == "binary":
        bad.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    elif kind == "deep":
        bad.write_text("[" * 200_000 + "]" * 200_000)
    else:  # over the 4 MiB cap: refused by its size, not parsed
        bad.write_text("{" + " " * (5 << 20) + "}")
    err = _refused(
        capsys, work, "layout", "probe", "--config", str(bad), names=str(bad), error="LayoutError"
    )
    if kind == "huge":
        assert "larger than 4 MiB" in err


@pytest.mark.timeout(60)
def test_layout_file_that_is_binary_is_a_layout_error(work, capsys):
    bad = work / "layout.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    _refused(
        capsys,
        work,
        "layout",
        "split",
        "--config",
        str(work / "config.json"),
        "--checkpoint",
        str(work / "none.safetensors"),
        "--layout",
        str(bad),
        "--out",
        str(work / "split"),
        names=str(bad),
        error="LayoutError",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_config_file_that_is_a_device_or_fifo_is_refused_without_reading_it(tmp_path, kind):
    if kind == "fifo":
        path = tmp_path / "config.fifo"
        os.mkfifo(path)  # no writer: a plain open blocks forever
    else:
        path = Path("/dev/zero")  # reads without end
    try:
        # 1 GiB of address space is plenty for the CLI; reading /dev/zero whole is not
        done = _subprocess(
            "layout",
            "probe",
            "--config",
            str(path),
            cwd=tmp_path,
            timeout=30,
            max_memory=1 << 30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"--config {path} hung")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("deltasync: error: LayoutError: ")
    assert str(path) in done.stderr and "not a regular file" in done.stderr


# ---------------------------------------------------------------------- 8: probe --out, --cache


@pytest.mark.timeout(60)
def test_probe_out_in_a_file_is_a_layout_error(work, capsys):
    target = work / "afile" / "x.json"
    _refused(
        capsys,
        work,
        "layout",
        "probe",
        "--config",
        str(work / "config.json"),
        "--out",
        str(target),
        names=str(target),
        error="LayoutError",
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_probe_cache_that_is_a_file_is_refused_before_probing(work, capsys, where):
    _refused(
        capsys,
        work,
        "layout",
        "probe",
        "--config",
        str(work / "config.json"),
        "--cache",
        str(work / where),
        names=str(work / where),
        error="LayoutError",
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leave", [0, 4096])  # nothing: the lock's pid; a page: the state file
def test_pull_on_a_full_dir_is_refused_naming_the_file_and_to_free_space(
    work, published, capsys, leave
):
    # It said only "cannot write ...: No space left on device".
    with mounted_tmpfs(work / "mnt") as mnt:
        out = mnt / "out"
        out.mkdir()
        fill_up(mnt, leave=leave)
        rc, _, err = _cli(capsys, *_pull(work, "--dir", str(out), "--once"))
        assert rc == 2 and err.startswith("deltasync: error: LocalStateError: cannot write "), err
        assert "No space left on device (its filesystem is full: free space in " in err, err
        assert not (out / f"{SHARD}.safetensors").exists()
        os.unlink(mnt / "FILLER")
        assert _cli(capsys, *_pull(work, "--dir", str(out), "--once"))[0] == 0
        assert_same_bits(load_file(str(out / f"{SHARD}.safetensors")), published[1][SHARD])


@pytest.mark.timeout(60)
def test_pull_reports_a_shard_file_it_cannot_write_and_the_loop_writes_it_later(
    work, capsys, monkeypatch
):
    # a full disk under --dir: a typed error naming the file and the version, no traceback;
    # the loop retries the write until it lands, though the pull has nothing new by then
    from deltasync.commands import pull

    real, calls = pull._safetensors_chunks, []

    def chunks(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            yield b"\0" * 4096
            raise OSError(28, "No space left on device")
        yield from real(*args, **kwargs)

    monkeypatch.setattr(pull, "_safetensors_chunks", chunks)
    out = work / "out"
    file = out / f"{SHARD}.safetensors"
    rc, _, err = _cli(capsys, *_pull(work, "--dir", str(out), "--once"))
    assert rc == 2 and "ApplyError: could not write version 2" in err and str(file) in err, err
    assert not file.exists()
    # the store never shows the sidecar at a version its file does not hold
    catalog = Catalog(scratch_store(work / "store"))
    assert catalog.acks(2) == {} and catalog.receivers() == {}
    calls.clear()
    argv = _pull(work, "--dir", str(out), "--interval", "0.05", "--iterations", "2")
    rc, _, err = _cli(capsys, *argv)
    assert rc == 0 and "could not write version 2" in err, err
    assert len(calls) == 2 and file.is_file()
    assert list(catalog.acks(2)) == [default_receiver_id(SHARD, out)]
    assert {r.version for r in catalog.receivers().values()} == {2}


# ------------------------------------------------- 9: blobs a manifest lists, read by the commands

_PEAK_RSS = (
    "import resource, sys\n"
    "from deltasync.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _peak_rss(cwd: Path, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI in a fresh interpreter, and its peak RSS in MiB (the last line of stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    *_, last = done.stderr.splitlines()
    return done, int(last) / 1024


def _relist(store: Path, version: int, edit) -> None:
    """Rewrite ``version``'s manifest through ``edit`` (as anyone who can write an unsigned
    store can)."""
    path = store / f"v{version:08d}" / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _entry(manifest: dict) -> dict:
    return next(b for b in manifest["blobs"] if b["shard"] == SHARD)


def _sparse_blob(store: Path, version: int, size: int) -> str:
    """SHARD's blob of ``version`` replaced by a sparse file of ``size`` bytes (no disk used)
    and listed at that size; its key."""
    keys = []

    def edit(manifest: dict) -> None:
        entry = _entry(manifest)
        with open(store / entry["key"], "r+b") as f:
            f.truncate(size)
        entry["size"] = size
        keys.append(entry["key"])

    _relist(store, version, edit)
    return keys[0]


def _numel_bound(store: Path, version: int) -> int:
    from deltasync.receiver.staging import numel_blob_bound

    path = store / f"v{version:08d}" / "MANIFEST.json"
    return numel_blob_bound(json.loads(path.read_text())["layout"]["shards"][SHARD]["numel"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("listed", ["beyond the layout's bound", "at the layout's bound"])
def test_inspect_checks_a_blob_listed_at_any_size_in_bounded_memory(work, published, listed):
    # a blob the manifest lists larger than its shard can hold is not read; one within that
    # bound is hashed in chunks: neither is ever held whole
    store = work / "store"
    bound = _numel_bound(store, 2)
    beyond = listed.startswith("beyond")
    key = _sparse_blob(store, 2, 1 << 30 if beyond else bound)
    done, peak = _peak_rss(work, "inspect", str(store), "--json", "--last", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    _, baseline = _peak_rss(work, "inspect", str(published[0]), "--json", "--last", "0")
    rows = json.loads(done.stdout)["rows"]
    (row,) = [r for r in rows if r["version"] == 2 and r["shard"] == SHARD]
    assert row["status"] == "corrupt" and key in row["reason"], row
    if beyond:
        assert f"more than any blob of shard {SHARD!r}" in row["reason"], row
        assert "not read" in row["reason"], row
    else:
        assert "does not match the manifest's digest" in row["reason"], row
    assert all(r["status"] == "ok" for r in rows if r is not row), rows
    assert peak - baseline < 64, f"peak RSS {peak:.0f} MiB, {baseline:.0f} MiB without the blob"


@pytest.mark.timeout(60)
def test_inspect_hashing_in_chunks_tells_ok_corrupt_truncated_and_missing_blobs_apart(
    work, capsys, monkeypatch
):
    from deltasync.commands import inspect_store

    monkeypatch.setattr(inspect_store, "HASH_CHUNK", 1000)  # every blob of the store is larger
    store = work / "store"

    def statuses() -> dict[int, tuple[str, str]]:
        rc, out, _ = _cli(capsys, "inspect", str(store), "--json", "--last", "0")
        assert rc == 0
        rows = json.loads(out)["rows"]
        return {r["version"]: (r["status"], r["reason"]) for r in rows if r["shard"] == SHARD}

    assert {s for s, _ in statuses().values()} == {"ok"}
    keys = {
        v: _entry(json.loads((store / f"v{v:08d}/MANIFEST.json").read_text()))["key"]
        for v in range(3)
    }
    for v in range(3):
        assert (store / keys[v]).stat().st_size > 1000
    blob = store / keys[0]
    data = bytearray(blob.read_bytes())
    data[-1500] ^= 1  # in the second-to-last chunk
    blob.write_bytes(bytes(data))
    (store / keys[1]).write_bytes((store / keys[1]).read_bytes()[:-1])
    (store / keys[2]).unlink()
    got = statuses()
    assert got[0][0] == "corrupt" and "digest" in got[0][1], got
    assert got[1][0] == "truncated", got
    assert got[2][0] == "missing blob", got


@pytest.mark.timeout(300)
def test_pull_without_config_refuses_an_anchor_blob_its_layout_record_cannot_hold_unread(
    work, published
):
    store = work / "store"
    key = _sparse_blob(store, 0, 1 << 30)
    shutil.copytree(published[0], work / "pristine")
    out = work / "out"
    done, peak = _peak_rss(work, *_pull(work, "--dir", str(out), "--once"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("deltasync: error: BlobLimitError: anchor version 0 blob")
    assert key in done.stderr and "pass --config" in done.stderr
    assert not out.exists()
    pristine = _pull(work, "--dir", str(work / "out2"), "--once", store=work / "pristine")
    ok, baseline = _peak_rss(work, *pristine)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert peak - baseline < 64, f"peak RSS {peak:.0f} MiB, {baseline:.0f} MiB without the blob"


@pytest.mark.timeout(60)
def test_pull_without_config_refuses_an_anchor_without_a_layout_record(work, capsys):
    # nothing bounds its blobs' sizes then: --config says what the shard holds
    _relist(work / "store", 0, lambda m: m.pop("layout"))
    _refused(
        capsys,
        work,
        *_pull(work, "--dir", str(work / "out"), "--once"),
        names="records no layout for shard 'tp1'",
    )


def _with_record(blob: bytes, record: bytes) -> bytes:
    """``blob`` with one more segment holding ``record``, resealed (its writer's doing)."""
    import xxhash
    import zstandard

    from deltasync.format.wire import DIGEST_SIZE, FLAG_ZSTD, HEADER, SEGMENT, TRAILER

    flags = HEADER.unpack_from(blob)[2]
    section = zstandard.ZstdCompressor().compress(record) if flags & FLAG_ZSTD else record
    segment = SEGMENT.pack(len(section), len(record), 1) + section
    end = len(blob) - DIGEST_SIZE - TRAILER.size
    magic, segments, records, raw, body = TRAILER.unpack_from(blob, end)
    trailer = TRAILER.pack(magic, segments + 1, records + 1, raw + len(record), body + len(segment))
    out = blob[:end] + segment + trailer
    return out + xxhash.xxh3_128_digest(out)


@pytest.mark.timeout(60)
def test_pull_without_config_refuses_an_anchor_tensor_with_a_dim_no_tensor_can_have(work, capsys):
    # (2^63, 0) holds no element, so its element count is in range; torch cannot make it
    import struct
    from types import SimpleNamespace

    import torch

    from deltasync.commit import blob_digest
    from deltasync.commit.model import specs_fingerprint
    from deltasync.format import TensorSpec, decode_blob
    from deltasync.format.wire import RECORD

    store = work / "store"

    def edit(manifest: dict) -> None:
        entry = _entry(manifest)
        blob = (store / entry["key"]).read_bytes()
        specs = {u.name: TensorSpec(u.shape, u.dtype) for u in decode_blob(blob).updates}
        evil = RECORD.pack(4, 1, 0, 2, 0, 0, 0, 0) + b"evil" + struct.pack("<2Q", 1 << 63, 0)
        blob = _with_record(blob, evil)
        (store / entry["key"]).write_bytes(blob)
        entry["size"], entry["digest"] = len(blob), blob_digest(blob)
        # the layout record agrees, so only the shape itself can be refused
        specs["evil"] = SimpleNamespace(shape=(1 << 63, 0), dtype=torch.bfloat16)  # unbuildable
        manifest["layout"]["shards"][SHARD]["specs"] = specs_fingerprint(specs)

    _relist(store, 0, edit)
    err = _refused(
        capsys,
        work,
        *_pull(work, "--dir", str(work / "out"), "--once"),
        names="tensor 'evil'",
        error="BlobLimitError",
    )
    assert "dim above 2^62" in err
