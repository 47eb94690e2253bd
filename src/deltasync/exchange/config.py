"""Settings of the in-cluster exchange: one keyword-only frozen dataclass, checked when built.

Every rank of a group must use the same ``max_chunk_bytes`` and ``max_inflight_ops``: the
round-2 schedule is derived from them, and two ranks with different schedules would wait for
messages the other never sends. Round 1 carries both values and refuses to go on when ranks
disagree, so a mismatch is an error on every rank rather than a hang.

This module knows nothing about processes, tensors or the schedule itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltasync.errors import ConfigError

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
        _check_int("max_chunk_bytes", self.max_chunk_bytes, 1, _MAX_CHUNK_LIMIT)
        _check_int("max_inflight_ops", self.max_inflight_ops, 2, 1 << 16)
        timeout = self.timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigError(
                f"ExchangeConfig.timeout_s must be a finite number of seconds > 0, got {timeout!r}"
            )


def _check_int(field: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"ExchangeConfig.{field} must be an int in [{lo}, {hi}], got {value!r}")
