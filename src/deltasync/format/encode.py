"""encode_blob: TensorUpdates -> one self-checking blob (header, zstd records, xxh3-128 digest).

Two steps: a pure plan per record (validation, encoding, gap width, exact byte size), then one
streaming pass that writes the planned records through zstd. Records keep the order of the given
updates, so equal inputs give equal bytes.

A sparse update is gap-coded in the narrowest width that fits its largest gap; an update that
names every element is written dense (no indices), which is never larger. The choice "sparse
would be larger than dense" for updates that do not name every element belongs to whoever holds
the full tensor (see :func:`deltasync.format.build.sparse_update`); the encoder cannot invent
missing values. The encoder refuses to write an invalid record (unsorted, duplicate or
out-of-range indices, bad ids, bad versions): a blob it produces always passes decode_blob.

This module knows the byte layout and the TensorUpdate record; it knows nothing about
receivers, layouts or storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from deltasync.errors import ManifestError
from deltasync.format import planes, section
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
from deltasync.format.records import BITS_DTYPES, DTYPE_CODES, TensorUpdate
from deltasync.names import check_token


@dataclass(frozen=True, eq=False)
class _RecordPlan:
    head: bytes  # record header + name + shape
    indices: np.ndarray | None  # int64, sparse records with nnz >= 2 only (gaps are written)
    width: int  # bytes per gap
    values: np.ndarray  # raw bit patterns, contiguous 1-D

    @property
    def size(self) -> int:
        gaps = 0 if self.indices is None else (self.indices.size - 1) * self.width
        return len(self.head) + gaps + self.values.nbytes


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _plan(update: TensorUpdate) -> _RecordPlan:
    what = f"tensor {update.name!r}"
    name = update.name.encode("utf-8")
    dims = shape_struct(len(update.shape)).pack(*update.shape)
    code, ndim = DTYPE_CODES[update.dtype], len(update.shape)
    values = _host(update.values).view(BITS_DTYPES[update.dtype]).numpy()

    indices = None if update.indices is None else _host(update.indices).numpy()
    if indices is not None and indices.size:
        first, last = int(indices[0]), int(indices[-1])
        if first < 0 or last >= update.numel:
            raise InvalidUpdateError(
                f"{what}: indices span [{first}, {last}] but the tensor has {update.numel} "
                "elements; indices are flat row-major positions in [0, numel)"
            )
        low, high = planes.gap_range(indices) if indices.size > 1 else (1, 0)
        if low < 1:
            at = int(np.argmax(np.diff(indices) < 1))
            raise InvalidUpdateError(
                f"{what}: indices are not strictly increasing at position {at + 1} "
                f"({int(indices[at])} then {int(indices[at + 1])}); sort them and drop duplicates"
            )
    if indices is None or indices.size == update.numel:
        # Every element named: strictly increasing in-range indices of length numel can only be
        # 0..numel-1, so the values are already in row-major order and dense is smaller.
        head = RECORD.pack(len(name), code, ENCODING_DENSE, ndim, 0, 0, update.numel, 0)
        return _RecordPlan(head + name + dims, None, 0, values)
    if indices.size == 0:
        head = RECORD.pack(len(name), code, ENCODING_SPARSE, ndim, 1, 0, 0, 0)
        return _RecordPlan(head + name + dims, None, 1, values)
    width = planes.gap_width(high)
    head = RECORD.pack(len(name), code, ENCODING_SPARSE, ndim, width, 0, indices.size, first)
    return _RecordPlan(head + name + dims, indices if indices.size > 1 else None, width, values)


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
    plans = []
    for update in updates:
        if not isinstance(update, TensorUpdate):
            raise InvalidUpdateError(f"encode_blob: {update!r} is not a TensorUpdate")
        if update.name in seen:
            raise InvalidUpdateError(
                f"encode_blob: tensor {update.name!r} appears twice; merge its updates first"
            )
        seen.add(update.name)
        plans.append(_plan(update))

    raw_len = sum(p.size for p in plans)
    out = section.SectionWriter(raw_len, level)
    for p in plans:
        out.write(p.head)
        if p.indices is not None:
            planes.write_gap_planes(out.write, p.indices, p.width)
        planes.write_value_planes(out.write, p.values)
    body = out.finish()

    shard_b, writer_b = shard.encode("utf-8"), writer.encode("utf-8")
    header = HEADER.pack(
        MAGIC, FORMAT_VERSION, FLAG_ZSTD if level else 0, version, base_version,
        sum(len(c) for c in body), raw_len, len(updates), len(shard_b), len(writer_b), 0,
    )  # fmt: skip
    digest = xxhash.xxh3_128()
    for part in (header, shard_b, writer_b, *body):
        digest.update(part)
    return b"".join((header, shard_b, writer_b, *body, digest.digest()))
