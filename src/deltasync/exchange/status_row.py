"""The status part of every fixed-size int64 row the collectives gather.

Round 1 of the exchange (``handshake.py``) and the in-cluster joint commit
(``cluster/joint_commit.py``) each gather one int64 row per rank in a single collective, so that no
rank waits for a message whose size it does not know. Both rows carry the same status part,
encoded here once:

    [0]          magic: 8 ASCII bytes naming the row kind (``dsxchg01``, ``dsclack1``), so a
                 rank calling some other collective is not misread
    [1]          status: 0 = ok, 1 = failed
    a length word and MESSAGE_WORDS words: up to 1024 bytes of UTF-8 saying what failed; a
                 longer text is cut at the last clause or word boundary that fits and marked
                 " [cut]", never inside a character

Where the length and message words sit, and what the other words mean, is each row's own
layout. This module knows int64 words and text; no process groups, no waiting.
"""

from __future__ import annotations

import numpy as np

OK, FAILED = 0, 1
MESSAGE_BYTES = 1024
CUT_MARK = " [cut]"
MESSAGE_WORDS = MESSAGE_BYTES // 8


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
