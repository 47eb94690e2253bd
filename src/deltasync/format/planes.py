"""Gap coding and byte planes, streamed in bounded chunks (numpy, vectorized per chunk).

Gap coding: strictly increasing indices i0 < i1 < ... become ``first = i0`` and the gaps
``i[k] - i[k-1]`` (all >= 1), stored in the narrowest unsigned width w that holds the largest.

Byte planes: n elements of w bytes are written as w planes of n bytes, plane k holding byte k
(little-endian order) of every element. High bytes of gaps and the sign/exponent byte of BF16
values repeat a lot; planes put the repeats next to each other, where zstd finds them (measured on
a 1% BF16 delta: 13% smaller than interleaved bytes, 2.4x smaller than int32 indices + values).

Planes are moved CHUNK elements at a time through one small reusable buffer, so neither side
ever holds a second full-size copy of a tensor's bytes; the loops run over planes and chunks,
never over elements.

This module knows numpy arrays and byte sinks/sources only: no tensors, no records, no error
messages about tensors (callers validate and name the tensor).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CHUNK = 1 << 18  # elements per plane chunk: 256 KiB of plane bytes, stays in L2

Sink = Callable[[memoryview], None]  # takes the next bytes of the section (may not keep them)
Source = Callable[[memoryview, str], None]  # fills a buffer with the next bytes of the section


def gap_width(max_gap: int) -> int:
    """Bytes per gap: the narrowest of 1, 2, 4, 8 that holds ``max_gap``."""
    if max_gap <= 0xFF:
        return 1
    if max_gap <= 0xFFFF:
        return 2
    if max_gap <= 0xFFFFFFFF:
        return 4
    return 8


def _gaps_into(indices: np.ndarray, a: int, b: int, out: np.ndarray) -> np.ndarray:
    """Gaps a..b-1 (gap j = indices[j+1] - indices[j]) as int64, written into ``out``."""
    return np.subtract(indices[a + 1 : b + 1], indices[a:b], out=out[: b - a])


def gap_range(indices: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) gap of a 1-D int64 array with at least 2 elements, chunk by chunk."""
    n = indices.size - 1
    buf = np.empty(min(n, CHUNK), dtype=np.int64)
    low, high = None, None
    for a in range(0, n, CHUNK):
        gaps = _gaps_into(indices, a, min(a + CHUNK, n), buf)
        lo, hi = int(gaps.min()), int(gaps.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    return low, high  # type: ignore[return-value]


def write_value_planes(sink: Sink, values: np.ndarray) -> None:
    """The byte planes of a contiguous 1-D array, in plane order."""
    n, w = values.size, values.dtype.itemsize
    as_bytes = values.view(np.uint8).reshape(n, w)
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(w):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            np.copyto(buf[:m], as_bytes[a : a + m, k])
            sink(memoryview(buf[:m]))


def write_gap_planes(sink: Sink, indices: np.ndarray, width: int) -> None:
    """The ``width`` byte planes of the gaps of ``indices`` (recomputed per plane: a subtract
    over a cached chunk costs less than holding a full gap array)."""
    n = indices.size - 1
    gaps = np.empty(min(n, CHUNK), dtype=np.int64)
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(width):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            chunk = _gaps_into(indices, a, a + m, gaps)
            np.copyto(buf[:m], chunk.view(np.uint8).reshape(m, 8)[:, k])
            sink(memoryview(buf[:m]))


def read_planes_into(source: Source, columns: np.ndarray, what: str) -> None:
    """Fill a (n, w) uint8 view, plane k into column k, from the next ``n * w`` section bytes.

    ``columns`` is usually the byte view of the output array itself (for int64 indices: its low
    w bytes), so the planes land in place without a staging copy of the tensor."""
    n, w = columns.shape
    buf = np.empty(min(n, CHUNK), dtype=np.uint8)
    for k in range(w):
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            source(memoryview(buf[:m]), what)
            columns[a : a + m, k] = buf[:m]


def read_gaps_as_indices(
    source: Source, first: int, n: int, width: int, what: str, dtype: type = np.int64
) -> np.ndarray:
    """``dtype`` (int64, or int32 when ``width`` <= 4) array: ``first``, then the n-1 gaps (NOT
    yet summed: the caller validates the gaps, then sums them in place with :func:`sum_gaps`)."""
    out = np.zeros(n, dtype=dtype)  # zeroed: the bytes above ``width`` must read as 0
    size = out.dtype.itemsize
    assert width <= size, (width, size)
    out[0] = first
    read_planes_into(source, out.view(np.uint8).reshape(n, size)[1:, :width], what)
    return out


def sum_gaps(indices: np.ndarray) -> np.ndarray:
    """In place: turn ``first, gap, gap, ...`` into the running sums (int64 or int32; overflow
    is the caller's to rule out)."""
    # the accumulator is the array's own dtype: no int64 temporary for int32 indices
    return np.cumsum(indices, dtype=indices.dtype, out=indices)
