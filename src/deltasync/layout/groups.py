"""Which trainer parameters must be routed together: the unit both senders route at once.

A receiver's local tensor can be fed by several trainer parameters (vLLM's fused ``qkv_proj``
from ``q/k/v_proj``, ``gate_up_proj`` from ``gate/up_proj``, stacked experts from every
expert's projections). Its sorted update can only be built once all of them are detected. So
parameters are grouped into the connected components of "feeds a common local tensor": a group
is routed as one, and its local tensors are fed by no other group, so each group's records are
final the moment it is routed and can go out as one segment of every shard's blob while later
groups are still being detected.

Groups are ordered by their last parameter in the caller's parameter order (a tracker's
detection order), which is when a streaming sender can close them: the store path's publisher
(``publish/segments.py``) and the in-cluster sender's batched build (``cluster/capture.py``)
both cut their segments only between groups.

This module is pure planning over layout tables: no tensors, no stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltasync.errors import ConfigError, LayoutError
from deltasync.layout.receiver_layout import ReceiverLayout
from deltasync.layout.trainer_layout import TrainerLayout


@dataclass(frozen=True)
class ParamGroup:
    """Parameters (in the caller's order) whose changes are routed and encoded together;
    ``last`` is the position of the last of them in that order."""

    params: tuple[str, ...]
    last: int


def param_groups(
    param_names: Sequence[str],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> list[ParamGroup]:
    """Group ``param_names`` (a trainer's named parameters, in detection order) by the receiver
    local tensors they feed; groups come sorted by their last parameter."""
    position = {}
    for i, name in enumerate(param_names):
        if name in position:
            raise ConfigError(f"parameter {name!r} is listed twice")
        position[name] = i
    parent = {name: name for name in param_names}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]  # path halving keeps the trees flat
            name = parent[name]
        return name

    owner: dict[tuple[str, str], str] = {}  # local tensor -> a param that feeds it
    for name in param_names:
        try:
            canonical = trainer_layout.canonical_names(name)
        except LayoutError:
            # Not a parameter of the model (say, an extra tensor in the caller's dict): its own
            # group, which fails with the routing error only if it ever carries changes.
            continue
        for canon in canonical:
            for holder in receiver_layout.holders(canon):
                other = owner.setdefault(holder, name)
                a, b = root(other), root(name)
                if a != b:
                    parent[max(a, b, key=position.__getitem__)] = min(
                        a, b, key=position.__getitem__
                    )
    members: dict[str, list[str]] = {}
    for name in param_names:
        members.setdefault(root(name), []).append(name)
    groups = [ParamGroup(tuple(ps), position[ps[-1]]) for ps in members.values()]
    return sorted(groups, key=lambda g: g.last)
