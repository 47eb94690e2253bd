"""vLLM's weight layout for Qwen3 and Qwen3-MoE under tensor and expert parallelism, as data.

Each rule below was checked against vLLM's own loader code (read, not copied):

- ``vllm/model_executor/models/qwen3.py`` and ``qwen3_moe.py``: fused ``qkv_proj``
  (QKVParallelLinear), ``o_proj`` (RowParallelLinear, no bias), ``q_norm``/``k_norm`` and the
  decoder norms (RMSNorm, replicated), ``mlp.gate`` (ReplicatedLinear router), experts as one
  ``FusedMoE`` (``mlp.experts.w13_weight`` / ``w2_weight``), dense-MLP layers by
  ``mlp_only_layers``/``decoder_sparse_step``; with ``tie_word_embeddings`` ``lm_head`` *is*
  ``model.embed_tokens`` (qwen3.py) or shares its weight (qwen3_moe.py), and the checkpoint's
  ``lm_head.weight`` is skipped, so a tied shard holds one tensor, ``model.embed_tokens.weight``.
  ``qwen3_moe.py`` also refuses TP larger than the number of experts.
- ``vllm/model_executor/models/qwen2.py``: ``Qwen2MLP`` (reused by Qwen3) fuses gate then up in
  ``gate_up_proj`` (MergedColumnParallelLinear, shard ids 0 = gate, 1 = up).
- ``vllm/model_executor/layers/linear.py``: QKVParallelLinear.weight_loader puts rank r's q
  heads, then its k heads, then its v heads; with fewer kv heads than TP ranks each rank holds
  one kv head, ``r // (tp // num_kv_heads)``. MergedColumnParallelLinear puts each logical
  output's rank-r slice at ``sum(previous sizes) / tp``. RowParallelLinear splits the input dim.
- ``vllm/model_executor/layers/vocab_parallel_embedding.py``: the vocabulary is padded to a
  multiple of 64 (``pad_vocab_size``), split evenly over TP; rank r holds padded rows
  ``[r*P, (r+1)*P)``, real rows first, the rest zero-filled (``param[n:].fill_(0)``).
- ``vllm/model_executor/layers/fused_moe/layer.py``: ``w13_weight`` is (E_local, 2*I_tp, H) with
  w1 (gate) in the first half and w3 (up) in the second; ``w2_weight`` is (E_local, H, I_tp),
  split along I; ``determine_expert_map`` with the default "linear" placement gives EP rank e
  the contiguous experts ``[e*base + min(e, rem), ...)``, the first ``rem`` ranks one extra.
- ``vllm/model_executor/layers/fused_moe/config.py``: ``FusedMoEParallelConfig.make`` — with
  expert parallelism the MoE layers use tp 1 and ep = dp*tp with ep_rank = dp_rank*tp + tp_rank;
  without it experts are tensor-parallel along the intermediate dim.

So an EP size M must be a multiple of TP (M = TP * DP); shard ep_rank e has attention TP rank
``e % tp``. Not modelled: vLLM's in-engine DP without EP (MoE then shards across tp*dp),
round-robin expert placement, EPLB redundant experts, quantized weights.
"""

from __future__ import annotations

from deltasync.errors import LayoutError
from deltasync.layout.blocks import Block, view_cols
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.table import LayoutTable, Placement, Shape
from deltasync.names import shard_id

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
RULE_MODEL_TYPES = ("qwen3", "qwen3_moe")  # the families these rules are written for


def pad_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab // pad_to) * pad_to


def expert_range(num_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """Global experts [start, stop) held by ``ep_rank`` under vLLM's linear placement."""
    base, rem = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + base + (1 if ep_rank < rem else 0)


def check_parallelism(spec: ModelSpec, tp: int, ep: int) -> None:
    """Raise LayoutError naming the first TP/EP size vLLM would refuse for this model."""
    if tp < 1 or ep < 1:
        raise LayoutError(f"tp ({tp}) and ep ({ep}) must be >= 1; pass --tp and --ep of 1 or more")
    if spec.model_type not in RULE_MODEL_TYPES:
        raise LayoutError(
            f"the hand-written vLLM rules cover {', '.join(RULE_MODEL_TYPES)}, not "
            f"{spec.model_type!r}: ReceiverLayout.build probes the reference loader for it"
        )
    if spec.attention_bias:
        raise LayoutError(
            "vLLM's Qwen3 o_proj has no bias: a checkpoint with attention_bias=True cannot be "
            "held; sync it to an --engine hf receiver instead"
        )
    if spec.num_attention_heads % tp:
        raise LayoutError(
            f"num_attention_heads ({spec.num_attention_heads}) is not divisible by tp ({tp}); "
            "pass a --tp that divides it"
        )
    kv = spec.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise LayoutError(
            f"num_key_value_heads ({kv}) and tp ({tp}): one must divide the other; pass a --tp "
            "that divides it or is a multiple of it"
        )
    if pad_vocab(spec.vocab_size) % tp:
        raise LayoutError(
            f"padded vocabulary ({pad_vocab(spec.vocab_size)}) is not divisible by tp ({tp}); "
            "pass a --tp that divides it"
        )
    dense_layers = spec.num_hidden_layers - len(spec.moe_layers)
    if dense_layers and spec.intermediate_size % tp:
        raise LayoutError(
            f"intermediate_size ({spec.intermediate_size}) is not divisible by tp ({tp}); "
            "pass a --tp that divides it"
        )
    if ep > 1:
        if not spec.is_moe:
            raise LayoutError(
                f"ep={ep} needs a MoE model; {spec.model_type!r} has no experts: pass --ep 1"
            )
        if ep % tp:
            raise LayoutError(
                f"ep ({ep}) must be a multiple of tp ({tp}): vLLM's EP spans tp*dp ranks; pass "
                "an --ep that is a multiple of --tp"
            )
    if spec.is_moe and not spec.moe_layers:
        raise LayoutError(
            "a Qwen3-MoE config without a sparse layer (mlp_only_layers or decoder_sparse_step "
            "leave none): vLLM's Qwen3MoeForCausalLM refuses to build it; fix those fields in "
            "the model config"
        )
    if spec.is_moe:
        if tp > spec.num_experts:
            raise LayoutError(
                f"tp ({tp}) is greater than the number of experts ({spec.num_experts}); pass a "
                "smaller --tp"
            )
        if ep == 1 and spec.moe_intermediate_size % tp:
            raise LayoutError(
                f"moe_intermediate_size ({spec.moe_intermediate_size}) is not divisible by tp "
                f"({tp}); pass a --tp that divides it, or shard the experts with --ep"
            )


def vllm_shards(spec: ModelSpec, tp: int, ep: int) -> list[tuple[str, int, int]]:
    """(shard id, tp_rank, ep_rank) of every distinct vLLM shard."""
    if ep == 1:
        return [(shard_id(t), t, 0) for t in range(tp)]
    return [(shard_id(e % tp, e), e % tp, e) for e in range(ep)]


class _Builder:
    def __init__(self, spec: ModelSpec) -> None:
        self.src = spec.canonical_shapes()
        self.dst: dict[str, dict[str, Shape]] = {}
        self.placements: dict[str, list[Placement]] = {}

    def local(self, shard: str, name: str, shape: Shape) -> None:
        self.dst.setdefault(shard, {})[name] = shape

    def rows(
        self, canon: str, shard: str, local: str, src_row: int, dst_row: int, rows: int
    ) -> None:
        """Full-width rows of ``canon`` into rows of ``local`` (same width)."""
        cols = view_cols(self.src[canon])
        block = Block(
            src_cols=cols,
            dst_cols=view_cols(self.dst[shard][local]),
            src_row=src_row,
            dst_row=dst_row,
            rows=rows,
        )
        self.placements.setdefault(canon, []).append(Placement(shard, local, block))

    def cols(
        self, canon: str, shard: str, local: str, src_col: int, dst_row: int, cols: int
    ) -> None:
        """A column slice of all rows of ``canon`` into rows of ``local`` starting at ``dst_row``."""
        shape = self.src[canon]
        block = Block(
            src_cols=shape[-1],
            dst_cols=self.dst[shard][local][-1],
            src_row=0,
            dst_row=dst_row,
            rows=shape[0],
            src_col=src_col,
            dst_col=0,
            cols=cols,
        )
        self.placements.setdefault(canon, []).append(Placement(shard, local, block))

    def replicated(self, canon: str, shard: str) -> None:
        self.local(shard, canon, self.src[canon])
        self.rows(canon, shard, canon, 0, 0, self.src[canon][0])


def build_vllm_table(spec: ModelSpec, tp: int, ep: int) -> LayoutTable:
    check_parallelism(spec, tp, ep)
    b = _Builder(spec)
    h, hd = spec.hidden_size, spec.head_dim
    padded = pad_vocab(spec.vocab_size)
    per_rank_vocab = padded // tp
    q_l = spec.num_attention_heads // tp * hd
    kv_heads = spec.num_key_value_heads
    kv_l = (kv_heads // tp if kv_heads >= tp else 1) * hd
    aliases: dict[str, dict[str, str]] = {}

    for sid, t, e in vllm_shards(spec, tp, ep):
        vocab_names = ["model.embed_tokens.weight"] + (
            [] if spec.tie_word_embeddings else ["lm_head.weight"]
        )
        for name in vocab_names:
            b.local(sid, name, (per_rank_vocab, h))
            lo, hi = (
                min(t * per_rank_vocab, spec.vocab_size),
                min((t + 1) * per_rank_vocab, spec.vocab_size),
            )
            if hi > lo:
                b.rows(name, sid, name, lo, 0, hi - lo)
        if spec.tie_word_embeddings:
            aliases[sid] = {"lm_head.weight": "model.embed_tokens.weight"}
        b.replicated("model.norm.weight", sid)
        kv_rank = t if kv_heads >= tp else t // (tp // kv_heads)

        for i in range(spec.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = p + "self_attn.qkv_proj.weight"
            b.local(sid, qkv, (q_l + 2 * kv_l, h))
            b.rows(p + "self_attn.q_proj.weight", sid, qkv, t * q_l, 0, q_l)
            b.rows(p + "self_attn.k_proj.weight", sid, qkv, kv_rank * kv_l, q_l, kv_l)
            b.rows(p + "self_attn.v_proj.weight", sid, qkv, kv_rank * kv_l, q_l + kv_l, kv_l)
            o = p + "self_attn.o_proj.weight"
            b.local(sid, o, (h, q_l))
            b.cols(o, sid, o, t * q_l, 0, q_l)
            for norm in (
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ):
                b.replicated(p + norm, sid)
            if not spec.is_moe_layer(i):
                i_l = spec.intermediate_size // tp
                gu, down = p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"
                b.local(sid, gu, (2 * i_l, h))
                b.rows(p + "mlp.gate_proj.weight", sid, gu, t * i_l, 0, i_l)
                b.rows(p + "mlp.up_proj.weight", sid, gu, t * i_l, i_l, i_l)
                b.local(sid, down, (h, i_l))
                b.cols(down, sid, down, t * i_l, 0, i_l)
                continue
            b.replicated(p + "mlp.gate.weight", sid)
            im = spec.moe_intermediate_size
            if ep > 1:  # whole experts, the ones this EP rank owns
                start, stop = expert_range(spec.num_experts, ep, e)
                im_l, moe_rank = im, 0
            else:  # every expert, tensor-parallel along the intermediate dim
                start, stop = 0, spec.num_experts
                im_l, moe_rank = im // tp, t
            w13, w2 = p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"
            b.local(sid, w13, (stop - start, 2 * im_l, h))
            b.local(sid, w2, (stop - start, h, im_l))
            for g in range(start, stop):
                j = g - start
                ex = p + f"mlp.experts.{g}."
                b.rows(ex + "gate_proj.weight", sid, w13, moe_rank * im_l, j * 2 * im_l, im_l)
                b.rows(ex + "up_proj.weight", sid, w13, moe_rank * im_l, j * 2 * im_l + im_l, im_l)
                b.cols(ex + "down_proj.weight", sid, w2, moe_rank * im_l, j * h, im_l)
    return LayoutTable(src_shapes=b.src, dst_shapes=b.dst, placements=b.placements, aliases=aliases)
