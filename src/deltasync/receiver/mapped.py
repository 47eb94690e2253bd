"""Live shard tensors in a shared memory-mapped file (e.g. under /dev/shm).

For engines (and tests) whose weights must outlive the process that writes them: the sync
agent maps the file, scatters into it, and may be killed at any instant; what it wrote is in
the kernel's page cache, seen by every process mapping the file, and the next agent on the
same file and state dir repairs from its journal. The file is the tensors of ``specs`` in
order, raw row-major bytes, each aligned to 64 bytes; nothing else.

This module knows files and tensor specs; it knows nothing about versions or stores.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from deltasync.errors import ConfigError
from deltasync.format import TensorSpec

_ALIGN = 64


def mapped_layout(specs: Mapping[str, TensorSpec]) -> tuple[dict[str, tuple[int, int]], int]:
    """``({name: (offset, nbytes)}, file size)`` for ``specs`` in order."""
    out = {}
    at = 0
    for name, spec in specs.items():
        at = -(-at // _ALIGN) * _ALIGN
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        out[name] = (at, nbytes)
        at += nbytes
    return out, max(at, 1)


def mapped_shard_tensors(
    path: str | os.PathLike[str], specs: Mapping[str, TensorSpec], *, create: bool = True
) -> dict[str, torch.Tensor]:
    """Tensors of ``specs`` backed by the shared file ``path`` (created zero-filled if absent
    and ``create``). Writes go straight to the shared mapping."""
    offsets, size = mapped_layout(specs)
    p = Path(path)
    if not p.exists():
        if not create:
            raise ConfigError(f"mapped shard file {str(p)!r} does not exist")
        _create(p, size)
    actual = p.stat().st_size
    if actual != size:
        raise ConfigError(
            f"mapped shard file {str(p)!r} is {actual} bytes; the specs need {size}: it was "
            "made for another layout"
        )
    raw = torch.from_file(str(p), shared=True, size=size, dtype=torch.uint8)
    return {
        name: raw[off : off + nbytes].view(specs[name].dtype).view(specs[name].shape)
        for name, (off, nbytes) in offsets.items()
    }


def _create(path: Path, size: int) -> None:
    """``path`` as a zero-filled file of ``size`` bytes, appearing whole or not at all: a
    process killed between creating it and sizing it would leave an empty file that every
    restart refuses as made for another layout. Sized under a temporary name, then linked into
    place (never over a file another process created meanwhile: that one is used)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
