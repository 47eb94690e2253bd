"""Trainer parameters (whole, or an FSDP2 dim-0 shard) → canonical coordinates.

The trainer's model is the transformers model (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``),
whose parameter names and fused expert tensors ``hf_model`` describes; this is that table read
backwards. A rank that holds an FSDP2 shard (``torch.distributed.fsdp.fully_shard``: dim 0 cut
with ``torch.chunk`` semantics, chunk ``ceil(D0 / W)`` rows, trailing ranks short or empty,
the padding not part of the parameter) maps its changed positions with its rank and world size
alone: no collective, no other rank's data.

This module knows parameter names and index arithmetic; it does not touch optimizers,
process groups or DTensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from deltasync.errors import ConfigError, LayoutError
from deltasync.layout.blocks import Block, bits, numel
from deltasync.layout.hf_model import HF_SHARD, TIED_ALIASES, build_hf_table
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.probe import ProbeConfig
from deltasync.layout.table import LayoutTable

_CANON = "canonical"
_MODEL = HF_SHARD  # the probed table has the hf receiver layout's one shard


def fsdp_dim0_rows(dim0: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that FSDP2 gives ``rank`` of ``world_size`` (may be empty)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise LayoutError(
            f"rank {rank} is not in a world of size {world_size}; pass the trainer's rank and "
            "world size (0 <= rank < world_size)"
        )
    chunk = -(-dim0 // world_size)
    start = min(rank * chunk, dim0)
    return start, min(start + chunk, dim0)


class TrainerLayout:
    """transformers-model parameter names → canonical (HF checkpoint) names and indices.

    ``table`` (canonical → the model's parameters, one shard) defaults to the hand-written
    ``hf_model``; :meth:`from_transformers` learns it from the transformers class instead.
    """

    def __init__(self, spec: ModelSpec, *, table: LayoutTable | None = None) -> None:
        self.spec = spec
        self._forward: LayoutTable = build_hf_table(spec) if table is None else table
        if len(self._forward.dst_shapes) != 1:
            raise LayoutError(
                "a trainer layout table maps into exactly one shard (the model); pass the table "
                "TrainerLayout.from_transformers builds, or none"
            )
        self._table: LayoutTable = self._forward.inverse(shard=_CANON)  # params → canonical
        if table is None:
            self._aliases = dict(TIED_ALIASES) if spec.tie_word_embeddings else {}
        else:
            self._aliases = dict(next(iter(self._forward.aliases.values()), {}))
        # (name, local shape, rank, world size) that misshapen() found right, once each
        self._shapes_ok: set[tuple[str, tuple[int, ...], int, int]] = set()

    @classmethod
    def build(cls, spec: ModelSpec) -> TrainerLayout:
        return cls(spec)

    @classmethod
    def from_transformers(
        cls, model: torch.nn.Module, *, config: ProbeConfig | None = None
    ) -> TrainerLayout:
        """The layout of a transformers model, probed from its class's own checkpoint loading.

        The probe runs on a twin built from ``model.config`` with uninitialised storage (as
        much memory as the model, for the duration of the probe); ``model`` is not touched.

        Args:
            model: the trainer's transformers model (its ``config`` names the family).
            config: a :class:`~deltasync.layout.probe.ProbeConfig`.

        Raises:
            LayoutError: the model's parameters are not those of its class built from its
                config, or the class's loader does not move elements unchanged.
        """
        from deltasync.layout.hf_model import TransformersLoader, empty_model
        from deltasync.layout.probe import probe_shard
        from deltasync.layout.probe_blocks import assemble_table

        spec = ModelSpec.from_hf_config(model.config)
        canonical = spec.canonical_shapes()
        twin = empty_model(model.config)
        shard = probe_shard(TransformersLoader(twin), canonical, config=config)
        del twin
        table = assemble_table(canonical, {_MODEL: shard})
        own = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if own != table.dst_shapes[_MODEL]:
            diff = sorted(set(own) ^ set(table.dst_shapes[_MODEL]))[:3]
            raise LayoutError(
                f"{type(model).__name__}'s parameters differ from its class built from its "
                f"config (e.g. {diff}): the trainer layout cannot be probed for it; pass the "
                "bare transformers model (no DDP, torch.compile or adapter wrapper)"
            )
        return cls(spec, table=table)

    # ------------------------------------------------------------------ names and shards

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and full shapes, as ``model.named_parameters()`` lists them."""
        return dict(self._table.src_shapes)

    def missing(self, names: Iterable[str] | Mapping[str, object]) -> list[str]:
        """The model's parameters (:meth:`param_shapes`) that ``names`` does not hold."""
        have = names if isinstance(names, Mapping) else set(names)
        return [n for n in self._table.src_shapes if n not in have]

    def aliases(self) -> dict[str, str]:
        """Tied names that ``state_dict()`` lists but ``named_parameters()`` does not."""
        return dict(self._aliases)

    def check_tied_once(self, param_names: Iterable[str]) -> None:
        """Refuse params that name one tied tensor twice (``lm_head.weight`` beside
        ``model.embed_tokens.weight``, as ``named_parameters(remove_duplicate=False)`` lists
        them): each canonical tensor is routed from one parameter.

        Raises:
            ConfigError: naming both names and the remedy."""
        names = set(param_names)
        for alias, target in self._aliases.items():
            if alias in names and target in names:
                raise ConfigError(
                    f"params name the tied tensor {target!r} twice (also as {alias!r}); pass "
                    f"each parameter once (drop {alias!r}, as model.named_parameters() does) to "
                    "the tracker and the sync"
                )

    def resolve(self, param_name: str) -> str:
        name = self._aliases.get(param_name, param_name)
        if name not in self._table.src_shapes:
            raise LayoutError(
                f"{param_name!r} is not a parameter of this {self.spec.model_type} model; pass "
                "the names model.named_parameters() gives for the model the config describes"
            )
        return name

    def canonical_names(self, param_name: str) -> tuple[str, ...]:
        """The canonical (checkpoint) tensors that hold elements of ``param_name``."""
        placements = self._table.placements[self.resolve(param_name)]
        return tuple(dict.fromkeys(p.local for p in placements))

    def shard_shape(self, param_name: str, rank: int = 0, world_size: int = 1) -> tuple[int, ...]:
        shape = self._table.src_shapes[self.resolve(param_name)]
        start, stop = fsdp_dim0_rows(shape[0], rank, world_size)
        return (stop - start, *shape[1:])

    def misshapen(
        self, shapes: Iterable[tuple[str, tuple[int, ...]]], rank: int = 0, world_size: int = 1
    ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
        """The first of ``shapes`` (parameter name, its local shape) that is not writer
        ``rank``'s dim-0 shard among ``world_size``: ``(name, its shape, the expected)``, or
        None. A shape of the same size is not enough: a matrix stored transposed (``x @ W``)
        would be routed as the layout's rows and scramble every receiver's copy, and a digest
        computed from the same params would not see it. Names outside the layout are skipped
        (they are named where their changes are routed)."""
        for name, shape in shapes:
            key = (name, shape, rank, world_size)
            if key in self._shapes_ok:
                continue
            try:
                want = self.shard_shape(name, rank, world_size)
            except (KeyError, LayoutError):
                continue
            if shape != want:
                return name, shape, want
            self._shapes_ok.add(key)
        return None

    # ------------------------------------------------------------------ sparse

    def _param_indices(
        self, name: str, indices: torch.Tensor, rank: int, world_size: int
    ) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise LayoutError(f"indices for {name!r} must be a 1-D tensor")
        if (
            indices.dtype.is_floating_point
            or indices.dtype.is_complex
            or indices.dtype == torch.bool
        ):
            raise LayoutError(f"indices for {name!r} must be integers, got {indices.dtype}")
        if indices.dtype != torch.int64:
            indices = indices.to(torch.int64)
        shape = self._table.src_shapes[name]
        start, stop = fsdp_dim0_rows(shape[0], rank, world_size)
        per_row = numel(shape[1:])
        if indices.numel() and (
            int(indices[0]) < 0 or int(indices[-1]) >= (stop - start) * per_row
        ):
            raise LayoutError(
                f"indices for {name!r} fall outside rank {rank}'s shard of "
                f"{(stop - start) * per_row} elements; pass flat indices into this rank's local "
                "shard, with the rank and world size it was sharded over"
            )
        offset = start * per_row
        return indices + offset if offset else indices

    def route(
        self, param_name: str, indices: torch.Tensor, *, rank: int = 0, world_size: int = 1
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Sorted flat indices into (rank's shard of) a parameter → canonical coordinates.

        Returns ``{canonical_name: (canonical_indices, source_positions)}``: sorted int64 indices
        and, for each, its position in ``indices``.
        """
        name = self.resolve(param_name)
        flat = self._param_indices(name, indices, rank, world_size)
        return self._table.route(name, flat).get(_CANON, {})

    def route_values(
        self,
        param_name: str,
        indices: torch.Tensor,
        values: torch.Tensor,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Like :meth:`route`, with values gathered: ``{canonical_name: (indices, values)}``."""
        name = self.resolve(param_name)
        flat = self._param_indices(name, indices, rank, world_size)
        return self._table.route_values(name, flat, values).get(_CANON, {})

    # ------------------------------------------------------------------ dense

    def to_canonical(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full model state dict → the canonical (checkpoint-format) state dict.

        Tied aliases (``lm_head.weight`` when embeddings are tied) may be present; they must equal
        their target bitwise and are dropped.
        """
        params = {}
        for name, t in state_dict.items():
            target = self._aliases.get(name)
            if target is not None:
                if target in state_dict and not torch.equal(
                    bits(t.detach()), bits(state_dict[target].detach())
                ):
                    raise LayoutError(
                        f"{name!r} is tied to {target!r} but differs from it; pass {target!r} "
                        "once (as model.named_parameters() does), or tie the weights again"
                    )
                continue
            params[name] = t.detach()
        return self._table.split(params)[_CANON]

    def canonical_spans(self) -> dict[str, tuple[str, int]]:
        """``{canonical name: (parameter, flat start)}`` of every canonical tensor that is one
        contiguous row range of one parameter (all of Qwen3's, and each expert of a fused
        Qwen3-MoE expert tensor): its elements are the parameter's flat elements from
        ``start`` on, in order. The others are assembled from several pieces."""
        by_dst: dict[str, list[tuple[str, Block]]] = {}
        for src, pls in self._table.placements.items():
            for p in pls:
                if p.block.size:
                    by_dst.setdefault(p.local, []).append((src, p.block))
        spans: dict[str, tuple[str, int]] = {}
        for name, shape in self._table.dst_shapes[_CANON].items():
            pieces = by_dst.get(name, [])
            if len(pieces) == 1 and pieces[0][1].contiguous and pieces[0][1].size == numel(shape):
                src, b = pieces[0]
                spans[name] = (src, b.src_span()[0])
        return spans

    def canonical_views(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Like :meth:`to_canonical` but without copying: every canonical tensor of
        :meth:`canonical_spans` is returned as a view of its parameter; any other is built by
        copying. Values keep the parameters' dtype (e.g. fp32 master weights)."""
        views: dict[str, torch.Tensor] = {}
        spans = self.canonical_spans()
        rest: set[str] = set()
        for name, shape in self._table.dst_shapes[_CANON].items():
            if name in spans:
                src, start = spans[name]
                flat = state_dict[src].detach().reshape(-1)
                views[name] = flat[start : start + numel(shape)].view(shape)
            else:
                rest.add(name)
        if rest:
            full = self.to_canonical(state_dict)
            views.update({n: full[n] for n in rest})
        return views

    def from_canonical(self, canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`to_canonical` (without aliases)."""
        (shard,) = self._forward.dst_shapes
        return self._forward.split(canonical)[shard]
