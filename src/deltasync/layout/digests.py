"""Receiver-shard state digests straight from canonical tensors, without building the shards.

``shard_state_digests(table, full)`` equals ``{s: state_digest(split_dense(table, full)[s])}``
(the digest the manifest lists and a receiver recomputes from its live tensors), but feeds the
hash with the canonical bytes each local tensor is made of, in local row-major order: row
blocks are hashed in place, vocabulary padding as zero bytes, and only blocks that are column
slices of their source (row-parallel ``o_proj``/``down_proj``) are copied, one at a time. So the
publisher's per-version digest pass costs one read of the BF16 state instead of a full split.

This module knows tables, blocks and the digest definition; it knows nothing about stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from deltasync.layout.blocks import Block, view_cols, view_rows
from deltasync.layout.table import LayoutTable
from deltasync.manifest.digest import combine_digests, tensor_digest

_ZEROS = bytes(1 << 20)
_CAST_ELEMENTS = 1 << 21  # rows per cast chunk: ~4 MiB of BF16


def _feed_zeros(h: xxhash.xxh3_128, n: int) -> None:
    while n > 0:
        k = min(n, len(_ZEROS))
        h.update(_ZEROS[:k] if k < len(_ZEROS) else _ZEROS)
        n -= k


def _feed(h: xxhash.xxh3_128, t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if t.device.type != "cpu":
        t = t.cpu()
    t = t if t.is_contiguous() else t.contiguous()  # a column slice: one block's copy
    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _feed_cast(h: xxhash.xxh3_128, block: torch.Tensor, dtype: torch.dtype) -> None:
    """Feed a 2-D block, cast to ``dtype`` a few MiB of rows at a time (never a whole copy of a
    large source such as the embedding: the digest pass must not cost model-sized memory)."""
    if block.dtype == dtype:
        _feed(h, block)
        return
    step = max(1, _CAST_ELEMENTS // max(1, block.shape[1]))
    for r in range(0, block.shape[0], step):
        _feed(h, block[r : r + step].to(dtype))


def _as2d(t: torch.Tensor) -> torch.Tensor:
    shape = tuple(t.shape)
    return t.reshape(view_rows(shape), view_cols(shape))


def shard_state_digests(table: LayoutTable, full: Mapping[str, torch.Tensor],
                        shards: Iterable[str] | None = None, *,
                        dtype: torch.dtype | None = None) -> dict[str, str]:
    """``{shard: state digest}`` of the shards ``split_dense(table, full)`` would build.

    With ``dtype`` (e.g. bf16 while ``full`` holds fp32 master weights) each block is cast a
    few MiB of rows at a time as it is hashed, so the pass never holds a cast copy of a whole
    tensor (replicated blocks are cast once per shard that holds them; they are small).
    """
    wanted = set(table.dst_shapes) if shards is None else set(shards)
    by_dst: dict[tuple[str, str], list[tuple[str, Block]]] = {}
    for name, pls in table.placements.items():
        for p in pls:
            if p.shard in wanted and p.block.size:
                by_dst.setdefault((p.shard, p.local), []).append((name, p.block))
    first = next(iter(full.values()))
    dtype = dtype or first.dtype
    esize = torch.empty(0, dtype=dtype).element_size()
    dtype_s = str(dtype).removeprefix("torch.")
    locals_in_order: dict[str, None] = {}
    for shard in sorted(wanted):
        for local in table.dst_shapes[shard]:
            locals_in_order[local] = None
    entries: dict[str, list] = {s: [] for s in wanted}
    for local in locals_in_order:
        for shard in sorted(wanted):
            shape = table.dst_shapes[shard].get(local)
            if shape is None:
                continue
            blocks = sorted(by_dst.get((shard, local), []), key=lambda nb: nb[1].dst_row)
            rows, cols = view_rows(shape), view_cols(shape)
            if all(b.dst_full_width for _, b in blocks):
                h = xxhash.xxh3_128()
                cursor = 0
                for src, b in blocks:
                    _feed_zeros(h, (b.dst_row - cursor) * cols * esize)  # uncovered rows: zero
                    _feed_cast(h, b.src_view(_as2d(full[src])), dtype)
                    cursor = b.dst_row + b.rows
                _feed_zeros(h, (rows - cursor) * cols * esize)
                digest = h.digest()
            else:  # blocks side by side within a row: build this one tensor
                t = torch.zeros(shape, dtype=dtype)
                for src, b in blocks:
                    b.dst_view(_as2d(t)).copy_(b.src_view(_as2d(full[src])))
                digest = tensor_digest(t)
            entries[shard].append((local, dtype_s, tuple(shape), digest))
    return {s: combine_digests(entries[s]) for s in sorted(wanted)}
