"""The one tiny Qwen3 config and the one synthetic trainer every example, benchmark and test uses.

``TINY_QWEN3`` is a transformers ``config.json`` of a two-layer Qwen3 (hidden 64, GQA 4/2,
vocab 251: odd, so vLLM's vocab padding is exercised); ``tiny_qwen3(**overrides)`` copies it
with changes. ``build_model`` makes the fp32 ``transformers`` model of any Qwen3 / Qwen3-MoE
config (random init, no hub).

``SyntheticTrainer`` holds fp32 master parameters and takes real ``torch.optim.AdamW`` steps on
seeded Gaussian gradients: ``step(v)`` draws version v's gradient for the full shape of every
parameter from one generator seeded by ``(seed, v)``, so the trajectory depends only on the
seed, never on the process or on how the parameters are split. With ``rows=(index, count)``
it keeps only FSDP writer ``index``'s dim-0 rows of every parameter (and of every gradient),
so ``count`` such trainers together follow exactly the trajectory of one unsplit trainer. The
point is the sparsity AdamW itself produces at an RL learning rate, never hand-made sparsity,
not a useful model.

This module knows model shapes and optimizers; nothing about publishing, stores or processes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

TINY_QWEN3: dict = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 251,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def tiny_qwen3(**overrides: object) -> dict:
    """A copy of :data:`TINY_QWEN3` with ``overrides`` applied (config.json keys)."""
    return {**TINY_QWEN3, **overrides}


def build_model(hf_config: Mapping, *, seed: int = 0) -> torch.nn.Module:
    """The fp32 ``transformers`` model of a Qwen3 / Qwen3-MoE ``config.json`` dict.

    Args:
        hf_config: the config (``model_type`` ``qwen3`` or ``qwen3_moe``).
        seed: seeds torch's global generator before the random initialisation.

    Returns:
        The model, fp32, in train mode.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "torch_dtype")}
    kind = cfg.pop("model_type")
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    elif kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    else:
        raise ValueError(f"build_model: model_type {kind!r} is not qwen3 or qwen3_moe")
    return model.float().train()


class SyntheticTrainer:
    """fp32 parameters under real AdamW steps on seeded Gaussian gradients.

    Args:
        params: the initial full fp32 parameters by name (e.g. ``model.named_parameters()``
            of :func:`build_model`, or :meth:`gaussian`'s). With ``rows`` None the trainer
            trains these very tensors (no copy: a model's memory is not doubled); with
            ``rows`` it trains a copy of its rows.
        lr: AdamW learning rate.
        weight_decay: AdamW's decoupled weight decay.
        grad_std: standard deviation of the gradients.
        seed: seeds the gradients (with the version).
        rows: ``(index, count)``: keep only FSDP writer ``index``'s dim-0 rows; None keeps all.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        lr: float,
        weight_decay: float = 0.01,
        grad_std: float = 1e-3,
        seed: int = 0,
        rows: tuple[int, int] | None = None,
    ) -> None:
        self.seed, self.grad_std, self.rows = seed, grad_std, rows
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.named: list[tuple[str, torch.nn.Parameter]] = [
            (
                n,
                torch.nn.Parameter(
                    p.detach() if rows is None else p.detach()[self._rows(n)].clone()
                ),
            )
            for n, p in params.items()
        ]
        self.opt = torch.optim.AdamW([p for _, p in self.named], lr=lr, weight_decay=weight_decay)

    @classmethod
    def gaussian(
        cls, shapes: Mapping[str, tuple[int, ...]], *, seed: int = 0, **kwargs: object
    ) -> SyntheticTrainer:
        """A trainer whose full parameters start as ``N(0, 0.02)`` draws from ``seed``, in
        ``shapes`` order (the same on every process, whatever its ``rows``)."""
        g = torch.Generator().manual_seed(seed)
        full = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
        return cls(full, seed=seed, **kwargs)  # type: ignore[arg-type]

    def _rows(self, name: str) -> slice:
        if self.rows is None:
            return slice(None)
        from deltasync.layout import fsdp_dim0_rows

        return slice(*fsdp_dim0_rows(self.shapes[name][0], *self.rows))

    def step(self, version: int) -> None:
        """One AdamW step on version ``version``'s gradients (gradients are freed after it)."""
        device = self.named[0][1].device if self.named else torch.device("cpu")
        g = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + version)
        for name, p in self.named:
            full = torch.randn(self.shapes[name], generator=g, device=device) * self.grad_std
            p.grad = full[self._rows(name)]
        self.opt.step()
        for _, p in self.named:
            p.grad = None  # steady-state memory is parameters + optimizer state

    def to(self, device: torch.device | str) -> SyntheticTrainer:
        """Move the parameters (before the first step: the optimizer holds no state yet)."""
        if self.opt.state:  # AdamW's m and v would stay behind on the old device
            raise RuntimeError("SyntheticTrainer.to: move the trainer before its first step")
        for _, p in self.named:
            p.data = p.data.to(device)
        return self

    def params(self) -> dict[str, torch.Tensor]:
        """The live fp32 parameters (detached views: they follow every step)."""
        return {n: p.detach() for n, p in self.named}

    def model_bytes_bf16(self) -> int:
        return sum(p.numel() for _, p in self.named) * 2
