"""A vLLM-convention weight loader, re-stated as vLLM's layers load weights, for probing.

``VllmReferenceLoader`` builds the parameters one vLLM TP/EP rank holds for a decoder-only
family (Qwen3, Qwen3-MoE, Llama, Mistral, Qwen2, Gemma: the models whose vLLM ``load_weights``
use the same ``stacked_params_mapping``) and fills them through per-parameter
``weight_loader`` functions that narrow the checkpoint tensor and copy it into a narrowed
slice of the fused parameter, the way vLLM's layers do (read in vLLM's source, not copied):

- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary padded to a multiple of 64, rank
  r holds padded rows ``[r*P, (r+1)*P)``, real rows first, the tail zero-filled; with tied
  embeddings the model's ``lm_head`` *is* ``embed_tokens`` and ``lm_head.weight`` is skipped;
- ``QKVParallelLinear`` (shard ids ``q``/``k``/``v``): rank r's q heads, then its k heads, then
  its v heads; with fewer kv heads than ranks, kv head ``r // (tp // kv_heads)``; biases alike;
- ``MergedColumnParallelLinear`` (shard ids 0/1): gate slice then up slice;
- ``RowParallelLinear``: the input dim is split; a bias is held whole by every rank;
- ``FusedMoE``: ``w13_weight`` (E_local, 2*I_l, H), w1 (gate) first; ``w2_weight`` (E_local, H,
  I_l); under expert parallelism the MoE layers use TP 1 and EP rank e holds the contiguous
  experts of the "linear" placement, other experts are skipped;
- everything else (norms, the MoE router ``mlp.gate``) is replicated (``default_weight_loader``).

It is the hand-written reference the probe is checked against (its tables must equal the
``vllm`` rules) and a stand-in engine where vLLM is not installed; for the Qwen3 families it
refuses the sizes the rules refuse (:func:`~deltasync.layout.vllm_rules.check_parallelism`:
what vLLM refuses to build). It knows checkpoint names, head counts and the vocabulary; it
does not know layout tables or blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from deltasync.errors import LayoutError
from deltasync.layout.vllm_rules import RULE_MODEL_TYPES, check_parallelism

VOCAB_PADDING = 64

_STACKED = (  # (fused param, checkpoint part, shard id): vLLM's stacked_params_mapping
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")

Loader = Callable[..., None]


def _check_sizes(spec, tp: int, ep: int) -> None:
    """The TP/EP sizes vLLM's layers accept for this model (LayoutError naming the field)."""
    kv = spec.num_key_value_heads
    checks = [
        (spec.num_attention_heads % tp == 0, f"num_attention_heads ({spec.num_attention_heads})"),
        ((kv % tp == 0) if kv >= tp else (tp % kv == 0), f"num_key_value_heads ({kv})"),
        (-(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING % tp == 0, "the padded vocabulary"),
    ]
    if spec.num_hidden_layers > len(spec.moe_layers):  # some layer has a dense MLP
        checks.append(
            (spec.intermediate_size % tp == 0, f"intermediate_size ({spec.intermediate_size})")
        )
    if spec.num_experts:
        if ep > 1:
            checks.append((ep % tp == 0, f"ep ({ep}), which must be a multiple of tp"))
        else:
            checks.append((spec.moe_intermediate_size % tp == 0, "moe_intermediate_size"))
    elif ep > 1:
        raise LayoutError(
            f"ep={ep} needs a MoE model; {spec.model_type!r} has no experts: pass --ep 1"
        )
    for ok, what in checks:
        if not ok:
            raise LayoutError(
                f"{what} does not split over tp={tp} the way vLLM's layers need; pass a --tp "
                "that fits it"
            )


class VllmReferenceLoader:
    """The parameters of one vLLM rank, filled by vLLM-style weight loaders.

    Args:
        spec: the model's :class:`~deltasync.layout.model_spec.ModelSpec` (head counts,
            vocabulary, tied embeddings, experts, canonical tensor shapes).
        tp, tp_rank: tensor-parallel size and this rank.
        ep, ep_rank: expert-parallel size (1 = off) and this rank; under EP the attention TP
            rank is ``ep_rank % tp``.
    """

    def __init__(self, spec, *, tp: int = 1, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0):
        if not 0 <= tp_rank < tp or not 0 <= ep_rank < ep:
            raise LayoutError(f"rank tp{tp_rank}/ep{ep_rank} is outside tp={tp}, ep={ep}")
        self.spec, self.tp, self.tp_rank, self.ep, self.ep_rank = spec, tp, tp_rank, ep, ep_rank
        _check_sizes(spec, tp, ep)
        if spec.model_type in RULE_MODEL_TYPES:  # what vLLM's Qwen3 families refuse besides
            check_parallelism(spec, tp, ep)
        self._params: dict[str, torch.Tensor] = {}
        self._loaders: dict[str, Loader] = {}
        self._aliases: dict[str, str] = {}
        self._build(spec.canonical_shapes())

    # ------------------------------------------------------------------ parameters

    def _param(self, name: str, shape: tuple[int, ...], loader: Loader) -> None:
        if name not in self._params:
            self._params[name] = torch.zeros(shape, dtype=torch.bfloat16)
            self._loaders[name] = loader

    def _build(self, shapes: dict[str, tuple[int, ...]]) -> None:
        s, tp, r = self.spec, self.tp, self.tp_rank
        hd, nh, nkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        q_l = nh // tp * hd
        kv_l = (nkv // tp if nkv >= tp else 1) * hd
        self._kv_rank = r if nkv >= tp else r // (tp // nkv)
        self._sizes = {
            "q": (q_l, r * q_l, 0),
            "k": (kv_l, self._kv_rank * kv_l, q_l),
            "v": (kv_l, self._kv_rank * kv_l, q_l + kv_l),
        }
        padded = -(-s.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        self._per_rank_vocab = padded // tp
        if s.num_experts and self.ep > 1:
            base, rem = divmod(s.num_experts, self.ep)
            start = self.ep_rank * base + min(self.ep_rank, rem)
            self._experts = (start, start + base + (1 if self.ep_rank < rem else 0))
            self._moe_tp, self._moe_rank = 1, 0
        else:
            self._experts = (0, s.num_experts)
            self._moe_tp, self._moe_rank = tp, r
        for name, shape in shapes.items():
            m = _EXPERT.match(name)
            if m:
                self._expert_param(m.group(1), shape)
                continue
            stacked = next(((f, p, sid) for f, p, sid in _STACKED if p in name), None)
            if stacked is not None:
                fused, part, _sid = stacked
                target = name.replace(part, fused)
                rows = q_l + 2 * kv_l if fused == ".qkv_proj." else 2 * (shape[0] // tp)
                self._param(target, (rows, *shape[1:]), self._load_stacked)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                self._param(name, (self._per_rank_vocab, shape[1]), self._load_vocab)
            elif name.endswith((".o_proj.weight", ".down_proj.weight")):
                self._param(name, (shape[0], shape[1] // tp), self._load_row_parallel)
            else:  # norms, the router, row-parallel biases: every rank holds them whole
                self._param(name, shape, self._load_replicated)
        if s.tie_word_embeddings:
            self._aliases["lm_head.weight"] = "model.embed_tokens.weight"

    def _expert_param(self, prefix: str, shape: tuple[int, ...]) -> None:
        n_local = self._experts[1] - self._experts[0]
        h = self.spec.hidden_size
        i_l = self.spec.moe_intermediate_size // self._moe_tp
        self._param(prefix + "w13_weight", (n_local, 2 * i_l, h), self._load_expert)
        self._param(prefix + "w2_weight", (n_local, h, i_l), self._load_expert)

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._params.items()
        if not remove_duplicate:
            for alias, target in self._aliases.items():
                yield alias, self._params[target]

    # ------------------------------------------------------------------ weight loaders

    def _load_vocab(self, param: torch.Tensor, w: torch.Tensor) -> None:
        start = self.tp_rank * self._per_rank_vocab
        n = max(0, min(w.shape[0] - start, self._per_rank_vocab))
        if n:
            param[:n].copy_(w.narrow(0, start, n))
        param[n:].fill_(0)

    def _load_stacked(self, param: torch.Tensor, w: torch.Tensor, shard_id) -> None:
        if shard_id in self._sizes:
            size, src_start, dst_start = self._sizes[shard_id]
        else:  # MergedColumnParallelLinear: each logical output's rank slice
            size = param.shape[0] // 2
            src_start, dst_start = self.tp_rank * size, shard_id * size
        param.narrow(0, dst_start, size).copy_(w.narrow(0, src_start, size))

    def _load_row_parallel(self, param: torch.Tensor, w: torch.Tensor) -> None:
        size = param.shape[1]
        param.copy_(w.narrow(1, self.tp_rank * size, size))

    def _load_replicated(self, param: torch.Tensor, w: torch.Tensor) -> None:
        if param.shape != w.shape:
            raise LayoutError(f"shape {tuple(w.shape)} does not fit parameter {tuple(param.shape)}")
        param.copy_(w)

    def _load_expert(
        self, param: torch.Tensor, w: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        start, stop = self._experts
        if not start <= expert_id < stop:
            return  # another EP rank's expert (FusedMoE's expert_map says -1)
        dst = param[expert_id - start]
        i_l = param.shape[2] if shard_id == "w2" else param.shape[1] // 2
        off = self._moe_rank * i_l
        if shard_id == "w2":
            dst.copy_(w.narrow(1, off, i_l))
        else:
            dst.narrow(0, 0 if shard_id == "w1" else i_l, i_l).copy_(w.narrow(0, off, i_l))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from checkpoint ``(name, tensor)`` pairs; returns the params loaded."""
        loaded: set[str] = set()
        with torch.no_grad():
            for name, w in weights:
                if self.spec.tie_word_embeddings and name == "lm_head.weight":
                    continue
                m = _EXPERT.match(name)
                if m:
                    proj = m.group(3)
                    target = m.group(1) + ("w2_weight" if proj == "down" else "w13_weight")
                    shard = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
                    self._loaders[target](self._params[target], w, shard, int(m.group(2)))
                    loaded.add(target)
                    continue
                for fused, part, sid in _STACKED:
                    if part in name:
                        target = name.replace(part, fused)
                        self._loaders[target](self._params[target], w, sid)
                        break
                else:
                    target = name
                    if target not in self._params:
                        raise LayoutError(f"checkpoint tensor {name!r} has no parameter here")
                    self._loaders[target](self._params[target], w)
                loaded.add(target)
        return loaded
