"""Checks that a receiver's live tensors are exactly what its layout says (names, shapes, dtypes).

Shared by the storage-path :class:`~deltasync.receiver.Receiver` and the in-cluster
:class:`~deltasync.cluster.ClusterReceiver`, so both refuse a mismatched engine the same way,
before anything is fetched or written.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltasync.errors import ConfigError
from deltasync.format import TensorSpec


def check_live_tensors(shard: str, tensors: Mapping[str, torch.Tensor],
                       specs: Mapping[str, TensorSpec]) -> None:
    missing = [n for n in specs if n not in tensors]
    extra = [n for n in tensors if n not in specs]
    if missing or extra:
        raise ConfigError(
            f"receiver shard {shard!r}: live tensors do not match the layout: missing "
            f"{missing[:5]}, unexpected {extra[:5]} (pass storage names only; tied aliases "
            "share storage and need no entry)"
        )
    for name, spec in specs.items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ConfigError(
                f"receiver shard {shard!r}: tensor {name!r} is {tuple(t.shape)} "
                f"{t.dtype}, the layout says {spec.shape} {spec.dtype}"
            )
