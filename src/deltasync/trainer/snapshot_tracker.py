"""Exact change detection by keeping the BF16 bits of every tracked parameter.

This is the oracle the tests compare :class:`~deltasync.AdamWTracker` against, and the exact
fallback the AdamW tracker uses for parameters its error bound does not cover. It costs two
bytes per element of host memory (the retained BF16 copy), which is exactly what the AdamW
tracker avoids for the parameters it covers.

It knows parameters and BF16 bit patterns; it knows nothing about optimizers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from deltasync.errors import ConfigError


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit pattern (int16) of ``t``: round-to-nearest-even cast for wider floats."""
    b = t.detach() if t.dtype == torch.bfloat16 else t.detach().to(torch.bfloat16)
    return b.contiguous().view(torch.int16).reshape(-1)


def named_unique(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in named_params:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise ConfigError(
                f"named_params must yield (str, Tensor) pairs, got ({type(name).__name__}, {type(p).__name__})"
            )
        if name in out:
            raise ConfigError(
                f"parameter name {name!r} appears twice in named_params; names must be unique"
            )
        if not p.is_floating_point():
            raise ConfigError(
                f"parameter {name!r} has dtype {p.dtype}; only floating-point tensors can be tracked"
            )
        out[name] = p
    return out


class SnapshotTracker:
    """Same contract as :class:`~deltasync.AdamWTracker`, by bitwise comparison to a snapshot.

    ``changed()`` returns exactly the elements whose BF16 bits differ from those at the last
    ``clear()`` (or construction): no extra elements, no missed ones.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._params = named_unique(named_params)
        self._snap: dict[str, torch.Tensor] = {}
        self.clear()

    @property
    def names(self) -> list[str]:
        return list(self._params)

    def snapshot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._snap.values())

    def changed(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            diff = bf16_bits(p) != self._snap[name]
            idx = torch.nonzero(diff, as_tuple=False).reshape(-1)
            if idx.numel():
                out[name] = idx.to(torch.int64)
        return out

    def iter_changes(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """The :class:`~deltasync.trainer.Tracker` stream: ``(name, indices, bf16 values)`` per
        changed param, in ``named_params`` order, one param compared at a time."""
        for name, p in self._params.items():
            cur = bf16_bits(p)
            idx = torch.nonzero(cur != self._snap[name], as_tuple=False).reshape(-1)
            if idx.numel():
                # the values come from the bits just compared: no second read of the param
                yield name, idx.to(torch.int64), cur.index_select(0, idx).view(torch.bfloat16).cpu()

    def changed_values(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (indices, current bf16 values)}``; the indices of :meth:`changed`."""
        return {name: (idx, vals) for name, idx, vals in self.iter_changes()}

    def clear(self) -> None:
        for name, p in self._params.items():
            bits = bf16_bits(p)
            prev = self._snap.get(name)
            if prev is not None and prev.shape == bits.shape:
                prev.copy_(bits)  # reuse the buffer: no fresh allocation per version
            else:
                self._snap[name] = bits.clone() if bits.data_ptr() == p.data_ptr() else bits
