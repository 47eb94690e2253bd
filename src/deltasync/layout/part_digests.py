"""Writer part digests: with several FSDP writers, each writer digests the part of every
receiver shard it owns, and each receiver hashes the same parts of its live tensors, so that a
shard's state is checked without any rank holding the full model.

A writer's *part* of a receiver shard is every rectangle of every local tensor whose source
elements live in the writer's FSDP dim-0 rows. The pieces are derived from metadata alone (the
model's HF table: canonical tensor -> trainer parameter; the receiver layout: canonical tensor
-> local tensors; the writer count), identically on every rank, once per sender or receiver:

    piece = (shard, local tensor, rectangle of its 2-D view, parameter, rectangle of its 2-D view)

Every map between them is a shift, so element (i, j) of the local rectangle is element (i, j) of
the parameter rectangle. The part digest of (writer, shard) is one xxh3-128 stream over the BF16
bytes of the writer's pieces of that shard in a fixed order (local tensor order, then rectangle
start), each rectangle in row-major order: the writer feeds its fp32 masters cast to BF16 a few
MiB of rows at a time; a receiver feeds its local rectangles (full-width ones in place), or,
to verify before it writes, the rectangles as they WILL be after a chain of updates
(:func:`chain_part_digests`: a chunk of rows with updated elements is copied, patched and
hashed; never a copy of the shard).

Both paths use them: the in-cluster path as a transit check per writer, the storage path
through the *parts digest* a manifest lists for a multi-writer version published without the
full state (:func:`deltasync.layout.digest.parts_digest` over the W part digests). Elements no
writer owns (vLLM's vocabulary padding) are in no part; an anchor writes them zero and deltas
never touch them. So a receiver's check also proves them zero (bit patterns) in the state it
checks: the rectangles no piece covers are derived from the pieces (:func:`unowned_rects`), and
a nonzero element there makes every part digest of the shard one that cannot match (the stream
digest extended by the names of the tensors concerned), with a warning naming them: the
callers' mismatch paths (refused before any write, marked dirty) then apply unchanged.

This module knows tables, blocks and bytes; it knows nothing about processes, envelopes,
stores or manifests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch
import xxhash

from deltasync.format import TensorUpdate
from deltasync.format.merge import TensorPieces
from deltasync.format.updates import SparsePiece
from deltasync.layout.blocks import as_2d, view_cols, view_rows
from deltasync.layout.hf_model import build_hf_table
from deltasync.layout.receiver_layout import ReceiverLayout
from deltasync.layout.trainer_layout import TrainerLayout, fsdp_dim0_rows

_CAST_ELEMENTS = 1 << 21  # elements per cast chunk: ~4 MiB of BF16
_ROW_ELEMENTS = 1 << 21  # elements per row chunk of a part digest after a chain: ~4 MiB of BF16
# An integer dtype of each element size: "zero" is the bit pattern (-0.0 is not an anchor's 0)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

log = logging.getLogger(__name__)

Rect = tuple[int, int, int, int]  # (row, col, rows, cols) of a local tensor's 2-D view


@dataclass(frozen=True)
class Piece:
    """One rectangle: ``rows x cols`` at (``local_row``, ``local_col``) of local tensor ``local``
    of shard ``shard``, holding the same rectangle at (``param_row``, ``param_col``) of the FULL
    parameter ``param`` (2-D views)."""

    shard: str
    local: str
    local_row: int
    local_col: int
    rows: int
    cols: int
    param: str
    param_row: int
    param_col: int


def _owned_rows(shape: tuple[int, ...], index: int, count: int) -> tuple[int, int]:
    """Rows of the parameter's 2-D view in FSDP dim-0 shard ``index`` of ``count``."""
    start, stop = fsdp_dim0_rows(shape[0], index, count)
    per = view_rows(shape) // shape[0] if shape[0] else 0
    return start * per, stop * per


def _overlap(a0: int, an: int, b0: int, bn: int) -> tuple[int, int]:
    lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
    return lo, max(0, hi - lo)


def parts_param_shapes(layout: ReceiverLayout) -> dict[str, tuple[int, ...]]:
    """The trainer parameters (full shapes) part digests are defined over: the transformers
    model's (``hf_model``), which a writer's params must be dim-0 shards of."""
    hf = build_hf_table(layout.spec)
    (hf_shard,) = hf.dst_shapes
    return {n: tuple(s) for n, s in hf.dst_shapes[hf_shard].items()}


def writer_pieces(layout: ReceiverLayout, index: int, count: int) -> dict[str, list[Piece]]:
    """``{shard: [Piece]}`` of writer ``index`` of ``count``, in digest order."""
    return _pieces(layout, index, count)


@lru_cache(maxsize=64)
def _pieces(layout: ReceiverLayout, index: int, count: int) -> dict[str, list[Piece]]:
    hf = build_hf_table(layout.spec)  # canonical -> trainer parameters (one shard)
    (hf_shard,) = hf.dst_shapes
    params = hf.dst_shapes[hf_shard]
    out: dict[str, list[Piece]] = {s.id: [] for s in layout.shards()}
    for canon, hf_pls in hf.placements.items():
        for hp in hf_pls:
            hb = hp.block
            o0, o1 = _owned_rows(tuple(params[hp.local]), index, count)
            # canonical rows of this block whose parameter rows this writer owns
            prow, prows = _overlap(hb.dst_row, hb.rows, o0, o1 - o0)
            if not prows or not hb.cols:
                continue
            crow = hb.src_row + (prow - hb.dst_row)
            for rp in layout.table.placements[canon]:
                rb = rp.block
                r0, nr = _overlap(crow, prows, rb.src_row, rb.rows)
                c0, nc = _overlap(hb.src_col, hb.cols, rb.src_col, rb.cols)
                if not nr or not nc:
                    continue
                out[rp.shard].append(
                    Piece(
                        shard=rp.shard,
                        local=rp.local,
                        local_row=rb.dst_row + (r0 - rb.src_row),
                        local_col=rb.dst_col + (c0 - rb.src_col),
                        rows=nr,
                        cols=nc,
                        param=hp.local,
                        param_row=hb.dst_row + (r0 - hb.src_row),
                        param_col=hb.dst_col + (c0 - hb.src_col),
                    )
                )
    for shard, pieces in out.items():
        pieces.sort(key=lambda p: (layout.local_position(shard, p.local), p.local_row, p.local_col))
    return out


def feed_bf16(h: xxhash.xxh3_128, block: torch.Tensor) -> None:
    """Feed a 2-D block's BF16 bytes in row-major order, a few MiB of rows at a time."""
    if block.numel() == 0:
        return
    step = max(1, _CAST_ELEMENTS // max(1, block.shape[1]))
    for r in range(0, block.shape[0], step):
        piece = block[r : r + step]
        if piece.dtype != torch.bfloat16:
            piece = piece.to(torch.bfloat16)
        if piece.device.type != "cpu":
            piece = piece.cpu()
        piece = piece if piece.is_contiguous() else piece.contiguous()
        h.update(memoryview(piece.reshape(-1).view(torch.uint8).numpy()))


def _digest(pieces: list[Piece], feed_piece: Callable[[xxhash.xxh3_128, Piece], None]) -> str:
    h = xxhash.xxh3_128()
    for p in pieces:
        feed_piece(h, p)
    return h.hexdigest()


def writer_part_digests(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    index: int,
    count: int,
) -> dict[str, str]:
    """``{shard: part digest}`` of writer ``index`` of ``count`` from its local dim-0 shards.

    Args:
        params: this writer's parameters (FSDP dim-0 shards, fp32 masters or BF16).
        trainer_layout: the trainer's layout (its model config must be the receivers').
        receiver_layout: the receivers' layout.
        index: this writer's FSDP shard index; count: the number of writers.

    Returns:
        What :func:`receiver_part_digests` computes from the receivers' tensors after an exact
        apply.
    """
    del trainer_layout  # the HF table of the shared model config is the trainer's own map
    hf = build_hf_table(receiver_layout.spec)
    (hf_shard,) = hf.dst_shapes
    full_shapes = hf.dst_shapes[hf_shard]
    views: dict[str, tuple[torch.Tensor, int]] = {}

    def rect(p: Piece) -> torch.Tensor:
        if p.param not in views:
            first = _owned_rows(tuple(full_shapes[p.param]), index, count)[0]
            views[p.param] = (as_2d(params[p.param].detach()), first)
        view, first = views[p.param]
        row = p.param_row - first
        return view[row : row + p.rows, p.param_col : p.param_col + p.cols]

    pieces = writer_pieces(receiver_layout, index, count)
    return {
        shard: _digest(pieces[shard], lambda h, p: feed_bf16(h, rect(p)))
        for shard in sorted(pieces)
    }


def receiver_part_digests(
    tensors: Mapping[str, torch.Tensor],
    *,
    layout: ReceiverLayout,
    shard: str,
    count: int,
    updates: Iterable[TensorUpdate] = (),
) -> dict[int, str]:
    """``{writer index: part digest}`` of receiver shard ``shard`` from its live tensors, or,
    given ``updates`` (at most one per tensor, a folded version), of the tensors as they will be
    after ``apply_updates(updates, tensors)``, without writing them (verify before write). An
    element no writer owns that is nonzero in that state makes every digest one that cannot
    match (see the module docstring).

    Args:
        tensors: the live local tensors (read only).
        layout: the receivers' layout; shard: this receiver's shard; count: the writers.
        updates: the version about to be applied (none: the tensors as they are).

    Returns:
        What :func:`writer_part_digests` gives each writer for ``shard`` when the state is exact.
    """
    views = {n: as_2d(t.detach()) for n, t in tensors.items()}
    sparse: dict[str, Sparse] = {}
    for u in updates:
        if not u.nnz:
            continue
        if u.indices is None:  # dense: the values are the whole new tensor
            views[u.name] = as_2d(u.values.reshape(tuple(u.shape)))
        else:
            sparse[u.name] = [u]

    def feed_piece(h: xxhash.xxh3_128, p: Piece) -> None:
        _feed_rows(h, views[p.local], p, sparse.get(p.local, []))

    digests = {k: _digest(writer_pieces(layout, k, count)[shard], feed_piece) for k in range(count)}
    nonzero = [
        name
        for name, rects in unowned_rects(layout, shard, count).items()
        if name in views
        and any(
            _any_bits(block)
            for r, c, n, w in rects
            for block in _blocks_after(views[name], r, c, n, w, sparse.get(name, []))
        )
    ]
    what = "the tensors as they will be after the update" if updates else "the live tensors"
    return _poisoned(digests, shard, nonzero, what)


def iter_pieces(layout: ReceiverLayout, count: int) -> Iterator[Piece]:
    """Every writer's pieces (tests check they tile each shard exactly once)."""
    for k in range(count):
        for pieces in writer_pieces(layout, k, count).values():
            yield from pieces


@lru_cache(maxsize=64)
def unowned_rects(layout: ReceiverLayout, shard: str, count: int) -> dict[str, tuple[Rect, ...]]:
    """``{local tensor: rectangles}`` of ``shard`` that no piece of any of ``count`` writers
    covers (vLLM's vocabulary padding), in the shard's tensor order; tensors fully covered are
    left out. The complement of the pieces, which tile what the writers own exactly once."""
    owned: dict[str, list[Rect]] = {}
    for k in range(count):
        for p in _pieces(layout, k, count)[shard]:
            owned.setdefault(p.local, []).append((p.local_row, p.local_col, p.rows, p.cols))
    out: dict[str, tuple[Rect, ...]] = {}
    for name, spec in layout.local_specs(shard).items():
        shape = tuple(spec.shape)
        gaps = _complement(owned.get(name, []), view_rows(shape), view_cols(shape))
        if gaps:
            out[name] = tuple(gaps)
    return out


def _complement(rects: list[Rect], rows: int, cols: int) -> list[Rect]:
    """The rectangles of a ``rows x cols`` grid that none of ``rects`` (disjoint) covers: per
    band of rows between rectangle edges, the column gaps; a gap continuing the same columns
    of the band above extends that rectangle. A sweep over the rows (the rectangles covering
    a band are the few that started and have not ended: thousands of expert pieces stay
    cheap)."""
    starts = sorted((r, c, c + w, r + n) for r, c, n, w in rects if n and w)
    edges = sorted({0, rows, *(r for r, _, _, _ in starts), *(e for _, _, _, e in starts)})
    out: list[Rect] = []
    open_at: dict[tuple[int, int], int] = {}  # (col, cols) -> index in out, ending at the band
    active: list[tuple[int, int, int]] = []  # (col, col end, row end) covering the band
    nxt = 0
    for lo, hi in pairwise(edges):
        active = [a for a in active if a[2] > lo]
        while nxt < len(starts) and starts[nxt][0] <= lo:
            active.append(starts[nxt][1:])
            nxt += 1
        gaps, at = [], 0
        for c0, c1, _ in sorted(active):
            if c0 > at:
                gaps.append((at, c0 - at))
            at = max(at, c1)
        if at < cols:
            gaps.append((at, cols - at))
        still: dict[tuple[int, int], int] = {}
        for gap in gaps:
            i = open_at.get(gap)
            if i is not None and out[i][0] + out[i][2] == lo:
                out[i] = (out[i][0], gap[0], out[i][2] + hi - lo, gap[1])
            else:
                i = len(out)
                out.append((lo, gap[0], hi - lo, gap[1]))
            still[gap] = i
        open_at = still
    return out


def _any_bits(block: torch.Tensor) -> bool:
    """Whether any element of ``block`` has a nonzero bit pattern (any strides, any device)."""
    return block.numel() > 0 and bool(block.view(_INT_OF_SIZE[block.element_size()]).any())


def _poisoned(digests: dict[int, str], shard: str, nonzero: list[str], what: str) -> dict[int, str]:
    """``digests`` as they are, or, when elements no writer owns are nonzero in the tensors
    ``nonzero``, digests no writer's can equal (a writer digests none of those elements, so an
    exact state has them zero): each extended by those names, so that every check of the state
    fails the way a mismatch does; a warning names them."""
    if not nonzero:
        return digests
    log.warning(
        "shard %r: %s hold nonzero elements in no writer's part (padding, e.g. vLLM's "
        "vocabulary padding) in %s; those elements must be zero (an anchor writes them zero, "
        "deltas never touch them), so this state does not match its parts digest",
        shard,
        what,
        ", ".join(repr(n) for n in nonzero),
    )
    mark = ("nonzero padding: " + ",".join(sorted(nonzero))).encode()
    return {k: xxhash.xxh3_128(bytes.fromhex(d) + mark).hexdigest() for k, d in digests.items()}


def chain_part_digests(
    tensors: Mapping[str, torch.Tensor],
    chain: Iterable[TensorPieces],
    *,
    listed: Collection[str],
    layout: ReceiverLayout,
    shard: str,
    count: int,
    again: Callable[[], Iterable[TensorPieces]] | None = None,
    max_held: int = 0,
) -> dict[int, str]:
    """``{writer index: part digest}`` of ``shard`` as it will be after ``apply_pieces`` of
    every item of ``chain`` (``format.iter_chain``: at most one per tensor), consuming it one
    tensor at a time; ``tensors`` are not written.

    A part digest is one stream over the writer's pieces in the shard's tensor order, so the
    tensors are hashed in that order: a tensor the chain does not list (``listed``: every
    name it lists, from the record headers) is hashed from its live values when its turn
    comes, a listed one when its pieces arrive. One that arrives before its turn (the chain
    lists tensors in the trainer's parameter order, e.g. ``lm_head`` last where a vLLM shard
    holds it second) is held until then; given ``again`` (the same chain read afresh), only
    while the held pieces list at most ``max_held`` elements: the rest are dropped and read
    again in another pass (each pass hashes at least the next tensor in turn), so the memory
    stays bounded at the cost of reading the chain again. ``chain`` is always read to its end
    first (its checks then have run).

    Returns:
        What :func:`receiver_part_digests` gives after the writes (digests that cannot match
        where an element no writer owns will be nonzero).
    """
    order = sorted(layout.local_specs(shard), key=lambda n: layout.local_position(shard, n))
    position = {name: i for i, name in enumerate(order)}
    by_tensor: list[dict[str, list[Piece]]] = []
    for k in range(count):
        mine: dict[str, list[Piece]] = {}
        for p in writer_pieces(layout, k, count)[shard]:  # digest order within a tensor too
            mine.setdefault(p.local, []).append(p)
        by_tensor.append(mine)
    hashers = [xxhash.xxh3_128() for _ in range(count)]
    unowned = unowned_rects(layout, shard, count)
    nonzero: list[str] = []  # tensors with a nonzero element no writer owns, after the chain
    arrived: dict[str, TensorPieces] = {}
    held = 0  # elements the held items' pieces list
    at = 0

    def advance() -> None:
        nonlocal at, held
        while at < len(order):
            name = order[at]
            item = arrived.pop(name, None)
            if item is None and name in listed:
                return  # its pieces have not been read yet
            if item is not None:
                held -= item.nnz
            base, sparse = _after(as_2d(tensors[name].detach()), item)
            for k in range(count):
                for p in by_tensor[k].get(name, ()):
                    _feed_rows(hashers[k], base, p, sparse)
            if any(
                _any_bits(block)
                for r, c, n, w in unowned.get(name, ())
                for block in _blocks_after(base, r, c, n, w, sparse)
            ):
                nonzero.append(name)
            at += 1

    source = chain
    while True:
        began = at
        for item in source:
            turn = position[item.name]
            if turn < at or item.name in arrived:
                continue  # hashed, or held, in an earlier pass
            if turn > at and again is not None and held + item.nnz > max_held:
                continue  # ahead of its turn and over the budget: read again later
            arrived[item.name] = item
            held += item.nnz
            advance()
        advance()
        if at == len(order) or again is None or at == began:
            break  # done; or a pass that hashed nothing (the chain lacks a listed tensor)
        source = again()
    assert at == len(order) and not arrived, (at, list(arrived))
    digests = {k: h.hexdigest() for k, h in enumerate(hashers)}
    return _poisoned(digests, shard, nonzero, "the tensors as they will be after the chain")


# A tensor's sparse pieces in chain order, read a row chunk's share at a time (``locate``,
# ``span``: a TensorUpdate, or a piece parked in a file)
Sparse = list[SparsePiece]


def _after(live: torch.Tensor, item: TensorPieces | None) -> tuple[torch.Tensor, Sparse]:
    """A tensor (2-D view) as it will be: the base its pieces start from (the live values,
    the last dense piece's values, or zeros for an anchor) and the sparse pieces on top."""
    if item is None:
        return live, []
    pieces = item.pieces[item.start() :]
    if pieces and pieces[0].is_dense:
        base = as_2d(pieces[0].values.reshape(item.shape))
        pieces = pieces[1:]
    elif item.from_zero:  # an anchor: elements it does not list are zero (no buffer)
        base = torch.zeros((), dtype=item.dtype).expand(live.shape)
    else:
        base = live
    return base, [p for p in pieces if p.nnz]


def _feed_rows(h: xxhash.xxh3_128, base: torch.Tensor, p: Piece, sparse: Sparse) -> None:
    """Feed piece ``p`` of ``base`` (2-D) with ``sparse`` written on top (see
    :func:`_blocks_after`). (xxh3 fed in pieces equals xxh3 of the whole, so the chunking is
    free.)"""
    for block in _blocks_after(base, p.local_row, p.local_col, p.rows, p.cols, sparse):
        feed_bf16(h, block)


def _blocks_after(
    base: torch.Tensor, row: int, col: int, rows: int, cols: int, sparse: Sparse
) -> Iterator[torch.Tensor]:
    """The rectangle ``rows x cols`` at (``row``, ``col``) of ``base`` (2-D) with ``sparse``
    written on top, a few MiB of rows at a time: rows nothing touches are views of ``base``
    as they are; touched rows are copied whole into a scratch chunk, patched there by flat
    index (``index_copy_``: an anchor patches every element) and the rectangle's columns of
    it given. ``base`` is never written; each piece's elements are read a chunk of rows'
    share at a time (a piece parked in a file never whole)."""
    width = base.shape[1]
    step = max(1, _ROW_ELEMENTS // max(1, width))
    stop = row + rows
    span = slice(col, col + cols)
    firsts = range(row, stop, step)
    bounds = []
    if sparse:
        starts = torch.tensor([r * width for r in firsts] + [stop * width], dtype=torch.int64)
        bounds = [p.locate(starts) for p in sparse]
    for i, r0 in enumerate(firsts):
        r1 = min(stop, r0 + step)
        hits = [
            p.span(b[i], b[i + 1]) for p, b in zip(sparse, bounds, strict=True) if b[i + 1] > b[i]
        ]
        if not hits:
            yield base[r0:r1, span]  # nothing written in these rows
            continue
        chunk = torch.empty((r1 - r0, width), dtype=base.dtype)
        chunk.copy_(base[r0:r1])  # a copy, never the live bits (also from a device)
        flat = chunk.view(-1)
        for idx, vals in hits:
            flat.index_copy_(0, idx.to(torch.int64) - r0 * width, vals)
        yield chunk[:, span]
