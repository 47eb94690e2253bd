"""PublisherConfig: every knob of the trainer-side publisher, validated at construction.

Keyword-only and frozen; each error names the field. Nothing is read from the environment.
This module knows settings only.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from deltasync import names
from deltasync.commit.retention import KEEP_VERSIONS, ORPHAN_GRACE_S, RECEIVER_TTL_S
from deltasync.commit.signing import MIN_KEY_BYTES
from deltasync.errors import ConfigError, ManifestError
from deltasync.validate import check_int, check_number, check_seconds, check_signing_key

_OWNER = "PublisherConfig"


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How one writer (trainer rank) publishes.

    - ``writer_rank`` / ``num_writers``: this writer among the trainer ranks that each hold a
      dim-0 shard of every parameter; rank 0 commits.
    - ``session``: a token shared by the writers of one attempt (e.g. the launcher's run id and
      restart count). Writer ids are ``w{rank:05d}-{session}``, so blobs and markers of a crashed
      or racing attempt never mix with this one. A single writer draws a random one; several
      writers must be given the same one.
    - ``anchor_every``: every K-th version (and version 0) is a full anchor.
    - ``signing_key``: HMAC-SHA256 key for manifests (>= 16 bytes), or None.
    - ``level``: zstd level of the blobs (1 = fast default, 0 = uncompressed).
    - ``marker_timeout_s``: how long the committer waits for every writer's marker, and a
      non-committer for the manifest.
    - ``max_staleness``: bounded-staleness mode: ``publish`` waits (up to
      ``staleness_timeout_s``) while a live registered receiver is more than this many
      versions behind the newest committed version. None: never wait.
    - ``receiver_ttl_s``: a receiver record older than this is not live (retention, staleness).
    - ``keep_versions``: retention keeps at least this many newest versions.
    - ``orphan_grace_s``: retention deletes an attempt that never committed only once its
      newest key is this many seconds old (its manifest write may still land; 0: at once).
    - ``upload_threads``: blob uploads running at once (None: one per receiver shard, at most
      32). Each shard's blob uploads from its first segment while a thread is free for it;
      with fewer threads than shards, a waiting shard's segments queue in memory until one is.
    - ``prefetch``: a lazy change stream (a tracker's detection) runs this many parameters
      ahead on its own thread, so detection overlaps routing and encoding (0: no thread).
    """

    writer_rank: int = 0
    num_writers: int = 1
    session: str | None = None
    anchor_every: int = 50
    signing_key: bytes | None = field(default=None, repr=False)
    level: int = 1
    marker_timeout_s: float = 120.0
    poll_interval_s: float = 0.02
    max_staleness: int | None = None
    staleness_timeout_s: float = 600.0
    receiver_ttl_s: float = RECEIVER_TTL_S
    keep_versions: int = KEEP_VERSIONS
    orphan_grace_s: float = ORPHAN_GRACE_S
    upload_threads: int | None = None
    prefetch: int = 2

    def __post_init__(self) -> None:
        check_int(_OWNER, "num_writers", self.num_writers, lo=1)
        check_int(_OWNER, "writer_rank", self.writer_rank, lo=0)
        if self.writer_rank >= self.num_writers:
            raise ConfigError(
                f"PublisherConfig.writer_rank {self.writer_rank} must be < num_writers "
                f"{self.num_writers}"
            )
        if self.session is None:
            if self.num_writers > 1:
                raise ConfigError(
                    "PublisherConfig.session is required with num_writers > 1: every writer of "
                    "one attempt must pass the same token (e.g. the launcher's run id)"
                )
            object.__setattr__(self, "session", secrets.token_hex(4))
        try:  # a part of every writer's name, w<index>-<session>
            names.check_token("session", f"w00000-{self.session}")
        except ManifestError:
            raise ConfigError(
                f"PublisherConfig.session {self.session!r} cannot be part of a writer's name "
                "(w<index>-<session>): use at most 121 characters from [A-Za-z0-9_.=-], "
                "without '..'"
            ) from None
        check_int(_OWNER, "anchor_every", self.anchor_every, lo=1)
        check_signing_key(_OWNER, self.signing_key, min_bytes=MIN_KEY_BYTES)
        check_int(_OWNER, "level", self.level, lo=0, hi=22)
        for name in (
            "marker_timeout_s",
            "poll_interval_s",
            "staleness_timeout_s",
            "receiver_ttl_s",
        ):
            check_seconds(_OWNER, name, getattr(self, name))
        if self.max_staleness is not None:
            check_int(_OWNER, "max_staleness", self.max_staleness, lo=0)
        check_int(_OWNER, "keep_versions", self.keep_versions, lo=1)
        check_number(_OWNER, "orphan_grace_s", self.orphan_grace_s, positive=False, unit="seconds")
        if self.upload_threads is not None:
            check_int(_OWNER, "upload_threads", self.upload_threads, lo=1)
        check_int(_OWNER, "prefetch", self.prefetch, lo=0)

    def writer_id(self, rank: int | None = None) -> str:
        """``w{rank:05d}-{session}``: the id of ``rank`` (default: this writer) in this attempt."""
        r = self.writer_rank if rank is None else rank
        return f"{names.writer_id(r)}-{self.session}"

    def all_writer_ids(self) -> list[str]:
        return [self.writer_id(r) for r in range(self.num_writers)]

    @property
    def is_committer(self) -> bool:
        return self.writer_rank == 0
