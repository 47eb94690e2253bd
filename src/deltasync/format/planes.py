"""Gap coding of sorted indices and byte-plane splitting of fixed-width arrays (numpy, vectorized).

Gap coding: strictly increasing indices i0 < i1 < ... become ``first = i0`` and the gaps
``i[k] - i[k-1]`` (all >= 1), stored in the narrowest unsigned width that holds the largest gap.

Byte planes: an array of n elements of w bytes is written as w planes of n bytes, plane k holding
byte k (little-endian order) of every element. High bytes of gaps and the sign/exponent byte of
BF16 values repeat a lot; planes put the repeats next to each other, which zstd then finds
(measured: ~13% smaller than interleaved bytes for a 1% BF16 delta, 2.4x smaller than raw int32
indices + values).

This module knows numpy arrays only: no tensors, no records, no error messages about tensors
(callers name the tensor).
"""

from __future__ import annotations

import numpy as np

_UNSIGNED = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def gap_width(max_gap: int) -> int:
    """Bytes per gap: the narrowest of 1, 2, 4, 8 that holds ``max_gap``."""
    if max_gap <= 0xFF:
        return 1
    if max_gap <= 0xFFFF:
        return 2
    if max_gap <= 0xFFFFFFFF:
        return 4
    return 8


def unsigned(width: int) -> np.dtype:
    return _UNSIGNED[width]


def to_gaps(indices: np.ndarray) -> tuple[int, np.ndarray]:
    """``(first, gaps)`` of a 1-D int64 array; gaps is int64 of length n-1 (n >= 1).

    The caller checks that the gaps are >= 1 (strictly increasing input)."""
    return int(indices[0]), np.diff(indices)


def narrow(gaps: np.ndarray) -> np.ndarray:
    """Gaps (int64, all >= 1) cast to the narrowest unsigned width that holds them."""
    width = gap_width(int(gaps.max())) if gaps.size else 1
    return gaps.astype(_UNSIGNED[width], copy=False)


def from_gaps(first: int, gaps: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_gaps`: int64 indices, ``first`` then the running sums of ``gaps``.

    Overflow is the caller's to rule out (decode checks that no partial sum wraps)."""
    out = np.empty(gaps.size + 1, dtype=np.int64)
    out[0] = first
    out[1:] = gaps  # widening copy from u8/u16/u32/u64; u64 gaps were checked to be < 2^62
    np.cumsum(out, out=out)
    return out


def split_planes(array: np.ndarray) -> np.ndarray:
    """(w, n) uint8 array of byte planes of a contiguous 1-D array with w-byte elements."""
    w = array.dtype.itemsize
    as_bytes = np.ascontiguousarray(array).view(np.uint8)
    if w == 1:
        return as_bytes.reshape(1, -1)
    return np.ascontiguousarray(as_bytes.reshape(-1, w).T)


def join_planes(buffer: np.ndarray, n: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`split_planes`: n elements of ``dtype`` from ``w * n`` plane bytes.

    ``buffer`` is a uint8 array of exactly ``w * n`` bytes; the result is a fresh, writable,
    contiguous array (it never aliases the decompressed section)."""
    w = dtype.itemsize
    # Always a fresh array: np.ascontiguousarray may return a view for n <= 1, and the decoded
    # tensors must not alias (read-only) decompressed bytes.
    out = np.empty((n, w), dtype=np.uint8)
    out[...] = buffer.reshape(w, n).T
    return out.view(dtype).reshape(n)
