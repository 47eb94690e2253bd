"""encode_blobs: one blob per receiver shard, encoded on a few threads.

A version's blobs are independent, and the expensive parts of encoding (numpy gap planes,
zstd) release the GIL, so a trainer with one blob per shard encodes them concurrently instead
of one after another. Each blob's bytes are exactly what :func:`encode_blob` returns for it
(a blob is a pure function of its updates), and results come back in the given shard order,
each as soon as it and those before it are done, so the caller can upload while the rest
encode.

This module knows encode_blob and threads; nothing about stores or layouts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from deltasync.format.encode import encode_blob
from deltasync.format.updates import TensorUpdate


def default_threads(jobs: int) -> int:
    """One thread per blob, at most one per CPU core this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(jobs, cores))


def encode_blobs(
    updates: Mapping[str, Sequence[TensorUpdate]],
    *,
    version: int,
    base_version: int,
    writer: str,
    level: int = 1,
    threads: int | None = 1,
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(shard, blob)`` for every shard of ``updates``, in its order; ``blob`` equals
    ``encode_blob(updates[shard], version=..., base_version=..., shard=shard, writer=...)``.
    ``threads``: blobs encoded at once (1, the default, = one after another; None = one per
    core, see :func:`default_threads`).

    An error while encoding one blob (e.g. InvalidUpdateError) is raised when that blob's turn
    comes; blobs not yet yielded are still finished (or cancelled) before it propagates."""
    shards = list(updates)
    n = default_threads(len(shards)) if threads is None else max(1, threads)
    if n == 1 or len(shards) <= 1:
        for shard in shards:
            yield (
                shard,
                encode_blob(
                    updates[shard],
                    version=version,
                    base_version=base_version,
                    shard=shard,
                    writer=writer,
                    level=level,
                ),
            )
        return
    with ThreadPoolExecutor(n, thread_name_prefix="ds-encode") as pool:
        futures = [
            pool.submit(
                encode_blob,
                updates[shard],
                version=version,
                base_version=base_version,
                shard=shard,
                writer=writer,
                level=level,
            )
            for shard in shards
        ]
        try:
            for shard, fut in zip(shards, futures, strict=False):
                yield shard, fut.result()
        finally:
            for fut in futures:
                fut.cancel()
