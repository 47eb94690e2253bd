"""Pure planning of what each receiver shard gets: tracker output + trainer params -> updates.

Data flow (no I/O, no store, no process group, so the in-cluster exchange reuses it as is)::

    changed {param: sorted local flat indices}  (a tracker's ``changed()``)
      -> gather the CURRENT values at those positions, cast to BF16 (round to nearest even,
         exactly what the trainer's own BF16 copy would hold; never a difference)
      -> TrainerLayout: param (or its FSDP dim-0 shard) coords -> canonical coords
      -> ReceiverLayout.route_changes: canonical -> every shard holding the element, merged per
         local tensor (q/k/v land in one sorted qkv_proj update)
      -> {shard: [TensorUpdate, ...]} in the shard's local tensor order

and for anchors and digests, :func:`full_shard_tensors` builds every shard's complete BF16
state from the FULL parameters (never from a delta iterator), so an anchor cannot inherit a
detection miss. Cost: a transient BF16 copy of the model (the cast and the canonical view;
anchors also the shard split), which this module deliberately does not hide. The digests of a
delta's resulting state (:func:`state_digests`) are hashed from the canonical tensors without
building the shards.

This module knows layouts and TensorUpdate; it knows nothing about blobs, keys or stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from deltasync.errors import ConfigError, LayoutError
from deltasync.format import TensorUpdate
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.digests import shard_state_digests
from deltasync.manifest import state_digest
from deltasync.native.ops import bf16_at

ShardUpdates = dict[str, list[TensorUpdate]]
Change = tuple[str, torch.Tensor, torch.Tensor | None]  # (param, sorted indices, bf16 values)
ShardTensors = dict[str, dict[str, torch.Tensor]]

# Sources whose cast to BF16 is the trainer's own (documented) rounding, or exact.
_SOURCE_DTYPES = (torch.float32, torch.bfloat16)


def _check_param(name: str, p: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, torch.Tensor):
        raise ConfigError(f"param {name!r} is a {type(p).__name__}, not a tensor")
    if p.dtype not in _SOURCE_DTYPES:
        raise ConfigError(
            f"param {name!r} is {p.dtype}; deltasync sends BF16 cast from an fp32 master or BF16 "
            "params (a cast from another dtype would not be what the trainer's BF16 copy holds)"
        )
    return p.detach()


def gather_bf16(name: str, param: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """BF16 values of ``param`` at sorted flat row-major ``indices`` (RNE cast from fp32)."""
    p = _check_param(name, param)
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        raise ConfigError(f"changed[{name!r}] must be a 1-D tensor of flat indices")
    idx = indices.to(device=p.device, dtype=torch.int64)
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= p.numel()):
        raise ConfigError(
            f"changed[{name!r}] spans [{int(idx[0])}, {int(idx[-1])}] outside the param's "
            f"{p.numel()} elements (are the indices local to this rank's shard?)"
        )
    try:
        return bf16_at(p, idx)
    except ConfigError as e:
        raise ConfigError(f"changed[{name!r}]: {e}") from None


def _given_values(name: str, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Values the caller captured with the indices (a tracker's ``changed_values()``)."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.bfloat16:
        raise ConfigError(
            f"values[{name!r}] must be a BF16 tensor (the current params' BF16 values at the "
            f"changed indices), got {getattr(values, 'dtype', type(values).__name__)}"
        )
    if values.shape != indices.shape:
        raise ConfigError(
            f"values[{name!r}] holds {values.numel()} values for {indices.numel()} changed "
            "indices; pass the pair from one changed_values() call"
        )
    return values.cpu()


def canonical_changes(
    changed: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    rank: int = 0,
    world_size: int = 1,
    values: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{canonical name: (sorted int64 indices, bf16 values)}`` of every changed element.

    ``params`` and the indices in ``changed`` are this rank's (FSDP dim-0 shard of the) trainer
    parameters; ``rank``/``world_size`` place the shard in the full tensor. ``values``, when
    given, are the params' current BF16 values at those indices (captured by the detection
    pass); otherwise they are gathered from ``params`` here."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, indices in changed.items():
        if name not in params:
            raise ConfigError(
                f"the tracker reports changes in {name!r}, which is not in params; pass the same "
                "named parameters the tracker watches"
            )
        if indices.numel() == 0:
            continue
        idx = indices.to(torch.int64).cpu()
        if values is not None and name in values:
            _check_param(name, params[name])
            vals = _given_values(name, idx, values[name])
        else:
            vals = gather_bf16(name, params[name], idx)
        routed = trainer_layout.route_values(name, idx, vals, rank=rank, world_size=world_size)
        for canon, pair in routed.items():
            if canon in out:  # the trainer table is a bijection; two params never share one
                raise LayoutError(f"canonical tensor {canon!r} is reached from two params")
            out[canon] = pair
    return out


def route_to_shards(
    changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, receiver_layout: ReceiverLayout
) -> ShardUpdates:
    """Canonical changes -> one list of sparse updates per receiver shard (empty if none), in
    each shard's own tensor order (deterministic bytes). Costs what was routed, not the size of
    the layout: a streaming publisher calls it once per parameter group."""
    routed = receiver_layout.route_changes(changes) if changes else {}
    dtype = receiver_layout.spec.dtype
    out: ShardUpdates = {}
    for info in receiver_layout.shards():
        mine = routed.get(info.id)
        if not mine:
            out[info.id] = []
            continue
        shapes = receiver_layout.table.dst_shapes[info.id]
        locals_ = sorted(mine, key=lambda n, s=info.id: receiver_layout.local_position(s, n))
        out[info.id] = [
            TensorUpdate(
                name=local, shape=shapes[local], dtype=dtype, indices=mine[local][0],
                values=mine[local][1],
            )  # fmt: skip
            for local in locals_
            if mine[local][0].numel()
        ]
    return out


def shard_updates(
    changed: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    rank: int = 0,
    world_size: int = 1,
    values: Mapping[str, torch.Tensor] | None = None,
) -> ShardUpdates:
    """Tracker output -> ``{shard: [TensorUpdate]}`` with current BF16 values (``values``:
    see :func:`canonical_changes`)."""
    changes = canonical_changes(
        changed, params, trainer_layout=trainer_layout, rank=rank, world_size=world_size,
        values=values,
    )
    return route_to_shards(changes, receiver_layout=receiver_layout)


def tracker_changes(
    tracker: object,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """``(changed, values)`` dicts from :func:`tracker_stream`, detected all at once (for
    callers that need every change before they start, or several times): with a tracker that
    reads values in its detection pass (AdamWTracker, SnapshotTracker) they save a second,
    cache-cold pass over the params; with only ``changed()``, ``values`` is None."""
    items = list(tracker_stream(tracker))
    values = {n: v for n, _, v in items if v is not None}
    return {n: idx for n, idx, _ in items}, values or None


def every_element_stream(params: Mapping[str, torch.Tensor]) -> Iterator[Change]:
    """A change stream naming every element of every param (a writer's part of an anchor), one
    param at a time, so the index tensors never exist all at once."""
    for n, p in params.items():
        yield n, torch.arange(p.numel(), dtype=torch.int64), None


def every_element(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`every_element_stream` as a ``changed`` dict."""
    return {n: idx for n, idx, _ in every_element_stream(params)}


def change_source(
    changed: Mapping[str, torch.Tensor] | Iterable[tuple],
    params: Mapping[str, torch.Tensor],
    values: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[Change]:
    """What a publisher streams from: ``(name, indices, values or None)`` in ``params`` order.

    ``changed`` is either a dict ``{name: indices}`` (a tracker's ``changed()``; ``values``
    optionally holds the BF16 values per name), checked against ``params`` before anything is
    produced, or an iterable of ``(name, indices)`` / ``(name, indices, values)`` tuples that is
    consumed lazily (a tracker's ``iter_changed()`` / ``iter_changed_values()``: detection runs
    as the publisher consumes it)."""
    if isinstance(changed, Mapping):
        unknown = [n for n in changed if n not in params]
        if unknown:
            raise ConfigError(
                f"the tracker reports changes in {unknown[:3]}, which are not in params; pass "
                "the same named parameters the tracker watches"
            )
        if values is not None and not isinstance(values, Mapping):
            raise ConfigError("values must be a dict {name: bf16 values} when changed is a dict")
        given = values or {}
        return (
            (n, changed[n], given.get(n)) for n in params if n in changed and changed[n].numel()
        )
    if values is not None:
        raise ConfigError(
            "values= goes with a changed dict; a stream of changes carries its values in each "
            "(name, indices, values) tuple"
        )
    return _tuples(changed)


def _tuples(items: Iterable[tuple]) -> Iterator[Change]:
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise ConfigError(
                f"a stream of changes yields (name, indices) or (name, indices, values) tuples, "
                f"got {type(item).__name__}"
            )
        yield (item[0], item[1], item[2] if len(item) == 3 else None)


def tracker_stream(tracker: object) -> Iterator[Change]:
    """A tracker's changes as a stream, the richest the tracker offers: ``iter_changed_values()``
    (lazy: each parameter is detected when the publisher asks for it, its BF16 values read in
    the same pass), else ``changed_values()`` (values from the detection pass, detected at
    once), else ``iter_changed()``, else ``changed()`` (values gathered later from params)."""
    t: Any = tracker
    if callable(getattr(t, "iter_changed_values", None)):
        return _tuples(t.iter_changed_values())
    if callable(getattr(t, "changed_values", None)):
        return _tuples((n, idx, vals) for n, (idx, vals) in t.changed_values().items())
    if callable(getattr(t, "iter_changed", None)):
        return _tuples(t.iter_changed())
    return _tuples(t.changed().items())


def canonical_bf16(
    params: Mapping[str, torch.Tensor], *, trainer_layout: TrainerLayout
) -> dict[str, torch.Tensor]:
    """The FULL trainer params (all names, full shapes) as canonical BF16 tensors."""
    bf16 = {n: _check_param(n, p).to(torch.bfloat16).cpu() for n, p in params.items()}
    return trainer_layout.to_canonical(bf16)


def full_shard_tensors(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> ShardTensors:
    """Every receiver shard's complete BF16 state from the FULL trainer params (all names,
    full shapes): what a dense refit writes, vLLM vocabulary padding zero."""
    return receiver_layout.split(canonical_bf16(params, trainer_layout=trainer_layout))


def state_digests(
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> dict[str, str]:
    """``{shard: state_digest}`` of :func:`full_shard_tensors` without building the shards:
    hashed straight from the canonical tensors (one read of the BF16 state)."""
    # fp32 views of the master weights, cast to BF16 one local tensor's sources at a time:
    # no full BF16 copy and no canonical copy (memory and time of the per-version digest).
    views = trainer_layout.canonical_views({n: _check_param(n, p) for n, p in params.items()})
    return shard_state_digests(receiver_layout.table, views, dtype=torch.bfloat16)


def shard_digests(shards: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """``{shard: state_digest}`` as the manifest lists them."""
    return {shard: state_digest(tensors) for shard, tensors in shards.items()}


def count_elements(updates: list[TensorUpdate]) -> int:
    return sum(u.nnz for u in updates)
