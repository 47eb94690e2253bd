"""ClusterConfig: the settings of the in-cluster sync, one keyword-only frozen dataclass.

Every rank of the group must use the same ``exchange`` chunking settings (the exchange itself
refuses a mismatch in round 1); the other fields may differ per role. Each error names the
field. Nothing is read from the environment.

This module knows settings only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltasync.errors import ConfigError
from deltasync.exchange import ExchangeConfig
from deltasync.validate import check_int, check_seconds

_OWNER = "ClusterConfig"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How one rank takes part in the in-cluster sync.

    exchange: chunking, pipelining and the per-wait timeout of every payload exchange.
    wait_for_version_s: how long a RECEIVER waits in the first exchange of a version for the
        trainer to arrive (the trainer may still be training when the rollout workers are
        already waiting). Trainer ranks and every later wait use ``exchange.timeout_s``.
    commit_timeout_s: how long any rank waits in the joint commit for the slowest rank, which
        includes the receivers' decode, apply and digest. A dead or stuck rank is named.
    level: zstd level of the blobs (1 = fast default, 0 = uncompressed).
    digest_every: writer 0 sends each receiver shard's expected state digest with every K-th
        version and with every anchor; 0 = never. Computing it needs the full parameters (a
        transient BF16 copy of the model, ~3x its BF16 size at the peak, see
        ``layout.routing.full_shard_tensors``), so it is off by default; a receiver always
        checks a digest it is sent.
    max_decompressed_bytes: a receiver refuses a blob that declares a larger record section.
    encode_threads: how many of a version's per-shard blobs are encoded at once (1 = one
        after another, the default). More helps a node with cores to spare and several shards;
        each concurrent encode holds its own buffers (on this project's 2-core VM it gave no
        speed-up, and the trainer's peak memory read higher in the run that used it).
    """

    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    wait_for_version_s: float = 600.0
    commit_timeout_s: float = 120.0
    level: int = 1
    digest_every: int = 0
    max_decompressed_bytes: int = 1 << 36
    encode_threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.exchange, ExchangeConfig):
            raise ConfigError(
                "ClusterConfig.exchange must be an ExchangeConfig, got "
                f"{type(self.exchange).__name__}"
            )
        check_seconds(_OWNER, "wait_for_version_s", self.wait_for_version_s)
        check_seconds(_OWNER, "commit_timeout_s", self.commit_timeout_s)
        check_int(_OWNER, "level", self.level, lo=0, hi=22)
        check_int(_OWNER, "encode_threads", self.encode_threads, lo=1, hi=1024)
        check_int(_OWNER, "digest_every", self.digest_every, lo=0, hi=1 << 31)
        check_int(_OWNER, "max_decompressed_bytes", self.max_decompressed_bytes, lo=1, hi=1 << 62)

    def sends_digest(self, version: int, *, anchor: bool) -> bool:
        """Whether writer 0 attaches expected state digests to ``version``."""
        return self.digest_every > 0 and (anchor or version % self.digest_every == 0)
