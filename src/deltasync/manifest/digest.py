"""Digests: of a blob's bytes, of one tensor, and of a receiver shard's full state.

All are xxh3-128 (fast, non-cryptographic: they detect corruption and drift; authenticity
comes from signing the manifest that lists them). The state digest is two-level so that it can
be computed tensor by tensor, in any order and in parallel, and combined later:

    tensor_digest(t)  = xxh3_128(raw bytes of t in row-major order)
    state_digest(ts)  = xxh3_128(concat over names in sorted order of
                          u32 len(name) | name utf-8 | u32 len(dtype) | dtype |
                          u32 ndim | i64 shape[0..ndim) | tensor_digest 16 bytes)

"dtype" is the torch dtype name without the "torch." prefix (e.g. "bfloat16"); integers are
little-endian. Raw bytes of contiguous CPU tensors are hashed in place (no copy); a
non-contiguous tensor is made contiguous first (one copy of that tensor), and device tensors
are copied to host in chunks of at most 64 MiB. This module knows nothing about
layouts or which tensors belong to a shard.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import xxhash

from deltasync.errors import ManifestError

if TYPE_CHECKING:  # torch is only needed by the callers that hash tensors
    import torch

_CHUNK_BYTES = 64 * 2**20  # host staging bound when hashing device tensors


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex xxh3-128 of a blob's bytes, as listed in the manifest."""
    return xxhash.xxh3_128_hexdigest(data)


def _byte_chunks(t: torch.Tensor) -> Iterable[memoryview]:
    import torch

    if t.numel() == 0:
        return
    if not t.is_contiguous():
        t = t.contiguous()  # one copy of this tensor only (row-major order is what we hash)
    flat = t.reshape(-1)  # a view: t is contiguous
    if flat.device.type == "cpu":
        # Reinterpret as bytes: no copy. numpy has no bfloat16, so view as uint8 first.
        yield memoryview(flat.view(torch.uint8).numpy())
        return
    step = max(1, _CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].to("cpu")
        yield memoryview(piece.view(torch.uint8).numpy())


def tensor_digest(t: torch.Tensor) -> bytes:
    """16-byte xxh3-128 of the tensor's raw bytes in row-major order."""
    h = xxhash.xxh3_128()
    for chunk in _byte_chunks(t.detach()):
        h.update(chunk)
    return h.digest()


def combine_digests(entries: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """State digest from (name, dtype name, shape, tensor_digest) records, in any order."""
    records = sorted(entries, key=lambda e: e[0])
    h = xxhash.xxh3_128()
    previous = None
    for name, dtype, shape, digest in records:
        if name == previous:
            raise ManifestError(f"tensor {name!r} appears twice in a state digest")
        previous = name
        if len(digest) != 16:
            raise ManifestError(f"tensor digest of {name!r} must be 16 bytes, got {len(digest)}")
        name_b = name.encode("utf-8")
        dtype_b = dtype.encode("ascii")
        h.update(struct.pack("<I", len(name_b)) + name_b)
        h.update(struct.pack("<I", len(dtype_b)) + dtype_b)
        h.update(struct.pack(f"<I{len(shape)}q", len(shape), *shape))
        h.update(digest)
    return h.hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex digest of a shard's full state (names, dtypes, shapes and bytes)."""
    return combine_digests(
        (name, dtype_name(t), tuple(t.shape), tensor_digest(t)) for name, t in tensors.items()
    )
