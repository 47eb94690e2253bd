"""Exact change detection by keeping the BF16 bits of every tracked parameter.

This is the oracle the tests compare :class:`~deltasync.AdamWTracker` against, and the exact
fallback the AdamW tracker uses for parameters its error bound does not cover. It costs two
bytes per (local) element of host memory (the retained BF16 copy), which is exactly what the
AdamW tracker avoids for the parameters it covers. FSDP2 DTensor parameters are compared on
this rank's local shard (see :mod:`deltasync.trainer.params`); indices are local to it.

It knows parameters and BF16 bit patterns; it knows nothing about optimizers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from deltasync.errors import ConfigError
from deltasync.trainer.params import Marks, Watched, watch
from deltasync.trainer.protocol import LocalShard


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit pattern (int16) of ``t``: round-to-nearest-even cast for wider floats."""
    b = t.detach() if t.dtype == torch.bfloat16 else t.detach().to(torch.bfloat16)
    return b.contiguous().view(torch.int16).reshape(-1)


class SnapshotTracker:
    """Same contract as :class:`~deltasync.AdamWTracker`, by bitwise comparison to a snapshot.

    ``changed()`` returns exactly the elements whose BF16 bits differ from those at the last
    ``clear()`` (or construction): no extra elements, no missed ones.
    """

    def __init__(
        self, named_params: Iterable[tuple[str, torch.Tensor]] | dict[str, Watched]
    ) -> None:
        """Args:
        named_params: ``model.named_parameters()`` (plain tensors or FSDP2 DTensors).
        """
        self._watched = named_params if isinstance(named_params, dict) else watch(named_params)
        for name, w in self._watched.items():
            if not isinstance(w, Watched):
                raise ConfigError(f"parameter {name!r}: expected (name, tensor) pairs")
        self._snap: dict[str, torch.Tensor] = {}
        self._marked: set[str] = set()  # reported in full until the next clear()
        self._marks = Marks()
        self.clear()

    @property
    def names(self) -> list[str]:
        return list(self._watched)

    @property
    def shards(self) -> dict[str, LocalShard]:
        """Per param, where this process's local tensor sits in the full parameter."""
        return {n: w.shard for n, w in self._watched.items()}

    def local_params(self) -> dict[str, torch.Tensor]:
        """Per param, the plain tensor the indices refer to (a DTensor's local shard)."""
        return {n: w.local() for n, w in self._watched.items()}

    def tracked_params(self) -> dict[str, torch.Tensor]:
        """Per param, the tensor this tracker was given (a DTensor under FSDP2)."""
        return {n: w.param for n, w in self._watched.items()}

    def snapshot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._snap.values())

    def iter_changes(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """The :class:`~deltasync.trainer.Tracker` stream: ``(name, indices, bf16 values)`` per
        changed param, in ``named_params`` order, one param compared at a time."""
        for name, w in self._watched.items():
            cur = bf16_bits(w.local())
            if name in self._marked:
                idx = torch.arange(cur.numel(), dtype=torch.int64, device=cur.device)
            else:
                idx = torch.nonzero(cur != self._snap[name], as_tuple=False).reshape(-1)
            if idx.numel():
                # the values come from the bits just compared: no second read of the param
                yield name, idx.to(torch.int64), cur.index_select(0, idx).view(torch.bfloat16).cpu()

    def changed(self) -> dict[str, torch.Tensor]:
        return {name: idx for name, idx, _ in self.iter_changes()}

    def changed_values(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (indices, current bf16 values)}``; the indices of :meth:`changed`."""
        return {name: (idx, vals) for name, idx, vals in self.iter_changes()}

    def mark_changed(self, *names: str) -> None:
        """Report these parameters changed in full until the next ``clear()``. The snapshot
        sees every write by itself, except one made after a detection read the parameter and
        before the ``clear()`` that follows it (an overlapped sender's read window, where the
        mark also refuses the version: see :meth:`marks`)."""
        for name in names:
            if name not in self._watched:
                raise KeyError(f"{name!r} is not a tracked parameter")
            self._marked.add(name)
            self._marks.add(name)

    @property
    def marked(self) -> frozenset[str]:
        """The parameters marked changed since the last ``clear()``."""
        return frozenset(self._marked)

    def marks(self) -> int:
        """How many ``mark_changed`` marks were made so far (never reset)."""
        return self._marks.count

    def marked_since(self, marks: int) -> set[str]:
        """The parameters marked changed after the ``marks``-th mark."""
        return self._marks.since(marks)

    def clear(self) -> None:
        self._marked.clear()
        for name, w in self._watched.items():
            local = w.local()
            bits = bf16_bits(local)
            prev = self._snap.get(name)
            if prev is not None and prev.shape == bits.shape:
                prev.copy_(bits)  # reuse the buffer: no fresh allocation per version
            elif bits.numel() and bits.data_ptr() == local.data_ptr():
                self._snap[name] = bits.clone()  # a BF16 param: bits are a view of it
            else:
                self._snap[name] = bits
