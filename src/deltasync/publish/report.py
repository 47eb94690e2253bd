"""PublishReport: what one writer's ``publish`` did, with its timings. Data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltasync.commit import BlobEntry


@dataclass(frozen=True, kw_only=True)
class PublishReport:
    version: int
    kind: str  # "delta" | "anchor"
    base_version: int | None
    writer: str
    # True when the version was already committed with this same state (a retry after a lost
    # reply, or a replayed trainer): nothing new was stored, the baseline still advanced.
    already_committed: bool = False
    anchor_reason: str | None = None  # why this version is an anchor
    blobs: tuple[BlobEntry, ...] = ()
    shard_bytes: dict[str, int] = field(default_factory=dict)
    shard_elements: dict[str, int] = field(default_factory=dict)
    build_s: float = 0.0  # gather, cast, route, (anchor: split)
    encode_s: float = 0.0
    upload_s: float = 0.0  # waiting for uploads after the last encode
    digest_s: float = 0.0  # full-state shard digests (committer)
    commit_s: float = 0.0  # markers, manifest, LATEST
    staleness_wait_s: float = 0.0
    total_s: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(self.shard_bytes.values())

    @property
    def elements_sent(self) -> int:
        return sum(self.shard_elements.values())
