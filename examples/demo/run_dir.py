"""The directory a demo run owns (``deltasync demo`` and ``rl-demo``, flag ``--store``).

Both demos put their local store and their receivers' state directories under one run
directory: the ``--store`` the user named, or a fresh temporary one. :func:`check_store_dir`
validates the flag's value when the config is built (a local directory path: the demos'
processes share the store through the filesystem, so an ``s3://`` or ``file://`` URL is
refused rather than turned into a directory named after it); :func:`run_dir` claims the
directory for one run (refusing one an earlier run used, whose versions and receiver states
would mix with this run's) and removes it at the end only when it made it.

This module knows paths only: nothing about stores, models or processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from deltasync.errors import ConfigError


def check_store_dir(field: str, store: object) -> None:
    """Raise ConfigError naming ``field`` unless ``store`` is None (a temporary directory) or
    a local directory path."""
    if store is None:
        return
    if not isinstance(store, str) or not store:
        raise ConfigError(
            f"{field} (--store) takes a local directory, got {store!r}; omit it for a fresh "
            "temporary one"
        )
    if "://" in store:
        raise ConfigError(
            f"{field} (--store) takes a local directory, got the URL {store!r}: the demo's "
            "processes share the store through the local filesystem; pass a path"
        )


@contextmanager
def run_dir(store: str | None, *, prefix: str) -> Iterator[str]:
    """The run directory: ``store`` when given (it must be absent or empty, and is kept), else
    a fresh temporary directory named ``prefix...``, removed when the block ends."""
    if store is None:
        root = tempfile.mkdtemp(prefix=prefix)
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    if os.path.exists(store) and not os.path.isdir(store):
        raise ConfigError(f"--store {store!r} is not a directory; pass an empty or new directory")
    entries = sorted(os.listdir(store)) if os.path.isdir(store) else []
    if entries:
        # A used store holds another run's versions and receiver states: the demo's exactness
        # check compares against this run only, so refuse instead of reporting a false mismatch
        # (or, in rl-demo, waiting for references of the old run's versions).
        held = (
            "an earlier demo run"
            if "store" in entries
            else f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {entries[0]!r} first"
        )
        raise ConfigError(
            f"--store {store!r} is not empty (it holds {held}); pass an empty or new "
            "directory, or omit --store for a fresh temporary one"
        )
    yield store
