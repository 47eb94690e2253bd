"""The engine adapter interface: what a receiver needs from an inference engine's weights.

An adapter exposes the engine's *live* local tensors by local name, in the layout of its
receiver shard (``ReceiverLayout.local_specs(shard_id)``), applies decoded updates into them
in place, and carries the version those tensors are at. That is all a receiver needs: it never
copies the model, and it never learns how the engine computes.

- ``params()``: local name -> the tensor the engine computes with (not a copy). Tied aliases
  (``lm_head.weight`` under tied embeddings) are not listed; the layout routes to the target.
- ``apply(updates)``: validate every update against every target first, then write; a bad
  update raises :class:`~deltasync.errors.ApplyError` with every tensor unchanged. Returns
  the number of elements written.
- ``version``: the version the tensors are at. The receiver sets it after a verified apply
  (the engine does not decide what a version is); ``-1`` means "not loaded yet".

:class:`TensorDictEngine` is the plain implementation over a dict of tensors (one TP rank of
:class:`~deltasync.engines.tp_qwen3.TPQwen3Engine`, tests). This module knows tensors and the
codec's ``TensorUpdate``; nothing about models, stores or processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from deltasync.errors import ApplyError
from deltasync.format import TensorUpdate, apply_updates

UNLOADED = -1


@runtime_checkable
class EngineAdapter(Protocol):
    """Live local tensors of one receiver shard, written in place."""

    version: int

    def params(self) -> Mapping[str, torch.Tensor]: ...

    def apply(self, updates: Sequence[TensorUpdate]) -> int: ...


def load_dense(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite every live tensor with a full dense copy (initial load or anchor restore)."""
    if set(tensors) != set(params):
        raise ApplyError(
            f"dense load: names differ from the engine's; missing "
            f"{sorted(set(params) - set(tensors))[:4]}, unexpected "
            f"{sorted(set(tensors) - set(params))[:4]}. Nothing was written"
        )
    for name, t in tensors.items():
        p = params[name]
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ApplyError(
                f"dense load: {name!r} is {tuple(t.shape)} {t.dtype}, the engine holds "
                f"{tuple(p.shape)} {p.dtype}. Nothing was written"
            )
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


class TensorDictEngine:
    """An engine adapter over a plain ``{local_name: tensor}`` dict it owns."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, version: int = UNLOADED) -> None:
        self._tensors = dict(tensors)
        self.version = version

    def params(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def apply(self, updates: Sequence[TensorUpdate]) -> int:
        return apply_updates(updates, self._tensors)
