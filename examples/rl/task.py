"""A verifiable toy task: reverse a short string. Prompts, references and rewards, all pure.

A prompt is ``BOS s =`` with ``s`` a random string of ``length`` characters from a small
alphabet; the policy must answer ``reversed(s)``. The reward is the fraction of answer
positions that hold the right character (partial credit makes the signal dense enough for a
randomly initialised model to climb within a few dozen GRPO steps), exact to compute from the
tokens alone.

This module knows strings, ids and rewards; nothing about models, processes or syncing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError
from deltasync_examples.rl.tokenizer import BOS, CharTokenizer

SEPARATOR = "="


@dataclass(frozen=True, kw_only=True)
class ReverseTask:
    letters: str = "abcd"
    length: int = 3

    def __post_init__(self) -> None:
        if SEPARATOR in self.letters or not self.letters:
            raise ConfigError(f"ReverseTask.letters must be non-empty without {SEPARATOR!r}")
        if not 1 <= self.length <= 32:
            raise ConfigError(f"ReverseTask.length must be in 1..32, got {self.length}")

    @property
    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(self.letters + SEPARATOR)

    @property
    def prompt_len(self) -> int:
        return 1 + self.length + 1  # BOS, the string, the separator

    @property
    def answer_len(self) -> int:
        return self.length

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts as a (n, prompt_len) int64 tensor."""
        tok = self.tokenizer
        letters = torch.randint(0, len(self.letters), (n, self.length), generator=generator)
        first = tok.encode(self.letters[0])[0]
        sep = tok.encode(SEPARATOR)[0]
        out = torch.empty((n, self.prompt_len), dtype=torch.int64)
        out[:, 0] = BOS
        out[:, 1:-1] = letters + first
        out[:, -1] = sep
        return out

    def rewards(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """Fraction of answer positions equal to the reversed prompt string, per row (fp32)."""
        target = prompts[:, 1 : 1 + self.length].flip(1)
        return (answers[:, : self.length] == target).float().mean(dim=1)
