"""What one in-cluster sync did on one rank, with its timings. Data only.

The trainer is stalled for the whole of ``SendReport.total_s`` when it syncs synchronously;
``stall_s`` is the part only it can shorten (detection, routing, encoding, digests). An
overlapped send (``overlapped``) blocked the trainer for ``captured_s`` only (``stall_s``), and
its ``total_s`` runs from the capture to the joint commit. ``transfer_s`` is the
payload exchange(s) as this rank saw them. A receiver's engine must stop reading weights only
for ``ReceiveReport.pause_s`` (journal + scatter); staging and the digest run while it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """A writer's payloads of one version, ready for the exchange."""

    version: int
    base: int  # -1: anchor
    payloads: dict[int, bytes]  # {receiver rank: envelope}
    shard_bytes: dict[str, int]  # blob bytes per receiver shard
    shard_elements: dict[str, int]
    detect_s: float  # tracker: which elements changed
    # gather current BF16 values, route to canonical and receiver shards; with overlap also
    # the blobs, built batch by batch as each batch is routed (cluster.capture)
    build_s: float
    encode_s: float  # blobs (without overlap) and envelopes
    digest_s: float  # expected shard digests (only when sent)
    # Per param, every index this delta sends (the union with uncommitted attempts); None for
    # an anchor. The sender keeps it once the payloads may reach a receiver.
    sent_indices: dict | None = None
    # {shard: state digest} this writer sent (whole-state digests only; empty otherwise): its
    # commit row carries their combination, checked against what the receivers hashed
    shard_digests: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SendReport:
    version: int
    base: int
    anchor: bool
    bytes_sent: int  # payload bytes to other ranks
    shard_bytes: dict[str, int] = field(default_factory=dict)
    shard_elements: dict[str, int] = field(default_factory=dict)
    elements: int = 0  # changed elements routed to all shards (replicated ones counted per shard)
    detect_s: float = 0.0
    build_s: float = 0.0
    encode_s: float = 0.0
    digest_s: float = 0.0
    transfer_s: float = 0.0
    commit_s: float = 0.0  # waiting in the joint commit (receivers' staging and apply)
    total_s: float = 0.0
    overlapped: bool = False  # sent in the background (ClusterSender(overlap=True))
    captured_s: float = 0.0  # overlapped: how long the capture took (detection)
    exchanges: int = 1  # the writers' payload exchanges: one, or one per part when streamed
    inline: bool = False  # overlapped, but small: all of it ran before sync returned

    @property
    def stall_s(self) -> float:
        """How long ``sync`` kept the trainer from training."""
        if self.inline:
            return self.total_s
        if self.overlapped:
            return self.captured_s
        return self.detect_s + self.build_s + self.encode_s + self.digest_s


@dataclass(frozen=True, kw_only=True)
class ApplyReport:
    """One receiver's staging and apply of one version (no collective involved)."""

    version: int
    base: int
    payload_bytes: int
    elements: int
    stage_s: float  # unwrap, blob digests and headers (held: decode): the engine keeps serving
    pause_s: float  # scatter into the live tensors (streamed: decoding the records again)
    verify_s: float  # every record decoded and checked, the state digest after the apply
    state_digest: str | None


@dataclass(frozen=True, kw_only=True)
class ReceiveReport:
    version: int
    base: int
    previous_version: int | None
    payload_bytes: int
    elements: int
    wait_s: float  # in the first exchange: waiting for the trainer, then its transfer
    forward_s: float  # the second exchange (forward mode), 0 otherwise
    stage_s: float
    pause_s: float
    verify_s: float
    commit_s: float
    total_s: float
