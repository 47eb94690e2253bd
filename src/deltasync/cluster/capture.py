"""What one in-cluster version sends: the tracker's changes joined with the carry.

The carry is the union of the changed positions of every attempt since the last joint commit
(``ClusterSender``'s "Retries"): per parameter a :class:`~deltasync.trainer.positions.Positions`,
about 1 byte per changed element at RL densities. A version is captured in one of two forms:

- *positions* (the overlapped sender): the tracker is asked for positions only
  (``iter_positions()`` or ``iter_changed()`` where it has one, so the detection reads no
  values), each parameter's
  are joined with its carry and encoded as ``Positions`` as soon as it is detected, and that
  dict is both what the background routes and, until the version commits, the carry. No BF16
  value is held between the capture and the background: :func:`route_positions` reads the
  values from the parameters there, which nothing changes until the optimizer's next step (the
  barrier). A failed version leaves only its positions; the retry re-reads the values;
- *indices and values* (the blocking sender): the tracker's ``(name, indices, values)`` triples,
  the carried parameters' indices widened to the union and their values gathered at routing.

Either way the union is sorted and unique, values are the parameters' current BF16 bits, and
an anchor (every element) is captured as neither.

This module knows the tracker protocol, ``Positions`` and routing; nothing about envelopes,
process groups, threads or receivers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from deltasync.errors import ConfigError, LayoutError
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.routing import (
    ShardUpdates,
    canonical_changes,
    checked_changes,
    route_to_shards,
)
from deltasync.trainer import Tracker
from deltasync.trainer.positions import Positions

Carry = dict[str, Positions]

_INTEGER = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


@dataclass(frozen=True, eq=False)
class Capture:
    """One version's captured changes.

    ``positions``: per param, what the overlapped background routes (values read there);
    ``changed``/``values``: the blocking form (int64 indices; the BF16 values the detection
    read, params absent from ``values`` gathered at routing). All three None: an anchor."""

    positions: Carry | None = None
    changed: dict[str, torch.Tensor] | None = None
    values: dict[str, torch.Tensor] | None = None
    detect_s: float = 0.0

    @property
    def anchor(self) -> bool:
        return self.positions is None and self.changed is None

    @property
    def sent(self) -> Mapping[str, Positions | torch.Tensor] | None:
        """Per param, every position this version sends (None for an anchor)."""
        return self.positions if self.positions is not None else self.changed


def _position_stream(tracker: Tracker) -> Iterator[tuple[str, torch.Tensor | Positions]]:
    """The tracker's changed positions, without values where the tracker can give them so:
    already encoded (``iter_positions()``: a whole parameter's int64 positions never exist),
    else as indices (``iter_changed()``), else from its triples."""
    encoded = getattr(tracker, "iter_positions", None)
    method = "iter_positions" if callable(encoded) else "iter_changed"
    positions_only = encoded if callable(encoded) else getattr(tracker, "iter_changed", None)
    if callable(positions_only):
        for item in positions_only():
            if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
                raise ConfigError(
                    f"a tracker's {method}() yields (name, positions) pairs, got "
                    f"{type(item).__name__}"
                )
            name, idx = item
            if isinstance(idx, Positions):
                yield name, idx
                continue
            if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in _INTEGER:
                raise ConfigError(
                    f"changes for {name!r}: indices must be a 1-D integer tensor of flat indices"
                )
            yield name, idx
        return
    for name, idx, _ in checked_changes(tracker.iter_changes()):
        yield name, idx


def capture_positions(tracker: Tracker, carry: Mapping[str, Positions]) -> Capture:
    """The tracker's changed positions joined with ``carry``, one parameter at a time (each
    parameter's int64 indices are dropped once encoded, before the next one is detected).

    Args:
        tracker: asked for positions only (``iter_positions()`` or ``iter_changed()``) where
            it offers that.
        carry: the positions of attempts since the last commit (not modified).

    Returns:
        A :class:`Capture` whose ``positions`` hold every parameter with a position to send.
    """
    t = time.perf_counter()
    out: Carry = {}
    for name, got in _position_stream(tracker):
        if not len(got):
            continue
        old = out.get(name, carry.get(name))  # a name given twice: both are sent
        if isinstance(got, Positions):
            out[name] = got if old is None else old.union(got.indices())
        else:
            out[name] = Positions.of(got) if old is None else old.union(got)
    for name, old in carry.items():
        if name not in out and len(old):
            out[name] = old
    return Capture(positions=out, detect_s=time.perf_counter() - t)


def capture_with_values(tracker: Tracker, carry: Mapping[str, Positions]) -> Capture:
    """The tracker's ``(indices, values)`` joined with ``carry`` as int64 indices; a carried
    parameter's values are dropped (the union's are gathered from the params at routing)."""
    t = time.perf_counter()
    changed: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, idx, vals in checked_changes(tracker.iter_changes()):
        if not idx.numel():
            continue
        changed[name] = idx
        values[name] = vals
    for name, old in carry.items():
        if name in changed:
            changed[name] = old.union(changed[name]).indices()
            del values[name]
        elif len(old):
            changed[name] = old.indices()
    return Capture(changed=changed, values=values, detect_s=time.perf_counter() - t)


def carry_of(sent: Mapping[str, Positions | torch.Tensor]) -> Carry:
    """What the sender keeps of a version whose payloads may reach receivers: each param's
    positions as :class:`Positions` (a private encoding: a tracker may reuse its buffers)."""
    return {
        n: p if isinstance(p, Positions) else Positions.of(p)
        for n, p in sent.items()
        if (len(p) if isinstance(p, Positions) else p.numel())
    }


def route_positions(
    positions: Mapping[str, Positions],
    params: Mapping[str, torch.Tensor],
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    rank: int = 0,
    world_size: int = 1,
) -> ShardUpdates:
    """``{shard: [TensorUpdate]}`` of captured positions, the values read from ``params`` now.

    One parameter at a time: its int64 indices exist only while its values are gathered and
    mapped to canonical coordinates (what routing then holds is O(changed) canonical pairs)."""
    canonical: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pos in positions.items():
        routed = canonical_changes(
            {name: pos.indices()},
            params,
            trainer_layout=trainer_layout,
            rank=rank,
            world_size=world_size,
        )
        for canon, pair in routed.items():
            if canon in canonical:  # the trainer table is a bijection; two params never share one
                raise LayoutError(f"canonical tensor {canon!r} is reached from two params")
            canonical[canon] = pair
    return route_to_shards(canonical, receiver_layout=receiver_layout)


def carry_bytes(carry: Mapping[str, Positions]) -> int:
    """Bytes the carry's positions hold (the tensors)."""
    return sum(p.nbytes for p in carry.values())
