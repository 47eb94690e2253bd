"""Receiver layouts: canonical tensors → the shards inference workers actually hold.

``ReceiverLayout.build(spec, engine, tp, ep)`` picks the table for an engine convention:

- ``"hf"``: the transformers model's own parameters, one shard (TP = EP = 1);
- ``"vllm"``: vLLM's fused, tensor- and expert-parallel layout: the hand-written
  ``vllm_rules`` for Qwen3 / Qwen3-MoE; for the other families, learned once per process by
  probing the vLLM-convention reference loader (``reference_loader``, ``probe``).

A layout learned from an engine's own loader (``probed.probe_receiver_layout``, ``deltasync
layout probe``) is a ``ReceiverLayout`` too, built with its table and shards directly.

A shard id names one distinct piece of the model (``tp{r}`` or ``tp{r}-ep{e}``); data-parallel
replicas of an engine hold identical shards and share the id, so a blob is produced once per
id. The publisher routes changed canonical elements here; receivers use ``local_specs`` to
validate blobs before writing, and ``split``/``merge`` serve anchors, dense baselines and tests.

This module knows engine conventions only through the rule modules; no I/O, no codec logic
(it hands the codec's ``TensorSpec`` type out).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import LayoutError
from deltasync.format import TensorSpec
from deltasync.layout.hf_model import HF_SHARD, build_hf_table
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.table import LayoutTable, Routed
from deltasync.layout.vllm_rules import RULE_MODEL_TYPES, build_vllm_table, vllm_shards

log = logging.getLogger(__name__)

ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class ShardInfo:
    """One distinct receiver shard. ``ep_rank`` is 0 when expert parallelism is off."""

    id: str
    tp_rank: int
    ep_rank: int

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "tp_rank": self.tp_rank, "ep_rank": self.ep_rank}


class ReceiverLayout:
    """Canonical (HF checkpoint) tensors → every receiver shard of one engine convention."""

    def __init__(
        self,
        *,
        spec: ModelSpec,
        engine: str,
        tp: int,
        ep: int,
        table: LayoutTable,
        shards: list[ShardInfo],
    ):
        self.spec = spec
        self.engine = engine
        self.tp = tp
        self.ep = ep
        self.table = table
        self._shards = list(shards)
        self._by_id = {s.id: s for s in shards}
        # Position of each local tensor in its shard's order, for ordering routed pieces.
        self._order = {sid: {n: i for i, n in enumerate(m)} for sid, m in table.dst_shapes.items()}

    @classmethod
    def build(
        cls, spec: ModelSpec, engine: str = "vllm", tp: int = 1, ep: int = 1
    ) -> ReceiverLayout:
        for name, v in (("tp", tp), ("ep", ep)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(
                    f"{name} must be a positive integer, got {v!r}; pass --{name} 1 or more"
                )
        if engine == "hf":
            if tp != 1 or ep != 1:
                raise LayoutError(
                    "engine 'hf' holds the whole model in one shard: tp and ep must be 1 "
                    f"(got tp={tp}, ep={ep}); pass --tp 1 --ep 1, or use --engine vllm for "
                    "a sharded receiver"
                )
            return cls(
                spec=spec,
                engine=engine,
                tp=1,
                ep=1,
                table=build_hf_table(spec),
                shards=[ShardInfo(HF_SHARD, 0, 0)],
            )
        if engine == "vllm":
            if spec.model_type in RULE_MODEL_TYPES:
                table = build_vllm_table(spec, tp, ep)
            else:
                table = _reference_vllm_table(spec, tp, ep)
            shards = [ShardInfo(sid, t, e) for sid, t, e in vllm_shards(spec, tp, ep)]
            return cls(spec=spec, engine=engine, tp=tp, ep=ep, table=table, shards=shards)
        raise LayoutError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")

    # ------------------------------------------------------------------ metadata

    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def shard(self, shard_id: str) -> ShardInfo:
        try:
            return self._by_id[shard_id]
        except KeyError:
            raise LayoutError(
                f"shard {shard_id!r} is not in this layout; shards: {list(self._by_id)}: pass "
                "one of them, or the --tp/--ep whose layout has it"
            ) from None

    def canonical_specs(self) -> dict[str, TensorSpec]:
        return {
            n: TensorSpec(shape=s, dtype=self.spec.dtype) for n, s in self.table.src_shapes.items()
        }

    def local_specs(self, shard_id: str) -> dict[str, TensorSpec]:
        """Every tensor the shard holds (storage names only; see :meth:`aliases`)."""
        self.shard(shard_id)
        return {
            n: TensorSpec(shape=s, dtype=self.spec.dtype)
            for n, s in self.table.dst_shapes[shard_id].items()
        }

    def local_position(self, shard_id: str, local_name: str) -> int:
        """Position of a local tensor in its shard's tensor order (:meth:`local_specs`)."""
        return self._order[shard_id][local_name]

    def aliases(self, shard_id: str) -> dict[str, str]:
        """Names that are the same storage as another local tensor (tied ``lm_head.weight``).

        Updates are routed to the target name only; an engine that lists the alias separately
        sees the change through the shared storage.
        """
        self.shard(shard_id)
        return dict(self.table.aliases[shard_id])

    def holders(self, canonical_name: str) -> tuple[tuple[str, str], ...]:
        """``(shard_id, local_name)`` of every local tensor holding elements of the canonical
        tensor (several shards for replicated or split tensors; one local tensor may hold
        several canonical ones, e.g. fused ``qkv_proj``)."""
        if canonical_name not in self.table.placements:
            raise LayoutError(
                f"{canonical_name!r} is not a tensor of this layout; pass a checkpoint (canonical) "
                "tensor name of the model the layout was built for"
            )
        return tuple(
            dict.fromkeys((p.shard, p.local) for p in self.table.placements[canonical_name])
        )

    # ------------------------------------------------------------------ sparse

    def route(self, canonical_name: str, indices: torch.Tensor) -> Routed:
        """``{shard_id: {local_name: (local_indices, source_positions)}}``, both int64.

        ``indices`` are sorted, distinct flat indices into the canonical tensor. ``local_indices``
        come out sorted; ``values[source_positions]`` are their values. An element held by
        several shards (replicated norms and kv heads, attention under EP) goes to each.
        """
        return self.table.route(canonical_name, indices)

    def route_values(
        self, canonical_name: str, indices: torch.Tensor, values: torch.Tensor
    ) -> Routed:
        """Like :meth:`route` with the values already gathered: ``(local_indices, values)``."""
        return self.table.route_values(canonical_name, indices, values)

    def route_changes(self, changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Routed:
        """Many canonical tensors at once, merged per local tensor (sorted ``(indices, values)``)."""
        return self.table.route_changes(changes)

    # ------------------------------------------------------------------ dense

    def split(self, full: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Full canonical state dict → ``{shard_id: {local_name: tensor}}`` (vLLM vocab padding zero)."""
        return self.table.split(full)

    def merge(self, shards: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`split`; replicated copies (and tied aliases, if given) must agree bitwise."""
        return self.table.merge(shards)


@functools.lru_cache(maxsize=32)
def _reference_vllm_table(spec: ModelSpec, tp: int, ep: int) -> LayoutTable:
    """The ``vllm`` table of a family without hand-written rules, probed once per process from
    :class:`~deltasync.layout.reference_loader.VllmReferenceLoader` (vLLM's loaders re-stated)."""
    from deltasync.layout.probe import probe_shard
    from deltasync.layout.probe_blocks import assemble_table
    from deltasync.layout.reference_loader import VllmReferenceLoader

    log.info(
        "no hand-written vLLM table for %r: probing the vLLM-convention reference loader "
        "(tp=%d, ep=%d)",
        spec.model_type,
        tp,
        ep,
    )
    canonical = spec.canonical_shapes()
    probes = {
        sid: probe_shard(VllmReferenceLoader(spec, tp=tp, tp_rank=t, ep=ep, ep_rank=e), canonical)
        for sid, t, e in vllm_shards(spec, tp, ep)
    }
    return assemble_table(canonical, probes)
