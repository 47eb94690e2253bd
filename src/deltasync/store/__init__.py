"""Byte storage under string keys: the Store protocol and its backends.

``LocalStore`` (the embedded default), ``S3Store`` (S3-compatible, boto3 imported lazily),
``MemoryStore`` (tests), ``ThrottledStore`` (emulated link rate), and ``open_store(url)``.
What is stored where is decided above, in :mod:`deltasync.names` and :mod:`deltasync.commit`.
"""

from deltasync.store.base import InvalidKeyError, RetryPolicy, Store, check_key, check_prefix
from deltasync.store.emulated import MemoryStore, ThrottleConfig, ThrottledStore
from deltasync.store.factory import open_store
from deltasync.store.local import LocalStore
from deltasync.store.s3 import S3Config, S3Store

__all__ = [
    "InvalidKeyError",
    "LocalStore",
    "MemoryStore",
    "RetryPolicy",
    "S3Config",
    "S3Store",
    "Store",
    "ThrottleConfig",
    "ThrottledStore",
    "check_key",
    "check_prefix",
    "open_store",
]
