"""The envelope: what one rank sends one rank in one exchange of a version.

A writer sends each receiver one envelope holding its one blob and, when configured, an
expected digest: the shard's state digest (from writer 0 of a single writer, or of writers
given the full state), or this writer's digest of the part of the shard it owns (several
writers, see ``layout.part_digests``); a forwarding replica sends each of its
shard's other replicas one envelope holding every envelope it received, unopened (so
forwarding never fails on, or hides, a damaged payload: each replica checks for itself).
Blobs carry their own header and xxh3-128 digest; the envelope only frames them. Layout,
little-endian::

    magic        8 bytes  b"DSCENV01"
    count        u32      number of parts
    flags        u32      bit 0: a digest follows; bit 1: parts are envelopes (forwarded);
                          bit 2: the digest is the sending writer's part digest
    digest       16 bytes expected digest (xxh3-128; zero when absent)
    lengths      count x u64
    check        8 bytes  xxh3-64 of everything above (catches damaged framing)
    parts        the parts, back to back; their lengths must add up to the rest exactly

``pack_envelope`` / ``unpack_envelope`` are inverses; ``seal_envelope`` frames a one-part
envelope in place, around a blob written after a reserved header.

A writer that streams its blob over several exchanges (``cluster.streaming``) sends a one-part
envelope *framing last*: the blob's bytes as they are written, then the framing, which holds
the blob's length and the state digest, both known only once the blob is complete.
``join_parts`` puts the framing back in front. A blob starts with its own magic, never with the
envelope's, which is how a receiver tells the two orders apart; the framing's check then
proves it whole.

This module knows bytes only: nothing about blob contents, tensors or processes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from deltasync.errors import EnvelopeError

MAGIC = b"DSCENV01"
_HEAD = struct.Struct("<8sII16s")
_CHECK = struct.Struct("<Q")
FLAG_DIGEST = 1
FLAG_NESTED = 2
FLAG_PART = 4
MAX_PARTS = 1 << 16

Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True, eq=False)
class Envelope:
    parts: list[memoryview]  # views into the received buffer: no copy
    state_digest: str | None  # hex xxh3-128: the shard's state, or the writer's part
    nested: bool  # parts are envelopes (a forwarded bundle)
    part: bool = False  # ``state_digest`` is the sending writer's part digest


def header_size(count: int) -> int:
    """Bytes of the framing in front of the parts of an envelope of ``count`` parts."""
    return _HEAD.size + 8 * count + _CHECK.size


def envelope_header(
    lengths: Sequence[int],
    *,
    state_digest: str | None = None,
    nested: bool = False,
    part_digest: bool = False,
) -> bytes:
    """The framing of an envelope whose parts have ``lengths`` (see :func:`pack_envelope`)."""
    if len(lengths) > MAX_PARTS:
        raise EnvelopeError(f"an envelope holds at most {MAX_PARTS} parts, got {len(lengths)}")
    digest = b"\0" * 16
    flags = FLAG_NESTED if nested else 0
    if state_digest is not None:
        try:
            digest = bytes.fromhex(state_digest)
        except ValueError:
            digest = b""
        if len(digest) != 16:
            raise EnvelopeError(f"state digest {state_digest!r} is not 32 hex characters")
        flags |= FLAG_DIGEST | (FLAG_PART if part_digest else 0)
    head = _HEAD.pack(MAGIC, len(lengths), flags, digest)
    head += struct.pack(f"<{len(lengths)}Q", *lengths)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def pack_envelope(
    parts: Sequence[Bytes | Sequence[Bytes]],
    *,
    state_digest: str | None = None,
    nested: bool = False,
    part_digest: bool = False,
) -> bytes:
    """Frame ``parts`` (blobs, or envelopes when ``nested``) into one payload; ``part_digest``:
    ``state_digest`` is the writer's part digest, not the whole shard's. A part may be given
    as the list of its pieces in order (a blob as its writer streamed it): they are copied
    once, into the payload, instead of being joined first."""
    pieces = [
        [memoryview(c).cast("B") for c in p]
        if isinstance(p, (list, tuple))
        else [memoryview(p).cast("B")]
        for p in parts
    ]
    head = envelope_header(
        [sum(len(v) for v in p) for p in pieces],
        state_digest=state_digest,
        nested=nested,
        part_digest=part_digest,
    )
    return b"".join((head, *(v for p in pieces for v in p)))


def seal_envelope(
    buf: bytearray, *, state_digest: str | None = None, part_digest: bool = False
) -> bytearray:
    """A one-part envelope framed in place: ``buf`` holds ``header_size(1)`` reserved bytes
    and then the part (a blob written straight after the reservation), so the payload never
    exists twice, as the part and as the envelope. Returns ``buf``, equal to
    ``pack_envelope([buf[header_size(1):]], ...)``."""
    reserved = header_size(1)
    if len(buf) < reserved:
        raise EnvelopeError(f"{len(buf)} bytes cannot hold the {reserved}-byte envelope framing")
    buf[:reserved] = envelope_header(
        [len(buf) - reserved], state_digest=state_digest, part_digest=part_digest
    )
    return buf


def framed_first(payload: Bytes | torch.Tensor) -> bool:
    """Whether ``payload`` starts with an envelope's framing (else: framing last)."""
    return bytes(as_view(payload)[: len(MAGIC)]) == MAGIC


def join_parts(
    parts: list[Bytes | torch.Tensor], *, on_copied: Callable[[int], None] | None = None
) -> torch.Tensor:
    """One payload received in ``parts`` (in order) as one flat uint8 tensor, the framing in
    front: moved there when the payload came framing last (see the module docstring).

    ``parts`` is emptied as it is copied: each part is dropped once its bytes are in place and
    ``on_copied(its length)`` is called, so the caller can hand the freed pages back while the
    joined payload's pages are still being touched (the two never need to be resident whole at
    once)."""
    total = sum(len(as_view(p)) for p in parts)
    reserved = header_size(1)
    head = b"".join(bytes(as_view(p)[: len(MAGIC)]) for p in parts)  # the first may be short
    last = not framed_first(head)
    if last and total < reserved:
        raise EnvelopeError(f"a payload of {total} bytes cannot hold a {reserved}-byte framing")
    # framing last: written after room for it, then moved into that room
    out = torch.empty(total + (reserved if last else 0), dtype=torch.uint8)
    flat = memoryview(out.numpy()).cast("B")
    at = reserved if last else 0
    while parts:
        view = as_view(parts.pop(0))
        n = len(view)
        flat[at : at + n] = view
        at += n
        del view
        if on_copied is not None:
            on_copied(n)
    if last:
        flat[:reserved] = flat[total:]
        return out[:total]
    return out


def as_view(payload: Bytes | torch.Tensor) -> memoryview:
    """A flat byte view of a payload as the exchange returns it (a uint8 CPU tensor) or bytes;
    anything else is an EnvelopeError."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise EnvelopeError(
                f"payload tensor must be 1-D uint8, got {payload.dtype} {tuple(payload.shape)}"
            )
        return memoryview(payload.cpu().contiguous().numpy()).cast("B")
    if isinstance(payload, str):
        raise EnvelopeError("a payload must be bytes or a 1-D uint8 tensor, got a str")
    try:
        return memoryview(payload).cast("B")
    except (TypeError, ValueError):
        raise EnvelopeError(
            f"a payload must be bytes or a 1-D uint8 tensor, got {type(payload).__name__}"
        ) from None


def unpack_envelope(payload: Bytes | torch.Tensor, *, where: str) -> Envelope:
    """Parse one envelope; ``where`` names the payload in errors (e.g. "payload from rank 0")."""
    view = as_view(payload)
    if len(view) < _HEAD.size + _CHECK.size:
        raise EnvelopeError(f"{where}: {len(view)} bytes is shorter than an envelope header")
    magic, count, flags, digest = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise EnvelopeError(f"{where}: not a deltasync envelope (magic {bytes(magic)!r})")
    if flags & ~(FLAG_DIGEST | FLAG_NESTED | FLAG_PART) or count > MAX_PARTS:
        raise EnvelopeError(f"{where}: unknown flags {flags:#x} or {count} parts (max {MAX_PARTS})")
    end = _HEAD.size + 8 * count
    if len(view) < end + _CHECK.size:
        raise EnvelopeError(f"{where}: {len(view)} bytes cannot hold {count} part lengths")
    (check,) = _CHECK.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != check:
        raise EnvelopeError(f"{where}: envelope header check failed: damaged in transit")
    lengths = struct.unpack_from(f"<{count}Q", view, _HEAD.size)
    at = end + _CHECK.size
    if at + sum(lengths) != len(view):
        raise EnvelopeError(
            f"{where}: parts declare {sum(lengths)} bytes but {len(view) - at} follow the header"
        )
    parts = []
    for n in lengths:
        parts.append(view[at : at + n])
        at += n
    return Envelope(
        parts=parts,
        state_digest=bytes(digest).hex() if flags & FLAG_DIGEST else None,
        nested=bool(flags & FLAG_NESTED),
        part=bool(flags & FLAG_PART),
    )


Item = tuple[memoryview, str | None, bool]  # (blob, digest of its envelope, part digest?)


def flatten(payload: Bytes | torch.Tensor, *, where: str) -> list[Item]:
    """Every blob in a payload (one level of forwarding unwrapped), each with the digest its
    envelope carried and whether that is a part digest."""
    outer = unpack_envelope(payload, where=where)
    if not outer.nested:
        return [(p, outer.state_digest, outer.part) for p in outer.parts]
    if outer.state_digest:
        raise EnvelopeError(f"{where}: a forwarded bundle carries a digest of its own")
    items: list[Item] = []
    for i, part in enumerate(outer.parts):
        inner = unpack_envelope(part, where=f"{where}, forwarded part {i}")
        if inner.nested:
            raise EnvelopeError(f"{where}, forwarded part {i}: forwarded twice (nested twice)")
        items.extend((p, inner.state_digest, inner.part) for p in inner.parts)
    return items
