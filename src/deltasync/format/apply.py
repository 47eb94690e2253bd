"""apply_updates: scatter decoded values in place into live target tensors, all or nothing.

Three phases, so that a bad update leaves every target bit-identical:
1. validate every update against every target (name, shape, dtype, index range and order,
   target memory that does not overlap itself and that this process can write: a tensor over
   a read-only mapping is refused here, not a SIGSEGV on its first write);
2. stage indices and values on each target's device (allocations that may fail happen here);
3. write. Contiguous targets (including slices with a storage offset) get
   ``target.view(-1).index_copy_``; non-contiguous targets (transposed or strided views) get the
   row-major flat indices unravelled into coordinates and ``index_put_`` through the view, which
   writes through the view's strides into the shared storage. (A ``reshape(-1)`` of a
   non-contiguous tensor would be a copy, and writes into it would be lost.)

:func:`apply_pieces` writes one tensor's pieces of a chain (:class:`TensorPieces`, streamed by
:func:`deltasync.format.merge.iter_chain`) in chain order, so a chain is applied one tensor at a
time without folding it first.

This module knows TensorUpdate and torch tensors; it knows nothing about blobs, versions or
journals (the receiver records progress before calling it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from deltasync.errors import ApplyError, IntegrityError
from deltasync.format.merge import TensorPieces
from deltasync.format.reader import decoded_in_place
from deltasync.format.updates import TensorUpdate
from deltasync.native.loader import outside_storage, overlaps, overlaps_itself
from deltasync.native.ops import scatter16
from deltasync.native.writable import READ_ONLY_REMEDY, first_read_only, is_read_only

SLICE = 1 << 18  # int32 indices widened to int64 this many at a time (2 MiB)

# The engine's pause: a factory of the context the writes into the live tensors run inside
# (the engine must not read them meanwhile).
PauseContext = Callable[[], contextlib.AbstractContextManager]


@contextlib.contextmanager
def inside_pause(pause: PauseContext, what: str) -> Iterator[None]:
    """``pause()`` around the writes, which must run to their end: an error raised among them
    that the pause's exit suppressed (a hook that logs and resumes) would leave the tensors
    holding part of ``what`` while the receiver went on to report it whole. It is an
    IntegrityError here, raised after the pause has ended."""
    finished, hidden = False, None
    with pause():
        try:
            yield
        except BaseException as exc:
            hidden = exc
            raise
        finished = True
    if not finished:
        raise IntegrityError(
            f"the writes of {what} stopped midway ({type(hidden).__name__}: {hidden}), and the "
            "engine's pause suppressed the error on its exit: the tensors hold part of it. Let "
            "the pause re-raise what it catches"
        ) from hidden


def _check(
    update: TensorUpdate,
    targets: Mapping[str, torch.Tensor],
    seen: set[str],
    *,
    ordered: bool = False,
    in_place: bool = False,
) -> None:
    if not isinstance(update, TensorUpdate):
        raise ApplyError(f"apply_updates: {update!r} is not a TensorUpdate; nothing was written")
    what = f"tensor {update.name!r}"
    if update.name in seen:
        raise ApplyError(f"{what} has two updates; merge them first. Nothing was written")
    seen.add(update.name)
    target = targets.get(update.name)
    if target is None:
        raise ApplyError(
            f"{what}: no target of this name; the update and the receiver's layout disagree. "
            "Nothing was written"
        )
    if tuple(target.shape) != update.shape or target.dtype != update.dtype:
        raise ApplyError(
            f"{what}: update is {update.shape} {update.dtype}, target is {tuple(target.shape)} "
            f"{target.dtype}; the update and the receiver's layout disagree. Nothing was written"
        )
    if update.nnz:
        _check_writable(what, target, update, in_place=in_place)
    if update.indices is None or update.indices.numel() == 0:
        return
    idx = update.indices
    first, last = int(idx[0]), int(idx[-1])
    if first < 0 or last >= update.numel:
        raise ApplyError(
            f"{what}: indices span [{first}, {last}] outside [0, {update.numel}). Nothing was "
            "written"
        )
    if not ordered and idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ApplyError(
            f"{what}: indices are not strictly increasing; sort them and drop duplicates. "
            "Nothing was written"
        )


def _check_writable(
    what: str, target: torch.Tensor, update: TensorUpdate, *, in_place: bool = False
) -> None:
    """Refuse a target that writing ``update`` would corrupt or could not reach (``in_place``:
    the update's values are the target's own elements, decoded into it; nothing to copy)."""
    if not target.is_contiguous() and overlaps_itself(target):
        raise ApplyError(
            f"{what}: the target's strides {target.stride()} let elements share memory (an "
            "expanded view?); pass the tensor that owns the memory. Nothing was written"
        )
    if target.is_meta:
        raise ApplyError(
            f"{what}: the target is on the meta device and holds no values; pass the "
            "materialized tensor. Nothing was written"
        )
    outside = outside_storage(target)
    if outside is not None:
        raise ApplyError(f"{what}: the target {outside}. Nothing was written")
    for part, t in (("values", update.values), ("indices", update.indices)):
        if in_place and part == "values":
            continue
        if t is not None and overlaps(target, t):
            raise ApplyError(
                f"{what}: the update's {part} share memory with the target (writing it would "
                "change what is being written); pass a copy. Nothing was written"
            )


def check_targets_writable(named: Iterable[tuple[str, torch.Tensor]], what: str = "") -> None:
    """Raise ApplyError if a target of ``named`` (name, tensor) lies in read-only memory (see
    :mod:`deltasync.native.writable`): its first write would kill the process, after the
    targets before it were written. ``what`` prefixes the message (the caller's step)."""
    name = first_read_only(named)
    if name is not None:
        raise ApplyError(f"{what}tensor {name!r}: the target {READ_ONLY_REMEDY}")


def _write(
    target: torch.Tensor, update: TensorUpdate, idx: torch.Tensor | None, values: torch.Tensor
) -> None:
    if idx is None:
        target.copy_(values.view(update.shape))  # copy_ honours any strides of the target
    elif target.is_contiguous():
        # the C scatter (5-7x index_copy_ of widened int32 slices on a 0.6B model's shard
        # here); torch where it cannot (devices, other dtypes)
        if not scatter16(target, idx, values):
            target.view(-1).index_copy_(0, idx, values)
    else:
        coords = torch.unravel_index(idx, update.shape)
        target.index_put_(coords, values)


def apply_updates(updates: Sequence[TensorUpdate], targets: Mapping[str, torch.Tensor]) -> int:
    """Write every update into ``targets[update.name]`` in place; return the elements written.

    Raises ApplyError, with every target unchanged, if any update does not fit its target."""
    seen: set[str] = set()
    for update in updates:
        _check(update, targets, seen)
    check_targets_writable((u.name, targets[u.name]) for u in updates if u.nnz)

    staged = []
    for update in updates:
        target = targets[update.name]
        if update.nnz == 0:
            continue
        # int32 indices (a decoder's compact form) widen here: index_copy_ takes int64
        idx = None if update.indices is None else update.indices.to(target.device, torch.int64)
        staged.append((target, update, idx, update.values.to(target.device)))

    written = 0
    with torch.no_grad():  # targets may be leaf Parameters that require grad
        for target, update, idx, values in staged:
            _write(target, update, idx, values)
            written += update.nnz
    return written


def apply_pieces(
    tensor: TensorPieces, targets: Mapping[str, torch.Tensor], *, ordered: bool = False
) -> int:
    """Write one tensor's pieces of a chain (see :class:`TensorPieces`) into
    ``targets[tensor.name]`` in place, in chain order; return the elements written.

    Every piece is validated against the target before the first write into it (raises
    ApplyError with the target unchanged); the chain as a whole was verified by the caller.
    ``ordered``: the pieces were decoded by :class:`~deltasync.format.decode.BlobRecords`,
    which proves every index strictly increasing and in range, so the O(nnz) order check is
    skipped (the O(1) checks of name, shape, dtype and index span still run)."""
    target = targets.get(tensor.name)
    seen: set[str] = set()
    # a dense piece decoded straight into the target (BlobRecords.writing_into) is written
    # already: never copied onto itself (its values ARE the target's memory)
    own = [
        target is not None and p.indices is None and decoded_in_place(p.values, target)
        for p in tensor.pieces
    ]
    for piece, in_place in zip(tensor.pieces, own, strict=True):
        seen.clear()  # the pieces of one tensor share its name by construction
        _check(piece, targets, seen, ordered=ordered, in_place=in_place)
    if target is None:  # no pieces: nothing was checked against a target
        raise ApplyError(f"tensor {tensor.name!r}: no target of this name. Nothing was written")
    if is_read_only(target):  # its first write (a zero_ or a scatter) would be a SIGSEGV
        raise ApplyError(f"tensor {tensor.name!r}: the target {READ_ONLY_REMEDY}")
    start = tensor.start()
    pieces = tensor.pieces[start:]
    written = 0
    with torch.no_grad():
        if tensor.from_zero and not (pieces and pieces[0].is_dense):
            target.zero_()  # an anchor defines the whole tensor: unlisted elements are zero
            written += target.numel()
        for piece, in_place in zip(pieces, own[start:], strict=True):
            if piece.nnz == 0:
                continue
            if in_place:
                # Decoded into the target as it was read: only the first dense piece of the
                # pieces written (start) can be; any later piece overwrites it below.
                assert piece is pieces[0], tensor.name
                written += piece.nnz
                continue
            compact = piece.indices is not None and piece.indices.dtype != torch.int64
            if (
                compact
                and target.is_contiguous()
                and scatter16(target, piece.indices, piece.values)
            ):
                pass  # the C scatter took the int32 indices as decoded
            elif not compact:
                idx = None if piece.indices is None else piece.indices.to(target.device)
                _write(target, piece, idx, piece.values.to(target.device))
            else:  # compact indices: index_copy_ takes int64, widened a slice at a time
                for a in range(0, piece.nnz, SLICE):
                    idx = piece.indices[a : a + SLICE].to(target.device, torch.int64)
                    _write(target, piece, idx, piece.values[a : a + SLICE].to(target.device))
            written += piece.nnz
    return written
