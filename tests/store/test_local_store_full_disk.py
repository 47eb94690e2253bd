"""LocalStore on a full filesystem: a write refused for room (ENOSPC, EDQUOT) is a StoreError
naming the key and the remedy (free space under the root; ``deltasync gc`` deletes the
versions no receiver needs), stores nothing under the key and leaves no temp file to keep the
disk full; once space is freed the same write lands. On a real tmpfs where this machine lets
the test mount one, else through a fsync refused for room (what delayed allocation or NFS
report at fsync)."""

from __future__ import annotations

import errno
import os

import pytest
from kit import fill_up, mounted_tmpfs

from deltasync.errors import StoreError
from deltasync.store import LocalStore

KEY = "v00000001/tp0/w00000-s.blob"
REMEDY = r"filesystem is full: free space under '.*' \(`deltasync gc` deletes the versions no "


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names
    )


def test_a_write_to_a_full_filesystem_names_the_key_and_the_remedy_and_leaves_nothing(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        store = LocalStore(mnt / "store")
        store.put("LATEST", b"0")
        fill_up(mnt)
        with pytest.raises(StoreError, match=rf"writing '{KEY}' in .*No space left.*{REMEDY}"):
            store.put(KEY, b"x" * 65536)
        with pytest.raises(StoreError, match=rf"writing 'LATEST' in .*{REMEDY}"):
            store.put("LATEST", b"1")
        assert _files(mnt / "store") == ["LATEST"]  # no temp file keeps the disk full
        assert store.get("LATEST") == b"0" and not store.exists(KEY)
        os.unlink(mnt / "FILLER")
        store.put(KEY, b"x" * 65536)
        assert store.get(KEY) == b"x" * 65536


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_refused_for_room_at_fsync_is_a_store_error_with_the_remedy(
    tmp_path, monkeypatch, code
):
    store = LocalStore(tmp_path / "store")  # durable: the temp file is fsynced
    store.put("v00000001/tp0/other", b"y")  # its directories exist

    def full(fd):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(StoreError, match=rf"writing '{KEY}' in .*{REMEDY}"):
            store.put(KEY, b"x" * 100)
    assert _files(tmp_path / "store") == ["v00000001/tp0/other"]  # no temp file, no key


def test_other_write_errors_carry_no_full_disk_remedy(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(StoreError) as failed:
        store.put(KEY, b"x")
    assert "full" not in str(failed.value) and "Input/output error" in str(failed.value)
