"""A ``full_state`` callable for sharded trainers: every parameter gathered whole, in BF16,
one at a time.

With several writers (FSDP2 ranks, each holding a dim-0 shard) the committing writer hashes
every receiver shard's state from the full parameters, so ``TrainerSync`` and
``ClusterSender`` take a ``full_state`` callable and call it on every writer (it is a
collective). The shard digests hash BF16 bits, and the BF16 cast is elementwise, so each
parameter can be cast on its own shard first and gathered in BF16: half the bytes of an fp32
gather, the same bits. :func:`gather_bf16` does that a parameter at a time, moving each
gathered tensor to ``device`` (the host by default) before the next is gathered, so the
accelerator holds one full parameter at most, and a rank that does not keep the result holds
nothing after the call.

This module knows DTensors and dtypes; nothing about layouts, digests or publishing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from deltasync.errors import ConfigError
from deltasync.trainer.params import is_dtensor


def gather_bf16(
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    keep: bool = True,
    device: str | torch.device = "cpu",
) -> Callable[[], dict[str, torch.Tensor]]:
    """A ``full_state`` callable: ``{name: the whole parameter in BF16, on device}``.

    Each call gathers every DTensor parameter (``full_tensor()`` of its BF16 cast: a
    collective over its mesh, so every rank holding a shard must call it, in the same order;
    ``TrainerSync`` and ``ClusterSender`` call it on every writer) and casts a plain tensor
    (already whole on this rank). Parameters are taken in ``named_params`` order, read once
    at construction (``model.named_parameters()`` is the same order on every rank).

    Args:
        named_params: the trainer's parameters, e.g. ``model.named_parameters()``.
        keep: whether this rank keeps what it gathered. Only the committing writer (writer 0)
            reads the state when it publishes; a rank with ``keep=False`` joins every gather
            and returns ``{}``. ``resume()`` compares the state's digests on every writer, so
            a job that resumes keeps it on every rank (``ConfigError`` naming this otherwise);
            a non-committing writer without it handed a version already committed cannot
            compare it (``CommitConflictError``, its changes kept, as without ``full_state``).
        device: where the gathered tensors go, one at a time (default: the host).

    Raises:
        ConfigError: ``named_params`` is empty or names a parameter twice.
    """
    params = [(name, p) for name, p in named_params]
    if not params:
        raise ConfigError("gather_bf16 needs the trainer's parameters; it was given none")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"gather_bf16 was given parameters {twice[:5]} more than once")
    target = torch.device(device)

    def gather() -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params:
                t = p.detach().to(torch.bfloat16)
                whole = t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
                if keep:
                    out[name] = whole.to(target)
                del t, whole
        return out

    return gather
