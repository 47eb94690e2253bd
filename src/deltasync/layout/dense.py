"""Dense conversion through a layout table: whole tensors split into shards and merged back.

``split_dense`` copies every block of every source tensor into freshly zeroed destination
tensors (so what no block covers, vLLM's vocabulary padding, is zero); ``merge_dense`` copies
each block back, once per distinct source rectangle, and compares every further replica of it
bit for bit. These serve anchors, dense baselines and tests; the sparse path is
``LayoutTable.route``. Both run the same :class:`~deltasync.layout.blocks.Block` maps.

This module knows tables and tensors, not models or engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from deltasync.errors import LayoutError
from deltasync.layout.blocks import view_cols, view_rows

if TYPE_CHECKING:
    from deltasync.layout.table import LayoutTable

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t`` for bitwise comparison (float ``==`` conflates ±0 and NaNs)."""
    return t.view(_INT_VIEW[t.element_size()])


def _as2d(t: torch.Tensor) -> torch.Tensor:
    shape = tuple(t.shape)
    return t.reshape(view_rows(shape), view_cols(shape))


def split_dense(
    table: LayoutTable, full: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Every source tensor → every shard's local tensors; all of one dtype, kept as given."""
    missing = [n for n in table.src_shapes if n not in full]
    extra = [n for n in full if n not in table.src_shapes]
    if missing or extra:
        raise LayoutError(f"split: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
    first = next(iter(full.values()), None)
    dtype = first.dtype if first is not None else torch.bfloat16
    device = first.device if first is not None else torch.device("cpu")
    for name, shape in table.src_shapes.items():
        t = full[name]
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise LayoutError(
                f"split: {name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"expected {shape} {dtype} on {device}"
            )
    out = {
        s: {n: torch.zeros(shape, dtype=dtype, device=device) for n, shape in locs.items()}
        for s, locs in table.dst_shapes.items()
    }
    for name, pls in table.placements.items():
        src2d = _as2d(full[name])
        for p in pls:
            p.block.dst_view(_as2d(out[p.shard][p.local])).copy_(p.block.src_view(src2d))
    return out


def _check_shards(table: LayoutTable, shards: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    extra = [s for s in shards if s not in table.dst_shapes]
    if extra:
        raise LayoutError(f"merge: unexpected shards {extra}")
    dtype = None
    for s, locs in table.dst_shapes.items():
        got = shards.get(s)
        if got is None:
            raise LayoutError(f"merge: shard {s!r} is missing")
        for n, shape in locs.items():
            t = got.get(n)
            if t is None or tuple(t.shape) != shape:
                raise LayoutError(f"merge: {s}/{n} is missing or not of shape {shape}")
            dtype = dtype or t.dtype
            if t.dtype != dtype:  # copy_ would cast silently
                raise LayoutError(f"merge: {s}/{n} is {t.dtype}, other tensors are {dtype}")
        for n, t in got.items():
            if n in locs:
                continue
            target = table.aliases[s].get(n)
            if target is None:
                raise LayoutError(f"merge: shard {s!r} has unexpected tensor {n!r}")
            if t.shape != got[target].shape or not torch.equal(bits(t), bits(got[target])):
                raise LayoutError(f"merge: {s}/{n} is tied to {target!r} but differs from it")


def merge_dense(
    table: LayoutTable, shards: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_dense`. Replicated copies must agree bitwise, else LayoutError."""
    _check_shards(table, shards)
    out: dict[str, torch.Tensor] = {}
    for name, shape in table.src_shapes.items():
        pls = table.placements[name]
        first = shards[pls[0].shard][pls[0].local]
        res = torch.empty(shape, dtype=first.dtype, device=first.device)
        res2d = _as2d(res)
        done: set[tuple[int, int, int, int]] = set()
        for p in pls:
            piece = p.block.dst_view(_as2d(shards[p.shard][p.local]))
            rect = p.block.src_rect()
            if rect not in done:
                p.block.src_view(res2d).copy_(piece)
                done.add(rect)
            elif not torch.equal(bits(p.block.src_view(res2d)), bits(piece)):
                raise LayoutError(
                    f"merge: replicas of {name!r} disagree ({p.shard}/{p.local} differs "
                    "from another shard holding the same elements)"
                )
        out[name] = res
    return out
