"""LocalStore's root is a boundary: no link below it is followed, only regular files are keys,
reads are bounded before they start, and every OS failure is a StoreError naming the key."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

import pytest

from deltasync import LocalStore
from deltasync.errors import (
    InvalidKeyError,
    KeyNotFoundError,
    ObjectTooLargeError,
    StoreError,
)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the store that must never be read or changed through it."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "precious.json").write_bytes(b"OUTSIDE-SECRET")
    (d / "sub" / "deep.blob").write_bytes(b"OUTSIDE-SECRET-2")
    return d


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_a_symlinked_directory_below_the_root_is_never_listed_read_written_or_deleted_through(
    tmp_path: Path, outside: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("acks/v00000001/r.json", b"{}")
    os.symlink(outside, tmp_path / "store" / "acks" / "v00000000")
    before = _tree(outside)

    assert store.list() == ["acks/v00000001/r.json"]
    assert store.list("acks/v00000000/") == []
    assert not store.exists("acks/v00000000/precious.json")
    with pytest.raises(StoreError, match="symbolic link"):
        store.get("acks/v00000000/precious.json")
    with pytest.raises(StoreError, match="symbolic link"):
        store.size("acks/v00000000/precious.json")
    with pytest.raises(StoreError, match="symbolic link"):
        store.put("acks/v00000000/new.json", b"x")
    with pytest.raises(StoreError, match="symbolic link"):
        store.delete("acks/v00000000/precious.json")
    with pytest.raises(StoreError, match="symbolic link"):
        store.delete("acks/v00000000/sub/deep.blob")
    assert _tree(outside) == before
    assert sorted(os.listdir(outside)) == ["precious.json", "sub"]


def test_a_symlinked_key_is_refused_and_deleting_it_removes_only_the_link(
    tmp_path: Path, outside: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("v00000001/MANIFEST.json", b"m")
    link = tmp_path / "store" / "v00000001" / "tp0.blob"
    os.symlink(outside / "precious.json", link)
    os.symlink("/dev/zero", tmp_path / "store" / "v00000001" / "zero.blob")
    for key in ("v00000001/tp0.blob", "v00000001/zero.blob"):
        with pytest.raises(StoreError, match="symbolic link"):
            store.get(key)
        with pytest.raises(StoreError, match="symbolic link"):
            store.get_range(key, 0, 4)
        assert not store.exists(key)
    assert store.list() == ["v00000001/MANIFEST.json"]
    store.delete("v00000001/tp0.blob")
    assert not link.is_symlink()
    assert (outside / "precious.json").read_bytes() == b"OUTSIDE-SECRET"


def test_put_over_a_symlinked_key_replaces_the_link_never_its_target(
    tmp_path: Path, outside: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir(exist_ok=True)
    os.symlink(outside / "precious.json", tmp_path / "store" / "LATEST")
    store.put("LATEST", b'{"version":1}')
    assert store.get("LATEST") == b'{"version":1}'
    assert (outside / "precious.json").read_bytes() == b"OUTSIDE-SECRET"
    os.symlink(outside / "precious.json", tmp_path / "store" / "other")
    with pytest.raises(StoreError, match="already exists"):
        store.put_if_absent("other", b"x")  # a link where a key goes counts as taken
    assert (outside / "precious.json").read_bytes() == b"OUTSIDE-SECRET"


@pytest.mark.timeout(20)
def test_a_fifo_in_place_of_a_blob_is_refused_at_once_instead_of_blocking(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("v00000001/tp0/w.blob", b"x")
    path = tmp_path / "store" / "v00000001" / "tp0" / "w.blob"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(StoreError, match="not a regular file"):
        store.get("v00000001/tp0/w.blob")
    with pytest.raises(StoreError, match="not a regular file"):
        store.size("v00000001/tp0/w.blob")
    assert store.list() == []
    assert not store.exists("v00000001/tp0/w.blob")


def test_a_huge_sparse_file_is_refused_by_its_size_before_any_byte_is_read(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("v00000001/tp0/w.blob", b"small")
    path = tmp_path / "store" / "v00000001" / "tp0" / "w.blob"
    os.truncate(path, 8 * 2**30)  # 8 GiB, sparse: no disk used, no page ever read
    with pytest.raises(ObjectTooLargeError, match=r"8589934592 bytes, more than the 1024"):
        store.get("v00000001/tp0/w.blob", max_bytes=1024)
    assert store.size("v00000001/tp0/w.blob") == 8 * 2**30
    assert store.get_range("v00000001/tp0/w.blob", 0, 5) == b"small"


def test_max_bytes_must_be_a_non_negative_int(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("k", b"abc")
    assert store.get("k", max_bytes=3) == b"abc"
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(StoreError, match="max_bytes"):
            store.get("k", max_bytes=bad)


def test_key_components_over_255_bytes_are_invalid_keys_not_os_errors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    for key in ("a" * 256, "v00000001/" + "é" * 128, "x/" + "b" * 300 + "/c"):
        for call in (
            lambda key=key: store.put(key, b"x"),
            lambda key=key: store.get(key),
            lambda key=key: store.exists(key),
            lambda key=key: store.delete(key),
        ):
            with pytest.raises(InvalidKeyError, match="255 bytes"):
                call()
    store.put("a" * 255, b"ok")  # the longest component a filesystem takes
    assert store.get("a" * 255) == b"ok"
    with pytest.raises(InvalidKeyError):
        store.get("lone\udc80surrogate")


def test_files_and_directories_get_the_configured_modes_whatever_the_umask(
    tmp_path: Path,
) -> None:
    old = os.umask(0)
    try:
        private = LocalStore(tmp_path / "private", file_mode=0o600, dir_mode=0o700)
        private.put("v00000001/tp0/w.blob", b"x")
        default = LocalStore(tmp_path / "default")
        default.put("v00000001/MANIFEST.json", b"x")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
    assert mode(tmp_path / "private" / "v00000001" / "tp0" / "w.blob") == 0o600
    assert mode(tmp_path / "private" / "v00000001" / "tp0") == 0o700
    assert mode(tmp_path / "default" / "v00000001" / "MANIFEST.json") == 0o640
    assert mode(tmp_path / "default" / "v00000001") == 0o750
    with pytest.raises(Exception, match="file_mode"):
        LocalStore(tmp_path / "bad", file_mode=0o1777)


def test_the_root_it_creates_gets_the_configured_mode_under_a_strict_umask(tmp_path: Path) -> None:
    # mkdir's mode went through the umask: 0o700 under umask 077, a root that the receivers,
    # other users of the store's group, could not enter.
    (tmp_path / "theirs").mkdir(mode=0o755)
    old = os.umask(0o077)
    try:
        LocalStore(tmp_path / "store").put("v00000001/MANIFEST.json", b"x")
        LocalStore(tmp_path / "theirs")  # an existing directory: its mode is its owner's
        LocalStore(tmp_path / "theirs" / "runs" / "run42")  # parents made for it: dir_mode
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
    assert mode(tmp_path / "theirs" / "runs") == mode(tmp_path / "theirs" / "runs" / "run42")
    assert mode(tmp_path / "theirs" / "runs") == 0o750
    assert mode(tmp_path / "store") == 0o750
    assert mode(tmp_path / "store" / "v00000001") == 0o750
    assert mode(tmp_path / "theirs") == 0o755


def test_a_directory_swapped_for_a_link_mid_write_is_refused_not_followed(
    tmp_path: Path, outside: Path
) -> None:
    store = LocalStore(tmp_path / "store", durable=False)
    stop = threading.Event()
    root = tmp_path / "store"

    def swapper() -> None:
        while not stop.is_set():
            d = root / "v00000009"
            try:
                if d.is_symlink():
                    d.unlink()
                elif d.is_dir():
                    for p in d.iterdir():
                        p.unlink()
                    d.rmdir()
                os.symlink(outside, d)
            except OSError:
                pass

    t = threading.Thread(target=swapper)
    t.start()
    try:
        for i in range(200):
            with contextlib.suppress(StoreError):
                store.put(f"v00000009/k{i}.blob", b"data")
    finally:
        stop.set()
        t.join(10)
    assert sorted(os.listdir(outside)) == ["precious.json", "sub"]


def test_missing_keys_and_paths_through_files_are_key_not_found(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put("LATEST", b"1")
    for key in ("nope", "LATEST/x", "a/b/c"):
        with pytest.raises(KeyNotFoundError):
            store.get(key)
        assert not store.exists(key)
        store.delete(key)  # missing: not an error


def test_a_put_refused_by_a_directory_at_its_key_leaves_no_temporary_file(tmp_path: Path) -> None:
    # A directory planted at LATEST or at a registration fails every write of that key (the
    # rename cannot replace it); each failed write must not leave its full copy behind.
    root = tmp_path / "store"
    store = LocalStore(root, durable=False)
    (root / "LATEST" / "x").mkdir(parents=True)
    (root / "receivers" / "r0.json" / "x").mkdir(parents=True)
    for _ in range(3):
        with pytest.raises(StoreError, match="'LATEST'"):
            store.put("LATEST", b'{"version":1}')
        with pytest.raises(StoreError, match=r"'receivers/r0\.json'"):
            store.put_stream("receivers/r0.json", [b"{", b"}"])
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "receivers"]
    assert sorted(p.name for p in (root / "receivers").iterdir()) == ["r0.json"]
    store.put("receivers/r1.json", b"{}")  # the directory is still usable
    assert store.list("receivers/") == ["receivers/r1.json"]
