"""``deltasync gc`` and ``inspect`` recognise a store only by keys that parse as deltasync's
(``LATEST``, a ``v########/`` version directory, a ``receivers/{id}.json`` registration): a
directory that merely holds ``venv/`` or ``vacation.txt`` is refused (rc 2, "not a deltasync
store"), and recognising it never walks such unrelated trees."""

from __future__ import annotations

import argparse

import pytest

from deltasync import names
from deltasync.cli import main
from deltasync.commands.inspect_store import is_store
from deltasync.commit import ReceiverRecord
from deltasync.store import LocalStore


def _not_a_store(root):
    """A project directory: files and trees under names that start with 'v' or 'receivers'."""
    for rel, text in {
        "venv/lib/site.py": "x",
        "var/log/syslog": "y",
        "vacation.txt": "z",
        "v1/notes.md": "n",
        "v00000001": "a file, not a version directory",
        "receivers/notes.txt": "not a registration",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(p.relative_to(root) for p in root.rglob("*"))


class ListingLog:
    """A LocalStore that remembers every key its listings returned."""

    def __init__(self, root) -> None:
        self.inner = LocalStore(root, create=False)
        self.listed: list[str] = []

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        keys = self.inner.list(prefix)
        self.listed.extend(keys)
        return keys


@pytest.mark.parametrize(
    "command", [["gc", "--dry-run"], ["gc"], ["inspect"], ["inspect", "--json"]]
)
def test_a_directory_with_files_under_v_names_is_refused_as_not_a_store(tmp_path, capsys, command):
    before = _not_a_store(tmp_path)
    assert main([command[0], str(tmp_path), *command[1:]]) == 2
    captured = capsys.readouterr()
    assert "holds no LATEST, version or registration: not a deltasync store" in captured.err
    assert captured.out == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_recognising_a_store_never_walks_unrelated_trees(tmp_path):
    _not_a_store(tmp_path)
    store = ListingLog(tmp_path)
    assert not is_store(store)
    # (only a tree named ``v<digit>...``, as ``v1/``, shares a version directory's list prefix)
    walked = [k for k in store.listed if k.startswith(("venv/", "var/"))]
    assert walked == [], f"listed keys of unrelated trees: {walked}"


@pytest.mark.parametrize(
    "key",
    [
        names.LATEST,
        names.writer_marker_key(3, "w00000"),  # an attempt that never committed
        names.blob_key(0, "tp0", "w00000"),
        names.manifest_key(12345678),
        names.receiver_key("pull-tp0"),
    ],
)
def test_any_one_key_of_deltasync_makes_a_store(tmp_path, key):
    _not_a_store(tmp_path)
    data = b"{}"
    if key.startswith(names.RECEIVERS_PREFIX):
        data = ReceiverRecord(receiver="pull-tp0", shard="tp0", version=None, updated_at=1.0)
        data = data.to_json()
    LocalStore(tmp_path).put(key, data)
    assert is_store(ListingLog(tmp_path))


@pytest.mark.parametrize(
    "command",
    [["gc", "--dry-run"], ["inspect"], ["pull", "--shard", "tp0", "--dir", "OUT", "--once"]],
)
def test_a_demo_run_directory_is_refused_with_the_path_of_the_store_inside_it(
    tmp_path, capsys, command
):
    run = tmp_path / "run1"  # `deltasync demo --store run1`: run1/store, run1/rx-tp0, ...
    inner = LocalStore(run / "store")
    inner.put(names.receiver_key("demo-tp0"), b"{}")
    (run / "rx-tp0").mkdir()
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    assert main([argv[0], str(run), *argv[1:]]) == 2
    assert f"its store is {str(run / 'store')!r}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command",
    [["gc", "--dry-run"], ["inspect"], ["pull", "--shard", "tp0", "--dir", "OUT", "--once"]],
)
def test_a_file_url_one_slash_short_is_refused_as_naming_a_host_not_waited_for(
    tmp_path, capsys, command
):
    LocalStore(tmp_path / "store").put(names.receiver_key("demo-tp0"), b"{}")
    url = "file:/" + str(tmp_path / "store")  # file://tmp/...: 'tmp' is the URL's host
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    assert main([argv[0], url, *argv[1:]]) == 2
    assert "names host" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_pull_loop_refuses_a_file_url_naming_a_host_before_waiting_for_it(tmp_path):
    from deltasync.commands.inspect_store import check_store_flags
    from deltasync.errors import ConfigError

    args = argparse.Namespace(
        store="file://tmp" + str(tmp_path),
        s3_endpoint=None,
        s3_read_timeout=None,
        s3_retry_deadline=None,
        s3_ca_bundle=None,
    )
    with pytest.raises(ConfigError, match="names host 'tmp'"):
        check_store_flags(args)  # what `pull` checks before it waits for a store directory
