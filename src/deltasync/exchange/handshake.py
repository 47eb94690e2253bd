"""Round 1's wire row: each rank's byte counts, status and settings in one fixed-size int64 row.

Every rank contributes one row of ``world_size + 38`` int64 values to a single all_gather:

    [0] magic        "dsxchg01", so a rank calling some other collective is not misread
    [1] status       0 = ready, 1 = failed before sending (``status_row``: magic, status and
                     the message words are the status part every gathered row shares)
    [2] max_chunk_bytes   } round 2's schedule depends on these, so all ranks must agree
    [3] max_inflight_ops  }
    [4] world size as this rank sees it
    [5] length of the message in bytes
    [6 : 6+W]        bytes this rank will send to each rank (its row of the matrix)
    [6+W : 6+W+32]   up to 256 bytes of UTF-8: what failed, when status is 1

A fixed size is what lets this be one collective with no size exchange before it. Decoding
is a pure function of the gathered rows, so every rank reaches the same verdict and raises the
same error with the same message.

This module knows the row layout only: no process groups, no waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltasync.errors import ExchangeError, PeerFailedError
from deltasync.exchange import status_row

MAGIC = status_row.magic(b"dsxchg01")
MESSAGE_BYTES = status_row.MESSAGE_BYTES
_HEADER = 6
_READY = status_row.OK


def row_length(world_size: int) -> int:
    return _HEADER + world_size + MESSAGE_BYTES // 8


def encode_row(
    counts: Sequence[int],
    *,
    failure: str | None,
    max_chunk_bytes: int,
    max_inflight_ops: int,
) -> torch.Tensor:
    """This rank's row, on the CPU. A failed rank sends zero counts and its message."""
    w = len(counts)
    row = torch.zeros(row_length(w), dtype=torch.int64)
    length, words = status_row.encode_message(failure)
    head = [MAGIC, status_row.status(failure), max_chunk_bytes, max_inflight_ops, w, length]
    row[:_HEADER] = torch.tensor(head, dtype=torch.int64)
    if failure is None:
        row[_HEADER : _HEADER + w] = torch.tensor(list(counts), dtype=torch.int64)
    row[_HEADER + w :] = torch.from_numpy(words)
    return row


def decode_rows(rows: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The byte-count matrix ``matrix[src][dst]`` from the gathered (W, W+38) rows.

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
            "no payload was sent and the group is still usable"
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
    return matrix


def _message(row: torch.Tensor, length: int, w: int) -> str:
    return status_row.decode_message(row[_HEADER + w :].cpu().numpy(), length) or "(no message)"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
