"""A config-built ``transformers`` Qwen3 policy and one REINFORCE step on sampled tokens.

The model is random-initialized from a config (no hub access here), trained in fp32 (master
weights) with ``torch.optim.AdamW`` at an RL learning rate. Each step samples continuations
from the current policy, scores them with a toy verifiable reward (how many sampled tokens fall
in a fixed "good" half of the vocabulary), and takes a policy-gradient step with a mean
baseline. The point is realistic update statistics (sparse BF16 changes at lr 1e-6..1e-5), not
a useful model.

This module knows models and losses; it knows nothing about publishing or receivers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError
from deltasync_examples.models import TINY_QWEN3, build_model, tiny_qwen3


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    vocab_size: int = 16003  # odd on purpose: exercises vLLM's vocab padding
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PolicyConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"PolicyConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @classmethod
    def small(cls, **overrides: object) -> PolicyConfig:
        """The tiny Qwen3 of :data:`deltasync_examples.models.TINY_QWEN3` (a quick run)."""
        t = TINY_QWEN3
        fields = dict(
            hidden_size=t["hidden_size"],
            num_layers=t["num_hidden_layers"],
            num_heads=t["num_attention_heads"],
            num_kv_heads=t["num_key_value_heads"],
            head_dim=t["head_dim"],
            intermediate_size=t["intermediate_size"],
            vocab_size=t["vocab_size"],
            tie_word_embeddings=t["tie_word_embeddings"],
        )
        return cls(**{**fields, **overrides})  # type: ignore[arg-type]

    def hf_config(self) -> dict:
        """A transformers ``config.json`` dict (model_type qwen3; the tiny config's other keys)."""
        return tiny_qwen3(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
        )


def build_policy(cfg: PolicyConfig) -> torch.nn.Module:
    """The fp32 transformers Qwen3 of ``cfg``, seeded by ``cfg.seed``."""
    return build_model(cfg.hf_config(), seed=cfg.seed)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    batch: int = 8
    prompt_len: int = 16
    gen_len: int = 16
    temperature: float = 1.0


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    gen_len: int,
    temperature: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Autoregressive sampling with a KV cache; returns (batch, prompt_len + gen_len) token ids."""
    model.eval()
    out = model(input_ids=prompts, use_cache=True)
    past, seq = out.past_key_values, prompts
    logits = out.logits[:, -1, :]
    for _ in range(gen_len):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        seq = torch.cat([seq, nxt], dim=1)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    model.train()
    return seq


def reward(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Fraction of generated tokens in the lower half of the vocabulary (a verifiable toy)."""
    return (tokens < vocab_size // 2).float().mean(dim=1)


def pg_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: RolloutConfig,
    vocab_size: int,
    gen: torch.Generator,
) -> dict[str, float]:
    """Sample, score, and take one REINFORCE step (mean baseline). Returns loss and reward."""
    prompts = torch.randint(0, vocab_size, (cfg.batch, cfg.prompt_len), generator=gen)
    seq = sample(model, prompts, cfg.gen_len, cfg.temperature, gen)
    gen_tokens = seq[:, cfg.prompt_len :]
    r = reward(gen_tokens, vocab_size)
    adv = r - r.mean()
    logits = model(input_ids=seq).logits[:, cfg.prompt_len - 1 : -1, :].float()
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    tok_logp = logp.gather(-1, gen_tokens.unsqueeze(-1)).squeeze(-1)
    loss = -(adv.unsqueeze(1) * tok_logp).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"loss": float(loss.detach()), "reward": float(r.mean())}
