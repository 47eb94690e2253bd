"""LocalStore specifics: temp files stay invisible, cross-process fencing, directory hygiene;
and open_store's URL parsing."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import stat
import tracemalloc
from pathlib import Path

import pytest

from deltasync import names
from deltasync.atomic import TMP_MARK
from deltasync.errors import CommitConflictError, ConfigError, OutcomeUnknownError, StoreError
from deltasync.store import LocalStore, MemoryStore, S3Config, S3Store, ThrottledStore, open_store


def test_a_crashed_write_leaves_the_old_value_and_an_invisible_temp_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("LATEST", b"old")
    # What a writer killed between writing and publishing leaves behind:
    tmp = tmp_path / f".LATEST{TMP_MARK}0123abcd"
    tmp.write_bytes(b"new-but-never-published")
    assert store.get("LATEST") == b"old"
    assert store.list() == ["LATEST"]
    assert store.sweep_temp_files() == 1
    assert sorted(os.listdir(tmp_path)) == ["LATEST"]


def test_put_if_absent_never_leaves_a_temp_file_behind(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("v00000001/MANIFEST.json", b"a")
    with pytest.raises(CommitConflictError):
        store.put_if_absent("v00000001/MANIFEST.json", b"b")
    assert os.listdir(tmp_path / "v00000001") == ["MANIFEST.json"]


def _race(root: str, key: str, i: int, start, results) -> None:
    store = LocalStore(root)
    start.wait()
    try:
        store.put_if_absent(key, f"process {i}".encode() * 4096)
        results.put((i, "won"))
    except CommitConflictError:
        results.put((i, "lost"))


@pytest.mark.timeout(60)
def test_racing_writer_processes_have_exactly_one_winner(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    key = names.manifest_key(42)
    start = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(str(tmp_path), key, i, start, results)) for i in range(6)
    ]
    for p in procs:
        p.start()
    start.set()
    outcomes = dict(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    winners = [i for i, o in outcomes.items() if o == "won"]
    assert len(winners) == 1 and len(outcomes) == 6
    assert LocalStore(tmp_path).get(key) == f"process {winners[0]}".encode() * 4096


def test_deleting_the_last_key_of_a_directory_prunes_it_but_not_the_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    store.put("v00000001/tp0/w00000.blob", b"x")
    store.delete("v00000001/tp0/w00000.blob")
    assert not (tmp_path / "root" / "v00000001").exists()
    assert (tmp_path / "root").is_dir()


def test_a_write_whose_directory_is_pruned_meanwhile_starts_over(tmp_path: Path) -> None:
    """A delete of a directory's last key prunes the directory; a put that had opened it
    just before writes again instead of failing (a receiver's registration beside another's
    deregister, gc beside a first ack)."""
    store = LocalStore(tmp_path / "root")
    write_temp = store._write_temp
    pruned = []

    def pruned_first(key, dfd, tmp, chunks):
        if not pruned:
            os.rmdir(tmp_path / "root" / "receivers")  # what the racing delete does
            pruned.append(key)
        return write_temp(key, dfd, tmp, chunks)

    store._write_temp = pruned_first
    store.put("receivers/rx-a.json", b"mine")
    assert pruned == ["receivers/rx-a.json"]
    assert store.get("receivers/rx-a.json") == b"mine"
    assert store.list("receivers/") == ["receivers/rx-a.json"]


def test_a_write_whose_parent_directory_is_pruned_meanwhile_starts_over(
    tmp_path: Path, monkeypatch
) -> None:
    # acks/ pruned (its last ack deleted) between its open and the mkdir of acks/v00000005:
    # the mkdir failed, and so did the put
    store = LocalStore(tmp_path / "root")
    root = tmp_path / "root"
    mkdir = os.mkdir
    pruned = []

    def pruned_first(path, mode=0o777, *, dir_fd=None):
        if not pruned and path == "v00000005":
            os.rmdir(root / "acks")
            pruned.append(path)
        return mkdir(path, mode, dir_fd=dir_fd)

    (root / "acks").mkdir()
    monkeypatch.setattr(os, "mkdir", pruned_first)
    store.put("acks/v00000005/rx.json", b"ack")
    monkeypatch.undo()
    assert pruned == ["v00000005"]
    assert store.get("acks/v00000005/rx.json") == b"ack"


def test_a_write_whose_directory_keeps_being_pruned_is_a_store_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "root")
    write_temp = store._write_temp

    def always_pruned(key, dfd, tmp, chunks):
        os.rmdir(tmp_path / "root" / "receivers")
        return write_temp(key, dfd, tmp, chunks)

    store._write_temp = always_pruned
    with pytest.raises(StoreError, match="keeps being removed"):
        store.put("receivers/rx-a.json", b"mine")
    assert not store.exists("receivers/rx-a.json")


def test_a_key_below_an_existing_file_is_a_store_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("LATEST", b"1")
    with pytest.raises(StoreError, match=r"is a file|Not a directory"):
        store.put("LATEST/x", b"2")


def test_a_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreError, match="root"):
        LocalStore(tmp_path / "f")


# --- open_store ------------------------------------------------------------------------------


@pytest.mark.parametrize("create", [True, False])
def test_a_root_the_filesystem_refuses_is_a_store_error_naming_it(tmp_path: Path, create) -> None:
    # Path.is_dir() raised a bare OSError (a name too long) or ValueError (a NUL byte).
    for root in (tmp_path / ("s" * 300) / "run", f"{tmp_path}/a\x00b"):
        with pytest.raises(StoreError, match=r"local store root .* (cannot be used|is not a dir)"):
            LocalStore(root, create=create)
    assert list(tmp_path.iterdir()) == []


def test_open_store_maps_paths_and_file_urls_to_local_stores(tmp_path: Path) -> None:
    plain = open_store(str(tmp_path / "a"))
    assert isinstance(plain, LocalStore) and plain.root == tmp_path / "a"
    url = open_store(f"file://{tmp_path}/b%20c")
    assert isinstance(url, LocalStore) and url.root == tmp_path / "b c"


def test_open_store_gives_fresh_or_named_shared_memory_stores() -> None:
    assert open_store("memory://") is not open_store("memory://")
    a = open_store("memory://shared-for-test")
    a.put("k", b"v")
    b = open_store("memory://shared-for-test")
    assert isinstance(b, MemoryStore) and b.get("k") == b"v"


def test_open_store_builds_an_s3_store_with_bucket_prefix_and_config(aws_env_isolated) -> None:
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    store = open_store("s3://my-bucket/runs/exp1/", s3=config)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.config) == ("my-bucket", "runs/exp1", config)
    store.close()


def test_open_store_can_wrap_in_a_throttle() -> None:
    store = open_store("memory://", throttle_gbps=1.0)
    assert isinstance(store, ThrottledStore) and isinstance(store.inner, MemoryStore)


@pytest.mark.parametrize(
    "url, kwargs, match",
    [
        ("", {}, "non-empty"),
        ("ftp://host/x", {}, "unknown scheme"),
        ("s3://", {}, "no bucket"),
        ("s3:///prefix", {}, "no bucket"),
        ("file://otherhost/x", {}, "names host"),
        ("memory://", {"s3": S3Config()}, "non-S3"),
    ],
)
def test_open_store_rejects_bad_urls_with_a_config_error(url, kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        open_store(url, **kwargs)


def _read_back(tmp_path: Path, size: int, read):
    """``size`` random bytes stored at ``v/blob``, what ``read(store)`` returns and the peak
    of memory traced while it ran."""
    payload = os.urandom(size)
    store = LocalStore(tmp_path / "s", durable=False)
    store.put("v/blob", payload)
    tracemalloc.start()
    try:
        got = read(store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return payload, got, peak


def test_a_get_holds_the_object_once_not_a_buffer_and_a_copy(tmp_path: Path) -> None:
    """A receiver's pull peaks with each fetched blob in memory: the read must not double it."""
    size = 16 * 2**20
    payload, (got, ranged), peak = _read_back(
        tmp_path, size, lambda s: (s.get("v/blob"), s.get_range("v/blob", 1, size - 2))
    )
    assert got == payload and ranged == payload[1:-1]
    # both objects alive at the end: 2 x size; a read through a buffer copied to bytes: 3 x
    assert peak < 2.25 * size, peak / size


def test_an_object_read_in_parts_is_held_once(tmp_path: Path, monkeypatch) -> None:
    # Linux returns at most ~2 GiB per read: a larger object (an anchor of a large shard) is
    # read in parts, here 1 MiB ones; joining the parts held it twice at the peak
    monkeypatch.setattr("deltasync.store.local._MAX_PREAD", 1 << 20)
    size = (5 << 20) + 123
    payload, got, peak = _read_back(tmp_path, size, lambda s: s.get("v/blob"))
    assert got == payload and len(got) == size
    assert peak < 1.25 * size, peak / size


def _failing_directory_fsyncs(monkeypatch) -> None:
    """Every fsync of a directory fails with EIO (a disk error: files still fsync)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr("deltasync.store.local.os.fsync", fsync)


def test_a_failed_directory_fsync_is_a_typed_error_and_a_published_key_possibly_written(
    tmp_path: Path, monkeypatch
) -> None:
    # It escaped as a bare OSError, after put_if_absent's link had made the key visible.
    store = LocalStore(tmp_path / "s", durable=True)
    store.put("v1/a", b"old")
    _failing_directory_fsyncs(monkeypatch)
    with pytest.raises(OutcomeUnknownError, match=r"'v1/MANIFEST' .* possibly written"):
        store.put_if_absent("v1/MANIFEST", b"m")
    assert store.get("v1/MANIFEST") == b"m"  # in place: a reader may have seen it
    with pytest.raises(OutcomeUnknownError, match="'v1/a'"):
        store.put("v1/a", b"new")
    with pytest.raises(
        StoreError, match=r"creating a directory of 'v2/b' .* failed: OSError: .*Input/output error"
    ):
        store.put("v2/b", b"x")
