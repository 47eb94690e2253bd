"""A layout table: which blocks of which destination tensors hold each source tensor.

A table maps *source* tensors (by name) to *destination* tensors (by shard id and local name)
through :class:`~deltasync.layout.blocks.Block` maps. The canonical → receiver tables have the
HF checkpoint tensors as sources; the trainer table is the inverse of the transformers-model
table, with the trainer's parameters as sources and the canonical tensors as destinations.

The same table drives the sparse path (:meth:`route`: sorted flat indices in, per-shard sorted
local indices out, as tensor arithmetic) and the dense path (:meth:`split` / :meth:`merge`), so
the two cannot disagree. A source element may be held by several shards (replicated norms, kv
heads, attention weights under expert parallelism); it is routed to each. Destination elements
no block covers (vocabulary padding) are zero after :meth:`split` and ignored by :meth:`merge`.

This module knows nothing about models, engines or files; rule modules build its contents.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import LayoutError
from deltasync.layout.blocks import (
    Block,
    as_2d,
    bits,
    find_overlap,
    gather,
    numel,
    positions_tensor,
    view_cols,
    view_rows,
)
from deltasync.native.ops import first_not_increasing

Shape = tuple[int, ...]
# A table that fails validation comes from user input only through a layout file; what to do then.
_REPROBE = "if the table was read from a layout file, write it again with `deltasync layout probe`"
# Merge input that does not fit the table: shard tensors that are not what split produced.
_RESPLIT = "pass every shard as split wrote it (shard files: split the checkpoint again)"
Routed = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class Placement:
    """Source block ``block`` is held by local tensor ``local`` of shard ``shard``."""

    shard: str
    local: str
    block: Block


class LayoutTable:
    """Source tensors → blocks of destination tensors in named shards. Immutable after init."""

    def __init__(
        self,
        *,
        src_shapes: Mapping[str, Shape],
        dst_shapes: Mapping[str, Mapping[str, Shape]],
        placements: Mapping[str, list[Placement]],
        aliases: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.src_shapes: dict[str, Shape] = dict(src_shapes)
        self.dst_shapes: dict[str, dict[str, Shape]] = {s: dict(m) for s, m in dst_shapes.items()}
        self.placements: dict[str, tuple[Placement, ...]] = {
            k: tuple(v) for k, v in placements.items()
        }
        self.aliases: dict[str, dict[str, str]] = {
            s: dict((aliases or {}).get(s, {})) for s in self.dst_shapes
        }
        self._validate()
        # Sparse routing plan per source: placements grouped by identical block (replicas are
        # computed once), and all group spans as one tensor for a single searchsorted call.
        self._groups: dict[str, list[tuple[Block, list[tuple[str, str]]]]] = {}
        self._bounds: dict[str, torch.Tensor] = {}
        for name, pls in self.placements.items():
            groups: dict[Block, list[tuple[str, str]]] = {}
            for p in pls:
                groups.setdefault(p.block, []).append((p.shard, p.local))
            items = sorted(groups.items(), key=lambda kv: kv[0].src_span())
            self._groups[name] = items
            self._bounds[name] = torch.tensor(
                [x for b, _ in items for x in b.src_span()], dtype=torch.int64
            )
        # Per destination tensor: blocks ordered by destination start, and whether their flat
        # extents are disjoint (then concatenating routed pieces in that order stays sorted).
        by_dst: dict[tuple[str, str], list[Block]] = {}
        for pls in self.placements.values():
            for p in pls:
                by_dst.setdefault((p.shard, p.local), []).append(p.block)
        self._covered = {key for key, blocks in by_dst.items() if any(b.size for b in blocks)}
        self._dst_concat_sorted: dict[tuple[str, str], bool] = {}
        for key, blocks in by_dst.items():
            ext = sorted(_dst_extent(b) for b in blocks if b.size)
            self._dst_concat_sorted[key] = all(a[1] <= b[0] for a, b in itertools.pairwise(ext))

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        for name in self.src_shapes:
            if not self.placements.get(name):
                raise LayoutError(f"layout table has no placement for tensor {name!r}; {_REPROBE}")
        dst_blocks: dict[tuple[str, str], list[Block]] = {}
        for name, pls in self.placements.items():
            if name not in self.src_shapes:
                raise LayoutError(f"layout table places unknown source tensor {name!r}; {_REPROBE}")
            shape = self.src_shapes[name]
            rects: dict[tuple[int, int, int, int], None] = {}
            for p in pls:
                dshape = self.dst_shapes.get(p.shard, {}).get(p.local)
                if dshape is None:
                    raise LayoutError(
                        f"{name!r} is placed into unknown tensor {p.local!r} of shard "
                        f"{p.shard!r}; {_REPROBE}"
                    )
                b = p.block
                if b.src_cols != view_cols(shape) or b.src_row + b.rows > view_rows(shape):
                    raise LayoutError(
                        f"block {b} does not fit source {name!r} of shape {shape}; {_REPROBE}"
                    )
                if b.dst_cols != view_cols(dshape) or b.dst_row + b.rows > view_rows(dshape):
                    raise LayoutError(
                        f"block {b} of {name!r} does not fit {p.shard}/{p.local} of shape "
                        f"{dshape}; {_REPROBE}"
                    )
                if b.size:
                    rects[b.src_rect()] = None
                    dst_blocks.setdefault((p.shard, p.local), []).append(b)
            distinct = list(rects)
            clash = find_overlap(distinct)
            if clash is not None:
                raise LayoutError(
                    f"{name!r}: blocks {distinct[clash[0]]} and {distinct[clash[1]]} overlap; "
                    f"{_REPROBE}"
                )
            if sum(r[1] * r[3] for r in distinct) != numel(shape):
                raise LayoutError(
                    f"{name!r}: the table does not cover every element of {shape}; {_REPROBE}"
                )
        for (shard, local), blocks in dst_blocks.items():
            # Replicas of one source block never target the same destination tensor twice.
            rects2 = [(b.dst_row, b.rows, b.dst_col, b.cols) for b in blocks]
            clash = find_overlap(rects2)
            if clash is not None:
                raise LayoutError(
                    f"{shard}/{local}: two source blocks write the same elements; {_REPROBE}"
                )
        for shard, amap in self.aliases.items():
            for alias, target in amap.items():
                if target not in self.dst_shapes[shard] or alias in self.dst_shapes[shard]:
                    raise LayoutError(
                        f"shard {shard!r}: alias {alias!r} -> {target!r} is not a tied name; "
                        f"{_REPROBE}"
                    )

    def uncovered(self, shard: str) -> list[str]:
        """The local tensors of ``shard`` that no source element reaches (all padding, e.g. a
        vLLM rank whose slice of the padded vocabulary starts past the last token): zero in
        every state, and absent from anything routed."""
        return [n for n in self.dst_shapes[shard] if (shard, n) not in self._covered]

    # ------------------------------------------------------------------ sparse routing

    def _check_indices(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        if name not in self.src_shapes:
            raise LayoutError(
                f"tensor {name!r} is not in this layout; pass one of its source tensors "
                "(the names the layout was built for)"
            )
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise LayoutError(f"indices for {name!r} must be a 1-D tensor")
        if indices.dtype != torch.int64:
            if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise LayoutError(f"indices for {name!r} must be integers, got {indices.dtype}")
            indices = indices.to(torch.int64)
        n = indices.numel()
        if n:
            total = numel(self.src_shapes[name])
            if int(indices[0]) < 0 or int(indices[-1]) >= total:
                raise LayoutError(f"indices for {name!r} fall outside 0..{total - 1}")
            # searchsorted below relies on strict order; an unsorted input would route silently wrong.
            bad = first_not_increasing(indices)
            if bad >= 0:
                raise LayoutError(
                    f"indices for {name!r} must be sorted and distinct (position {bad}: "
                    f"{int(indices[bad - 1])} then {int(indices[bad])})"
                )
        return indices

    def _select(self, name: str, indices: torch.Tensor):
        indices = self._check_indices(name, indices)
        bounds = self._bounds[name]
        if bounds.device != indices.device:  # indices may live on the trainer's GPU
            bounds = bounds.to(indices.device)
        cuts = torch.searchsorted(indices, bounds).tolist()
        bases: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for g, (block, targets) in enumerate(self._groups[name]):
            lo, hi = cuts[2 * g], cuts[2 * g + 1]
            if lo == hi:
                continue
            if block.src_full_width:
                dst, pos = block.map_sorted(indices, lo, hi)
            else:  # one C pass per column block, else the blocks over the same rows
                mapped = block.map_columns_native(indices[lo:hi], lo)  # share one unravel
                if mapped is None:
                    key = (lo, hi, block.dst_cols)
                    if key not in bases:
                        bases[key] = block.column_basis(indices[lo:hi])
                    mapped = block.map_columns(bases[key], lo)
                dst, pos = mapped
            if dst.numel():
                yield block, targets, dst, pos

    def route(self, name: str, indices: torch.Tensor) -> Routed:
        """Sorted flat indices of source ``name`` → ``{shard: {local: (local_idx, positions)}}``.

        ``local_idx`` is sorted int64; ``positions`` (int64) index into ``indices`` so the caller
        gathers values with ``values[positions]``. Shards holding none of them are left out.
        Returned tensors may be shared between replica shards: treat them as read-only.
        """
        out: Routed = {}
        for _, targets, dst, pos in self._select(name, indices):
            pos_t = positions_tensor(pos, indices.device)
            for shard, local in targets:
                out.setdefault(shard, {})[local] = (dst, pos_t)
        return out

    def route_values(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> Routed:
        """Like :meth:`route`, but with the values gathered: ``{shard: {local: (idx, values)}}``."""
        if values.shape != indices.shape:
            raise LayoutError(
                f"{name!r}: {values.numel()} values for {indices.numel()} indices; pass one "
                "value per index"
            )
        out: Routed = {}
        for _, targets, dst, pos in self._select(name, indices):
            vals = gather(values, pos)
            for shard, local in targets:
                out.setdefault(shard, {})[local] = (dst, vals)
        return out

    def route_changes(self, changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Routed:
        """Route many source tensors at once and merge pieces per destination tensor.

        ``changes`` maps source names to ``(sorted indices, values)``. The result holds, per shard
        and local tensor, sorted int64 indices and their values, ready to encode.
        """
        pieces: dict[tuple[str, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for name, (indices, values) in changes.items():
            if values.shape != indices.shape:
                raise LayoutError(
                    f"{name!r}: {values.numel()} values for {indices.numel()} indices; pass "
                    "one value per index"
                )
            for block, targets, dst, pos in self._select(name, indices):
                vals = gather(values, pos)
                start = _dst_extent(block)[0]
                for key in targets:
                    pieces.setdefault(key, []).append((start, dst, vals))
        out: Routed = {}
        for key, parts in pieces.items():
            parts.sort(key=lambda p: p[0])
            idx = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            vals = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2]
            if len(parts) > 1 and not self._dst_concat_sorted[key]:
                order = torch.argsort(idx)
                idx, vals = idx.index_select(0, order), vals.index_select(0, order)
            out.setdefault(key[0], {})[key[1]] = (idx, vals)
        return out

    # ------------------------------------------------------------------ dense conversion

    def split(self, full: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Every source tensor → every shard's local tensors (uncovered elements are zero)."""
        return split_dense(self, full)

    def merge(self, shards: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`split`. Replicated copies must agree bitwise, else LayoutError."""
        return merge_dense(self, shards)

    # ------------------------------------------------------------------ inverse

    def inverse(self, *, shard: str) -> LayoutTable:
        """The table read backwards: this table's only shard's tensors become the sources, and
        this table's sources become the tensors of shard ``shard``."""
        if len(self.dst_shapes) != 1:
            raise LayoutError("only a single-shard table can be inverted")
        (own,) = self.dst_shapes
        placements: dict[str, list[Placement]] = {}
        for name, pls in self.placements.items():
            for p in pls:
                placements.setdefault(p.local, []).append(Placement(shard, name, p.block.inverse()))
        return LayoutTable(
            src_shapes=self.dst_shapes[own],
            dst_shapes={shard: self.src_shapes},
            placements=placements,
        )


def _dst_extent(b: Block) -> tuple[int, int]:
    """Flat [first, last+1) of the destination elements a block writes."""
    if not b.size:
        return (0, 0)
    first = b.dst_row * b.dst_cols + b.dst_col
    last = (b.dst_row + b.rows - 1) * b.dst_cols + b.dst_col + b.cols
    return first, last


# ------------------------------------------------------------------ dense conversion
# split copies every block of every source into freshly zeroed destinations (what no block
# covers, vLLM's vocabulary padding, is zero); merge copies each block back once per distinct
# source rectangle and compares every further replica bit for bit. They serve anchors, dense
# baselines and tests; the sparse path is LayoutTable.route. Both run the same Block maps.


def split_dense(
    table: LayoutTable, full: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Every source tensor → every shard's local tensors; all of one dtype, kept as given."""
    missing = [n for n in table.src_shapes if n not in full]
    extra = [n for n in full if n not in table.src_shapes]
    if missing or extra:
        raise LayoutError(
            f"split: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}; pass exactly "
            "the table's source tensors (the model config's full checkpoint)"
        )
    first = next(iter(full.values()), None)
    dtype = first.dtype if first is not None else torch.bfloat16
    device = first.device if first is not None else torch.device("cpu")
    for name, shape in table.src_shapes.items():
        t = full[name]
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
            raise LayoutError(
                f"split: {name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"expected {shape} {dtype} on {device}; pass every tensor with the table's "
                "shape, in one dtype on one device"
            )
    out = {
        s: {n: torch.zeros(shape, dtype=dtype, device=device) for n, shape in locs.items()}
        for s, locs in table.dst_shapes.items()
    }
    for name, pls in table.placements.items():
        src2d = as_2d(full[name])
        for p in pls:
            p.block.dst_view(as_2d(out[p.shard][p.local])).copy_(p.block.src_view(src2d))
    return out


def _check_shards(table: LayoutTable, shards: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    extra = [s for s in shards if s not in table.dst_shapes]
    if extra:
        raise LayoutError(f"merge: unexpected shards {extra}; {_RESPLIT}")
    dtype = None
    for s, locs in table.dst_shapes.items():
        got = shards.get(s)
        if got is None:
            raise LayoutError(f"merge: shard {s!r} is missing; {_RESPLIT}")
        for n, shape in locs.items():
            t = got.get(n)
            if t is None or tuple(t.shape) != shape:
                raise LayoutError(f"merge: {s}/{n} is missing or not of shape {shape}; {_RESPLIT}")
            dtype = dtype or t.dtype
            if t.dtype != dtype:  # copy_ would cast silently
                raise LayoutError(
                    f"merge: {s}/{n} is {t.dtype}, other tensors are {dtype}; {_RESPLIT}"
                )
        for n, t in got.items():
            if n in locs:
                continue
            target = table.aliases[s].get(n)
            if target is None:
                raise LayoutError(f"merge: shard {s!r} has unexpected tensor {n!r}; {_RESPLIT}")
            if t.shape != got[target].shape or not torch.equal(bits(t), bits(got[target])):
                raise LayoutError(
                    f"merge: {s}/{n} is tied to {target!r} but differs from it; {_RESPLIT}"
                )


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
        res2d = as_2d(res)
        done: set[tuple[int, int, int, int]] = set()
        for p in pls:
            piece = p.block.dst_view(as_2d(shards[p.shard][p.local]))
            rect = p.block.src_rect()
            if rect not in done:
                p.block.src_view(res2d).copy_(piece)
                done.add(rect)
            elif not torch.equal(bits(p.block.src_view(res2d)), bits(piece)):
                raise LayoutError(
                    f"merge: replicas of {name!r} disagree ({p.shard}/{p.local} differs "
                    f"from another shard holding the same elements); {_RESPLIT}"
                )
        out[name] = res
    return out
