"""Build TensorUpdates from live tensors: full_updates (anchors) and sparse_update (deltas).

These are the only places that hold the whole source tensor, so they make the
"sparse would be larger than dense" choice: sparse_update returns a dense update when the
indices plus their values would take more raw bytes than all values. Sending values of
unchanged elements is harmless (values are absolute; they equal what the receiver holds).

Values are read, never recomputed, except for the documented dtype conversion fp32 -> bf16/fp16
(torch's ``.to``, round to nearest even). Dense values of a contiguous source with the wire dtype
ALIAS the source: encode them before the source changes.

This module knows tensors and TensorUpdate; nothing about bytes or receivers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltasync.errors import InvalidUpdateError
from deltasync.format.section import gap_width
from deltasync.format.updates import DTYPE_CODES, SUPPORTED, TensorUpdate

# (source dtype, wire dtype) pairs that are either exact or the documented rounding.
_CONVERSIONS = {
    (torch.float32, torch.bfloat16),  # round to nearest even: the trainer's master -> BF16 copy
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),  # exact widening
    (torch.float16, torch.float32),
}


def _check_dtypes(name: str, source: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype not in DTYPE_CODES or source.dtype not in DTYPE_CODES:
        raise InvalidUpdateError(
            f"tensor {name!r}: source {source.dtype} -> wire {dtype}; both must be one of "
            f"{SUPPORTED}"
        )
    if source.dtype != dtype and (source.dtype, dtype) not in _CONVERSIONS:
        raise InvalidUpdateError(
            f"tensor {name!r}: converting {source.dtype} to {dtype} would change values; send "
            "the tensor in its own dtype or from its fp32 master"
        )


def _flat_values(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return source.detach().reshape(-1).to(dtype)


def full_updates(tensors: Mapping[str, torch.Tensor]) -> list[TensorUpdate]:
    """Dense updates of whole tensors in their own dtype (for anchors), in mapping order."""
    out = []
    for name, tensor in tensors.items():
        _check_dtypes(name, tensor, tensor.dtype)
        out.append(
            TensorUpdate(
                name=name,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                indices=None,
                values=_flat_values(tensor, tensor.dtype),
            )
        )
    return out


def sparse_update(
    name: str, source: torch.Tensor, indices: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> TensorUpdate:
    """The current values of ``source`` at the flat row-major ``indices`` (strictly increasing),
    converted to ``dtype``; dense when that is smaller on the wire."""
    _check_dtypes(name, source, dtype)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise InvalidUpdateError(f"tensor {name!r}: indices must be a 1-D integer tensor")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise InvalidUpdateError(f"tensor {name!r}: indices must be integers, got {indices.dtype}")
    shape = tuple(source.shape)
    numel = source.numel()
    idx = indices.detach().to(device=source.device, dtype=torch.int64)
    n = idx.numel()
    max_gap = 0
    if n:
        first, last = int(idx[0]), int(idx[-1])
        if first < 0 or last >= numel:
            raise InvalidUpdateError(
                f"tensor {name!r}: indices span [{first}, {last}] outside [0, {numel}) for "
                f"shape {shape}"
            )
        if n > 1:
            gaps = idx[1:] - idx[:-1]
            low, max_gap = int(gaps.min()), int(gaps.max())
            if low < 1:
                raise InvalidUpdateError(
                    f"tensor {name!r}: indices are not strictly increasing; sort them and drop "
                    "duplicates"
                )
    itemsize = dtype.itemsize
    sparse_bytes = n * itemsize + max(n - 1, 0) * gap_width(max_gap)
    if sparse_bytes >= numel * itemsize:
        return TensorUpdate(
            name=name, shape=shape, dtype=dtype, indices=None, values=_flat_values(source, dtype)
        )
    if source.is_contiguous():
        picked = source.detach().view(-1).index_select(0, idx)
    else:  # gather through the strides instead of copying the whole tensor with reshape
        picked = source.detach()[torch.unravel_index(idx, shape)]
    return TensorUpdate(name=name, shape=shape, dtype=dtype, indices=idx, values=picked.to(dtype))
