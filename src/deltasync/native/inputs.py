"""What the C kernels may be handed, checked before any raw pointer is taken.

The kernels read and write through ``data_ptr()`` with no bounds, stride or type checks of
their own, so every entry point (``native/ops.py``, ``trainer/detect.py``) asks this module
first. A tensor is *kernel-ready* only if it is a plain dense CPU tensor (exactly
``torch.Tensor`` or ``nn.Parameter``, never a subclass such as DTensor or a fake/functional
tensor), strided layout, not meta, contiguous (so its elements are one non-overlapping run
from ``data_ptr()``, whatever its storage offset), aligned for its dtype, inside its storage,
and without lazy conjugate/negative bits. Anything else either takes the exact torch path
(a strided view, a CUDA tensor, an expanded view) or, when no exact answer exists
(wrong dtype, disagreeing shapes, meta, sparse, a subclass), raises
:class:`~deltasync.errors.TensorInputError` naming the tensor.

This module knows tensor metadata only; it never reads element values.
"""

from __future__ import annotations

import torch

from deltasync.errors import TensorInputError

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def describe(t: object) -> str:
    """A short description of ``t`` for error messages."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{type(t).__name__}(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


def check_readable(
    name: str, t: object, *, dtypes: tuple[torch.dtype, ...] | None = None
) -> torch.Tensor:
    """Raise unless ``t`` is a tensor any exact path (C or torch) can read element by element.

    Args:
        name: what the tensor is, for the error message (e.g. ``"exp_avg of 'w'"``).
        t: the object handed in.
        dtypes: accepted dtypes (None: any).

    Returns:
        ``t``, typed as a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TensorInputError(f"{name} must be a torch.Tensor, got {describe(t)}")
    if type(t) not in _PLAIN:
        hint = " (pass its local shard: .to_local())" if hasattr(t, "to_local") else ""
        raise TensorInputError(
            f"{name} is a tensor subclass {type(t).__name__}, which the detection kernels do "
            f"not read{hint}"
        )
    if t.layout != torch.strided:
        raise TensorInputError(f"{name} has layout {t.layout}; only dense (strided) tensors")
    if t.is_meta or t.device.type == "meta":
        raise TensorInputError(f"{name} is on the meta device and holds no values")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TensorInputError(f"{name} has dtype {t.dtype}; expected {want}")
    return t


def kernel_ready(t: torch.Tensor) -> bool:
    """Whether the C kernels can read ``t`` through its raw pointer (see the module doc).

    ``t`` must already have passed :func:`check_readable`; a False answer means: take the
    torch path."""
    if type(t) not in _PLAIN or t.layout != torch.strided or t.device.type != "cpu":
        return False
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return False
    size = t.element_size()
    if t.numel() and t.data_ptr() % size:
        return False
    storage = t.untyped_storage()
    return (t.storage_offset() + t.numel()) * size <= storage.nbytes()


def check_same_shape(first: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor]) -> None:
    """Raise unless every tensor has the shape and device of the first (θ, m, v agreement)."""
    name0, t0 = first
    for name, t in others:
        if tuple(t.shape) != tuple(t0.shape):
            raise TensorInputError(
                f"{name} has shape {tuple(t.shape)} but {name0} has {tuple(t0.shape)}; they "
                "must agree element for element"
            )
        if t.device != t0.device:
            raise TensorInputError(f"{name} is on {t.device} but {name0} is on {t0.device}")


def check_bitset(
    name: str, bits: object, numel: int, device: torch.device | None = None
) -> torch.Tensor:
    """Raise unless ``bits`` is a 1-D uint8 tensor holding at least ``ceil(numel/8)`` bytes."""
    b = check_readable(name, bits, dtypes=(torch.uint8,))
    if b.dim() != 1:
        raise TensorInputError(f"{name} must be 1-D, got shape {tuple(b.shape)}")
    need = (numel + 7) // 8
    if b.numel() < need:
        raise TensorInputError(f"{name} holds {b.numel()} bytes; {numel} elements need {need}")
    if device is not None and b.device != device:
        raise TensorInputError(f"{name} is on {b.device}; the tensors it flags are on {device}")
    if b.numel() and b.stride(0) == 0 and b.numel() > 1:
        raise TensorInputError(
            f"{name} is an expanded view: its bytes overlap and cannot be written"
        )
    return b


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two CPU tensors intersect (conservative: by extent)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + _extent(a)
    b1 = b0 + _extent(b)
    return a0 < b1 and b0 < a1


def _extent(t: torch.Tensor) -> int:
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size()
