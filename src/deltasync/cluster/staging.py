"""Staging on a receiver: received payloads -> a version checked and verified before any write.

For the payloads one receiver got in a version (``{source rank: envelope}``),
:func:`stage_payloads` checks:

1. the sources are exactly the ranks the role plan says send to this receiver;
2. every envelope is well framed (``envelope``), forwarded bundles unwrapped;
3. every blob's digest, header and trailer are verified (``format.BlobRecords`` over the
   received bytes: no copy, nothing decoded yet); all blobs bring the same version on the same
   base and are for this shard, and the receiver's journal accepts that base (a wrong base is
   refused here);
4. exactly one blob per writer of the plan (writer ids as on the storage path);
5. a small version (its decoded records within ``max_staged_bytes``) is decoded now and held
   until the scatter; a larger one stays compressed in the received bytes and is decoded one
   tensor at a time, twice: once to verify, once to write.

The writers' blobs are then read in lockstep, one tensor at a time (:meth:`Staged.chain`, the
storage path's ``format.iter_chain``): every record checked against the shard's specs (int32
indices where a tensor has fewer than 2^31 elements), the writers' elements of each tensor
proven disjoint (the refusal of ``format.merge_writers``), an anchor proven complete (it
defines the whole state: elements it does not list are zero). Verify before write consumes
that stream to the end: :func:`state_digest_after` (the shard's state digest, one writer or a
writer given the full state), :func:`part_digests_after` (every writer's part digest of it,
``layout.part_digests``), or :func:`check_staged` (no digest sent). So a version whose
records, writers or digests do not hold up is refused with nothing written. The received
bytes stay the only copy of the payload; the extra memory is one tensor's decoded records (per
writer) and a few MiB of scratch, never the version's whole decoded change set (unless it fits
``max_staged_bytes``).

The engine keeps serving during all of this. The storage path's readers are reused so that
both paths accept and refuse the same things. This module reads live tensors (to hash them as
they will be) and never writes them; it knows nothing about processes or journals' files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.cluster.envelope import flatten
from deltasync.cluster.roles import RolePlan
from deltasync.errors import (
    BlobLimitError,
    BlobMismatchError,
    EnvelopeError,
    FormatError,
    MissingBlobError,
)
from deltasync.format import (
    BlobRecords,
    NamedOnce,
    Records,
    TensorPieces,
    TensorSpec,
    iter_chain,
)
from deltasync.format.decode import restated
from deltasync.format.merge import RecordStream
from deltasync.layout import ReceiverLayout
from deltasync.layout.part_digests import chain_part_digests
from deltasync.layout.verify import chain_state_digest

MIN_STAGED_BYTES = 4 << 20  # the default max_staged_bytes of a small shard
# Decoded bytes per decompressed section byte, at most: int32 indices from 1-byte gaps plus
# BF16 values (4 + 2 for 1 + 2 bytes) is 2x (as the storage path estimates it).
_DECODED_PER_RAW = 2


def default_staged_bytes(shard_bytes: int) -> int:
    """The storage path's default decode-and-hold budget: 1/16 of the shard, at least 4 MiB."""
    return max(shard_bytes // 16, MIN_STAGED_BYTES)


@dataclass(frozen=True, eq=False)
class Staged:
    """One version's blobs for one receiver, checked up to their records (which
    :meth:`chain` reads)."""

    version: int
    base: int  # -1: anchor
    streams: list[RecordStream]  # one per writer, in writer id order
    state_digest: str | None  # what the shard must hash to afterwards, if the trainer said
    part_digests: dict[str, str]  # {writer id: its part digest}, from several writers
    payload_bytes: int
    held: bool  # decoded at staging and held until the scatter

    @property
    def is_anchor(self) -> bool:
        return self.base == -1

    def chain(
        self, specs: Mapping[str, TensorSpec], *, check: bool = True
    ) -> Iterator[TensorPieces]:
        """The version one tensor at a time (tensors no writer lists are not yielded). With
        ``check`` (the verify pass) the writers are proven disjoint and an anchor complete;
        the scatter reads the same records again without those checks."""
        kind = "anchor" if self.is_anchor else "delta"
        return iter_chain([(self.version, kind, self.streams)], specs, check=check)

    def names(self) -> set[str]:
        """Every tensor some writer lists (record headers only)."""
        return {name for stream in self.streams for name in stream.names()}


def stage_payloads(
    received: Mapping[int, object],
    *,
    plan: RolePlan,
    rank: int,
    specs: Mapping[str, TensorSpec],
    journal: ClusterJournal,
    max_decompressed_bytes: int = 1 << 36,
    max_staged_bytes: int = 0,
) -> Staged:
    """Check a version's payloads for receiver ``rank`` up to their records; raise a typed
    error (and write nothing) on any problem.

    Args:
        received: ``{source rank: payload}`` (bytes or 1-D uint8 CPU tensors), read in place.
        plan: the role plan; rank: this receiver's rank; specs: its shard's tensor specs.
        journal: refuses a base it cannot take.
        max_decompressed_bytes: a blob declaring a larger record section is refused.
        max_staged_bytes: decode the version now and hold it when its decoded records are
            estimated within this many bytes (0: never; read it one tensor at a time).

    Returns:
        The :class:`Staged` version; its records are checked when :meth:`Staged.chain` is read.
    """
    role = plan.receiver(rank)
    where = f"receiver {role.shard} replica {role.replica} (rank {rank})"
    expected = set(plan.sources(rank))
    unexpected = sorted(set(received) - expected)
    if unexpected:
        raise EnvelopeError(
            f"{where}: got payloads from ranks {unexpected}, which the role plan does not name "
            f"as its sources {sorted(expected)}: the ranks run different role plans"
        )
    missing = sorted(expected - set(received))
    if missing:
        raise MissingBlobError(
            f"{where}: no payload from ranks {missing} (a writer or forwarder sent nothing); "
            "nothing was applied"
        )

    items, total = [], 0
    for src in sorted(received):
        got = flatten(received[src], where=f"{where}: payload from rank {src}")
        items.extend((src, *item) for item in got)
        total += sum(len(b) for b, _, _ in got)
    digests = {d for _, _, d, part in items if d is not None and not part}
    if len(digests) > 1:
        raise EnvelopeError(f"{where}: the payloads carry {len(digests)} different state digests")

    per_writer: dict[str, BlobRecords] = {}
    part_digests: dict[str, str] = {}
    version = base = None
    for src, blob, digest, part in items:
        try:
            records = BlobRecords(  # digest, header and trailer; the records stay compressed
                blob,
                expected=specs,
                version=version,
                base_version=base,
                shard=role.shard,
                max_decompressed_bytes=max_decompressed_bytes,
                narrow_indices=True,  # 6 bytes per decoded element instead of 10
            )
        except BlobLimitError:
            raise  # a limit of this receiver's (max_decompressed_bytes), named as such
        except FormatError as exc:
            # in-cluster there is nothing to fetch again: the version is sent again
            raise restated(
                exc,
                f"{where}: payload from rank {src}",
                "; nothing was applied: retry the version (sync on every rank)",
            ) from exc
        h = records.header
        if version is None:
            version, base = h.version, h.base_version
            journal.accepts(version=version, base=base, where=where)
        if h.writer in per_writer:
            raise BlobMismatchError(
                f"{where}: two blobs of version {version} from writer {h.writer!r}; nothing "
                "was applied"
            )
        per_writer[h.writer] = records
        if part and digest is not None:
            part_digests[h.writer] = digest
    writers = set(plan.writer_ids())
    if set(per_writer) - writers:
        raise BlobMismatchError(
            f"{where}: blobs from writers {sorted(set(per_writer) - writers)} that the role plan "
            f"does not have ({sorted(writers)}); nothing was applied"
        )
    if writers - set(per_writer):
        raise MissingBlobError(
            f"{where}: version {version}: no blob from writers "
            f"{sorted(writers - set(per_writer))}; "
            "nothing was applied"
        )
    if part_digests and set(part_digests) != writers:
        raise EnvelopeError(
            f"{where}: version {version}: writers {sorted(set(part_digests))} sent their part "
            f"digests, writers {sorted(writers - set(part_digests))} did not, so their parts "
            "could not be verified: the writers run with different digest settings "
            "(ClusterConfig.digest_every, full_state); nothing was applied"
        )
    assert version is not None and base is not None  # at least one writer, so one blob
    raw = sum(r.raw_len for r in per_writer.values())
    held = raw * _DECODED_PER_RAW <= max_staged_bytes
    streams: list[RecordStream] = [
        Records(list(per_writer[w])) if held else NamedOnce(per_writer[w])  # held: decoded once
        for w in sorted(per_writer)
    ]
    return Staged(
        version=version,
        base=base,
        streams=streams,
        state_digest=digests.pop() if digests else None,
        part_digests=part_digests,
        payload_bytes=total,
        held=held,
    )


class _Counted:
    """Passes a chain through, counting the elements the scatter will write (an anchor
    writes every element of every tensor)."""

    def __init__(self, chain: Iterable[TensorPieces]) -> None:
        self.chain = chain
        self.elements = 0

    def __iter__(self) -> Iterator[TensorPieces]:
        for item in self.chain:
            self.elements += _numel(item.shape) if item.from_zero else item.nnz
            yield item


def check_staged(staged: Staged, specs: Mapping[str, TensorSpec]) -> int:
    """Read ``staged`` to the end once (every record, writer and anchor check) with no digest
    to compare; returns the elements the scatter will write."""
    counted = _Counted(staged.chain(specs))
    for _ in counted:
        pass
    return counted.elements


def state_digest_after(
    staged: Staged, tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec]
) -> tuple[str, int]:
    """The state digest ``tensors`` will have after ``staged`` is written, read one tensor at
    a time (``layout.verify.chain_state_digest``; ``tensors`` are not written), and the
    elements the scatter will write."""
    counted = _Counted(staged.chain(specs))
    return chain_state_digest(tensors, counted), counted.elements


def part_digests_after(
    staged: Staged,
    tensors: Mapping[str, torch.Tensor],
    *,
    layout: ReceiverLayout,
    shard: str,
    count: int,
) -> tuple[dict[int, str], int]:
    """``{writer index: part digest}`` of ``shard`` as it will be after ``staged`` is written
    (what ``layout.part_digests.receiver_part_digests`` gives after the scatter; computed by
    ``layout.part_digests.chain_part_digests``), and the elements the scatter will write;
    ``tensors`` are not written."""
    counted = _Counted(staged.chain(specs=layout.local_specs(shard)))
    digests = chain_part_digests(
        tensors, counted, listed=staged.names(), layout=layout, shard=shard, count=count
    )
    return digests, counted.elements


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def as_cpu_bytes(received: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The exchange's outputs on the host (they live on the GPU under NCCL)."""
    return {src: t if t.device.type == "cpu" else t.cpu() for src, t in received.items()}
