"""Caller payloads as flat uint8 tensors, without copying them.

``bytes``, ``bytearray`` and ``memoryview`` become CPU tensors that share the caller's memory
(``torch.frombuffer`` keeps the buffer alive); contiguous uint8 tensors become flat views.
Nothing is copied here: whether a chunk must be staged onto the group's device is the
executor's business, chunk by chunk, so no copy ever exceeds ``max_chunk_bytes``.

Errors raised here happen before round 1; the exchange reports them to every peer there.

This module knows nothing about process groups or schedules.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from deltasync.errors import ExchangeError

Payload = bytes | bytearray | memoryview | torch.Tensor


def as_byte_tensors(payloads: Mapping[int, Payload], world_size: int) -> dict[int, torch.Tensor]:
    """``{dst: flat uint8 tensor}`` for every non-empty payload; raises ExchangeError naming
    the destination whose payload is unusable."""
    if not isinstance(payloads, Mapping):
        raise ExchangeError(
            f"payloads must be a mapping of destination rank to bytes, got {type(payloads).__name__}"
        )
    out: dict[int, torch.Tensor] = {}
    for dst, payload in payloads.items():
        if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world_size:
            raise ExchangeError(
                f"payload key {dst!r} is not a rank of this group (ints 0..{world_size - 1})"
            )
        flat = _flat_bytes(dst, payload)
        if flat.numel() > 0:
            out[dst] = flat
    return out


def _flat_bytes(dst: int, payload: object) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise ExchangeError(
                f"payload for rank {dst} is a {payload.dtype} tensor; pass bytes as uint8 "
                "(for other dtypes use tensor.view(torch.uint8))"
            )
        if not payload.is_contiguous():
            # A flat view of a strided tensor would be a full copy; refuse instead of hiding it.
            raise ExchangeError(
                f"payload tensor for rank {dst} is not contiguous; call .contiguous()"
            )
        return payload.reshape(-1)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        view = memoryview(payload)
        if not view.c_contiguous:
            raise ExchangeError(f"payload memoryview for rank {dst} is not C-contiguous")
        if view.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        with warnings.catch_warnings():
            # Read-only buffers (bytes) are only ever read by the exchange: sends and copies.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=torch.uint8)
    raise ExchangeError(
        f"payload for rank {dst} is a {type(payload).__name__}; expected bytes, bytearray, "
        "memoryview or a uint8 tensor"
    )
