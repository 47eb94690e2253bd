"""The fixed-size int64 rows the collectives gather: the status part every row shares, and
round 1's row of the exchange.

Round 1 of the exchange and the in-cluster joint commit and preflight
(``cluster/joint_commit.py``, ``cluster/preflight.py``) each gather one int64 row per rank in a
single collective, so that no rank waits for a message whose size it does not know. A fixed
size is what lets each be one collective with no size exchange before it. Every row carries the
same status part, encoded here once:

    magic        8 ASCII bytes naming the row kind (``dsxchg01``, ``dsclack1``), so a rank
                 calling some other collective is not misread
    status       0 = ok, 1 = failed
    a length word and MESSAGE_WORDS words: up to 1024 bytes of UTF-8 saying what failed; a
                 longer text is cut at the last clause or word boundary that fits and marked
                 " [cut]", never inside a character

The preflight's and the joint commit's rows also say when the rank arrived and how long it
waits there (:func:`late_after`): a rank whose wait ended raises and judges nothing, while the
ranks that came after it still complete the all_gather with the row it sent.

Where the length and message words sit, and what the other words mean, is each row's own
layout. Round 1's row (``encode_row`` / ``decode_rows``) is ``world_size + 7 + MESSAGE_WORDS``
int64 values:

    [0] magic        "dsxchg01"
    [1] status       0 = ready, 1 = failed before sending
    [2] max_chunk_bytes   } round 2's schedule depends on these, so all ranks must agree
    [3] max_inflight_ops  }
    [4] world size as this rank sees it
    [5] length of the message in bytes
    [6] more         1 = this rank has more to send after this exchange (a payload streamed
                     over several exchanges), else 0
    [7 : 7+W]        bytes this rank will send to each rank (its row of the matrix)
    [7+W : ...]      the message words: what failed, when status is 1

Decoding is a pure function of the gathered rows, so every rank reaches the same verdict and
raises the same error with the same message.

This module knows int64 words, text and round 1's layout; no process groups, no waiting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from deltasync.errors import ExchangeError, PeerFailedError

OK, FAILED = 0, 1
MESSAGE_BYTES = 1024
CUT_MARK = " [cut]"
MESSAGE_WORDS = MESSAGE_BYTES // 8


# How far apart the ranks' clocks may be (NTP keeps a cluster within milliseconds): a rank is
# taken to have stopped waiting only when the last arrival came this much after its wait ended,
# so a collective every rank completes is never judged late because of the clocks.
CLOCK_SKEW_S = 1.0
# How much longer than the patience it stamps a rank waits in a judged gather. The judges take
# a row stamped within patience + CLOCK_SKEW_S of a rank's arrival as on time, i.e. up to
# 2 * CLOCK_SKEW_S later in true time: a rank still waiting then gets it (with 0.5 s for the
# row's way), so it never gives up on a gather that the others complete and commit.
WAIT_BEYOND_S = 2 * CLOCK_SKEW_S + 0.5


def now_ms() -> int:
    """This rank's clock for an arrival stamp (ms since the epoch)."""
    return time.time_ns() // 1_000_000


def late_after(
    stamps: Sequence[tuple[int, int, int]], unknown: int
) -> tuple[int, int, list[tuple[int, int]]] | None:
    """From every rank's ``(rank, arrived ms, waits ms)``: ``(rank, waits ms, [(late rank, ms
    after that rank arrived), ...])`` for the first rank whose wait ended before the last rank
    arrived (by more than ``CLOCK_SKEW_S``); None when every wait outlasted every arrival.
    Stamps holding ``unknown`` are left out."""
    known = [s for s in stamps if unknown not in s[1:]]
    skew = CLOCK_SKEW_S * 1000
    last = max((at for _, at, _ in known), default=None)
    gone = [s for s in known if last - s[1] > s[2] + skew]
    if not gone:
        return None
    rank, at, waits = min(gone, key=lambda s: s[1] + s[2])
    late = [(r, a - at) for r, a, _ in known if a - at > waits + skew]
    return rank, waits, late


def magic(tag: bytes) -> int:
    """The int64 word of an 8-byte row tag."""
    assert len(tag) == 8, tag
    return int.from_bytes(tag, "little")


def describe(exc: BaseException) -> str:
    """The one-line text a failed rank sends to its peers: ``"ClassName: message"`` (its lines
    joined, so a reason on a second line is not lost)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fit(text: str, limit: int = MESSAGE_BYTES) -> bytes:
    """``text`` as UTF-8 of at most ``limit`` bytes: whole if it fits, else cut at the last
    clause (``"; "``, ``". "``), else word, boundary and marked with CUT_MARK."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return raw
    room = limit - len(CUT_MARK)
    head = raw[:room].decode("utf-8", "ignore")
    for sep in ("; ", ". ", ", ", " "):
        at = head.rfind(sep)
        if at >= room // 2:
            head = head[: at + (1 if sep != " " else 0)]
            break
    return (head.rstrip() + CUT_MARK).encode("utf-8")


def status(failure: str | None) -> int:
    """The status word of a rank that failed with ``failure`` (None: it did not)."""
    return OK if failure is None else FAILED


def encode_message(failure: str | None) -> tuple[int, np.ndarray]:
    """``(length in bytes, MESSAGE_WORDS int64 words)`` carrying ``failure`` (empty if None)."""
    message = b"" if failure is None else fit(failure)
    words = np.frombuffer(message.ljust(MESSAGE_BYTES, b"\0"), dtype="<i8").copy()
    return len(message), words


def decode_message(words: np.ndarray, length: int) -> str:
    """The text of MESSAGE_WORDS int64 ``words`` whose sender declared ``length`` bytes."""
    raw = np.ascontiguousarray(words, dtype="<i8").tobytes()
    n = min(max(int(length), 0), MESSAGE_BYTES)
    return raw[:n].decode("utf-8", "replace")


# --- round 1 of the exchange -----------------------------------------------------------------

MAGIC = magic(b"dsxchg01")  # round 1's row
_HEADER = 7
_READY = OK


def row_length(world_size: int) -> int:
    return _HEADER + world_size + MESSAGE_WORDS


def encode_row(
    counts: Sequence[int],
    *,
    failure: str | None,
    max_chunk_bytes: int,
    max_inflight_ops: int,
    more: bool = False,
) -> torch.Tensor:
    """This rank's row, on the CPU. A failed rank sends zero counts and its message."""
    w = len(counts)
    row = torch.zeros(row_length(w), dtype=torch.int64)
    length, words = encode_message(failure)
    head = [MAGIC, status(failure), max_chunk_bytes, max_inflight_ops, w, length, int(more)]
    row[:_HEADER] = torch.tensor(head, dtype=torch.int64)
    if failure is None:
        row[_HEADER : _HEADER + w] = torch.tensor(list(counts), dtype=torch.int64)
    row[_HEADER + w :] = torch.from_numpy(words)
    return row


def decode_rows(rows: torch.Tensor) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """The byte-count matrix ``matrix[src][dst]`` from the gathered (W, row_length(W)) rows,
    and whether any rank has more to send after this exchange.

    Raises, identically on every rank: ExchangeError when a rank sent something that is not an
    exchange row or used different settings, PeerFailedError when any rank reported a failure.
    """
    w = rows.shape[0]
    if rows.dim() != 2 or rows.shape[1] != row_length(w) or rows.dtype != torch.int64:
        raise ExchangeError(
            f"round 1: gathered rows have shape {tuple(rows.shape)} and dtype {rows.dtype}, "
            f"expected ({w}, {row_length(w)}) int64"
        )
    table = rows.cpu().tolist()
    alien = [r for r, row in enumerate(table) if row[0] != MAGIC or row[4] != w]
    if alien:
        raise ExchangeError(
            f"round 1: rank(s) {_ranks(alien)} sent a row that is not a deltasync exchange row "
            f"for {w} ranks; every rank of the group must call exchange() together"
        )
    failed = [r for r, row in enumerate(table) if row[1] != _READY]
    if failed:
        reasons = "; ".join(f"rank {r}: {_message(rows[r], table[r][5], w)}" for r in failed)
        noun = "rank" if len(failed) == 1 else "ranks"
        raise PeerFailedError(
            f"exchange round 1: {noun} {_ranks(failed)} failed before sending ({reasons}); "
            "nothing of this exchange was sent and the group is still usable"
        )
    settings = {(row[2], row[3]) for row in table}
    if len(settings) > 1:
        each = ", ".join(
            f"rank {r}: max_chunk_bytes={row[2]} max_inflight_ops={row[3]}"
            for r, row in enumerate(table)
        )
        raise ExchangeError(
            "exchange round 1: ranks disagree on the ExchangeConfig that shapes round 2 "
            f"({each}); use one config on every rank"
        )
    matrix = tuple(tuple(row[_HEADER : _HEADER + w]) for row in table)
    negative = [(s, d) for s, row in enumerate(matrix) for d, n in enumerate(row) if n < 0]
    if negative:
        raise ExchangeError(f"round 1: negative byte counts for (src, dst) pairs {negative}")
    return matrix, any(row[6] for row in table)


def _message(row: torch.Tensor, length: int, w: int) -> str:
    return decode_message(row[_HEADER + w :].cpu().numpy(), length) or "(no message)"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
