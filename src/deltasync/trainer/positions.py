"""Positions: one parameter's sorted changed positions, held compactly between versions.

The overlapped senders (``TrainerSync(overlap=True)``, ``ClusterSender(overlap=True)``) keep the
positions of every version not yet committed: they are what the background routes, and what a
failed version carries into the next one. At RL
densities the gaps between neighbouring changed elements are small (a few dozen at 3%, and
above 255 for a handful of elements in a million), so the positions are held as 8-bit gaps
with escapes: about 1 byte per changed element, instead of 8 (int64) or 4 (int32). Where the
escapes would cost more than that (a sparse parameter, gaps of thousands), the positions are
kept as int32 (int64 at 2^31 elements or more). Decoding is one cumsum; the round trip is
exact (tests pin it).

Encoding: ``first`` (the smallest position, a Python int), ``gaps[i] = p[i+1] - p[i] - 1`` as
uint8 when it is below 255, else the escape 255 with the gap itself in ``escapes`` (in order).
Tensors stay on the device the positions came from (a GPU tracker's are encoded there).

This module knows sorted integer tensors only: nothing about trackers, layouts or stores.
"""

from __future__ import annotations

import torch

_ESCAPE = 255  # a gap byte of 255: the gap is the next entry of ``escapes``
CHUNK = 1 << 20  # positions encoded per slice: the int64 gaps never exist for a whole tensor


class Positions:
    """Sorted unique non-negative flat positions of one parameter, compactly held.

    Build with :meth:`of`; :meth:`indices` gives them back as sorted int64."""

    __slots__ = ("count", "device", "escapes", "first", "gaps", "wide")

    def __init__(
        self,
        *,
        count: int,
        first: int,
        device: torch.device,
        gaps: torch.Tensor | None = None,
        escapes: torch.Tensor | None = None,
        wide: torch.Tensor | None = None,
    ) -> None:
        assert count <= 1 or (gaps is None) != (wide is None)
        self.count, self.first, self.device = count, first, device
        self.gaps, self.escapes, self.wide = gaps, escapes, wide

    @classmethod
    def of(cls, indices: torch.Tensor) -> Positions:
        """Encode sorted, unique, non-negative 1-D integer ``indices`` (any integer dtype).

        The caller vouches for the order (a tracker's output, or a union from
        ``torch.unique``): nothing here re-checks it beyond what the encoding needs."""
        n = indices.numel()
        device = indices.device
        if n <= 1:
            return cls(count=n, first=int(indices[0]) if n else 0, device=device)
        first, last = int(indices[0]), int(indices[-1])
        wide_dtype = torch.int32 if last < 2**31 else torch.int64
        wide_size = torch.empty(0, dtype=wide_dtype).element_size()
        gaps = torch.empty(n - 1, dtype=torch.uint8, device=device)
        escapes, n_escaped = [], 0
        # Slice by slice, so the int64 gaps are a CHUNK-sized transient, not 8 bytes per
        # position of the largest parameter (the embedding) next to its indices.
        for lo in range(0, n - 1, CHUNK):
            hi = min(n - 1, lo + CHUNK)
            diff = indices[lo + 1 : hi + 1].to(torch.int64) - indices[lo:hi].to(torch.int64)
            escaped = diff > _ESCAPE
            k = int(torch.count_nonzero(escaped))
            if k:
                escapes.append(diff[escaped].to(wide_dtype))
                n_escaped += k
                if (n - 1) + n_escaped * wide_size >= n * wide_size:  # too wide to pay off
                    return cls(count=n, first=first, device=device, wide=indices.to(wide_dtype))
            diff.sub_(1).clamp_(max=_ESCAPE)  # an escaped gap is >= 256 - 1: it becomes 255
            gaps[lo:hi] = diff
        return cls(
            count=n,
            first=first,
            device=device,
            gaps=gaps,
            escapes=torch.cat(escapes) if escapes else torch.empty(0, dtype=wide_dtype),
        )

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
            if self.escapes is not None and self.escapes.numel():
                rest[self.gaps == _ESCAPE] = self.escapes.to(torch.int64) - 1
            rest.add_(1)
            rest.cumsum_(0)
            rest.add_(self.first)
        return out

    def union(self, indices: torch.Tensor) -> Positions:
        """These positions joined with sorted ``indices`` (a later version's), encoded again."""
        if indices.numel() == 0:
            return self
        old = self.indices()
        return Positions.of(torch.unique(torch.cat([old, indices.to(old.device, torch.int64)])))

    @property
    def nbytes(self) -> int:
        """Bytes held for this parameter's positions (the tensors, not the object)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.gaps, self.escapes, self.wide)
            if t is not None
        )

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        kind = "gaps8" if self.gaps is not None else ("wide" if self.wide is not None else "small")
        return f"Positions(count={self.count}, {kind}, {self.nbytes} bytes)"
