"""The benchmark workload: a model shape, a learning rate, and the trainer's real AdamW steps.

Weights are a ``transformers`` model built from a config (random init; no hub here) in fp32,
trained by :class:`deltasync_examples.models.SyntheticTrainer`: each step draws seeded
Gaussian gradients and takes a real ``torch.optim.AdamW`` step, so the sparsity of BF16
changes is what AdamW at that learning rate produces, never hand-made. Every system's trainer
process replays the identical sequence (same seeds), so their receivers must end at
bit-identical weights.

This module knows model shapes and the trainer; nothing about systems or transport.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deltasync.errors import ConfigError
from deltasync.validate import check_int, check_number
from deltasync_examples.models import TINY_QWEN3, SyntheticTrainer
from deltasync_examples.models import build_model as build_hf_model

MODELS: dict[str, dict] = {
    # Qwen3-0.6B's shape (hidden 1024, 28 layers, GQA 16/8, head_dim 128, tied, 151936 vocab).
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # A Qwen3-MoE shape sized for this machine (16 experts, top-4, 8 layers).
    "qwen3-moe-small": dict(
        model_type="qwen3_moe",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        moe_intermediate_size=384,
        num_experts=16,
        num_experts_per_tok=4,
        vocab_size=32003,
        tie_word_embeddings=False,
    ),
    # Small shapes: --preset small, and the tiny Qwen3 every example and test uses.
    "qwen3-small": dict(
        model_type="qwen3",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        vocab_size=8003,
        tie_word_embeddings=False,
    ),
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=1001,
        tie_word_embeddings=False,
    ),
    "qwen3-tiny": dict(TINY_QWEN3),
}


@dataclass(frozen=True, kw_only=True)
class Workload:
    model: str = "qwen3-small"
    lr: float = 3e-6
    weight_decay: float = 0.01
    grad_std: float = 1e-3
    # Optimizer steps before version 0 (not synced): AdamW's first steps move every element by
    # about lr (m/sqrt(v) ~ 1), later ones by a fraction of it. Steady state is what RL syncs.
    pre_steps: int = 10
    seed: int = 0
    hf_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"Workload.model {self.model!r} is not one of {sorted(MODELS)}")
        check_number("Workload", "lr", self.lr)
        check_number("Workload", "weight_decay", self.weight_decay, positive=False)
        check_number("Workload", "grad_std", self.grad_std)
        check_int("Workload", "pre_steps", self.pre_steps, lo=0)
        check_int("Workload", "seed", self.seed, lo=0)

    def hf_config(self) -> dict:
        cfg = dict(MODELS[self.model])
        cfg.update(self.hf_overrides)
        cfg.setdefault("max_position_embeddings", 4096)
        cfg.setdefault("rms_norm_eps", 1e-6)
        return cfg


def build_model(w: Workload) -> torch.nn.Module:
    """The trainer's fp32 model (transformers class chosen by model_type)."""
    return build_hf_model(w.hf_config(), seed=w.seed)


def build_trainer(w: Workload) -> SyntheticTrainer:
    """The workload's trainer: the model's parameters under seeded AdamW steps."""
    params = dict(build_model(w).named_parameters())  # the model object itself is dropped
    return SyntheticTrainer(
        params, lr=w.lr, weight_decay=w.weight_decay, grad_std=w.grad_std, seed=w.seed
    )


class ForwardBackward:
    """Stand-in for the trainer's next forward/backward, taking ``seconds`` in this process.

    ``on="cpu"``: a fixed amount of real compute (fp32 matmuls on two preallocated 1 MiB
    buffers, so it allocates nothing and its memory is not counted as the sync's), calibrated
    once; it holds the GIL only between matmuls, as a CPU trainer's forward/backward does
    between kernels, so CPU time a background publish takes from it shows up as a longer
    ``run``. ``on="device"``: the host only waits (a GPU trainer's forward/backward leaves the
    host's cores free for the background)."""

    def __init__(self, seconds: float, *, on: str = "cpu") -> None:
        if on not in ("cpu", "device"):
            raise ValueError(f"ForwardBackward.on must be 'cpu' or 'device', got {on!r}")
        self.seconds, self.on = seconds, on
        g = torch.Generator().manual_seed(0)
        self._a = torch.randn(512, 512, generator=g)
        self._out = torch.empty(512, 512)
        self.iters = 0
        if seconds <= 0 or on == "device":
            return
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < min(0.3, seconds):
            torch.mm(self._a, self._a, out=self._out)
            n += 1
        self.iters = max(1, round(seconds * n / (time.perf_counter() - t)))

    def run(self) -> float:
        """Do the work; its wall time in seconds."""
        t = time.perf_counter()
        if self.on == "device":
            time.sleep(max(0.0, self.seconds))
        for _ in range(self.iters):
            torch.mm(self._a, self._a, out=self._out)
        return time.perf_counter() - t
