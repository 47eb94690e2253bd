"""From where a probe saw elements land to Blocks and one LayoutTable.

A probe (:mod:`~deltasync.layout.probe`) knows, for every element of a receiver parameter, the
canonical tensor and flat index it came from. This module compresses that into
:class:`~deltasync.layout.blocks.Block` maps: first *row runs* (elements of one source row
landing contiguously in one destination row), found with tensor arithmetic over flat
segments (a whole row-major copy is one segment, cut only where a row ends), then rectangles,
by merging runs that continue each other row after row. The result is the decomposition the
hand-written rules use (a full-width row block, a column slice of every row, a stacked expert),
so probed and hand-written tables compare block for block. ``assemble_table`` joins every
shard's blocks into one :class:`~deltasync.layout.table.LayoutTable`.

This module knows blocks, tables and element ids; it does not drive loaders or know models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from deltasync.errors import LayoutError, LayoutProbeError
from deltasync.layout.blocks import Block, numel, view_cols
from deltasync.layout.table import LayoutTable, Placement

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShardProbe:
    """What one shard's loader did with the canonical tensors.

    ``local_shapes``: every parameter the shard holds (storage names, aliases left out);
    ``placements``: canonical name -> ``(local name, Block)`` pieces (canonical tensors this
    shard holds none of, e.g. other EP ranks' experts, are absent); ``aliases``: parameter
    names that are the same storage as another (tied ``lm_head.weight``); ``padding``: per
    local tensor, elements no canonical element landed in.
    """

    local_shapes: dict[str, Shape]
    placements: dict[str, tuple[tuple[str, Block], ...]]
    aliases: dict[str, str] = field(default_factory=dict)
    padding: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    passes: int = 0

    def dropped(self, canonical: Iterable[str]) -> list[str]:
        """Canonical tensors of which this shard holds no element."""
        return [n for n in canonical if n not in self.placements]


@dataclass
class Runs:
    """Row runs of one parameter: contiguous elements of one source row in one dest row."""

    src: list[np.ndarray] = field(default_factory=list)  # canonical ordinal
    src_row: list[np.ndarray] = field(default_factory=list)
    src_col: list[np.ndarray] = field(default_factory=list)
    dst_row: list[np.ndarray] = field(default_factory=list)
    dst_col: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)


def row_runs(
    runs: Runs,
    covered: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    ordinals: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: int,
    chunk: int,
) -> None:
    # Runs never cross a destination row, so row-aligned chunks do not change them.
    step = max(1, chunk // dst_cols) * dst_cols
    for lo in range(0, covered.numel(), step):
        cov = covered[lo : lo + step]
        if bool(cov.all()):  # the common case: no gather, positions are the chunk itself
            gid = ids[lo : lo + step].to(torch.int64)
            _chunk_runs(runs, None, lo, gid, offsets, ordinals, src_cols, dst_cols)
            continue
        pos = torch.nonzero(cov).squeeze(1)
        if pos.numel():
            pos += lo
            gid = ids.index_select(0, pos).to(torch.int64)
            _chunk_runs(runs, pos, lo, gid, offsets, ordinals, src_cols, dst_cols)


def _chunk_runs(
    runs: Runs,
    pos: torch.Tensor | None,
    lo: int,
    gid: torch.Tensor,
    offsets: torch.Tensor,
    ordinals: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: int,
) -> None:
    """Row runs of the covered elements at ``pos`` (None: every element from ``lo``) whose
    element ids are ``gid``."""
    # 1. Flat segments: where destination position and element id both step by one (a whole
    #    row-major copy is one segment), cut where the source tensor changes.
    cut = torch.ones_like(gid, dtype=torch.bool)
    cut[1:] = gid[1:] != gid[:-1] + 1
    if pos is not None:
        cut[1:] |= pos[1:] != pos[:-1] + 1
    starts = torch.nonzero(cut).squeeze(1)
    ends = torch.cat([starts[1:], torch.tensor([gid.numel()])])
    seg_pos = starts + lo if pos is None else pos.index_select(0, starts)
    seg_gid = gid.index_select(0, starts)
    seg_len = ends - starts
    t = torch.searchsorted(offsets, seg_gid, right=True) - 1
    t_last = torch.searchsorted(offsets, seg_gid + seg_len - 1, right=True) - 1
    if bool((t != t_last).any()):  # a segment running from one tensor into the next
        p_l, g_l, n_l = [], [], []
        for p0, g0, n0, a, z in zip(
            seg_pos.tolist(),
            seg_gid.tolist(),
            seg_len.tolist(),
            t.tolist(),
            t_last.tolist(),
            strict=True,
        ):
            while a < z:
                k = int(offsets[a + 1]) - g0
                p_l.append(p0), g_l.append(g0), n_l.append(k)
                p0, g0, n0, a = p0 + k, g0 + k, n0 - k, a + 1
            p_l.append(p0), g_l.append(g0), n_l.append(n0)
        seg_pos, seg_gid, seg_len = (torch.tensor(x, dtype=torch.int64) for x in (p_l, g_l, n_l))
        t = torch.searchsorted(offsets, seg_gid, right=True) - 1
    f = seg_gid - offsets.index_select(0, t)
    cs = src_cols.index_select(0, t)
    sp, sf, sn = seg_pos.numpy(), f.numpy(), seg_len.numpy()
    st, scs = t.numpy(), cs.numpy()
    # 2. Row runs: a segment breaks where a destination row or a source row ends.
    d_room = dst_cols - sp % dst_cols
    s_room = scs - sf % scs
    one = (sn <= d_room) & (sn <= s_room)  # the common case: the segment is one run already
    parts = [(sp[one], sf[one], sn[one], st[one], scs[one])]
    for i in np.flatnonzero(~one).tolist():
        p0, f0, n0, c = int(sp[i]), int(sf[i]), int(sn[i]), int(scs[i])
        d_cuts = np.arange((-p0) % dst_cols or dst_cols, n0, dst_cols)
        s_cuts = np.arange((-f0) % c or c, n0, c)
        rel = np.concatenate([[0], np.union1d(d_cuts, s_cuts)]).astype(np.int64)
        lens = np.diff(np.append(rel, n0))
        parts.append((p0 + rel, f0 + rel, lens, np.full(len(rel), st[i]), np.full(len(rel), c)))
    p_all, f_all, n_all, t_all, c_all = (np.concatenate([x[j] for x in parts]) for j in range(5))
    s_row = f_all // c_all
    d_row = p_all // dst_cols
    runs.src.append(ordinals.numpy()[t_all])
    runs.src_row.append(s_row)
    runs.src_col.append(f_all - s_row * c_all)
    runs.dst_row.append(d_row)
    runs.dst_col.append(p_all - d_row * dst_cols)
    runs.length.append(n_all)


def merge_runs(
    runs: Runs, names: list[str], canonical: Mapping[str, Shape], dst_shape: Shape
) -> dict[str, list[Block]]:
    """Merge row runs that continue each other row after row into rectangles."""
    if not runs.src:
        return {}
    src, s_row, s_col, d_row, d_col, ln = (
        np.concatenate(getattr(runs, a))
        for a in ("src", "src_row", "src_col", "dst_row", "dst_col", "length")
    )
    order = np.lexsort((d_row, ln, s_col, d_col, src))
    src, s_row, s_col, d_row, d_col, ln = (a[order] for a in (src, s_row, s_col, d_row, d_col, ln))
    new = np.ones(len(src), dtype=bool)
    new[1:] = (
        (src[1:] != src[:-1])
        | (d_col[1:] != d_col[:-1])
        | (s_col[1:] != s_col[:-1])
        | (ln[1:] != ln[:-1])
        | (d_row[1:] != d_row[:-1] + 1)
        | (s_row[1:] != s_row[:-1] + 1)
    )
    starts = np.flatnonzero(new)
    rows = np.diff(np.append(starts, len(src)))
    dcols = view_cols(dst_shape)
    out: dict[str, list[Block]] = {}
    for i, r in zip(starts.tolist(), rows.tolist(), strict=True):
        name = names[int(src[i])]
        out.setdefault(name, []).append(
            Block(
                src_cols=view_cols(canonical[name]),
                dst_cols=dcols,
                src_row=int(s_row[i]),
                dst_row=int(d_row[i]),
                rows=int(r),
                src_col=int(s_col[i]),
                dst_col=int(d_col[i]),
                cols=int(ln[i]),
            )
        )
    return out


def assemble_table(canonical: Mapping[str, Shape], probes: Mapping[str, ShardProbe]) -> LayoutTable:
    """One table from every distinct shard's probe.

    Args:
        canonical: checkpoint tensor names and shapes (the table's sources).
        probes: ``{shard id: ShardProbe}``, one per distinct shard.

    Returns:
        A validated :class:`LayoutTable`.

    Raises:
        LayoutProbeError: a canonical tensor (or part of one) is held by no shard.
    """
    placements: dict[str, list[Placement]] = {}
    for sid, pr in probes.items():
        for name, pieces in pr.placements.items():
            if name not in canonical:
                raise LayoutError(f"shard {sid!r} places unknown tensor {name!r}")
            placements.setdefault(name, []).extend(Placement(sid, loc, b) for loc, b in pieces)
    missing = {n: "no shard holds any of its elements" for n in canonical if n not in placements}
    for name, pls in placements.items():
        rects = {p.block.src_rect(): p.block.size for p in pls}
        if sum(rects.values()) < numel(canonical[name]):
            missing[name] = (
                f"the shards hold {sum(rects.values())} of its {numel(canonical[name])} elements"
            )
    if missing:
        raise LayoutProbeError(
            "the engine's loaders drop checkpoint elements (an element no receiver shard "
            "holds could never be synced): "
            + "; ".join(f"{n}: {why}" for n, why in list(missing.items())[:8])
            + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""),
            missing,
        )
    return LayoutTable(
        src_shapes=canonical,
        dst_shapes={sid: pr.local_shapes for sid, pr in probes.items()},
        placements={n: placements[n] for n in canonical},
        aliases={sid: pr.aliases for sid, pr in probes.items() if pr.aliases},
    )
