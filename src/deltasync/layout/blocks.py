"""Affine index maps between two tensors: a rectangle of one copied into a rectangle of another.

Every layout conversion deltasync supports (split, concatenate, stack, slice, pad) moves each
element unchanged from one tensor to another. Viewing both tensors as 2-D matrices
``(numel // last_dim, last_dim)`` (a 1-D tensor of n elements as ``(n, 1)``), each such move is a
*block*: ``rows x cols`` elements starting at (src_row, src_col) in the source view land at
(dst_row, dst_col) in the destination view, in the same order. Stacking experts is a row offset,
a tensor-parallel split along the output dim a row block, along the input dim a column block,
vocabulary padding a block that leaves the destination's tail rows uncovered.

Because a block keeps row-major order, sorted source flat indices map to sorted destination
flat indices, so no sort is needed inside one block. This module does the index arithmetic on
int64 tensors (no Python loop over elements) and knows nothing about names, shards or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltasync.native.ops import column_block


def view_cols(shape: tuple[int, ...]) -> int:
    """Width of the 2-D view of a tensor: its last dim, or 1 for a 1-D tensor."""
    if len(shape) == 0:
        return 1
    return shape[-1] if len(shape) >= 2 else 1


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as its 2-D view (``view_rows`` x ``view_cols``): what every block indexes."""
    shape = tuple(t.shape)
    return t.reshape(view_rows(shape), view_cols(shape))


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def view_rows(shape: tuple[int, ...]) -> int:
    cols = view_cols(shape)
    return numel(shape) // cols if cols else 0


@dataclass(frozen=True)
class Block:
    """``rows x cols`` elements from the source 2-D view into the destination 2-D view."""

    src_cols: int  # width of the source view
    dst_cols: int  # width of the destination view
    src_row: int
    dst_row: int
    rows: int
    src_col: int = 0
    dst_col: int = 0
    cols: int = -1  # -1: the full width (src_cols == dst_cols required)

    def __post_init__(self) -> None:
        if self.cols == -1:
            object.__setattr__(self, "cols", self.src_cols)
        # Internal invariants of the tables: violations are bugs, not user errors.
        assert self.rows >= 0 and self.cols >= 0
        assert self.src_col >= 0 and self.src_col + self.cols <= self.src_cols
        assert self.dst_col >= 0 and self.dst_col + self.cols <= self.dst_cols

    # -- geometry -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def src_full_width(self) -> bool:
        return self.cols == self.src_cols

    @property
    def dst_full_width(self) -> bool:
        return self.cols == self.dst_cols

    @property
    def contiguous(self) -> bool:
        """Both sides are full-width: the block is one flat range on each side."""
        return self.src_full_width and self.dst_full_width

    def src_span(self) -> tuple[int, int]:
        """Flat [start, stop) of the source rows this block touches (a superset if not full-width)."""
        return self.src_row * self.src_cols, (self.src_row + self.rows) * self.src_cols

    def dst_span(self) -> tuple[int, int]:
        return self.dst_row * self.dst_cols, (self.dst_row + self.rows) * self.dst_cols

    def src_rect(self) -> tuple[int, int, int, int]:
        return (self.src_row, self.rows, self.src_col, self.cols)

    def inverse(self) -> Block:
        return Block(
            src_cols=self.dst_cols,
            dst_cols=self.src_cols,
            src_row=self.dst_row,
            dst_row=self.src_row,
            rows=self.rows,
            src_col=self.dst_col,
            dst_col=self.src_col,
            cols=self.cols,
        )

    def src_overlaps(self, other: Block) -> bool:
        return _rects_overlap(self.src_rect(), other.src_rect())

    def dst_overlaps(self, other: Block) -> bool:
        return _rects_overlap(
            (self.dst_row, self.rows, self.dst_col, self.cols),
            (other.dst_row, other.rows, other.dst_col, other.cols),
        )

    # -- dense copies ---------------------------------------------------------------------

    def src_view(self, src2d: torch.Tensor) -> torch.Tensor:
        return src2d[
            self.src_row : self.src_row + self.rows, self.src_col : self.src_col + self.cols
        ]

    def dst_view(self, dst2d: torch.Tensor) -> torch.Tensor:
        return dst2d[
            self.dst_row : self.dst_row + self.rows, self.dst_col : self.dst_col + self.cols
        ]

    # -- sparse index maps ----------------------------------------------------------------

    def map_sorted(
        self, idx: torch.Tensor, lo: int, hi: int
    ) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """Map the source flat indices in ``idx[lo:hi]`` (those inside :meth:`src_span`).

        Returns ``(dst_indices, positions)``: sorted int64 destination flat indices, and where
        in ``idx`` they came from, as a slice when the selection is one run (full-width source)
        or an int64 tensor otherwise.
        """
        sub = idx[lo:hi]
        if self.src_full_width:
            if self.dst_full_width:
                # One flat range onto another: a constant shift.
                shift = self.dst_row * self.dst_cols - self.src_row * self.src_cols
                return (sub + shift if shift else sub), slice(lo, hi)
            rel = sub - self.src_row * self.src_cols
            r = rel // self.cols
            c = rel - r * self.cols
            dst = (r + self.dst_row) * self.dst_cols + (c + self.dst_col)
            return dst, slice(lo, hi)
        mapped = self.map_columns_native(sub, lo)
        return mapped if mapped is not None else self.map_columns(self.column_basis(sub), lo)

    def _column_shift(self) -> int:
        return (self.dst_row - self.src_row) * self.dst_cols + (self.dst_col - self.src_col)

    def map_columns_native(
        self, sub: torch.Tensor, lo: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`map_columns` of ``column_basis(sub)`` in one C pass over ``sub`` (no basis
        tensors), or None where the kernel cannot take ``sub`` (device or non-int64 indices)."""
        return column_block(
            sub,
            src_cols=self.src_cols,
            cols=(self.src_col, self.src_col + self.cols),
            dst_cols=self.dst_cols,
            shift=self._column_shift(),
            pos_base=lo,
        )

    def column_basis(self, sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-element source column and ``row * dst_cols + col`` for source indices ``sub``.

        Shared by every column block over the same source rows with the same destination width
        (the TP ranks of a row-parallel weight), so it is computed once for all of them.
        """
        r = sub // self.src_cols
        c = sub - r * self.src_cols
        return c, r * self.dst_cols + c

    def map_columns(
        self, basis: tuple[torch.Tensor, torch.Tensor], lo: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`map_sorted` for a block narrower than its source, from a :meth:`column_basis`."""
        c, base = basis
        end = self.src_col + self.cols
        if self.src_col == 0:
            keep = c < end
        elif end == self.src_cols:
            keep = c >= self.src_col
        else:
            keep = (c >= self.src_col) & (c < end)
        pos = torch.nonzero(keep).squeeze(1)
        # index_select, not base[pos]: advanced indexing was ~300x slower on a contended 2-core
        # host (torch 2.13 CPU, 2 threads); index_select is not.
        shift = self._column_shift()
        dst = base.index_select(0, pos)
        if shift:
            dst += shift
        return dst, (pos + lo if lo else pos)


def _rects_overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    ar, an, ac, am = a
    br, bn, bc, bm = b
    if an == 0 or am == 0 or bn == 0 or bm == 0:
        return False
    return ar < br + bn and br < ar + an and ac < bc + bm and bc < ac + am


def gather(values: torch.Tensor, pos: slice | torch.Tensor) -> torch.Tensor:
    """``values`` at positions from :meth:`Block.map_sorted` (a view for a slice)."""
    if isinstance(pos, slice):
        return values[pos]
    return values.index_select(0, pos)


def positions_tensor(pos: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A slice from :meth:`Block.map_sorted` as an int64 index tensor on ``device``."""
    if isinstance(pos, slice):
        return torch.arange(pos.start, pos.stop, dtype=torch.int64, device=device)
    return pos


def find_overlap(rects: list[tuple[int, int, int, int]]) -> tuple[int, int] | None:
    """Indices of two overlapping (row, rows, col, cols) rectangles, or None.

    A sweep over rows, so that thousands of stacked expert blocks cost O(n log n), not O(n^2).
    """
    order = sorted(range(len(rects)), key=lambda i: rects[i][0])
    active: list[int] = []
    for i in order:
        row = rects[i][0]
        active = [a for a in active if rects[a][0] + rects[a][1] > row]
        for a in active:
            if _rects_overlap(rects[a], rects[i]):
                return a, i
        if rects[i][1] and rects[i][3]:
            active.append(i)
    return None


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t`` for bitwise comparison (float ``==`` conflates ±0 and NaNs)."""
    return t.view(_INT_VIEW[t.element_size()])
