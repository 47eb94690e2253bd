"""The one shard-state digest: of a tensor, of a receiver shard's state, and of the shards a
layout builds from canonical (or trainer) tensors without building them.

xxh3-128 (fast, non-cryptographic: it detects corruption and drift; authenticity comes from
signing the manifest that lists it). The state digest is two-level so that it can be computed
tensor by tensor, in any order, and combined later:

    tensor_digest(t)  = xxh3_128(raw bytes of t in row-major order)
    state_digest(ts)  = xxh3_128(concat over names in sorted order of
                          u32 len(name) | name utf-8 | u32 len(dtype) | dtype |
                          u32 ndim | i64 shape[0..ndim) | tensor_digest 16 bytes)

"dtype" is the torch dtype name without the "torch." prefix (e.g. "bfloat16"); integers are
little-endian. Raw bytes of contiguous CPU tensors are hashed in place (no copy); a
non-contiguous tensor is made contiguous first (one copy of that tensor), and device tensors
are copied to host in chunks of at most 64 MiB.

With several FSDP writers and no full state, a manifest lists a shard's *parts digest*
instead (:mod:`deltasync.layout.part_digests`: writer k's part digest hashes the shard's
elements that come from its dim-0 rows):

    parts_digest(W, shard) = "w{W}:" + hex(xxh3_128(concat over writers k = 0..W-1 in
                                                     order of part_digest(k, shard) 16 bytes)))

W is written in plain decimal (2..65536, no leading zeros); the hex is 32 lowercase digits.
The ``w`` prefix tells the two forms apart: a state digest is bare hex.

``shard_state_digests(table, full)`` equals ``{s: state_digest(table.split(full)[s])}`` (what
the manifest lists and a receiver recomputes from its live tensors) but feeds the hash with the
canonical bytes each local tensor is made of, in local row-major order: row blocks are hashed in
place, vocabulary padding as zero bytes, and only blocks that are column slices of their source
(row-parallel ``o_proj``/``down_proj``) are copied, one at a time. So a per-version digest pass
costs one read of the BF16 state instead of a full split. :func:`state_digests` does the same
from trainer parameters (fp32 masters cast to BF16 a few MiB at a time).

This module knows tables, blocks and the digest definition; it knows nothing about stores,
manifests or transports.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping, Sequence

import torch
import xxhash

from deltasync.errors import ManifestError
from deltasync.layout.blocks import Block, as_2d, view_cols, view_rows
from deltasync.layout.receiver_layout import ReceiverLayout
from deltasync.layout.routing import check_param
from deltasync.layout.table import LayoutTable
from deltasync.layout.trainer_layout import TrainerLayout
from deltasync.native.ops import cast_bf16_into

_CHUNK_BYTES = 64 * 2**20  # host staging bound when hashing device tensors


def _byte_chunks(t: torch.Tensor) -> Iterable[memoryview]:
    if t.numel() == 0:
        return
    if not t.is_contiguous():
        t = t.contiguous()  # one copy of this tensor only (row-major order is what we hash)
    flat = t.reshape(-1)  # a view: t is contiguous
    if flat.device.type == "cpu":
        # Reinterpret as bytes: no copy. numpy has no bfloat16, so view as uint8 first.
        yield memoryview(flat.view(torch.uint8).numpy())
        return
    step = max(1, _CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].to("cpu")
        yield memoryview(piece.view(torch.uint8).numpy())


def tensor_digest(t: torch.Tensor) -> bytes:
    """16-byte xxh3-128 of the tensor's raw bytes in row-major order."""
    h = xxhash.xxh3_128()
    for chunk in _byte_chunks(t.detach()):
        h.update(chunk)
    return h.digest()


def combine_digests(entries: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> str:
    """State digest from (name, dtype name, shape, tensor_digest) records, in any order."""
    records = sorted(entries, key=lambda e: e[0])
    h = xxhash.xxh3_128()
    previous = None
    for name, dtype, shape, digest in records:
        if name == previous:
            raise ManifestError(f"tensor {name!r} appears twice in a state digest")
        previous = name
        if len(digest) != 16:
            raise ManifestError(f"tensor digest of {name!r} must be 16 bytes, got {len(digest)}")
        name_b = name.encode("utf-8")
        dtype_b = dtype.encode("ascii")
        h.update(struct.pack("<I", len(name_b)) + name_b)
        h.update(struct.pack("<I", len(dtype_b)) + dtype_b)
        h.update(struct.pack(f"<I{len(shape)}q", len(shape), *shape))
        h.update(digest)
    return h.hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex digest of a shard's full state (names, dtypes, shapes and bytes)."""
    return combine_digests(
        (name, dtype_name(t), tuple(t.shape), tensor_digest(t)) for name, t in tensors.items()
    )


MAX_PARTS_WRITERS = 65536
_PARTS_RE = re.compile(r"w([1-9][0-9]{0,4}):([0-9a-f]{32})\Z")


def parts_digest(parts: Sequence[str]) -> str:
    """The parts digest of one shard from its W part digests (hex), in writer index order."""
    if not 2 <= len(parts) <= MAX_PARTS_WRITERS:
        raise ManifestError(
            f"a parts digest joins 2 to {MAX_PARTS_WRITERS} writers' part digests, got {len(parts)}"
        )
    h = xxhash.xxh3_128()
    for k, part in enumerate(parts):
        if not isinstance(part, str) or not re.fullmatch(r"[0-9a-f]{32}", part):
            raise ManifestError(
                f"part digest of writer {k} must be 32 lowercase hex characters, got {part!r:.80}"
            )
        h.update(bytes.fromhex(part))
    return f"w{len(parts)}:{h.hexdigest()}"


def parse_parts_digest(value: str) -> tuple[int, str] | None:
    """``(W, hex)`` of a parts digest; None for any other string (a state digest)."""
    m = _PARTS_RE.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    count = int(m.group(1))
    return (count, m.group(2)) if 2 <= count <= MAX_PARTS_WRITERS else None


def is_parts_digest(value: str) -> bool:
    """Whether ``value`` is a parts digest (else it is, if valid, a whole-state digest)."""
    return parse_parts_digest(value) is not None


_ZEROS = bytes(1 << 20)
_CAST_ELEMENTS = 1 << 21  # rows per cast chunk: ~4 MiB of BF16


def feed_zeros(h: xxhash.xxh3_128, n: int) -> None:
    """Feed ``n`` zero bytes (uncovered rows, e.g. vocabulary padding)."""
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


def _feed_cast(
    h: xxhash.xxh3_128, block: torch.Tensor, dtype: torch.dtype, buf: torch.Tensor | None
) -> None:
    """Feed a 2-D block, cast to ``dtype`` a few MiB of rows at a time (never a whole copy of a
    large source such as the embedding: the digest pass must not cost model-sized memory).
    fp32 -> BF16 goes through ``buf`` (one reused staging buffer, so the pass allocates
    nothing per chunk) and the C cast where it applies."""
    if block.dtype == dtype:
        _feed(h, block)
        return
    step = max(1, _CAST_ELEMENTS // max(1, block.shape[1]))
    for r in range(0, block.shape[0], step):
        rows = block[r : r + step]
        if buf is not None and rows.device.type == "cpu" and rows.numel() <= buf.numel():
            cast = cast_bf16_into(rows, buf)
            h.update(memoryview(cast.view(torch.uint8).numpy()))
        else:
            _feed(h, rows.to(dtype))


TensorEntry = tuple[str, tuple[int, ...], bytes]  # (dtype name, shape, tensor_digest)
TensorEntries = dict[str, dict[str, TensorEntry]]  # {shard: {local: entry}}


def shard_state_digests(
    table: LayoutTable,
    full: Mapping[str, torch.Tensor],
    shards: Iterable[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """``{shard: state digest}`` of the shards ``split_dense(table, full)`` would build.

    With ``dtype`` (e.g. bf16 while ``full`` holds fp32 master weights) each block is cast a
    few MiB of rows at a time as it is hashed, so the pass never holds a cast copy of a whole
    tensor (replicated blocks are cast once per shard that holds them; they are small).
    """
    return combine_entries(shard_tensor_digests(table, full, shards, dtype=dtype))


def combine_entries(entries: TensorEntries) -> dict[str, str]:
    """``{shard: state digest}`` from every shard's per-tensor entries."""
    return {
        s: combine_digests((local, *e) for local, e in entries[s].items()) for s in sorted(entries)
    }


def shard_tensor_digests(
    table: LayoutTable,
    full: Mapping[str, torch.Tensor],
    shards: Iterable[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    keep: TensorEntries | None = None,
) -> TensorEntries:
    """Every local tensor's entry (dtype name, shape, :func:`tensor_digest`) of the shards
    :func:`shard_state_digests` hashes; a tensor listed in ``keep`` takes that entry without
    being read (the caller vouches that its bytes are those the entry was computed from)."""
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
    entries: TensorEntries = {s: {} for s in wanted}
    staging: torch.Tensor | None = None  # made when a tensor is first read (none may be)
    for local in locals_in_order:
        for shard in sorted(wanted):
            shape = table.dst_shapes[shard].get(local)
            if shape is None:
                continue
            kept = None if keep is None else keep.get(shard, {}).get(local)
            if kept is not None and kept[0] == dtype_s and tuple(kept[1]) == tuple(shape):
                entries[shard][local] = kept
                continue
            blocks = sorted(by_dst.get((shard, local), []), key=lambda nb: nb[1].dst_row)
            rows, cols = view_rows(shape), view_cols(shape)
            if all(b.dst_full_width for _, b in blocks):
                h = xxhash.xxh3_128()
                cursor = 0
                if staging is None and dtype == torch.bfloat16:
                    staging = torch.empty(_CAST_ELEMENTS, dtype=torch.bfloat16)
                for src, b in blocks:
                    feed_zeros(h, (b.dst_row - cursor) * cols * esize)  # uncovered rows: zero
                    _feed_cast(h, b.src_view(as_2d(full[src])), dtype, staging)
                    cursor = b.dst_row + b.rows
                feed_zeros(h, (rows - cursor) * cols * esize)
                digest = h.digest()
            else:  # blocks side by side within a row: build this one tensor
                t = torch.zeros(shape, dtype=dtype)
                for src, b in blocks:
                    b.dst_view(as_2d(t)).copy_(b.src_view(as_2d(full[src])))
                digest = tensor_digest(t)
            entries[shard][local] = (dtype_s, tuple(shape), digest)
    return entries


def shard_digests(shards: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """``{shard: state_digest}`` of built shards, as the manifest lists them."""
    return {shard: state_digest(tensors) for shard, tensors in shards.items()}


def state_digests(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> dict[str, str]:
    """Every receiver shard's BF16 state digest from the FULL trainer params.

    Args:
        params: every trainer parameter, full shapes (fp32 masters or BF16).
        trainer_layout: trainer params -> canonical tensors.
        receiver_layout: canonical tensors -> receiver shards.

    Returns:
        ``{shard: state_digest}``, equal to hashing ``receiver_layout.split`` of the BF16
        canonical tensors, without building the shards or a BF16 copy of the model.
    """
    return combine_entries(
        state_tensor_digests(params, trainer_layout=trainer_layout, receiver_layout=receiver_layout)
    )


def state_tensor_digests(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    keep: TensorEntries | None = None,
) -> TensorEntries:
    """:func:`state_digests` one level down: every receiver tensor's entry, those in ``keep``
    taken as given (a publisher keeps the entries of tensors no changed parameter feeds:
    their bytes are the committed ones). :func:`combine_entries` gives the shard digests."""
    # fp32 views of the master weights, cast to BF16 one local tensor's sources at a time:
    # no full BF16 copy and no canonical copy (memory and time of the per-version digest).
    views = trainer_layout.canonical_views({n: check_param(n, p) for n, p in params.items()})
    return shard_tensor_digests(receiver_layout.table, views, dtype=torch.bfloat16, keep=keep)
