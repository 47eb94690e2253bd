"""Parse and validate the decompressed record section into TensorUpdates.

Every declared length is compared with the bytes that remain BEFORE anything of that length is
read or allocated; the shape's element count is bounded by MAX_NUMEL; indices are proven
strictly increasing and in range without trusting int64 arithmetic (see ``_indices``). When the
receiver's layout (``expected``) is given, names, shapes and dtypes must match it.

This module knows the record layout and TensorUpdate; the blob header, digest and zstd live in
decode.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from deltasync.errors import BlobMismatchError, FormatError, TruncatedBlobError
from deltasync.format.errors import BlobLimitError
from deltasync.format.layout import (
    ENCODING_DENSE,
    ENCODING_SPARSE,
    GAP_WIDTHS,
    MAX_NDIM,
    MAX_NUMEL,
    RECORD,
    shape_struct,
)
from deltasync.format.planes import from_gaps, join_planes, unsigned
from deltasync.format.records import BITS_DTYPES, CODE_DTYPES, TensorSpec, TensorUpdate

_MALFORMED = (
    "the blob is malformed although its digest matched, so its writer produced it this way: "
    "do not apply it; re-publish this version from a fixed writer"
)
_LAYOUT = "writer and receiver disagree on the layout: check both use the same layout table"
_VALUE_NP = {torch.int16: np.dtype("<i2"), torch.int32: np.dtype("<i4")}


class _Cursor:
    """Reads a bytes object front to back; every read is bounds-checked first."""

    def __init__(self, raw: bytes, where: str) -> None:
        self.raw, self.pos, self.where = raw, 0, where

    @property
    def left(self) -> int:
        return len(self.raw) - self.pos

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes and return their offset (no copy)."""
        if n > self.left:
            raise TruncatedBlobError(
                f"{self.where}: {what} declares {n} bytes but only {self.left} remain in the "
                f"record section; {_MALFORMED}"
            )
        at, self.pos = self.pos, self.pos + n
        return at

    def array(self, n: int, what: str) -> np.ndarray:
        """``n`` bytes as a read-only uint8 view of the section."""
        return np.frombuffer(self.raw, dtype=np.uint8, count=n, offset=self.take(n, what))


def parse_records(
    raw: bytes, count: int, where: str, expected: Mapping[str, TensorSpec] | None
) -> list[TensorUpdate]:
    cursor = _Cursor(raw, where)
    updates: list[TensorUpdate] = []
    seen: set[str] = set()
    for k in range(count):
        updates.append(_record(cursor, k, seen, expected))
    if cursor.left:
        raise FormatError(
            f"{where}: {cursor.left} bytes follow the last of {count} records; {_MALFORMED}"
        )
    return updates


def _record(
    cursor: _Cursor, k: int, seen: set[str], expected: Mapping[str, TensorSpec] | None
) -> TensorUpdate:
    where = cursor.where
    at = cursor.take(RECORD.size, f"record {k} header")
    name_len, code, encoding, ndim, width, reserved, nnz, first = RECORD.unpack_from(cursor.raw, at)
    name_at = cursor.take(name_len, f"record {k} name")
    raw_name = cursor.raw[name_at : name_at + name_len]
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{where}: record {k}: name is not valid UTF-8; {_MALFORMED}") from None
    what = f"{where}: tensor {name!r} (record {k})"
    if not name:
        raise FormatError(f"{where}: record {k}: empty tensor name; {_MALFORMED}")
    if name in seen:
        raise FormatError(f"{what}: the name appears twice; {_MALFORMED}")
    seen.add(name)
    if reserved:
        raise FormatError(f"{what}: reserved field is {reserved}, must be 0; {_MALFORMED}")
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise FormatError(f"{what}: unknown dtype code {code} (known: 1, 2, 3); {_MALFORMED}")
    if encoding not in (ENCODING_DENSE, ENCODING_SPARSE):
        raise FormatError(f"{what}: unknown encoding {encoding} (known: 0, 1); {_MALFORMED}")
    if ndim > MAX_NDIM:
        raise BlobLimitError(f"{what}: {ndim} dims exceed the limit of {MAX_NDIM}; {_MALFORMED}")
    dims = shape_struct(ndim)
    shape = dims.unpack_from(cursor.raw, cursor.take(dims.size, f"tensor {name!r} shape"))
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise BlobLimitError(f"{what}: shape {shape} has more than 2^62 elements; {_MALFORMED}")

    if expected is not None:
        spec = expected.get(name)
        if spec is None:
            raise BlobMismatchError(f"{what}: the receiver has no tensor of this name; {_LAYOUT}")
        if tuple(spec.shape) != shape or spec.dtype != dtype:
            raise BlobMismatchError(
                f"{what}: blob has shape {shape} {dtype}, receiver expects {tuple(spec.shape)} "
                f"{spec.dtype}; {_LAYOUT}"
            )

    itemsize = dtype.itemsize
    value_dtype = _VALUE_NP[BITS_DTYPES[dtype]]
    if encoding == ENCODING_DENSE:
        if width or first or nnz != numel:
            raise FormatError(
                f"{what}: a dense record needs gap width 0, first index 0 and {numel} values, "
                f"has {width}, {first}, {nnz}; {_MALFORMED}"
            )
        planes = cursor.array(numel * itemsize, f"tensor {name!r} values")
        values = join_planes(planes, numel, value_dtype)
        return _update(name, shape, dtype, None, values)

    if width not in GAP_WIDTHS:
        raise FormatError(f"{what}: gap width {width} is not 1, 2, 4 or 8; {_MALFORMED}")
    if nnz > numel:
        raise FormatError(f"{what}: {nnz} indices for only {numel} elements; {_MALFORMED}")
    if nnz == 0:
        if first:
            raise FormatError(f"{what}: first index {first} in an empty record; {_MALFORMED}")
        return _update(name, shape, dtype, np.empty(0, np.int64), np.empty(0, value_dtype))
    if first >= numel:
        raise FormatError(
            f"{what}: first index {first} is out of range for {numel} elements; {_MALFORMED}"
        )
    # Both lengths are checked before either array is built.
    gap_at = cursor.take((nnz - 1) * width, f"tensor {name!r} gaps")
    value_bytes = cursor.array(nnz * itemsize, f"tensor {name!r} values")
    gap_bytes = np.frombuffer(cursor.raw, np.uint8, count=(nnz - 1) * width, offset=gap_at)
    indices = _indices(first, join_planes(gap_bytes, nnz - 1, unsigned(width)), numel, what)
    return _update(name, shape, dtype, indices, join_planes(value_bytes, nnz, value_dtype))


def _indices(first: int, gaps: np.ndarray, numel: int, what: str) -> np.ndarray:
    """Indices from gaps, proven strictly increasing and inside [0, numel).

    Every gap is checked to be in [1, numel) with numel <= 2^62. If the int64 running sum ever
    wrapped, it would land in [-2^63, -2^62) (a step is < 2^62, too short to jump over the
    negative half), so "no wrap" follows from the minimum being >= 0; the check runs only when
    the widest possible sum could wrap at all."""
    if gaps.size:
        low = int(gaps.min())
        if low < 1:
            at = int(np.argmax(gaps < 1))
            raise FormatError(
                f"{what}: indices are not strictly increasing (gap {low} after position {at}); "
                f"{_MALFORMED}"
            )
        if gaps.dtype.itemsize >= 4:
            high = int(gaps.max())
            if high >= numel:
                raise FormatError(
                    f"{what}: a gap of {high} is out of range for {numel} elements; {_MALFORMED}"
                )
        else:  # u8/u16 gaps cannot exceed their type; the last-index check catches the rest
            high = int(np.iinfo(gaps.dtype).max)
    else:
        high = 0
    indices = from_gaps(first, gaps)
    if first + high * gaps.size >= 1 << 63 and int(indices.min()) < 0:
        raise FormatError(f"{what}: indices overflow int64; {_MALFORMED}")
    last = int(indices[-1])
    if last >= numel:
        raise FormatError(
            f"{what}: index {last} is out of range for {numel} elements; {_MALFORMED}"
        )
    return indices


def _update(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    indices: np.ndarray | None,
    values: np.ndarray,
) -> TensorUpdate:
    return TensorUpdate(
        name=name,
        shape=shape,
        dtype=dtype,
        indices=None if indices is None else torch.from_numpy(indices),
        values=torch.from_numpy(values).view(dtype),
    )
