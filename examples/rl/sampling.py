"""Sampling completions and scoring the probe batch with any ``logits(input_ids)`` function.

The rollout worker passes its engine's forward pass (vLLM-convention TP shards or the
transformers model); the trainer passes its dense reference of the same weights. No KV cache:
the toy sequences are a dozen tokens long, and recomputing the prefix keeps one code path.

This module knows tensors and callables; nothing about processes or syncing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def generate(
    logits_fn: LogitsFn,
    prompts: torch.Tensor,
    gen_len: int,
    *,
    temperature: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``gen_len`` tokens after each prompt.

    Returns ``(answers, logprobs)``: (n, gen_len) token ids and the fp32 log-probabilities the
    sampling distribution gave them (the behaviour policy's, for the importance ratio).
    """
    seq = prompts
    picked, logprobs = [], []
    for _ in range(gen_len):
        logits = logits_fn(seq)[:, -1, :].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        picked.append(nxt)
        logprobs.append(logp.gather(-1, nxt))
        seq = torch.cat([seq, nxt], dim=1)
    return torch.cat(picked, dim=1), torch.cat(logprobs, dim=1)


def probe_batch(
    vocab_size: int, *, rows: int = 4, length: int = 8, seed: int = 1234
) -> torch.Tensor:
    """A fixed batch of token ids every process builds identically (for the exactness probe)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, length), generator=gen)


def logits_bits(logits: torch.Tensor) -> torch.Tensor:
    """The logits' bit patterns (an integer view), for bitwise comparison across processes."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[logits.element_size()]
    return logits.contiguous().view(view).clone()
