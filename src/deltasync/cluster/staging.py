"""Staging on a receiver: received payloads -> verified updates, before any live write.

For the payloads one receiver got in a version (``{source rank: envelope}``):

1. the sources are exactly the ranks the role plan says send to this receiver;
2. every envelope is well framed (``envelope``), forwarded bundles unwrapped;
3. every blob decodes (``decode_blob``: its xxh3-128 digest, header, every record against the
   shard's tensor specs); all blobs bring the same version on the same base and are for this
   shard, and the receiver's journal accepts that base (a wrong base is refused here);
4. exactly one blob per writer of the plan (writer ids as on the storage path);
5. the writers' updates are merged per tensor (``format.merge_writers``: disjoint or
   refused) and folded as the storage path folds one step (``fold_chain``: an anchor defines the
   whole state, elements it does not list are zero).

The engine keeps serving during all of this. The storage path's staging functions are reused
so that both paths accept and refuse the same things. This module never touches live tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.cluster.envelope import flatten
from deltasync.cluster.roles import RolePlan
from deltasync.errors import BlobMismatchError, EnvelopeError, MissingBlobError
from deltasync.format import TensorSpec, TensorUpdate, decode_blob, fold_chain, merge_writers


@dataclass(frozen=True, eq=False)
class Staged:
    """Everything one version will write into one receiver's tensors, verified."""

    version: int
    base: int  # -1: anchor
    updates: list[TensorUpdate]  # one per local tensor, in the shard's tensor order
    state_digest: str | None  # what the shard must hash to afterwards, if the trainer said
    part_digests: dict[str, str]  # {writer id: its part digest}, from several writers
    payload_bytes: int
    elements: int

    @property
    def is_anchor(self) -> bool:
        return self.base == -1


def stage_payloads(
    received: Mapping[int, object],
    *,
    plan: RolePlan,
    rank: int,
    specs: Mapping[str, TensorSpec],
    journal: ClusterJournal,
    max_decompressed_bytes: int = 1 << 36,
) -> Staged:
    """Verify and decode a version's payloads for receiver ``rank``; raise a typed error (and
    write nothing) on any problem."""
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
        items.extend(got)
        total += sum(len(b) for b, _, _ in got)
    digests = {d for _, d, part in items if d is not None and not part}
    if len(digests) > 1:
        raise EnvelopeError(f"{where}: the payloads carry {len(digests)} different state digests")

    per_writer: dict[str, list[TensorUpdate]] = {}
    part_digests: dict[str, str] = {}
    version = base = None
    for blob, digest, part in items:
        decoded = decode_blob(
            blob,
            expected=specs,
            version=version,
            base_version=base,
            shard=role.shard,
            max_decompressed_bytes=max_decompressed_bytes,
        )
        h = decoded.header
        if version is None:
            version, base = h.version, h.base_version
            journal.accepts(version=version, base=base, where=where)
        if h.writer in per_writer:
            raise BlobMismatchError(
                f"{where}: two blobs of version {version} from writer {h.writer!r}; nothing "
                "was applied"
            )
        per_writer[h.writer] = decoded.updates
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
    assert version is not None and base is not None  # at least one writer, so one blob
    merged = merge_writers(version, [per_writer[w] for w in sorted(per_writer)])
    updates = fold_chain([("anchor" if base == -1 else "delta", merged)], specs)
    return Staged(
        version=version,
        base=base,
        updates=updates,
        state_digest=digests.pop() if digests else None,
        part_digests=part_digests,
        payload_bytes=total,
        elements=sum(u.nnz for u in updates),
    )


def as_cpu_bytes(received: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The exchange's outputs on the host (they live on the GPU under NCCL)."""
    return {src: t if t.device.type == "cpu" else t.cpu() for src, t in received.items()}
