"""CharTokenizer: one token per character, plus PAD/BOS/EOS. Shipped, so the demo needs no hub.

Ids: ``0`` PAD, ``1`` BOS, ``2`` EOS, then the characters of ``alphabet`` in order. Encoding
an unknown character is an error, never a silent UNK: rewards are computed on decoded strings,
so a lossy tokenizer would make a verifiable task unverifiable.

This module knows strings and ids; nothing about models or tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deltasync.errors import ConfigError

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = 3


@dataclass(frozen=True)
class CharTokenizer:
    alphabet: str

    def __post_init__(self) -> None:
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise ConfigError(
                f"CharTokenizer.alphabet must be non-empty with distinct characters, "
                f"got {self.alphabet!r}"
            )

    @property
    def vocab_size(self) -> int:
        return _SPECIALS + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        ids = []
        for ch in text:
            i = self.alphabet.find(ch)
            if i < 0:
                raise ConfigError(f"character {ch!r} is not in the alphabet {self.alphabet!r}")
            ids.append(_SPECIALS + i)
        return ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Characters of ``ids``; specials are dropped, and decoding stops at EOS."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS and stop_at_eos:
                break
            if _SPECIALS <= i < self.vocab_size:
                out.append(self.alphabet[i - _SPECIALS])
        return "".join(out)

    def batch_encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]
