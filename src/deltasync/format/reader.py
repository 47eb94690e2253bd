"""Parse and validate the decompressed record section into TensorUpdates.

Every declared length is compared with the bytes that remain BEFORE anything of that length is
read or allocated; each dim of a shape, and its element count, is bounded by MAX_NUMEL; indices
are proven strictly increasing and in range without trusting int64 arithmetic (see
``_check_and_sum``).
Payload planes are read straight into the output arrays, chunk by chunk. A BF16/FP16 sparse
record of a section held whole is decoded in one C pass instead (``decode_sparse``: a small
blob in ~40% less CPU), which applies the same rules and declines a record that breaks one:
the checked path then reads it again and names the fault. When the receiver's layout
(``expected``) is given, names, shapes and dtypes must match it.

This module knows the record layout and TensorUpdate; the blob header and digest live in
decode.py, zstd in section.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from deltasync.errors import BlobLimitError, BlobMismatchError, FormatError
from deltasync.format.section import (
    SectionReader,
    read_gaps_as_indices,
    read_words,
    read_words_in_place,
    sum_gaps,
)
from deltasync.format.updates import (
    BITS_DTYPES,
    CODE_DTYPES,
    INT32_NUMEL,
    LazyDense,
    TensorSpec,
    TensorUpdate,
)
from deltasync.format.wire import (
    ENCODING_DENSE,
    ENCODING_SPARSE,
    GAP_WIDTHS,
    MAX_NDIM,
    MAX_NUMEL,
    RECORD,
    shape_struct,
)
from deltasync.native.ops import decode_sparse, prefix_sum_
from deltasync.native.writable import is_read_only

_MALFORMED = (
    "the blob is malformed although its digest matched, so its writer produced it this way: "
    "do not apply it; re-publish this version from a fixed writer"
)
_LAYOUT = "writer and receiver disagree on the layout: check both use the same layout table"
_VALUE_NP = {torch.int16: np.dtype("<i2"), torch.int32: np.dtype("<i4")}
# A BF16/FP16 sparse record's payload (gaps and values) up to this many bytes is read out of a
# streamed section into a buffer for the C decode (its decoded arrays are larger: 6 bytes an
# element from at most 4); a larger one is decoded plane by plane from the stream.
PAYLOAD_MAX = 4 << 20


def iter_records(
    reader: SectionReader,
    count: int,
    expected: Mapping[str, TensorSpec] | None,
    *,
    seen: set[str] | None = None,
    headers_only: bool = False,
    narrow: bool = False,
    into: Mapping[str, torch.Tensor] | None = None,
    lazy_min: int | None = None,
) -> Iterator:
    """The ``count`` records of ``reader``, one at a time; ``seen`` (names of earlier
    segments' records, updated here) makes a name repeated anywhere in the blob an error.

    Yields TensorUpdates, or with ``headers_only`` ``(name, nnz)`` pairs whose payloads are
    skipped unread (their lengths are still checked against what remains). With ``narrow``,
    the indices of a tensor of at most 2^31 elements come as int32 (6 bytes per decoded
    element instead of 10). With ``into`` (tensors by name), a dense record of a tensor there
    that is contiguous, on the CPU and of the record's dtype is decoded straight into it, and
    its update's values are that tensor (see :func:`decoded_in_place`): for a caller that
    writes these records into those tensors anyway, after proving them by a first read.
    With ``lazy_min``, a dense BF16/FP16 record of at least that many value bytes comes as a
    :class:`~deltasync.format.updates.LazyDense`: its values are read when asked, chunk by
    chunk, and only before the next record is read (the reader skips them if nobody asks)."""
    seen = set() if seen is None else seen
    for k in range(count):
        yield _record(reader, k, seen, expected, headers_only, narrow, into, lazy_min)
    reader.finish()


def parse_records(
    reader: SectionReader,
    count: int,
    expected: Mapping[str, TensorSpec] | None,
    *,
    seen: set[str] | None = None,
) -> list[TensorUpdate]:
    """All ``count`` records of ``reader`` as a list (see :func:`iter_records`)."""
    return list(iter_records(reader, count, expected, seen=seen))


def _record(
    reader: SectionReader,
    k: int,
    seen: set[str],
    expected: Mapping[str, TensorSpec] | None,
    headers_only: bool = False,
    narrow: bool = False,
    into: Mapping[str, torch.Tensor] | None = None,
    lazy_min: int | None = None,
) -> TensorUpdate | LazyDense | tuple[str, int]:
    where = reader.where
    head = reader.read(RECORD.size, f"record {k} header")
    name_len, code, encoding, ndim, width, reserved, nnz, first = RECORD.unpack(head)
    try:
        name = reader.read(name_len, f"record {k} name").decode("utf-8")
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
    shape = dims.unpack(reader.read(dims.size, f"tensor {name!r} shape"))
    if max(shape, default=0) > MAX_NUMEL:
        # a zero-element tensor keeps the product in range with any dim: bound each one too,
        # or the shape reaches callers (torch.zeros) that cannot hold a dim of 2^63
        raise BlobLimitError(f"{what}: shape {shape} has a dim above 2^62; {_MALFORMED}")
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
        if headers_only:
            reader.skip(numel * itemsize, f"tensor {name!r} values")
            return name, numel
        reader.check(numel * itemsize, f"tensor {name!r} values")
        out = _live_words(into, name, shape, dtype, value_dtype)
        if out is not None:
            if itemsize == 2:  # BF16/FP16: no low-plane scratch beside the live tensor
                read_words_in_place(reader.read_into, out, f"tensor {name!r} values")
            else:
                read_words(reader.read_into, out, itemsize, f"tensor {name!r} values")
            return _update(name, shape, dtype, None, out)
        if lazy_min is not None and itemsize == 2 and numel * itemsize >= lazy_min:
            words = reader.lazy_words(numel, f"tensor {name!r} values")
            return LazyDense(name=name, shape=shape, dtype=dtype, source=words)
        return _update(name, shape, dtype, None, _values(reader, numel, value_dtype, name))

    if width not in GAP_WIDTHS:
        raise FormatError(f"{what}: gap width {width} is not 1, 2, 4 or 8; {_MALFORMED}")
    if nnz > numel:
        raise FormatError(f"{what}: {nnz} indices for only {numel} elements; {_MALFORMED}")
    if nnz == 0:
        if first:
            raise FormatError(f"{what}: first index {first} in an empty record; {_MALFORMED}")
        if headers_only:
            return name, 0
        return _update(name, shape, dtype, np.empty(0, np.int64), np.empty(0, value_dtype))
    if first >= numel:
        raise FormatError(
            f"{what}: first index {first} is out of range for {numel} elements; {_MALFORMED}"
        )
    # Both payload lengths are checked before either array is allocated.
    size = (nnz - 1) * width + nnz * itemsize
    reader.check(size, f"tensor {name!r} gaps and values")
    if headers_only:
        reader.skip(size, f"tensor {name!r} gaps and values")
        return name, nnz
    small = narrow and numel <= INT32_NUMEL and width <= 4
    # BF16/FP16: one C pass over the payload, from a section held whole, or (a verify's
    # read, whose sections stream) read out of the stream into a buffer of its own when it
    # is at most PAYLOAD_MAX bytes (smaller than the arrays it decodes to); what the C pass
    # declines takes the checked path
    payload = reader.held(size) if itemsize == 2 else None
    source: SectionReader | _Payload = reader
    if payload is None and itemsize == 2 and lazy_min is not None and size <= PAYLOAD_MAX:
        payload = np.empty(size, dtype=np.uint8)
        reader.read_into(memoryview(payload), f"tensor {name!r} gaps and values")
        source = _Payload(payload)  # the checked path reads the buffer, not the section
    words = np.int32 if small else np.int64
    decoded = None if payload is None else decode_sparse(payload, nnz, first, width, numel, words)
    if decoded is not None:
        if source is reader:
            reader.skip(size, f"tensor {name!r} gaps and values")
        return _update(name, shape, dtype, *decoded)
    indices = read_gaps_as_indices(
        source.read_into, first, nnz, width, f"tensor {name!r} gaps", words
    )
    _check_and_sum(indices, width, numel, what)
    return _update(name, shape, dtype, indices, _values(source, nnz, value_dtype, name))


class _Payload:
    """A sparse record's payload bytes read out of a streamed section, as the source its
    checked decode reads (the section has moved past them)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.at = data, 0

    def read_into(self, buf: memoryview, what: str) -> None:
        n = len(buf)
        assert self.at + n <= self.data.size, what  # the record's sizes were checked
        buf[:] = memoryview(self.data[self.at : self.at + n])
        self.at += n


def _live_words(
    into: Mapping[str, torch.Tensor] | None,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    value_dtype: np.dtype,
) -> np.ndarray | None:
    """The flat words of ``into[name]`` to decode a dense record into, when that tensor can
    take them as they are (contiguous, writable, on the CPU, the record's shape and dtype),
    else None."""
    target = None if into is None else into.get(name)
    if (
        target is None
        or target.device.type != "cpu"
        or target.dtype != dtype
        or tuple(target.shape) != shape
        or not target.is_contiguous()
        or target.numel() == 0
        or is_read_only(target)  # apply_pieces refuses it by name (a decode would SIGSEGV)
    ):
        return None
    return target.detach().view(-1).view(BITS_DTYPES[dtype]).numpy().view(value_dtype)


def decoded_in_place(values: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``values`` (a dense update's) are ``target``'s own elements: decoded into it
    by a read with ``into`` (there is nothing left to write)."""
    return (
        target.is_contiguous()
        and values.device == target.device
        and values.dtype == target.dtype
        and values.numel() == target.numel()
        and values.numel() > 0
        and values.data_ptr() == target.data_ptr()
    )


def _values(reader: SectionReader | _Payload, n: int, dtype: np.dtype, name: str) -> np.ndarray:
    out = np.empty(n, dtype=dtype)
    read_words(reader.read_into, out, dtype.itemsize, f"tensor {name!r} values")
    return out


def _check_and_sum(indices: np.ndarray, width: int, numel: int, what: str) -> None:
    """Turn ``first, gaps...`` into indices in place, proven strictly increasing and in
    [0, numel).

    Every gap is checked to be in [1, numel) with numel <= 2^62. If the int64 running sum ever
    wrapped, it would land in [-2^63, -2^62) (a step is < 2^62, too short to jump over the
    negative half), so "no wrap" follows from the minimum being >= 0; that check runs only when
    the widest possible sum could wrap at all. int32 indices (numel <= 2^31, every step below
    2^31) cannot wrap from a non-negative sum to a non-negative one either: the first wrap
    lands below zero, and the minimum over all sums sees it."""
    size = indices.dtype.itemsize
    # gaps as wide as the array: read unsigned (a hostile gap must not look negative here)
    gaps = indices[1:] if width < size else indices[1:].view(np.uint64 if size == 8 else np.uint32)
    high = 0
    if gaps.size:
        low = int(gaps.min())
        if low < 1:
            at = int(np.argmax(gaps < 1))
            raise FormatError(
                f"{what}: indices are not strictly increasing (gap {low} after position {at}); "
                f"{_MALFORMED}"
            )
        if width >= 4:
            high = int(gaps.max())
            if high >= numel:
                raise FormatError(
                    f"{what}: a gap of {high} is out of range for {numel} elements; {_MALFORMED}"
                )
        else:  # u8/u16 gaps cannot exceed their type; the last-index check catches the rest
            high = (1 << (8 * width)) - 1
    first = int(indices[0])
    # the C running sum (~3x numpy's: two passes per record of every pull), else numpy's
    if not (indices.flags.writeable and prefix_sum_(torch.from_numpy(indices))):
        sum_gaps(indices)
    if first + high * gaps.size >= 1 << (8 * size - 1) and int(indices.min()) < 0:
        raise FormatError(f"{what}: indices overflow int64; {_MALFORMED}")
    last = int(indices[-1])
    if last >= numel:
        raise FormatError(
            f"{what}: index {last} is out of range for {numel} elements; {_MALFORMED}"
        )


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
