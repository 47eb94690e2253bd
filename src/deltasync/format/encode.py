"""encode_blob: TensorUpdates -> one self-checking blob (header, zstd records, xxh3-128 digest).

Records keep the order of the given updates, so equal inputs give equal bytes. A sparse update
is gap-coded in the narrowest width that fits its largest gap; an update that names every
element is written dense (no indices), which is never larger. The choice "sparse would be larger
than dense" for updates that do not name every element belongs to whoever holds the full tensor
(see :func:`deltasync.format.build.sparse_update`); the encoder cannot invent missing values.

The encoder refuses to write an invalid record (unsorted, duplicate or out-of-range indices,
bad ids, bad versions): a blob it produces always passes decode_blob.

This module knows the byte layout and the TensorUpdate record; it knows nothing about
receivers, layouts or storage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from deltasync.errors import ManifestError
from deltasync.format import section
from deltasync.format.errors import InvalidUpdateError
from deltasync.format.layout import (
    ENCODING_DENSE,
    ENCODING_SPARSE,
    FLAG_ZSTD,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    MAX_ID_BYTES,
    MAX_RECORDS,
    RECORD,
    shape_struct,
)
from deltasync.format.planes import narrow, split_planes, to_gaps
from deltasync.format.records import BITS_DTYPES, DTYPE_CODES, TensorUpdate
from deltasync.names import check_token


def _bits(values: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """The raw bit patterns of ``values`` as a contiguous little-endian numpy integer array."""
    host = values.detach().to("cpu").contiguous()
    return host.view(BITS_DTYPES[dtype]).numpy()


def _record(update: TensorUpdate) -> list[bytes | np.ndarray]:
    """The byte pieces of one record, in wire order."""
    what = f"tensor {update.name!r}"
    name = update.name.encode("utf-8")
    dims = shape_struct(len(update.shape)).pack(*update.shape)
    code = DTYPE_CODES[update.dtype]
    values = _bits(update.values, update.dtype)

    if update.indices is None or update.nnz == update.numel:
        # Naming every element: dense is smaller, and strictly increasing in-range indices of
        # length numel can only be 0..numel-1, so the values are already in row-major order.
        if update.indices is not None:
            _check_indices(update.indices.detach().to("cpu").numpy(), update.numel, what)
        head = RECORD.pack(
            len(name), code, ENCODING_DENSE, len(update.shape), 0, 0, update.numel, 0
        )
        return [head, name, dims, split_planes(values)]

    indices = update.indices.detach().to("cpu").numpy()
    if indices.size == 0:
        head = RECORD.pack(len(name), code, ENCODING_SPARSE, len(update.shape), 1, 0, 0, 0)
        return [head, name, dims]
    first, gaps = to_gaps(indices)
    _check_indices(indices, update.numel, what, first=first, gaps=gaps)
    gaps = narrow(gaps)
    head = RECORD.pack(
        len(name),
        code,
        ENCODING_SPARSE,
        len(update.shape),
        gaps.dtype.itemsize,
        0,
        indices.size,
        first,
    )
    return [head, name, dims, split_planes(gaps), split_planes(values)]


def _check_indices(
    indices: np.ndarray,
    numel: int,
    what: str,
    *,
    first: int | None = None,
    gaps: np.ndarray | None = None,
) -> None:
    if indices.size == 0:
        return
    if first is None or gaps is None:
        first, gaps = to_gaps(indices)
    if first < 0 or int(indices[-1]) >= numel:
        raise InvalidUpdateError(
            f"{what}: indices span [{first}, {int(indices[-1])}] but the tensor has {numel} "
            "elements; indices are flat row-major positions in [0, numel)"
        )
    if gaps.size and int(gaps.min()) < 1:
        at = int(np.argmax(gaps < 1))
        raise InvalidUpdateError(
            f"{what}: indices are not strictly increasing at position {at + 1} "
            f"({int(indices[at])} then {int(indices[at + 1])}); sort them and drop duplicates"
        )


def _check_header(version: int, base_version: int, shard: str, writer: str, level: int) -> None:
    for field, value in (("version", version), ("base_version", base_version), ("level", level)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidUpdateError(f"encode_blob: {field} must be an int, got {value!r}")
    if not 0 <= version < 1 << 63:
        raise InvalidUpdateError(f"encode_blob: version {version} must be in [0, 2^63)")
    if not -1 <= base_version < version:
        raise InvalidUpdateError(
            f"encode_blob: base_version {base_version} must be -1 (anchor) or a version below "
            f"version {version}"
        )
    if not section.MIN_LEVEL <= level <= section.MAX_LEVEL:
        raise InvalidUpdateError(
            f"encode_blob: level {level} must be in [{section.MIN_LEVEL}, {section.MAX_LEVEL}] "
            "(0 stores the records uncompressed; 1 is the recommended default)"
        )
    for field, value in (("shard", shard), ("writer", writer)):
        try:
            check_token(field, value)
        except ManifestError as e:
            raise InvalidUpdateError(f"encode_blob: {e}") from None
        if len(value.encode("utf-8")) > MAX_ID_BYTES:  # the token rule already implies this
            raise InvalidUpdateError(f"encode_blob: {field} is longer than {MAX_ID_BYTES} bytes")


def encode_blob(
    updates: Sequence[TensorUpdate],
    *,
    version: int,
    base_version: int,
    shard: str,
    writer: str,
    level: int = 1,
) -> bytes:
    """Encode ``updates`` for one (version, receiver shard, writer) into a blob.

    ``base_version`` is -1 for an anchor (full) blob. ``level`` is the zstd level (1 = fast
    default; 0 = no compression, for links faster than zstd)."""
    _check_header(version, base_version, shard, writer, level)
    if len(updates) > MAX_RECORDS:
        raise InvalidUpdateError(f"encode_blob: {len(updates)} updates exceed {MAX_RECORDS}")
    seen: set[str] = set()
    pieces: list[bytes | np.ndarray] = []
    for update in updates:
        if not isinstance(update, TensorUpdate):
            raise InvalidUpdateError(f"encode_blob: {update!r} is not a TensorUpdate")
        if update.name in seen:
            raise InvalidUpdateError(
                f"encode_blob: tensor {update.name!r} appears twice; merge its updates first"
            )
        seen.add(update.name)
        pieces.extend(_record(update))

    raw = b"".join(memoryview(p.reshape(-1)) if isinstance(p, np.ndarray) else p for p in pieces)
    body = section.compress(raw, level) if level else raw
    shard_b, writer_b = shard.encode("utf-8"), writer.encode("utf-8")
    header = HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_ZSTD if level else 0,
        version,
        base_version,
        len(body),
        len(raw),
        len(updates),
        len(shard_b),
        len(writer_b),
        0,
    )
    digest = xxhash.xxh3_128()
    for part in (header, shard_b, writer_b, body):
        digest.update(part)
    return b"".join((header, shard_b, writer_b, body, digest.digest()))
