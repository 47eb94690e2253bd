"""Retry with capped exponential backoff and full jitter, for remote stores.

:class:`RetryPolicy` is a keyword-only frozen config; :func:`backoff_delays` is the pure
schedule (seeded, so tests can pin it); :func:`call_with_retries` runs an operation, retrying
only what the caller's ``is_transient`` says is transient, and raises the last error once the
attempts or the deadline are spent. It knows nothing about S3 or HTTP.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from deltasync.errors import ConfigError, RetriesExhausted
from deltasync.validate import check_int, check_number

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``max_attempts`` tries in all (1 = no retry), within ``deadline_s`` seconds of the first."""

    max_attempts: int = 8
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        check_int("RetryPolicy", "max_attempts", self.max_attempts, lo=1)
        for name in ("base_delay_s", "max_delay_s", "deadline_s"):
            check_number(
                "RetryPolicy",
                name,
                getattr(self, name),
                positive=False,
                finite=False,
                unit="seconds",
            )
        if self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"RetryPolicy.max_delay_s ({self.max_delay_s}) must be >= base_delay_s "
                f"({self.base_delay_s})"
            )


def backoff_delays(policy: RetryPolicy, rng: random.Random | None = None) -> Iterator[float]:
    """Sleep before attempt 2, 3, ...: uniform in [0, min(max, base * 2**i)] ("full jitter"),
    which spreads out writers that all lost the server at the same moment."""
    rng = rng or random.Random()
    for i in range(policy.max_attempts - 1):
        yield rng.uniform(0.0, min(policy.max_delay_s, policy.base_delay_s * (2**i)))


def call_with_retries(
    op: Callable[[int], T],
    *,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``op(attempt)`` (attempt counts from 0) until it returns or fails permanently.

    A non-transient error propagates at once; a transient one is retried after a backoff delay
    while attempts and the deadline last, then RetriesExhausted is raised from it.
    """
    t0 = clock()
    delays = backoff_delays(policy)
    attempt = 0
    while True:
        try:
            return op(attempt)
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempt += 1
            delay = next(delays, None)
            elapsed = clock() - t0
            if delay is None or elapsed + delay > policy.deadline_s:
                log.warning(
                    "store operation failed after %d attempt(s) in %.1f s: %s: %s",
                    attempt,
                    elapsed,
                    type(exc).__name__,
                    exc,
                )
                raise RetriesExhausted(exc, attempt, elapsed) from exc
            log.info(
                "transient store error on attempt %d (%s: %s); retrying in %.2f s",
                attempt,
                type(exc).__name__,
                exc,
                delay,
            )
            sleep(delay)
