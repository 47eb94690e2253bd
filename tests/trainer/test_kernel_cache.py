"""The native kernel cache is a private directory (0700, ours, no symlink) and a built library
whose SHA-256 does not match its record is rebuilt before it is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync.native.loader import CacheDirError, check_private_dir

_LOAD = "from deltasync.native import loader; lib = loader.load(); print(lib._name if lib else loader.build_error)"


def test_a_new_cache_dir_is_created_private(tmp_path):
    d = check_private_dir(tmp_path / "a" / "deltasync")
    assert (os.lstat(d).st_mode & 0o777) == 0o700


def test_an_open_cache_dir_of_ours_is_tightened(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    check_private_dir(d)
    assert (os.lstat(d).st_mode & 0o777) == 0o700


def test_a_symlinked_cache_dir_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(CacheDirError, match="not a plain directory"):
        check_private_dir(link)


def test_a_cache_dir_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    owner = os.lstat(d).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # we are now someone else
    with pytest.raises(CacheDirError, match=f"owned by uid {owner}, not by this user"):
        check_private_dir(d)


def _load(cache: Path) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(180)
def test_a_tampered_library_is_rebuilt_before_loading(tmp_path):
    first = Path(_load(tmp_path))
    assert first.parent == tmp_path / "deltasync" and first.suffix == ".so"
    digest = first.with_name(first.name + ".sha256").read_text()
    first.write_bytes(b"\x7fELF not a library")  # tampered or truncated
    second = Path(_load(tmp_path))
    assert second == first and first.with_name(first.name + ".sha256").read_text() == digest
    assert first.read_bytes()[:4] == b"\x7fELF" and len(first.read_bytes()) > 1000


@pytest.mark.timeout(120)
def test_an_unusable_cache_home_falls_back_to_a_fresh_private_temp_dir(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "deltasync").symlink_to(tmp_path)  # a planted symlink where the cache would go
    got = Path(_load(home))
    assert got.parent != home / "deltasync" and got.parent.name.startswith("deltasync-kernels-")
    assert (os.lstat(got.parent).st_mode & 0o777) == 0o700
