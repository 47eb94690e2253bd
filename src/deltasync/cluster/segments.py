"""A writer's blobs of one captured version, built batch by batch: nothing O(changed) but the
compressed blobs and the captured positions lives at once.

Routing every captured position at once holds, next to the positions, every changed element's
canonical pair (int64 index + BF16 value) and again each receiver shard's (about 20 bytes per
element: at 0.6B and a few percent changed, a sizeable share of the BF16 model). Here the
parameters are taken in batches: each batch's positions are decoded, its values read from the
params, routed to every shard and written as one segment of that shard's blob
(:class:`~deltasync.format.BlobWriter`), and dropped before the next batch. A receiver local
tensor may be fed by several parameters (vLLM's fused ``qkv_proj``, ``gate_up_proj``, stacked
experts) and may appear in one segment only, so a batch never ends inside such a set: it
closes only after the last changed parameter that feeds any local tensor it feeds
(:func:`closing_points`). Batches gather at least ``batch_elements`` changed elements (fewer,
larger zstd frames) unless the version ends first. A parameter that splits into row pieces
whose receiver tensors no other piece writes (the vocab-parallel embedding,
:func:`~deltasync.layout.routing.row_pieces`) is routed piece by piece, one segment each, so
only one piece's indices ever exist.

The bytes differ from a one-segment blob of the same updates; what a receiver decodes from
them is the same (tests pin both).

This module knows layouts, routing and the blob writer; nothing about envelopes, process
groups or trackers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from deltasync.cluster.capture import route_positions
from deltasync.errors import ConfigError
from deltasync.format import BlobWriter
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.groups import param_groups
from deltasync.layout.routing import ShardUpdates, check_param, piece_updates, row_pieces
from deltasync.native.ops import bf16_at
from deltasync.trainer.positions import Positions

BATCH_ELEMENTS = 1 << 18  # changed elements per segment, at least (~5 MiB of transients)


def closing_points(
    names: Sequence[str], *, trainer_layout: TrainerLayout, receiver_layout: ReceiverLayout
) -> list[int]:
    """Per position ``i`` of ``names``: the last position whose parameter feeds a local tensor
    that one of ``names[:i+1]`` still feeds. A batch ``names[a:b]`` may close at ``b`` only
    when ``closing_points(...)[b - 1] < b``: the batch is then a union of whole parameter
    groups (:func:`~deltasync.layout.groups.param_groups`, the grouping the store path routes
    by). A name outside the layout feeds nothing (routing raises its error)."""
    groups = param_groups(names, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    last_of = {name: group.last for group in groups for name in group.params}
    out, reach = [], -1
    for i, name in enumerate(names):
        reach = max(reach, i, last_of[name])
        out.append(reach)
    return out


def _piece_updates(
    name: str,
    positions: Positions,
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    world_size: int,
) -> Iterator[ShardUpdates] | None:
    """``name``'s updates piece by piece (None when it is not routed in row pieces)."""
    if name not in params:
        return None
    pieces = row_pieces(
        name, trainer_layout=trainer_layout, receiver_layout=receiver_layout, world_size=world_size
    )
    if pieces is None:
        return None
    local = check_param(name, params[name])
    local = local.to_local() if hasattr(local, "to_local") else local

    def gen() -> Iterator[ShardUpdates]:
        bounds = [p.start for p in pieces] + [pieces[-1].stop]
        seen = 0
        for piece, idx in zip(pieces, positions.ranges(bounds), strict=True):
            seen += idx.numel()
            if idx.numel():
                vals = bf16_at(local, idx, trusted=True)  # inside [0, numel): ranges() clips
                yield piece_updates(name, piece, idx, vals, receiver_layout=receiver_layout)
        if seen != len(positions):
            raise ConfigError(
                f"{len(positions) - seen} changed position(s) of {name!r} lie outside its "
                f"{pieces[-1].stop} elements (are the indices local to this rank?)"
            )

    return gen()


def streamed_blobs(
    positions: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    shards: Sequence[str],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    version: int,
    base_version: int,
    writer: str,
    rank: int = 0,
    world_size: int = 1,
    level: int = 1,
    batch_elements: int = BATCH_ELEMENTS,
) -> tuple[dict[str, list[bytes]], dict[str, int]]:
    """Every shard's blob of the captured ``positions``, values read from ``params`` now.

    Args:
        positions: per param, what this writer sends (a capture joined with its carry).
        params: this writer's parameters (the values at the positions are read here).
        shards: every receiver shard (each gets a blob, empty ones included).
        batch_elements: changed elements gathered per batch before it is routed.

    Returns:
        ``({shard: the blob's pieces in order}, {shard: elements routed to it})``: the pieces
        are framed without joining them first (``pack_envelope`` takes a list).
    """
    names = [n for n in params if n in positions]
    names += [n for n in positions if n not in params]  # routing names the error
    reach = closing_points(names, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    chunks: dict[str, list[bytes]] = {s: [] for s in shards}
    writers = {
        s: BlobWriter(
            chunks[s].append,
            version=version,
            base_version=base_version,
            shard=s,
            writer=writer,
            level=level,
        )
        for s in shards
    }
    elements = dict.fromkeys(shards, 0)
    batch: dict[str, Positions] = {}
    size = 0

    def write(updates: ShardUpdates) -> None:
        for shard, ups in updates.items():
            writers[shard].segment(ups)
            elements[shard] += sum(u.nnz for u in ups)

    layouts = {"trainer_layout": trainer_layout, "receiver_layout": receiver_layout}
    for i, name in enumerate(names):
        # feeds tensors no other changed param feeds: the batch so far may close before it
        alone = reach[i] == i and (i == 0 or reach[i - 1] < i)
        pieces = None
        if alone and len(positions[name]) >= batch_elements:
            pieces = _piece_updates(name, positions[name], params, **layouts, world_size=world_size)
        if pieces is not None:
            if batch:
                write(route_positions(batch, params, **layouts, rank=rank, world_size=world_size))
                batch, size = {}, 0
            for updates in pieces:
                write(updates)
                del updates  # this piece's pairs: gone before the next piece
            continue
        batch[name] = positions[name]
        size += len(positions[name])
        if reach[i] > i or (size < batch_elements and i + 1 < len(names)):
            continue
        write(route_positions(batch, params, **layouts, rank=rank, world_size=world_size))
        batch, size = {}, 0  # this batch's canonical and shard pairs are gone with it
    for s in shards:
        writers[s].finish()
    return chunks, elements
