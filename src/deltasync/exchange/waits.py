"""Bounded waits: every wait of the exchange ends within its timeout with an error that names
what it waited for (the round, the message, the peer).

Measured with torch 2.13 on CPU: gloo honours ``Work.wait(timeout)`` for send, receive and
all_gather, raising RuntimeError ("Timed out waiting 1000ms for recv operation to complete",
"Operation timed out!"). A gloo send waits for the matching receive, so sends time out too.
A timed-out gloo wait closes the connection to that peer ("Application timeout caused pair
closure"), and a peer whose process died surfaces at once as "Connection closed by peer".
After any round-2 failure the group must be treated as broken and re-created.

``abandon`` uses that closing on purpose: when one message fails, a rank gives up its other
unfinished messages with a near-zero wait, which closes those connections, so the peers on
the other side fail within moments instead of each waiting out its own timeout. It does this
for gloo only; NCCL aborts its communicator on a timeout by itself.

This module knows nothing about schedules or payloads.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from deltasync.errors import ExchangeError, ExchangeTimeoutError

_TIMEOUT_WORDS = ("timed out", "timeout")
_CLOSED_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused")


def wait(work: dist.Work, *, timeout_s: float, what: str, peers: str) -> None:
    """Wait for ``work`` at most ``timeout_s``; raise a typed error naming ``what`` and ``peers``.

    what: the operation, e.g. "exchange round 2, batch 3 of 9: receive of chunk 2/5 (1024 bytes)
        from rank 4"; peers: who could be at fault, e.g. "rank 4".
    """
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout_s))
    except (
        RuntimeError
    ) as exc:  # gloo and NCCL raise RuntimeError (or DistBackendError, a subclass)
        raise failure(exc, what=what, peers=peers, timeout_s=timeout_s) from exc
    if finished is False:  # some backends report a timeout by returning False
        raise ExchangeTimeoutError(_timeout_message(what, peers, timeout_s))


def abandon(works: Iterable[dist.Work], *, backend: str) -> None:
    """Give up unfinished works after a failure; on gloo this closes their connections."""
    if "gloo" not in backend:
        return
    for work in works:
        try:
            work.wait(timeout=timedelta(milliseconds=1))
        except RuntimeError:
            pass  # expected: the point is the side effect of closing the connection


def failure(exc: RuntimeError, *, what: str, peers: str, timeout_s: float) -> ExchangeError:
    """The typed error for a backend's RuntimeError about ``what``."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    lowered = text.lower()
    if any(word in lowered for word in _CLOSED_WORDS):
        return ExchangeError(
            f"{what}: the connection closed ({first}); {peers} died or gave up on the exchange. "
            "Re-create the process group before exchanging again"
        )
    if any(word in lowered for word in _TIMEOUT_WORDS):
        return ExchangeTimeoutError(_timeout_message(what, peers, timeout_s))
    return ExchangeError(f"{what} failed: {first}. Re-create the process group before retrying")


def _timeout_message(what: str, peers: str, timeout_s: float) -> str:
    return (
        f"{what}: not finished within timeout_s={timeout_s:g} s; {peers} may be dead, stuck, or "
        "not running the same exchange. Re-create the process group before exchanging again"
    )
