"""Positions: one parameter's sorted changed positions, held compactly between versions.

``TrainerSync(overlap=True)`` keeps the positions of every version not yet committed (they are
what the background routes, and what a failed version carries into the next one). At RL
densities the gaps between neighbouring changed elements are small (a few dozen at 3%), so
the positions are held as 16-bit gaps: 2 bytes per changed element, instead of 8 (int64) or
4 (int32). A parameter with any gap above 65536 keeps its positions as int32 (int64 at 2^31
elements or more). Decoding is one cumsum; the round trip is exact (a test pins it).

Encoding: ``first`` (the smallest position, a Python int) and ``gaps[i] = p[i+1] - p[i] -
_OFFSET`` as int16, so that gaps 1..65536 fill the whole int16 range. Tensors stay on the
device the positions came from (a GPU tracker's positions are encoded on the GPU).

This module knows sorted integer tensors only: nothing about trackers, layouts or stores.
"""

from __future__ import annotations

import torch

_OFFSET = 32769  # gap g in [1, 65536] is stored as g - 32769 in [-32768, 32767]
_MAX_GAP = 65536


class Positions:
    """Sorted unique non-negative flat positions of one parameter, compactly held.

    Build with :meth:`of`; :meth:`indices` gives them back as sorted int64."""

    __slots__ = ("count", "device", "first", "gaps", "wide")

    def __init__(
        self,
        *,
        count: int,
        first: int,
        gaps: torch.Tensor | None,
        wide: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        assert (gaps is None) != (wide is None) or count <= 1
        self.count, self.first, self.gaps, self.wide, self.device = count, first, gaps, wide, device

    @classmethod
    def of(cls, indices: torch.Tensor) -> Positions:
        """Encode sorted, unique, non-negative 1-D integer ``indices`` (any integer dtype).

        The caller vouches for the order (a tracker's output, or a union from
        ``torch.unique``): nothing here re-checks it beyond what the encoding needs."""
        n = indices.numel()
        device = indices.device
        if n == 0:
            return cls(count=0, first=0, gaps=None, wide=None, device=device)
        first = int(indices[0])
        if n == 1:
            return cls(count=1, first=first, gaps=None, wide=None, device=device)
        # One parameter at a time: the int64 diff is the transient (8 bytes per position).
        diff = torch.diff(indices.to(torch.int64))
        if int(diff.max()) <= _MAX_GAP:
            diff.sub_(_OFFSET)
            return cls(count=n, first=first, gaps=diff.to(torch.int16), wide=None, device=device)
        del diff
        last = int(indices[-1])
        wide = indices.to(torch.int32 if last < 2**31 else torch.int64)
        return cls(count=n, first=first, gaps=None, wide=wide, device=device)

    def indices(self) -> torch.Tensor:
        """The positions as a sorted int64 tensor on their device."""
        if self.wide is not None:
            return self.wide.to(torch.int64)
        out = torch.empty(self.count, dtype=torch.int64, device=self.device)
        if self.count == 0:
            return out
        out[0] = self.first
        if self.gaps is not None:
            rest = out[1:]
            rest.copy_(self.gaps)  # widen in place: no second int64 temporary
            rest.add_(_OFFSET)
            rest.cumsum_(0)
            rest.add_(self.first)
        return out

    def union(self, indices: torch.Tensor) -> Positions:
        """These positions joined with sorted ``indices`` (a later version's), encoded again."""
        old = self.indices()
        if indices.numel() == 0:
            return self
        return Positions.of(torch.unique(torch.cat([old, indices.to(old.device, torch.int64)])))

    @property
    def nbytes(self) -> int:
        """Bytes held per this parameter's positions (the tensors, not the object)."""
        held = self.gaps if self.gaps is not None else self.wide
        return 0 if held is None else held.numel() * held.element_size()

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        kind = "gaps16" if self.gaps is not None else ("wide" if self.wide is not None else "small")
        return f"Positions(count={self.count}, {kind}, {self.nbytes} bytes)"
