"""open_store: turn a store URL into a Store.

- a plain path or ``file:///abs/path``  -> LocalStore
- ``s3://bucket`` or ``s3://bucket/prefix`` -> S3Store (endpoint, credentials and retries from
  the ``s3`` config; nothing is read from environment variables here)
- ``memory://``  -> a fresh MemoryStore; ``memory://NAME`` -> the process-wide MemoryStore of
  that name, so two components opened from the same URL in one process share it.

``throttle_gbps`` wraps the result in a ThrottledStore (benchmarks). This module only parses
URLs; it knows nothing about what is stored.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from deltasync.errors import ConfigError, DeltaSyncError, StoreError
from deltasync.store.base import Store
from deltasync.store.emulated import MemoryStore, ThrottledStore
from deltasync.store.local import LocalStore
from deltasync.store.s3 import S3Config, S3Store

_named_memory: dict[str, MemoryStore] = {}
_named_lock = threading.Lock()


def url_scheme(url: str) -> str:
    """The lowercased scheme of a store URL (``S3://b`` is ``s3``), ``""`` for a plain path:
    the one parse every caller that routes by scheme uses, so they all agree with
    :func:`open_store`."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def open_store(
    url: str,
    *,
    s3: S3Config | None = None,
    durable: bool = True,
    throttle_gbps: float | None = None,
    create: bool = True,
) -> Store:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, got {url!r}")
    store: Store
    scheme = url_scheme(url)
    if scheme in ("", "file"):
        if scheme == "file":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(
                    f"file URL {url!r} names host {parts.netloc!r}; use file:///abs/path"
                )
            path = unquote(parts.path)
        else:
            path = url
        if not path:
            raise ConfigError(f"store URL {url!r} has no path")
        try:
            store = LocalStore(path, durable=durable, create=create)
        except StoreError as exc:
            if create:
                raise
            # create=False: a path that is not a store's directory is the caller's setting
            # (a typo, a store not made yet), refused as one; nothing was created
            raise ConfigError(f"{exc} (nothing was created)") from None
    elif scheme == "s3":
        rest = url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ConfigError(f"S3 URL {url!r} has no bucket; use s3://bucket/prefix")
        store = S3Store(bucket, prefix, config=s3)
    elif scheme == "memory":
        name = url.split("://", 1)[1]
        if not name:
            store = MemoryStore()
        else:
            with _named_lock:
                store = _named_memory.setdefault(name, MemoryStore(name))
    else:
        raise ConfigError(
            f"store URL {url!r} has unknown scheme {scheme!r}; use a path, file://, s3:// or memory://"
        )
    if s3 is not None and scheme != "s3":
        raise ConfigError(f"an S3Config was given for the non-S3 store URL {url!r}")
    if throttle_gbps is not None:
        store = ThrottledStore(store, throttle_gbps)
    return store


def open_existing_store(
    url: str, *, s3: S3Config | None = None, durable: bool = True, what: str = "store"
) -> Store:
    """:func:`open_store` for a reader of a store its trainer made (an engine's receivers): a
    local path where no store directory exists is a ConfigError naming ``what`` and the path,
    and nothing is created (a mistyped path would otherwise become an empty store the receiver
    registers into and waits on)."""
    try:
        return open_store(url, s3=s3, durable=durable, create=False)
    except DeltaSyncError as exc:
        said = "nothing was created" in str(exc)  # open_store's refusal of a missing root
        raise ConfigError(
            f"{what} {url!r}: {exc}. A receiver reads the store its trainer made: check the "
            f"path{'' if said else '. Nothing was created'}"
        ) from None


def open_engine_store(
    url: str, s3_fields: Mapping[str, Any] | None, *, durable: bool, what: str
) -> Store:
    """:func:`open_existing_store` for an engine hook, whose request carries its S3 settings
    as a dict of :class:`S3Config` fields; ``what`` names the request (``what.s3``,
    ``what.store``) in a ConfigError."""
    try:
        s3 = S3Config(**s3_fields) if s3_fields is not None else None
    except TypeError as exc:
        raise ConfigError(f"{what}.s3 does not hold S3Config fields: {exc}") from None
    return open_existing_store(url, s3=s3, durable=durable, what=f"{what}.store")
