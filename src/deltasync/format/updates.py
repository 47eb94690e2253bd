"""The in-memory records of the wire format: TensorSpec, TensorUpdate, PartedUpdate, BlobHeader,
DecodedBlob.

A TensorUpdate carries ABSOLUTE new values (never differences) for a set of flat, row-major
element indices of one tensor, or for every element (dense). Construction checks only what is
O(1) to check (types, ranks, lengths, dtypes); order and range of the indices are checked by
encode_blob, decode_blob and apply_updates, which look at the data anyway.

This module knows no bytes, no compression and no target tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deltasync.errors import ConfigError, InvalidUpdateError
from deltasync.format.wire import MAX_NAME_BYTES, MAX_NDIM, MAX_NUMEL
from deltasync.native.loader import outside_storage, overlapping, overlaps_itself
from deltasync.native.writable import READ_ONLY_REMEDY, first_read_only

# Wire dtype code <-> torch dtype <-> the integer dtype whose bits we copy. The table has an exact
# inverse; values are always moved as integer bit patterns so -0.0 and NaN payloads survive.
DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
BITS_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}
SUPPORTED = ", ".join(str(d) for d in DTYPE_CODES)
INT32_NUMEL = (1 << 31) - 1  # tensors of at most this many elements may carry int32 indices


def check_shape(shape: object, what: str, error: type[Exception]) -> tuple[int, ...]:
    """Return ``shape`` as a tuple of non-negative ints within MAX_NDIM / MAX_NUMEL, else raise."""
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{what}: shape {shape!r} is not a sequence of ints") from None
    if len(dims) > MAX_NDIM:
        raise error(f"{what}: shape has {len(dims)} dims; at most {MAX_NDIM} are supported")
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise error(f"{what}: shape {dims!r} must hold non-negative ints")
        if d > MAX_NUMEL:  # a zero-element shape keeps the product in range with any dim
            raise error(f"{what}: shape {dims!r} has a dim above 2^62")
    if math.prod(dims) > MAX_NUMEL:
        raise error(f"{what}: shape {dims!r} has more than 2^62 elements")
    return dims


def _check_record_header(record: TensorUpdate | PartedUpdate, kind: str) -> str:
    """Check a record's name, shape and dtype (normalising the shape in place); returns the
    ``tensor 'name'`` prefix its other errors use."""
    if not isinstance(record.name, str) or not record.name:
        raise InvalidUpdateError(f"{kind} name {record.name!r} must be a non-empty str")
    if len(record.name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise InvalidUpdateError(
            f"tensor {record.name[:60]!r}...: name is longer than {MAX_NAME_BYTES} UTF-8 bytes"
        )
    what = f"tensor {record.name!r}"
    object.__setattr__(record, "shape", check_shape(record.shape, what, InvalidUpdateError))
    if record.dtype not in DTYPE_CODES:
        raise InvalidUpdateError(f"{what}: dtype {record.dtype} is not one of {SUPPORTED}")
    return what


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects a tensor to be (its layout entry, as decode_blob checks it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", check_shape(self.shape, "TensorSpec", ConfigError))
        if self.dtype not in DTYPE_CODES:
            raise ConfigError(f"TensorSpec: dtype {self.dtype} is not one of {SUPPORTED}")


# eq=False: the fields hold tensors, whose == is elementwise; identity is the only sane equality.
@dataclass(frozen=True, eq=False)
class TensorUpdate:
    """New values for one tensor: at ``indices`` (1-D int64, or int32 for tensors of at most
    2^31 elements; strictly increasing, in [0, numel)) or, when ``indices`` is None, at every element in row-major order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor | None
    values: torch.Tensor

    def __post_init__(self) -> None:
        what = _check_record_header(self, "TensorUpdate")
        if not isinstance(self.values, torch.Tensor) or self.values.dim() != 1:
            raise InvalidUpdateError(f"{what}: values must be a 1-D tensor")
        if self.values.dtype != self.dtype:
            raise InvalidUpdateError(
                f"{what}: values have dtype {self.values.dtype} but the update declares "
                f"{self.dtype}; convert them first (sparse_update does this)"
            )
        if self.indices is None:
            if self.values.numel() != self.numel:
                raise InvalidUpdateError(
                    f"{what}: a dense update needs {self.numel} values for shape {self.shape}, "
                    f"got {self.values.numel()}"
                )
            return
        if not isinstance(self.indices, torch.Tensor) or self.indices.dim() != 1:
            raise InvalidUpdateError(f"{what}: indices must be a 1-D tensor or None")
        # int32 only where every index fits: a decoder's compact form of a tensor's indices
        # (int64 is the one form every producer uses; tensors can exceed 2^31 elements).
        if self.indices.dtype != torch.int64 and not (
            self.indices.dtype == torch.int32 and self.numel <= INT32_NUMEL
        ):
            raise InvalidUpdateError(
                f"{what}: indices must be int64 (tensors can exceed 2^31 elements; int32 only "
                f"below that), got {self.indices.dtype}"
            )
        if self.indices.numel() != self.values.numel():
            raise InvalidUpdateError(
                f"{what}: {self.indices.numel()} indices but {self.values.numel()} values"
            )
        if self.indices.numel() > self.numel:
            raise InvalidUpdateError(
                f"{what}: {self.indices.numel()} indices for only {self.numel} elements"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Number of elements this update writes."""
        return self.numel if self.indices is None else self.indices.numel()

    @property
    def is_dense(self) -> bool:
        return self.indices is None

    # A sparse update's elements as a verify reads them, a chunk's share at a time; a piece
    # parked in a file (deltasync.format.stash.StashedPiece) answers the same calls.

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Elements ``[lo, hi)`` of a sparse update: (indices, values) on the CPU (views of
        its own arrays where they lie there)."""
        return self.indices[lo:hi].cpu(), self.values[lo:hi].cpu()  # type: ignore[index]

    def all_indices(self) -> torch.Tensor:
        """Every index of a sparse update."""
        return self.indices  # type: ignore[return-value]

    def index_range(self) -> tuple[int, int] | None:
        """(first, last) index of a sparse update whose indices are strictly increasing
        (checked a chunk at a time), else None: its elements' range is not known."""
        idx = self.indices.detach().cpu().numpy()  # type: ignore[union-attr]
        if not idx.size or not strictly_increasing(idx):
            return None
        return int(idx[0]), int(idx[-1])

    def locate(self, starts: torch.Tensor) -> list[int]:
        """``searchsorted(indices, starts)`` of a sparse update (sorted indices): how many of
        its elements lie below each start."""
        idx = self.indices
        return torch.searchsorted(idx, starts.to(device=idx.device, dtype=idx.dtype)).tolist()  # type: ignore[arg-type, union-attr]

    def chunk_bounds(self, chunk: int) -> list[int]:
        """Where each ``chunk``-element block of the tensor starts among a sparse update's
        elements: ``locate(chunk_starts(numel, chunk))`` (the last: nnz)."""
        return self.locate(chunk_starts(self.numel, chunk))


class SparsePiece(Protocol):
    """A sparse piece as a verify reads it, a chunk's share at a time: a sparse
    :class:`TensorUpdate`, or one parked in a file
    (:class:`deltasync.format.stash.StashedPiece`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nnz(self) -> int: ...

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def locate(self, starts: torch.Tensor) -> list[int]: ...

    def chunk_bounds(self, chunk: int) -> list[int]: ...

    def index_range(self) -> tuple[int, int] | None: ...

    def all_indices(self) -> torch.Tensor: ...


ORDER_CHUNK = 1 << 16  # indices per step of a strict-order check (stays in cache)


def strictly_increasing(idx: np.ndarray) -> bool:
    """Whether ``idx`` is strictly increasing (a chunk at a time: no full-size temporary)."""
    n = idx.size
    out = np.empty(min(max(n - 1, 0), ORDER_CHUNK), dtype=bool)
    for a in range(0, n - 1, ORDER_CHUNK):
        b = min(n, a + ORDER_CHUNK + 1)
        got = out[: b - a - 1]
        np.greater(idx[a + 1 : b], idx[a : b - 1], out=got)
        if not got.all():
            return False
    return True


def chunk_starts(numel: int, chunk: int) -> torch.Tensor:
    """The first element of each ``chunk``-element block of a tensor of ``numel`` elements,
    then ``numel``: ``[0, chunk, 2 * chunk, ..., numel]`` (int64)."""
    return torch.arange(0, numel + chunk, chunk, dtype=torch.int64).clamp_(max=numel)


class WordSource(Protocol):
    """A dense record's 2-byte words, read once, in element order (a
    :class:`deltasync.format.section.LazyPlanes`)."""

    n: int

    def chunks(self, m: int) -> Iterator[np.ndarray]: ...

    def read(self) -> np.ndarray: ...


@dataclass(frozen=True, eq=False)
class LazyDense:
    """A dense update (every element, BF16/FP16) whose values are read from its blob only
    when asked, ``chunk`` elements at a time (:meth:`chunks`), so that a large record (an
    anchor's embedding) is hashed without being held whole. Its words are readable once,
    and only before the blob's next record is read (a later read raises FormatError); a
    reader that keeps the record past that takes :meth:`materialized` first. Only a verify
    pass reads records this way (:meth:`deltasync.format.decode.BlobRecords.lazily`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: WordSource

    indices = None  # dense: every element, in row-major order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        return self.numel

    @property
    def is_dense(self) -> bool:
        return True

    def chunks(self, m: int) -> Iterator[torch.Tensor]:
        """The values, ``m`` elements at a time, as tensors of ``dtype`` valid until the next
        one is asked for (one buffer is reused)."""
        for words in self.source.chunks(m):
            yield torch.from_numpy(words).view(self.dtype)

    def materialized(self) -> TensorUpdate:
        """This record read whole, as an update that outlives the blob's next record."""
        values = torch.from_numpy(self.source.read()).view(self.dtype)
        return TensorUpdate(
            name=self.name, shape=self.shape, dtype=self.dtype, indices=None, values=values
        )

    @property
    def values(self) -> torch.Tensor:
        """The values read whole (a reader that does not stream them); readable once."""
        return self.materialized().values


def materialized(record: TensorUpdate | LazyDense) -> TensorUpdate:
    """``record`` as an update that outlives its blob's next record."""
    return record.materialized() if isinstance(record, LazyDense) else record


# One part of a PartedUpdate: sorted int64 indices (1-D) and their values (1-D, the update's
# dtype), equally long.
Part = tuple[torch.Tensor, torch.Tensor]


# eq=False: like TensorUpdate, identity is the only equality.
@dataclass(frozen=True, eq=False)
class PartedUpdate:
    """A sparse update too large to hold whole: the same record as the TensorUpdate with these
    indices and values (the encoder writes the same bytes), its indices and values produced a
    bounded part at a time. ``parts()`` yields ``(indices, values)`` in order, every index above
    the previous part's, together exactly ``nnz`` of them starting at ``first`` with ``max_gap``
    the largest difference between neighbours; each call starts again from the first part, and
    a part may live in a buffer the next one reuses (the consumer copies what it keeps). The
    summary fields are what the encoder needs before the first byte (the record's count,
    first index and gap width); it checks them against the parts as it writes and refuses the
    record when they disagree.

    The vocab-parallel embedding's row pieces are published this way: the parts are slices of
    the captured positions and the values read at them, so neither the piece's int64 indices
    nor its values ever exist at once."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nnz: int
    first: int
    max_gap: int  # 0 when nnz < 2
    parts: Callable[[], Iterable[Part]]
    # The parts' indices alone, when the producer gives them cheaper than with their values
    # (the encoder's passes over the gap planes need no values); None: read from ``parts``.
    indices: Callable[[], Iterable[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        what = _check_record_header(self, "PartedUpdate")
        for field, value in (("nnz", self.nnz), ("first", self.first), ("max_gap", self.max_gap)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidUpdateError(
                    f"{what}: {field} must be a non-negative int, got {value!r}"
                )
        if not 1 <= self.nnz <= self.numel:
            raise InvalidUpdateError(
                f"{what}: a parted update writes 1 to {self.numel} elements, not {self.nnz}"
            )
        if self.first >= self.numel or (self.nnz >= 2) != (self.max_gap >= 1):
            raise InvalidUpdateError(
                f"{what}: first index {self.first} and largest gap {self.max_gap} do not fit "
                f"{self.nnz} sorted indices in [0, {self.numel})"
            )
        if self.first + (self.nnz - 1) + max(0, self.max_gap - 1) >= self.numel:
            raise InvalidUpdateError(
                f"{what}: {self.nnz} indices from {self.first} with a largest gap of "
                f"{self.max_gap} run past the tensor's {self.numel} elements"
            )
        if not callable(self.parts):
            raise InvalidUpdateError(f"{what}: parts must be a callable yielding the parts")
        if self.indices is not None and not callable(self.indices):
            raise InvalidUpdateError(f"{what}: indices must be None or a callable")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_dense(self) -> bool:
        return False


@dataclass(frozen=True)
class BlobHeader:
    format_version: int
    version: int  # the version this blob brings the shard to
    base_version: int  # the version it must be applied on; -1 for a full (anchor) blob
    shard: str  # receiver shard id, e.g. "tp0" or "tp1-ep1"
    writer: str  # trainer writer id, e.g. "w00000"

    @property
    def is_anchor(self) -> bool:
        return self.base_version == -1


@dataclass(frozen=True, eq=False)
class DecodedBlob:
    header: BlobHeader
    updates: list[TensorUpdate]

    def total_elements(self) -> int:
        """Elements the updates write when applied."""
        return sum(u.nnz for u in self.updates)


def check_tensors_match(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], *, what: str, hint: str
) -> None:
    """Raise ConfigError unless ``tensors`` holds exactly the tensors ``specs`` describes (names,
    shapes, dtypes), each in memory this process can write. Receivers and engines run it
    before their first sync, so a layout/engine mismatch is refused before anything is fetched
    or written, never half-applied. ``what`` names the holder, ``hint`` says how to fix a name
    mismatch."""
    missing = [n for n in specs if n not in tensors]
    extra = [n for n in tensors if n not in specs]
    if missing or extra:
        raise ConfigError(
            f"{what}: tensors do not match the receiver layout: missing {missing[:5]}, "
            f"unexpected {extra[:5]} ({hint})"
        )
    for name, spec in specs.items():
        t = tensors[name]
        _check_holds(name, t, spec, what)
        # The scatter writes one tensor at a time after the whole version is verified, so a
        # target it would refuse mid-way (elements sharing memory) is refused here, up front.
        if not t.is_contiguous() and overlaps_itself(t):
            raise ConfigError(
                f"{what}: tensor {name!r} has strides {t.stride()} that let elements share "
                "memory (an expanded view?); pass the tensor that owns the memory"
            )
    _check_memory_writable(tensors, specs, what)
    shared = overlapping((n, tensors[n], n) for n in specs)
    if shared:
        name = next(iter(shared))
        raise ConfigError(
            f"{what}: tensors {name!r} and {shared[name]!r} share memory, so writing one "
            "changes the other; give each name its own storage (tied weights: the layout "
            "leaves the alias out)"
        )


def check_tensors_still_match(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], *, what: str
) -> None:
    """:func:`check_tensors_match`'s checks of each tensor alone (shape, dtype, values inside
    its storage: metadata only, microseconds a tensor; memory writable: a probe of the mapped
    memory torch did not allocate, see :mod:`deltasync.native.writable`), again before a sync:
    an engine may have freed or resized a tensor's storage in place since it handed it over
    (FSDP's resharding, offloading), or a mapping may have been made read-only, and the
    scatter, which writes one tensor at a time, would find it only after writing the ones
    before it (a read-only one: as a SIGSEGV). (The receivers hold the tensor objects they
    were given: one the engine replaced in its own mapping is not seen here.)"""
    for name, spec in specs.items():
        _check_holds(name, tensors.get(name), spec, what)
    # a mapping may have been made read-only since (mprotect, a file mapped again read-only)
    _check_memory_writable(tensors, specs, what)


def _check_memory_writable(
    tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], what: str
) -> None:
    """Refuse a tensor in read-only memory: the scatter's first write into it would kill the
    process (SIGSEGV), after the tensors before it were written."""
    name = first_read_only((n, tensors[n]) for n in specs)
    if name is not None:
        raise ConfigError(f"{what}: tensor {name!r} {READ_ONLY_REMEDY}")


def _check_holds(name: str, t: object, spec: TensorSpec, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{what}: {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ConfigError(
            f"{what}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, the layout says "
            f"{spec.shape} {spec.dtype}"
        )
    if t.is_meta:
        raise ConfigError(
            f"{what}: tensor {name!r} is on the meta device and holds no values; pass the "
            "engine's materialized tensor"
        )
    outside = outside_storage(t)
    if outside is not None:
        raise ConfigError(
            f"{what}: tensor {name!r} {outside}; pass the engine's tensor while it holds its values"
        )
