"""Settings of the in-cluster exchange: one keyword-only frozen dataclass, checked when built.

Every rank of a group must use the same ``max_chunk_bytes`` and ``max_inflight_ops``: the
round-2 schedule is derived from them, and two ranks with different schedules would wait for
messages the other never sends. Round 1 carries both values and refuses to go on when ranks
disagree, so a mismatch is an error on every rank rather than a hang.

This module knows nothing about processes, tensors or the schedule itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltasync.validate import check_int, check_seconds

_OWNER = "ExchangeConfig"

# A chunk size must fit the int64 fields of round 1 and gloo's int sizes comfortably.
_MAX_CHUNK_LIMIT = 1 << 40


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """How the two-round exchange chunks, pipelines and waits.

    max_chunk_bytes: no staging buffer and no single point-to-point message exceeds this.
    max_inflight_ops: at most this many sends and receives are posted and unfinished on a rank
        at once. At least 2, because one step may pair a send and a receive that only complete
        together.
    timeout_s: the longest any single wait (round 1 or one round-2 message) may take before the
        exchange raises ExchangeTimeoutError naming the peer and the round.
    """

    max_chunk_bytes: int = 64 << 20
    max_inflight_ops: int = 8
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_int(_OWNER, "max_chunk_bytes", self.max_chunk_bytes, lo=1, hi=_MAX_CHUNK_LIMIT)
        check_int(_OWNER, "max_inflight_ops", self.max_inflight_ops, lo=2, hi=1 << 16)
        check_seconds(_OWNER, "timeout_s", self.timeout_s)
