"""TPQwen3Engine: a tensor-parallel Qwen3 receiver that runs its forward pass from vLLM shards.

Each TP rank holds exactly the tensors of its ``vllm`` receiver shard
(``ReceiverLayout.build(spec, engine="vllm", tp=tp)``): the fused ``qkv_proj`` (this rank's q
heads, then its k heads, then its v heads), the merged ``gate_up_proj`` (gate rows then up
rows of this rank's slice), the row-parallel ``o_proj``/``down_proj`` (a column slice), the
vocab-parallel, zero-padded ``embed_tokens``/``lm_head`` and the replicated norms
(``q_norm``/``k_norm`` included). The forward pass is computed *from those shards*, the way a
TP engine computes it:

- embedding: each rank looks up the ids that fall in its vocabulary rows and contributes zero
  for the others; the partials are summed (exact: every position has one non-zero partial);
- attention and MLP: column-parallel matmuls on the local heads / intermediate slice, then the
  row-parallel output matmul gives a partial hidden state per rank; the partials are summed in
  rank order, which is what an all-reduce computes (this file simulates every rank in one
  process, so the order is fixed and the result deterministic);
- lm_head: each rank computes the logits of its padded vocabulary rows; they are concatenated
  and the padding columns dropped.

If a single element sat in the wrong place (a k head where a v head belongs, the wrong
vocabulary block), the logits would differ from the transformers model's; that is what this
engine exists to prove (``tests/engines``). Weights are held in BF16 and cast to
``compute_dtype`` per matmul; norms run in fp32 and RoPE tables are built in fp32, as
transformers does, so in fp64 compute the only difference from the transformers forward pass is
summation order. With the same weights, inputs, compute dtype and thread count the result is
bit-for-bit reproducible (the rollout probe check relies on that).

Not modelled: Qwen3-MoE experts, KV caching, padding masks, real process groups.
This module knows the Qwen3 architecture and the vLLM layout; nothing about stores or syncing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltasync.engines.adapters import UNLOADED, TensorDictEngine
from deltasync.errors import ConfigError, VersionError
from deltasync.format import check_tensors_match
from deltasync.layout import ModelSpec, ReceiverLayout

_COMPUTE_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True)
class Qwen3Arch:
    """The non-shape hyperparameters the forward pass needs (from the HF config)."""

    rms_norm_eps: float
    rope_theta: float

    def __post_init__(self) -> None:
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"Qwen3Arch.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"Qwen3Arch.rope_theta must be > 0, got {self.rope_theta}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Qwen3Arch:
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"only default RoPE is supported, got {rope.get('rope_type')!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ConfigError("hf_config has neither rope_theta nor rope_parameters.rope_theta")
        return cls(rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm as transformers and vLLM's native path compute it: statistics in fp32."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim), built in fp32 then cast (transformers' rule)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TPQwen3Engine:
    """All TP ranks of a vLLM-convention Qwen3 receiver in one process, with a forward pass.

    ``rank(shard_id)`` (or ``ranks``) are the per-shard engine adapters a receiver writes into;
    ``logits`` reads those very tensors.
    """

    def __init__(
        self,
        spec: ModelSpec,
        arch: Qwen3Arch,
        *,
        tp: int,
        shards: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        compute_dtype: torch.dtype = torch.float32,
        version: int = UNLOADED,
    ) -> None:
        _check_dense(spec)
        if compute_dtype not in _COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
        self.spec, self.arch, self.tp, self.compute_dtype = spec, arch, tp, compute_dtype
        self.layout = ReceiverLayout.build(spec, engine="vllm", tp=tp)
        infos = sorted(self.layout.shards(), key=lambda s: s.tp_rank)
        self.ranks: dict[str, TensorDictEngine] = {}
        for info in infos:
            specs = self.layout.local_specs(info.id)
            if shards is None:
                tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
            else:
                if info.id not in shards:
                    raise ConfigError(f"TPQwen3Engine: no tensors for shard {info.id!r}")
                tensors = dict(shards[info.id])
                check_tensors_match(
                    tensors,
                    specs,
                    what=f"TPQwen3Engine shard {info.id!r}",
                    hint="build the engine and the layout from the same config",
                )
            self.ranks[info.id] = TensorDictEngine(tensors, version=version)

    @classmethod
    def from_canonical(
        cls,
        hf_config: Mapping[str, Any],
        canonical: Mapping[str, torch.Tensor],
        *,
        tp: int,
        compute_dtype: torch.dtype = torch.float32,
        version: int = UNLOADED,
    ) -> TPQwen3Engine:
        """Split a canonical BF16 state dict into every rank's shard (a dense load)."""
        spec = _check_dense(ModelSpec.from_hf_config(hf_config))
        layout = ReceiverLayout.build(spec, engine="vllm", tp=tp)
        return cls(
            spec,
            Qwen3Arch.from_hf_config(hf_config),
            tp=tp,
            shards=layout.split(canonical),
            compute_dtype=compute_dtype,
            version=version,
        )

    def rank(self, shard_id: str) -> TensorDictEngine:
        try:
            return self.ranks[shard_id]
        except KeyError:
            raise ConfigError(f"no shard {shard_id!r}; shards: {list(self.ranks)}") from None

    @property
    def version(self) -> int:
        """The version every rank is at; VersionError if they disagree (mid-sync)."""
        versions = {r.version for r in self.ranks.values()}
        if len(versions) != 1:
            raise VersionError(
                f"TP ranks are at different versions {sorted(versions)}: finish the sync of "
                "every rank before running the model"
            )
        return versions.pop()

    # ------------------------------------------------------------------ forward

    def _w(self, rank: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        return rank[name].to(self.compute_dtype)

    def _embed(self, ids: torch.Tensor, tensors: list[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        out = None
        for r, t in enumerate(tensors):
            table = t["model.embed_tokens.weight"]
            rows = table.shape[0]
            local = ids - r * rows
            inside = (local >= 0) & (local < rows)
            part = table[local.clamp(0, rows - 1)].to(self.compute_dtype)
            part = torch.where(inside.unsqueeze(-1), part, 0.0)  # where, not *: 0 * inf is nan
            out = part if out is None else out + part
        return out

    def _attention(
        self, h: torch.Tensor, t: Mapping[str, torch.Tensor], p: str, cos, sin
    ) -> torch.Tensor:
        spec, hd, eps = self.spec, self.spec.head_dim, self.arch.rms_norm_eps
        b, s, _ = h.shape
        q_heads = spec.num_attention_heads // self.tp
        kv_heads = max(spec.num_key_value_heads // self.tp, 1)
        qkv = h @ self._w(t, p + "self_attn.qkv_proj.weight").T
        q, k, v = qkv.split([q_heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q = rms_norm(q.view(b, s, q_heads, hd), t[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k.view(b, s, kv_heads, hd), t[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, kv_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=s > 1, scale=hd**-0.5, enable_gqa=q_heads != kv_heads
        )
        attn = attn.transpose(1, 2).reshape(b, s, q_heads * hd)
        return attn @ self._w(t, p + "self_attn.o_proj.weight").T

    def _mlp(self, h: torch.Tensor, t: Mapping[str, torch.Tensor], p: str) -> torch.Tensor:
        gate, up = (h @ self._w(t, p + "mlp.gate_up_proj.weight").T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self._w(t, p + "mlp.down_proj.weight").T

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids → (batch, seq, vocab_size) logits in ``compute_dtype``."""
        self.version  # noqa: B018 -- refuse to run on ranks caught mid-sync
        if input_ids.dim() != 2:
            raise ConfigError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        tensors = [r.params() for r in self.ranks.values()]
        eps = self.arch.rms_norm_eps
        cos, sin = rope_tables(
            input_ids.shape[1], self.spec.head_dim, self.arch.rope_theta, self.compute_dtype
        )
        x = self._embed(input_ids, tensors)
        for i in range(self.spec.num_hidden_layers):
            p = f"model.layers.{i}."
            partials = [
                self._attention(rms_norm(x, t[p + "input_layernorm.weight"], eps), t, p, cos, sin)
                for t in tensors
            ]
            x = x + _all_reduce(partials)
            partials = [
                self._mlp(rms_norm(x, t[p + "post_attention_layernorm.weight"], eps), t, p)
                for t in tensors
            ]
            x = x + _all_reduce(partials)
        head = "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        pieces = [rms_norm(x, t["model.norm.weight"], eps) @ self._w(t, head).T for t in tensors]
        return torch.cat(pieces, dim=-1)[..., : self.spec.vocab_size]


def _check_dense(spec: ModelSpec) -> ModelSpec:
    if spec.is_moe:
        raise ConfigError("TPQwen3Engine runs dense Qwen3 only; Qwen3-MoE is not modelled")
    return spec


def _all_reduce(partials: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the ranks' partial results, in rank order (what the all-reduce would return)."""
    out = partials[0]
    for part in partials[1:]:
        out = out + part
    return out
