"""``open_store(path, create=False)`` refuses a missing local store with ConfigError and
creates nothing (docs/storage.md, open_store)."""

from __future__ import annotations

import pytest

from deltasync.errors import ConfigError
from deltasync.store import LocalStore, open_store


def test_open_store_without_create_refuses_a_missing_directory_as_a_config_error(tmp_path):
    missing = tmp_path / "run42"
    with pytest.raises(ConfigError, match="nothing was created"):
        open_store(str(missing), create=False)
    assert not missing.exists()


def test_open_store_without_create_refuses_a_file_url_to_a_missing_directory(tmp_path):
    with pytest.raises(ConfigError):
        open_store(f"file://{tmp_path}/run42", create=False)
    assert list(tmp_path.iterdir()) == []


def test_open_store_without_create_opens_an_existing_store(tmp_path):
    LocalStore(tmp_path / "run42").put("LATEST", b'{"version":0}')
    store = open_store(str(tmp_path / "run42"), create=False)
    assert store.get("LATEST") == b'{"version":0}'


def test_a_receivers_missing_store_says_nothing_was_created_once(tmp_path):
    from deltasync.store.factory import open_existing_store

    with pytest.raises(ConfigError) as raised:
        open_existing_store(str(tmp_path / "missing"), what="engine store")
    message = str(raised.value)
    assert message.lower().count("nothing was created") == 1, message
    assert "engine store" in message and "check the path" in message
    assert not (tmp_path / "missing").exists()
