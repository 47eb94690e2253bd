"""A writer killed mid-write leaves its temp file in the key's directory. Once every key there
is deleted (gc deleting a version), a temp file nothing has written for an hour goes with the
directory; a younger one (a write that may be in progress) keeps it. (Deleting the last key
left the directory and a blob's worth of temp file forever: only a manual sweep_temp_files,
with every writer stopped, removed them.)"""

from __future__ import annotations

import os
import time

from deltasync import LocalStore
from deltasync.atomic import TMP_MARK
from deltasync.store import local

DEAD_TEMP_S = getattr(local, "DEAD_TEMP_S", 3600.0)


def _left_by_a_killed_write(directory, name: str, age_s: float):
    """The temp file a writer killed after writing it whole leaves (a blob's bytes)."""
    path = directory / f".{name}{TMP_MARK}0123456789abcdef0123456789abcdef"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(4096))
    at = time.time() - age_s
    os.utime(path, (at, at))
    return path


def test_deleting_a_versions_last_keys_removes_the_temp_files_killed_writers_left_long_ago(
    tmp_path,
):
    store = LocalStore(tmp_path / "store", durable=False)
    store.put("v00000003/tp0/w00000-a.blob", b"blob")
    store.put("v00000003/writers/w00000-a.json", b"{}")
    store.put("v00000004/MANIFEST.json", b"{}")
    version = tmp_path / "store" / "v00000003"
    dead = [
        _left_by_a_killed_write(version / "tp0", "w00000-b.blob", DEAD_TEMP_S + 60),
        _left_by_a_killed_write(version / "writers", "w00000-b.json", DEAD_TEMP_S + 60),
    ]
    (version / "tp1").mkdir()  # a shard whose only upload was killed: no key ever there
    dead.append(_left_by_a_killed_write(version / "tp1", "w00000-b.blob", DEAD_TEMP_S + 60))

    store.delete("v00000003/tp0/w00000-a.blob")
    assert not dead[0].exists() and not (version / "tp0").exists()
    assert dead[1].exists(), "removed beside a key"
    assert dead[2].exists(), "the version's directory still holds a key"
    store.delete("v00000003/writers/w00000-a.json")

    assert not any(p.exists() for p in dead)
    assert not version.exists()
    assert store.list("") == ["v00000004/MANIFEST.json"]
    assert (tmp_path / "store").is_dir()


def test_a_temp_file_written_within_the_hour_keeps_its_directory(tmp_path):
    store = LocalStore(tmp_path / "store", durable=False)
    store.put("v00000003/tp0/w00000-a.blob", b"blob")
    shard = tmp_path / "store" / "v00000003" / "tp0"
    young = _left_by_a_killed_write(shard, "w00000-b.blob", DEAD_TEMP_S - 60)
    store.delete("v00000003/tp0/w00000-a.blob")
    assert young.exists() and shard.is_dir()
    assert store.list("") == []
