"""The ``any_store`` fixture: each contract test runs on every backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deltasync.store import LocalStore, MemoryStore, Store


@pytest.fixture(params=["local", "memory", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path) -> Iterator[Store]:
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
    elif request.param == "memory":
        yield MemoryStore()
    else:
        # Under a prefix, so every test also checks that keys are relative to it.
        yield request.getfixturevalue("s3_store")
