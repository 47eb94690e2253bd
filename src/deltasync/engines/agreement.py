"""What the TP ranks of one engine tell each other about one update, in the same words for
every engine hook (the vLLM backend, the SGLang loader).

An engine replies to its caller with one rank's result, so a rank that failed alone would
leave the engine serving two versions while reporting the new one. Every rank therefore
shares its outcome (``failed_ranks``) before its first write and after it, and a refused update
is one :class:`~deltasync.errors.ApplyError` naming each failed shard's error (``refused``).
An update refused before any rank's first write says :data:`NOTHING_WRITTEN`, which is how
a trainer engine tells that the weights served are still the previous version's.

This module knows ranks' outcomes and messages; nothing of engines, stores or versions'
contents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deltasync.errors import ApplyError

# All-gather of one picklable item per TP rank, in rank order (the engine's TP CPU group).
Gather = Callable[[Any], list[Any]]

# In the message of every update refused before any rank's first write.
NOTHING_WRITTEN = "no rank wrote anything"
NOTHING_WRITTEN_STATE = f"{NOTHING_WRITTEN}; every rank stays at its previous verified version"


def group_gather(group: Any, size: int) -> Gather:
    """The all-gather over ``group`` (a gloo CPU process group of ``size`` ranks)."""
    import torch.distributed as dist

    def gather(item: Any) -> list[Any]:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, item, group=group)
        return out

    return gather


def failed_ranks(
    shard: str, error: BaseException | None, gather: Gather | None
) -> list[tuple[str, str]]:
    """Every rank's ``(shard, error)``, for the ranks that failed; ``gather`` None: this rank
    alone (TP = 1)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = [(shard, mine)] if gather is None else gather((shard, mine))
    return [(s, err) for s, err in outcomes if err is not None]


def refused(version: int, failed: Sequence[tuple[str, str]], state: str) -> ApplyError:
    """The error of an update the ranks did not take: ``state`` says what the ranks hold."""
    where = "; ".join(f"shard {shard!r}: {err}" for shard, err in failed)
    return ApplyError(f"version {version} was not taken ({state}): {where}")
