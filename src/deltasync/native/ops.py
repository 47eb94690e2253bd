"""Two hot operations on sorted flat index lists, shared by the trainer, publisher and layouts.

* :func:`bf16_at`: the BF16 values (round to nearest even, exactly torch's cast) of a tensor at
  sorted flat positions -- what a delta carries for each changed element;
* :func:`first_not_increasing`: where a list stops being strictly increasing, the precondition
  of every searchsorted-based routing step;
* :func:`cast_bf16_into`: a contiguous fp32 range cast to BF16 into a caller's buffer (what the
  shard-state digest hashes), at memory speed;
* :func:`scatter16`: values written at flat positions of a contiguous 2-byte tensor (a
  receiver's scatter of a decoded piece, int32 indices as they are decoded);
* :func:`patch16`: a copy of a 2-byte range with values written at flat positions (one chunk
  of a tensor as an update will leave it: the verify-before-write hash);
* :func:`prefix_sum_`: running sums in place (a receiver's gap decode), ~3x numpy's cumsum;
* :func:`column_block`: the indices of a row-major matrix inside a column range, re-addressed
  for a narrower destination (routing a row-parallel weight's TP split);
* :func:`join_planes`: 2-, 4- or 8-byte words from byte planes (a receiver's decode of a
  record's gaps and values), each word written once;
* :func:`decode_sparse`: a whole sparse BF16/FP16 record from its planes held in memory
  (indices summed and range-checked, values joined) in one pass: a receiver's decode of the
  small records most versions are made of;
* :func:`patched_digests16`: the xxh3-128 digests of many 2-byte tensors as sparse writes will
  leave them, without writing them (a receiver's verify before write, a shard in one call).

All ten run a small C kernel when it is built (:mod:`deltasync.native.loader`, one pass, no
temporaries) and fall back to torch otherwise (CUDA tensors, no compiler, or values the kernel
declines: NaN and fp32 subnormals, whose BF16 cast torch itself performs); the decoder asks
:func:`can_join_planes` before it reads a record and joins the planes with numpy where the
kernel cannot. Results are bit-identical on both paths; the tests compare them.

This module knows tensors, index lists and byte planes; nothing about names, layouts or
optimizers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from numbers import Integral

import numpy as np
import torch
import xxhash

from deltasync.errors import ConfigError, TensorInputError
from deltasync.native import loader as native
from deltasync.native.loader import check_readable
from deltasync.native.writable import READ_ONLY_REMEDY, is_read_only

log = logging.getLogger(__name__)

_INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def first_not_increasing(indices: torch.Tensor) -> int:
    """The first position ``k >= 1`` with ``indices[k] <= indices[k-1]``, or -1 (1-D int64)."""
    check_readable("indices", indices, dtypes=_INT)
    if indices.dim() != 1:
        raise TensorInputError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    n = indices.numel()
    if n < 2:
        return -1
    if indices.dtype == torch.int64 and native.usable(indices):
        lib = native.load()
        assert lib is not None
        return int(lib.ds_first_not_increasing(indices.data_ptr(), n))
    bad = torch.nonzero(indices[1:] <= indices[:-1])
    return -1 if bad.numel() == 0 else int(bad[0, 0]) + 1


def bf16_at(
    values: torch.Tensor,
    indices: torch.Tensor,
    *,
    trusted: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """BF16 copies of ``values.reshape(-1)[indices]`` for sorted, distinct int64 ``indices``.

    ``values`` is fp32 (cast with round-to-nearest-even, as ``Tensor.to(torch.bfloat16)``) or
    already BF16. Unless ``trusted`` (the caller produced the indices itself, e.g. the detection
    kernel), the order and bounds are checked first, since the C gather does not bounds-check.
    The result lives on the CPU: in the first ``len(indices)`` elements of ``out`` when given
    (a reused 1-D BF16 CPU buffer), else in a new tensor."""
    check_readable("bf16_at values", values, dtypes=(torch.float32, torch.bfloat16))
    check_readable("bf16_at indices", indices, dtypes=_INT)
    if out is not None:
        check_readable("bf16_at out", out)
        if (
            out.dtype != torch.bfloat16
            or out.dim() != 1
            or out.numel() < indices.numel()
            or out.device.type != "cpu"
        ):
            raise TensorInputError(
                "bf16_at: out must be a 1-D bfloat16 CPU tensor of at least "
                f"{indices.numel()} elements"
            )
        _check_out("bf16_at", out, values, indices)
    n = indices.numel()
    total = values.numel()
    if indices.dim() != 1:
        raise TensorInputError(f"bf16_at: indices must be 1-D, got shape {tuple(indices.shape)}")
    if not trusted and n:
        bad = first_not_increasing(indices)
        if bad >= 0:
            raise ConfigError(
                f"bf16_at: indices are not strictly increasing at position {bad} "
                f"({int(indices[bad - 1])} then {int(indices[bad])})"
            )
        if int(indices[0]) < 0 or int(indices[-1]) >= total:
            raise ConfigError(
                f"bf16_at: indices span [{int(indices[0])}, {int(indices[-1])}] outside the "
                f"tensor's {total} elements"
            )
    if (
        n
        and values.dtype == torch.float32
        and indices.dtype == torch.int64
        and native.usable(values, indices)
    ):
        lib = native.load()
        assert lib is not None
        dst = torch.empty(n, dtype=torch.bfloat16) if out is None else out[:n]
        if native.usable(dst) and (
            lib.ds_gather_bf16(values.data_ptr(), indices.data_ptr(), n, dst.data_ptr()) == n
        ):
            return dst
    if values.is_contiguous():
        picked = values.view(-1).index_select(0, indices.to(values.device, torch.int64))
    else:  # reshape(-1) of a strided tensor would copy all of it; gather through the strides
        picked = values[torch.unravel_index(indices.to(values.device), tuple(values.shape))]
    result = picked.to(torch.bfloat16).cpu()
    if out is None:
        return result
    out[:n].copy_(result)
    return out[:n]


def cast_bf16_into(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``src`` (fp32, any shape) cast to BF16 (round to nearest even, exactly
    ``src.to(torch.bfloat16)``) into the first ``src.numel()`` elements of the 1-D BF16
    buffer ``out``; returns that view of ``out``, flat. The C kernel runs on kernel-ready
    tensors whose values it can round exactly; otherwise (NaN, fp32 subnormals, strided or
    device tensors) torch casts."""
    check_readable("cast_bf16_into src", src)
    check_readable("cast_bf16_into out", out)
    n = src.numel()
    if out.dtype != torch.bfloat16 or out.dim() != 1 or out.numel() < n:
        raise TensorInputError(
            f"cast_bf16_into: out must be a 1-D bfloat16 tensor of at least {n} elements"
        )
    _check_out("cast_bf16_into", out, src)
    dst = out[:n]
    if n == 0:
        return dst
    if src.dtype == torch.float32 and native.usable(src, out):
        lib = native.load()
        assert lib is not None
        if lib.ds_cast_bf16(src.data_ptr(), n, dst.data_ptr()) == n:
            return dst
    elif (
        src.dtype == torch.float32
        and src.dim() == 2
        and src.stride(1) == 1
        and src.device.type == "cpu"
        and type(src) is torch.Tensor
        and not src.is_neg()  # a lazy negation or conjugation: raw memory is not the values
        and not src.is_conj()
        and src.data_ptr() % 4 == 0
        and native.usable(out)
    ):
        # Rows contiguous, apart by a stride (a column slice): row by row in the kernel. The
        # view lies inside its storage (check_readable above).
        lib = native.load()
        assert lib is not None
        rows, cols = src.shape
        if lib.ds_cast_bf16_rows(src.data_ptr(), rows, cols, src.stride(0), dst.data_ptr()) == n:
            return dst
    if not dst.is_contiguous():
        # a strided buffer: torch's strided fp32 -> BF16 copy gives NaN another bit pattern
        # (0x7FC0) than .to(torch.bfloat16) (0xFFFF here); cast densely, then copy the bits
        dst.copy_(src.reshape(-1).to(torch.bfloat16))
        return dst
    dst.view(src.shape).copy_(src) if src.is_contiguous() else dst.copy_(src.reshape(-1))
    return dst


_TWO_BYTE = (torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


def _check_out(op: str, out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """``out`` must be writable element by element and overlap none of ``inputs`` (a kernel
    would read an input after writing over it; torch refuses some such calls untyped)."""
    if native.overlaps_itself(out):
        raise TensorInputError(
            f"{op}: out has strides {out.stride()} that let elements share memory (an expanded "
            "view?); pass a buffer that owns its memory. Nothing was written"
        )
    for t in inputs:
        if native.overlaps(out, t):
            raise TensorInputError(
                f"{op}: out overlaps an input in memory; pass a separate buffer. Nothing was "
                "written"
            )


def _two_byte_writable(
    op: str, target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *others
) -> bool:
    """Whether the 2-byte kernels can write ``values`` at ``indices`` of ``target`` (reading
    ``others`` too): contiguous CPU tensors, a 2-byte dtype, 1-D int32/int64 indices, and
    ``target`` overlapping none of the others. Mismatched values, and a target in read-only
    memory (which any write, the kernel's or torch's, would fault on), are an error, not a
    decline."""
    named = [("target", target), ("indices", indices), ("values", values)]
    named += [(f"input {k + 1}", t) for k, t in enumerate(others)]
    for name, t in named:  # any tensor the torch path takes too (a subclass: it declines)
        if not isinstance(t, torch.Tensor):
            raise TensorInputError(f"{op}: {name} must be a torch.Tensor, got {native.describe(t)}")
        outside = native.outside_storage(t)
        if outside is not None:
            raise TensorInputError(f"{op}: {name} {outside}. Nothing was written")
    if is_read_only(target):  # its write would be a SIGSEGV
        raise TensorInputError(f"{op}: target {READ_ONLY_REMEDY}")
    if values.numel() != indices.numel() or values.dtype != target.dtype:
        raise TensorInputError(
            f"{op}: {values.numel()} {values.dtype} values for {indices.numel()} indices into a "
            f"{target.dtype} tensor"
        )
    if (
        target.dtype not in _TWO_BYTE
        or indices.dtype not in _INDEX
        or indices.dim() != 1
        or not native.usable(target, indices, values, *others)
    ):
        return False
    return not any(native.overlaps(target, t) for t in (indices, values, *others))


# the largest flat position the 2-byte kernels take (int64, with room for base + numel)
_MAX_BASE = (1 << 62) - 1


def _check_base(op: str, base: object, target: torch.Tensor) -> None:
    """``base`` must be an int with ``[base, base + numel)`` inside int64 (ctypes would wrap
    anything else modulo 2^64, and the kernel would then take far indices for near ones)."""
    if not isinstance(base, Integral) or isinstance(base, bool) or not 0 <= base <= _MAX_BASE:
        raise TensorInputError(
            f"{op}: base {base!r} must be an int in [0, {_MAX_BASE}]; nothing was written"
        )
    if int(base) + target.numel() > _MAX_BASE:
        raise TensorInputError(
            f"{op}: base {base} + {target.numel()} elements passes {_MAX_BASE}; nothing was written"
        )


def _check_int(op: str, name: str, value: object) -> None:
    """``value`` must be an int (ctypes refuses a float with an untyped ArgumentError, and
    the range checks before the kernel call would take one)."""
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TensorInputError(f"{op}: {name} must be an int, got {value!r}; nothing was done")


def _check_int64(op: str, name: str, value: object) -> None:
    """``value`` must be an int inside int64: ctypes wraps one outside it modulo 2^64, and the
    kernel would then work with another value than the one passed."""
    _check_int(op, name, value)
    if not -(1 << 63) <= value < (1 << 63):  # type: ignore[operator]
        raise TensorInputError(f"{op}: {name} {value} is outside int64; nothing was done")


def _written(op: str, rc: int, target: torch.Tensor, indices: torch.Tensor, base: int) -> bool:
    """A 2-byte kernel's result: True, or the bad index it found (nothing was written)."""
    if rc < 0:
        k = -1 - rc
        raise TensorInputError(
            f"{op}: index {int(indices[k])} (position {k}) is outside "
            f"[{base}, {base + target.numel()}); nothing was written"
        )
    return True


def scatter16(
    target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, base: int = 0
) -> bool:
    """``target.view(-1)[indices - base] = values`` in the C kernel, if it can take them.

    ``target`` must be a contiguous CPU tensor of a 2-byte dtype, ``values`` the same dtype,
    ``indices`` 1-D int32 or int64; every index is checked before anything is written.

    Returns:
        True when written; False when the kernel cannot take these tensors (the caller then
        writes with torch: device or strided tensors, other dtypes, no compiler).

    Raises:
        TensorInputError: an index outside ``[base, base + target.numel())``, values that do
            not match the indices, or a target in read-only memory (nothing written).
    """
    if not _two_byte_writable("scatter16", target, indices, values):
        return False
    _check_base("scatter16", base, target)
    lib = native.load()
    assert lib is not None
    kernel = lib.ds_scatter16_i32 if indices.dtype == torch.int32 else lib.ds_scatter16_i64
    n = indices.numel()
    rc = kernel(target.data_ptr(), target.numel(), indices.data_ptr(), values.data_ptr(), n, base)
    return _written("scatter16", rc, target, indices, base)


def patch16(
    target: torch.Tensor,
    source: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    *,
    base: int = 0,
) -> bool:
    """``target.copy_(source)`` then ``target.view(-1)[indices - base] = values``, in one C
    pass over ``target`` when the kernel can take the tensors (as :func:`scatter16`, and
    ``source`` a contiguous CPU tensor of ``target``'s dtype and size that overlaps none of
    the others).

    Returns:
        True when written; False when the kernel cannot take them (nothing written: the
        caller copies and scatters with torch).

    Raises:
        TensorInputError: an index outside ``[base, base + target.numel())``, values that do
            not match the indices, or a target in read-only memory (nothing written).
    """
    if not isinstance(source, torch.Tensor):
        raise TensorInputError(
            f"patch16: source must be a torch.Tensor, got {native.describe(source)}; nothing "
            "was written"
        )
    if (
        source.dtype != target.dtype
        or source.numel() != target.numel()
        or not _two_byte_writable("patch16", target, indices, values, source)
    ):
        return False
    _check_base("patch16", base, target)
    lib = native.load()
    assert lib is not None
    kernel = lib.ds_patch16_i32 if indices.dtype == torch.int32 else lib.ds_patch16_i64
    ptrs = (target.data_ptr(), source.data_ptr(), indices.data_ptr(), values.data_ptr())
    rc = kernel(ptrs[0], ptrs[1], target.numel(), ptrs[2], ptrs[3], indices.numel(), base)
    return _written("patch16", rc, target, indices, base)


def prefix_sum_(x: torch.Tensor) -> bool:
    """``x[k] = x[0] + ... + x[k]`` in place in the C kernel, if it can take ``x``: the sums
    wrap modulo 2^32 / 2^64 exactly as ``numpy.cumsum`` and ``torch.cumsum`` in the tensor's
    own dtype do (the caller rules a wrap out or detects it).

    ``x`` must be a 1-D contiguous int32 or int64 CPU tensor (e.g. ``torch.from_numpy`` of a
    decoded gap array: the numpy array's memory, summed in place).

    Returns:
        True when summed; False when the kernel cannot take ``x`` (another dtype or shape, a
        strided or device tensor, no compiler): the caller then sums with numpy or torch.
    """
    if x.dtype not in (torch.int32, torch.int64) or x.dim() != 1 or not native.usable(x):
        return False
    lib = native.load()
    assert lib is not None
    kernel = lib.ds_prefix_sum_i32 if x.dtype == torch.int32 else lib.ds_prefix_sum_i64
    kernel(x.data_ptr(), x.numel())
    return True


def column_block(
    indices: torch.Tensor,
    *,
    src_cols: int,
    cols: tuple[int, int],
    dst_cols: int,
    shift: int,
    pos_base: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Of flat row-major ``indices`` (non-negative; the caller checked them) into a matrix of
    ``src_cols`` columns, those in columns ``[cols[0], cols[1])``: ``(row * dst_cols + column
    + shift, their positions in indices + pos_base)``, both int64 in input order, in one C pass.

    Returns:
        The pair, or None when the kernel cannot take ``indices`` (not a 1-D contiguous int64
        CPU tensor, or no compiler): the caller then maps them with torch.

    Raises:
        TensorInputError: a geometry argument that is not an int in int64's range (ctypes
            would wrap it modulo 2^64 and the kernel would map with another geometry).
    """
    for name, value in (
        ("src_cols", src_cols),
        ("cols[0]", cols[0]),
        ("cols[1]", cols[1]),
        ("dst_cols", dst_cols),
        ("shift", shift),
        ("pos_base", pos_base),
    ):
        _check_int64("column_block", name, value)
    if (
        indices.dtype != torch.int64
        or indices.dim() != 1
        or src_cols <= 0
        or not native.usable(indices)
    ):
        return None
    lib = native.load()
    assert lib is not None
    n = indices.numel()
    dst = torch.empty(n, dtype=torch.int64)
    pos = torch.empty(n, dtype=torch.int64)
    k = lib.ds_column_block(
        indices.data_ptr(),
        n,
        src_cols,
        cols[0],
        cols[1],
        dst_cols,
        shift,
        pos_base,
        dst.data_ptr(),
        pos.data_ptr(),
    )
    return dst[:k], pos[:k]


# The word types join_planes writes, by item size (int64 only among 8-byte words: indices).
_WORD_DTYPES = {
    2: (np.dtype(np.int16), np.dtype(np.uint16)),
    4: (np.dtype(np.int32), np.dtype(np.uint32)),
    8: (np.dtype(np.int64),),
}


def _flat_array(a: np.ndarray) -> bool:
    """Whether the kernel can read ``a`` through its address: 1-D, contiguous, aligned. The
    numpy flags say it (a numpy array lies inside its buffer), with no tensor made for it."""
    return a.ndim == 1 and a.flags.c_contiguous and a.flags.aligned


def can_join_planes(out: np.ndarray, width: int) -> bool:
    """Whether :func:`join_planes` can fill ``out`` from ``width`` planes: a writeable 1-D
    contiguous numpy array of 2-, 4- or 8-byte integers on a little-endian host, ``1 <= width
    <=`` its item size, and the kernel built. Asked before any plane is read: a caller that
    gets False fills ``out`` another way (a strided pass per plane)."""
    if not (_flat_array(out) and out.flags.writeable) or sys.byteorder != "little":
        return False
    size = out.dtype.itemsize
    return (
        1 <= width <= size and out.dtype in _WORD_DTYPES.get(size, ()) and native.load() is not None
    )


def join_planes(
    out: np.ndarray, width: int, lower: np.ndarray | None, last: np.ndarray, start: int
) -> None:
    """``out[start : start + last.size]`` from byte planes, low byte first: byte ``k < width -
    1`` of word ``i`` is ``lower[k * out.size + i]``, byte ``width - 1`` is ``last[i -
    start]``, the bytes above are zero. ``out`` must pass :func:`can_join_planes`; ``lower``
    (when ``width > 1``) and ``last`` are contiguous 1-D uint8 arrays.

    Raises:
        TensorInputError: planes that do not cover the words asked for, or a ``width`` or
            ``start`` that is not an int (nothing written).
    """
    _check_int("join_planes", "width", width)
    _check_int("join_planes", "start", start)
    n, m = out.size, last.size
    need = (width - 1) * n
    planes = [last] if lower is None else [lower, last]
    ok = (
        can_join_planes(out, width)
        and all(p.dtype == np.uint8 and _flat_array(p) for p in planes)
        and (width == 1 or (lower is not None and lower.size >= need))
        and 0 <= start <= n - m
        # by extent, as native.overlaps: a plane sharing out's memory would be overwritten
        and not any(p.size and np.may_share_memory(out, p) for p in planes)
    )
    if not ok:
        raise TensorInputError(
            f"join_planes: {width} planes of {m} bytes at word {start} do not fit a "
            f"{out.dtype} array of {n} words (lower plane bytes: "
            f"{None if lower is None else lower.size}, need {need}); nothing was written"
        )
    lib = native.load()
    assert lib is not None
    low = None if lower is None or not lower.size else lower.ctypes.data
    rc = lib.ds_planes_join(
        out.ctypes.data, out.dtype.itemsize, n, width, low, last.ctypes.data, start, m
    )
    if rc != m:
        raise TensorInputError(f"join_planes: the kernel refused its arguments ({rc})")


def decode_sparse(
    payload: np.ndarray, n: int, first: int, width: int, numel: int, index_dtype: type
) -> tuple[np.ndarray, np.ndarray] | None:
    """One sparse record's indices and 2-byte values from its payload bytes held in memory (the
    gaps' ``width`` byte planes, then the values' two), summed, range-checked and joined in
    one C pass: ``indices[0] = first``, each next one the previous plus its gap, every gap at
    least 1 and every index below ``numel``.

    ``payload`` must be a contiguous 1-D uint8 array of exactly ``(n - 1) * width + 2 * n``
    bytes (``n >= 1``: the record's element count); ``index_dtype`` int32 (for ``numel <=
    2^31``) or int64.

    Returns:
        ``(indices, values)`` as new numpy arrays (``index_dtype``, int16); None when the
        kernel cannot take the arguments (no compiler, a big-endian host, sizes that do not
        fit) or the payload breaks a rule. The caller then decodes the record on its checked
        path, which names the fault.

    Raises:
        TensorInputError: ``n``, ``first``, ``width`` or ``numel`` is not an int.
    """
    for name, value in (("n", n), ("first", first), ("width", width), ("numel", numel)):
        _check_int("decode_sparse", name, value)
    words = np.dtype(index_dtype)
    if (
        n < 1
        or not 1 <= width <= 8
        or not (0 <= first < numel <= _MAX_BASE)
        or payload.dtype != np.uint8
        or payload.size != (n - 1) * width + 2 * n
        or not _flat_array(payload)
        or sys.byteorder != "little"
        or words not in (np.dtype(np.int32), np.dtype(np.int64))
    ):
        return None
    lib = native.load()
    if lib is None:
        return None
    indices = np.empty(n, dtype=words)
    values = np.empty(n, dtype=np.int16)
    rc = lib.ds_decode_sparse(
        payload.ctypes.data,
        n,
        width,
        first,
        numel,
        indices.ctypes.data,
        words.itemsize,
        values.ctypes.data,
    )
    return (indices, values) if rc == 0 else None


Patch = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # live, indices, values


def can_patch_digest(
    live: torch.Tensor, indices: torch.Tensor | None, values: torch.Tensor | None
) -> bool:
    """Whether :func:`patched_digests16` can take this tensor and its patch: ``live`` a
    contiguous CPU tensor of a 2-byte dtype, ``indices`` 1-D int32/int64 and ``values`` of
    ``live``'s dtype, one per index, both contiguous CPU tensors (or both None)."""
    if live.dtype not in _TWO_BYTE or not native.kernel_ready(live):
        return False
    if indices is None:
        return values is None
    return (
        values is not None
        and indices.dtype in _INDEX
        and indices.dim() == 1
        and values.dtype == live.dtype
        and values.numel() == indices.numel()
        and native.kernel_ready(indices)
        and native.kernel_ready(values)
    )


def patched_digests16(
    items: Sequence[Patch], scratch: torch.Tensor, chunk: int
) -> list[bytes | None] | None:
    """For each ``(live, indices, values)``, the 16-byte ``xxhash.xxh3_128`` digest of the
    row-major bytes of the 2-byte tensor ``live`` as ``live.view(-1)[indices] = values`` will
    leave it (``indices`` None: ``live`` as it is), in one C call for all of them, writing
    nothing but ``scratch``.

    ``indices`` must be strictly increasing flat positions inside ``live``. The tensors are
    hashed ``chunk`` elements at a time: a touched chunk is copied into ``scratch``, patched
    there and hashed, an untouched one hashed where it lies. ``scratch`` is a 2-byte buffer of
    the caller's own (no tensor here may share its memory) of at least ``min(chunk,
    live.numel())`` elements for every patched ``live``.

    Returns:
        The digests in ``items`` order, None for an item the kernel cannot take (see
        :func:`can_patch_digest`); None for all when it cannot run (a short scratch, no
        compiler, xxhash's C API not reachable) or a position breaks a rule. The caller
        hashes what it was not given in Python, which names any fault.
    """
    _check_int("patched_digests16", "chunk", chunk)
    fns = _xxh3_checked()
    if fns is None or chunk < 1 or scratch.element_size() != 2 or not native.kernel_ready(scratch):
        return None
    taken = [k for k, item in enumerate(items) if can_patch_digest(*item)]
    if any(
        items[k][1] is not None and scratch.numel() < min(chunk, items[k][0].numel()) for k in taken
    ):
        return None
    if any(  # the kernel writes scratch: never over what it hashes
        t is not None and native.overlaps(scratch, t) for k in taken for t in items[k]
    ):
        return None
    lib = native.load()
    if lib is None:  # disable() since the check
        return None
    raw = _digests(lib, fns, [items[k] for k in taken], scratch, chunk)
    if raw is None:
        return None
    got: list[bytes | None] = [None] * len(items)
    for t, k in enumerate(taken):
        got[k] = raw[16 * t : 16 * t + 16]
    return got


def _digests(
    lib, fns: np.ndarray, items: Sequence[Patch], scratch: torch.Tensor, chunk: int
) -> bytes | None:
    """One ``ds_patched_digests16`` call over checked ``items``: their 16-byte digests end to
    end, or None when the kernel refused a position."""
    count = len(items)
    table = np.zeros((6, count), dtype=np.int64)  # live, numel, idx, idx size, vals, nnz
    for t, (live, indices, values) in enumerate(items):
        table[0, t] = live.data_ptr()
        table[1, t] = live.numel()
        if indices is not None and indices.numel():
            table[2, t] = indices.data_ptr()
            table[3, t] = indices.element_size()
            table[4, t] = values.data_ptr()  # type: ignore[union-attr]
            table[5, t] = indices.numel()
    out = np.empty(16 * count, dtype=np.uint8)
    rows = [table[r].ctypes.data for r in range(6)]
    rc = lib.ds_patched_digests16(
        count, *rows, scratch.data_ptr(), chunk, fns.ctypes.data, out.ctypes.data
    )
    return out.tobytes() if rc == count else None


_UNCHECKED = object()
_xxh3_table: object = _UNCHECKED


def _xxh3_checked() -> np.ndarray | None:
    """xxhash's XXH3-128 functions for the kernel, once they have hashed a patched buffer in
    pieces exactly as :mod:`xxhash` does (else None: the callers hash in Python)."""
    global _xxh3_table
    if _xxh3_table is _UNCHECKED:
        fns = native.xxh3_functions()
        lib = native.load()
        if lib is None:  # no kernels now (disable(), or none built): asked again next time
            return None
        table = None
        if fns is not None and lib is not None and sys.byteorder == "little":
            table = np.array(fns, dtype=np.int64)
            live = torch.arange(5000, dtype=torch.int16)
            idx = torch.tensor([0, 999, 1000, 4999], dtype=torch.int32)
            vals = torch.tensor([-1, -2, -3, -4], dtype=torch.int16)
            want = live.clone()
            want[idx.long()] = vals
            scratch = torch.empty(1000, dtype=torch.int16)
            got = _digests(lib, table, [(live, idx, vals)], scratch, 1000)
            if got != xxhash.xxh3_128(want.numpy().tobytes()).digest():
                log.warning("xxhash's C API hashed differently here: verify hashes in Python")
                table = None
        _xxh3_table = table
    return _xxh3_table  # type: ignore[return-value]
