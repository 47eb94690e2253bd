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


# Ends the error of a rank left holding no verified version (its weights were changed by
# something else and could not be restored): no rank wrote, yet not every rank stays where it was.
UNVERIFIED_NOTE = " (this rank now holds no verified version)"
# What an update refused before any write says instead of NOTHING_WRITTEN_STATE when a rank
# failed with UNVERIFIED_NOTE (without NOTHING_WRITTEN: the weights served are not a version).
UNVERIFIED_STATE = (
    "nothing of it was written, but ranks whose weights something else had changed hold no "
    "verified version until the next update restores them"
)


def failed_ranks(
    shard: str,
    error: BaseException | None,
    gather: Gather | None,
    *,
    unverified: bool = False,
    asked: str | None = None,
) -> list[tuple[str, str]]:
    """Every rank's ``(shard, error)``, for the ranks that failed; ``gather`` None: this rank
    alone (TP = 1). ``unverified``: this rank holds no verified version now (its error then
    ends with :data:`UNVERIFIED_NOTE`). ``asked``: what this rank was asked to take; ranks
    asked for different things all fail (:data:`ASKED_OTHERWISE`), since each alone would
    take what it was asked and the engine would serve a mix."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if mine is not None and unverified:
        mine += UNVERIFIED_NOTE
    outcomes = [(shard, mine, asked)] if gather is None else gather((shard, mine, asked))
    if len({a for _, _, a in outcomes}) > 1:
        outcomes = [(s, _asked_otherwise(err, a), a) for s, err, a in outcomes]
    return [(s, err) for s, err, _ in outcomes if err is not None]


# Why each rank fails an update its ranks were asked for differently.
ASKED_OTHERWISE = "the TP ranks were asked for different updates"


def _asked_otherwise(err: str | None, asked: str | None) -> str:
    why = f"{ASKED_OTHERWISE}; this one for {asked}"
    return why if err is None else f"{err} ({why})"


def unwritten_state(failed: Sequence[tuple[str, str]]) -> str:
    """What the ranks hold after an update refused before any write."""
    if any(err.endswith(UNVERIFIED_NOTE) for _, err in failed):
        return UNVERIFIED_STATE
    return NOTHING_WRITTEN_STATE


def refused(version: int, failed: Sequence[tuple[str, str]], state: str) -> ApplyError:
    """The error of an update the ranks did not take: ``state`` says what the ranks hold."""
    where = "; ".join(f"shard {shard!r}: {err}" for shard, err in failed)
    return ApplyError(f"version {version} was not taken ({state}): {where}")
