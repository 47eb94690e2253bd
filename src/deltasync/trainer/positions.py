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

Once a background has routed a parameter, its positions only wait for the commit (a failed
version's carry is read again, nothing else is): :meth:`Positions.pack` then holds the gap
bytes zstd-compressed (level 1: ~70% of them at RL densities), and every read decompresses a
temporary copy.

Encoding: ``first`` (the smallest position, a Python int), ``gaps[i] = p[i+1] - p[i] - 1`` as
uint8 when it is below 255, else the escape 255 with the gap itself in ``escapes`` (in order).
Tensors stay on the device the positions came from (a GPU tracker's are encoded there).

This module knows sorted integer tensors only: nothing about trackers, layouts or stores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

import torch
import zstandard

from deltasync.errors import TensorInputError
from deltasync.native import loader as native

_ESCAPE = 255  # a gap byte of 255: the gap is the next entry of ``escapes``
CHUNK = 1 << 20  # positions encoded per slice: the int64 gaps never exist for a whole tensor
PACK_MIN = 1 << 16  # gap bytes below this are never packed (the frame would not pay off)


_tls = threading.local()


def _scratch_esc(n: int) -> torch.Tensor:
    """This thread's reused int64 buffer for a slice's escapes (grown to the largest slice)."""
    buf = getattr(_tls, "esc", None)
    if buf is None or buf.numel() < n:
        buf = _tls.esc = torch.empty(max(n, 1 << 16), dtype=torch.int64)
    return buf


def _encode_native(cur: torch.Tensor, before: int) -> tuple[torch.Tensor, int]:
    """Gap bytes of int64 ``cur`` after position ``before``, and how many escapes went to
    :func:`_scratch_esc` (-1: not strictly increasing)."""
    lib = native.load()
    assert lib is not None
    gaps = torch.empty(cur.numel(), dtype=torch.uint8)
    esc = _scratch_esc(cur.numel())
    k = lib.ds_gaps_encode(cur.data_ptr(), cur.numel(), before, gaps.data_ptr(), esc.data_ptr())
    return gaps, int(k)


class Positions:
    """Sorted unique non-negative flat positions of one parameter, compactly held.

    Build with :meth:`of`; :meth:`indices` gives them back as sorted int64."""

    __slots__ = ("count", "device", "escapes", "first", "gaps", "packed", "wide")

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
        self.packed: bytes | None = None  # the gap bytes zstd-compressed, after pack()

    def pack(self) -> None:
        """Hold the gap bytes zstd-compressed (level 1: ~70% of them at RL densities) from now
        on; every read decompresses a temporary copy. For positions that only wait for a
        commit (a failed version's carry is read again, nothing else is) once the background
        has routed them. No-op on the device, for small or incompressible gaps."""
        gaps = self.gaps
        if gaps is None or gaps.device.type != "cpu" or gaps.numel() < PACK_MIN:
            return
        packed = zstandard.ZstdCompressor(level=1).compress(memoryview(gaps.numpy()))
        if len(packed) * 10 < gaps.numel() * 9:
            self.packed = packed  # before gaps goes: a reader seeing no gaps finds these
            self.gaps = None

    def _gap_bytes(self) -> torch.Tensor | None:
        """The uint8 gap bytes (decompressed into a temporary where packed), or None."""
        gaps = self.gaps
        if gaps is not None or self.packed is None:
            return gaps
        raw = zstandard.ZstdDecompressor().decompress(self.packed)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def of(cls, indices: torch.Tensor) -> Positions:
        """Encode sorted, unique, non-negative 1-D integer ``indices`` (any integer dtype).

        The caller vouches for the order (a tracker's output, or a union from
        ``torch.unique``): nothing here re-checks it beyond what the encoding needs."""
        return cls.from_chunks([indices], device=indices.device)

    @classmethod
    def held(cls, indices: torch.Tensor) -> Positions:
        """Sorted, unique, non-negative 1-D int64 or int32 ``indices`` held as they are, not
        encoded (4 or 8 bytes a position instead of about 1): for positions that live only
        while a small delta publishes on the caller's thread, where encoding each parameter's
        costs more than the bytes it saves. :meth:`compact` encodes them when they are kept
        longer. The caller vouches for the order, as for :meth:`of`."""
        n = indices.numel()
        if n <= 1:
            return cls(count=n, first=int(indices[0]) if n else 0, device=indices.device)
        return cls(count=n, first=int(indices[0]), device=indices.device, wide=indices)

    def compact(self) -> Positions:
        """These positions at about a byte each: :meth:`held` ones encoded, others as they
        are."""
        if self.wide is None or self.wide.dtype != torch.int64:
            return self
        return Positions.of(self.wide)

    @classmethod
    def from_chunks(
        cls, chunks: Iterable[torch.Tensor], *, device: torch.device | None = None
    ) -> Positions:
        """Encode the concatenation of ``chunks`` (each sorted, unique, non-negative 1-D
        integers, every chunk above the one before) without ever building it: a detection
        pass hands over each chunk's positions as it finishes the chunk, and only the 8-bit
        gaps (about 1 byte per position) are kept. Equal to ``of(torch.cat(chunks))``.

        Args:
            chunks: the positions in order, in pieces of any size (empty ones are skipped).
            device: where the encoding lives when ``chunks`` is empty (default: CPU).

        Returns:
            The encoded positions.
        """
        first: int | None = None
        prev = last = 0
        n = n_escaped = 0
        gap_parts: list[torch.Tensor] = []
        escapes: list[torch.Tensor] = []
        for chunk in chunks:
            m = chunk.numel()
            if m == 0:
                continue
            device = chunk.device
            if first is None:
                first = prev = int(chunk[0])
                start = 1
            else:
                start = 0
            # Slice by slice, so the int64 gaps are a CHUNK-sized transient, not 8 bytes per
            # position of the largest parameter (the embedding) next to its indices.
            for lo in range(start, m, CHUNK):
                hi = min(m, lo + CHUNK)
                cur = chunk[lo:hi].to(torch.int64)
                before = int(chunk[lo - 1]) if lo else prev
                if native.usable(cur):  # one C pass: gap bytes and escapes, no temporaries
                    g, k = _encode_native(cur, before)
                    if k < 0:
                        raise TensorInputError("Positions: the positions do not strictly increase")
                    if k:
                        escapes.append(_scratch_esc(hi - lo)[:k].clone())
                        n_escaped += k
                    gap_parts.append(g)
                    continue
                diff = torch.empty_like(cur)
                diff[0] = cur[0] - before
                torch.sub(cur[1:], cur[:-1], out=diff[1:])
                escaped = diff > _ESCAPE
                k = int(torch.count_nonzero(escaped))
                if k:
                    escapes.append(diff[escaped])
                    n_escaped += k
                diff.sub_(1).clamp_(max=_ESCAPE)  # an escaped gap is >= 256 - 1: it becomes 255
                gap_parts.append(diff.to(torch.uint8))
            prev = last = int(chunk[-1])
            n += m
        device = torch.device("cpu") if device is None else device
        if first is None or n <= 1:
            return cls(count=n, first=first or 0, device=device)
        wide_dtype = torch.int32 if last < 2**31 else torch.int64
        wide_size = torch.empty(0, dtype=wide_dtype).element_size()
        gaps = torch.cat(gap_parts) if len(gap_parts) > 1 else gap_parts[0]
        del gap_parts
        esc = torch.cat(escapes) if escapes else torch.empty(0, dtype=torch.int64, device=device)
        out = cls(count=n, first=first, device=device, gaps=gaps, escapes=esc.to(wide_dtype))
        if (n - 1) + n_escaped * wide_size >= n * wide_size:  # escapes too wide to pay off
            return cls(count=n, first=first, device=device, wide=out.indices().to(wide_dtype))
        return out

    def indices(self) -> torch.Tensor:
        """The positions as a sorted int64 tensor on their device."""
        if self.wide is not None:
            return self.wide.to(torch.int64)
        out = torch.empty(self.count, dtype=torch.int64, device=self.device)
        if self.count == 0:
            return out
        out[0] = self.first
        gaps = self._gap_bytes()
        if gaps is not None and native.usable(gaps):  # one C pass
            lib = native.load()
            assert lib is not None
            esc = self._escapes_int64()
            lib.ds_gaps_decode(
                gaps.data_ptr(), self.count - 1, esc.data_ptr(), self.first, out.data_ptr() + 8
            )
            return out
        if gaps is not None:
            rest = out[1:]
            rest.copy_(gaps)  # widen in place: no second int64 temporary
            if self.escapes is not None and self.escapes.numel():
                rest[gaps == _ESCAPE] = self.escapes.to(torch.int64) - 1
            rest.add_(1)
            rest.cumsum_(0)
            rest.add_(self.first)
        return out

    def slices(self, size: int = CHUNK) -> Iterator[torch.Tensor]:
        """The positions in order as sorted int64 tensors of at most ``size`` (>= 1) each,
        decoded one at a time: never the int64 positions of a whole parameter."""
        assert size >= 1
        if self.count == 0:
            return
        if self.wide is not None:
            for lo in range(0, self.count, size):
                yield self.wide[lo : lo + size].to(torch.int64)
            return
        yield torch.tensor([self.first], dtype=torch.int64, device=self.device)
        gaps = self._gap_bytes()
        if gaps is None:
            return
        prev, e = self.first, 0
        if native.usable(gaps):  # one C pass per slice
            lib = native.load()
            assert lib is not None
            esc = self._escapes_int64()
            for lo in range(0, self.count - 1, size):
                m = min(size, self.count - 1 - lo)
                out = torch.empty(m, dtype=torch.int64)
                e += lib.ds_gaps_decode(
                    gaps.data_ptr() + lo, m, esc.data_ptr() + 8 * e, prev, out.data_ptr()
                )
                prev = int(out[-1])
                yield out
            return
        for lo in range(0, self.count - 1, size):
            raw = gaps[lo : lo + size]
            out = raw.to(torch.int64)
            if self.escapes is not None and self.escapes.numel():
                escaped = raw == _ESCAPE
                k = int(torch.count_nonzero(escaped))
                if k:
                    out[escaped] = self.escapes[e : e + k].to(torch.int64) - 1
                    e += k
            out.add_(1).cumsum_(0).add_(prev)
            prev = int(out[-1])
            yield out

    def ranges(
        self, bounds: Sequence[int], *, size: int = CHUNK, reuse: bool = False
    ) -> Iterator[torch.Tensor]:
        """Per range ``[bounds[i], bounds[i + 1])`` (ascending), the positions inside it as a
        sorted int64 tensor, one range at a time: two decoding passes (the first counts), so
        only one range's int64 positions ever exist, never the whole parameter's. With
        ``reuse`` every range is a view of one buffer sized to the largest (the caller is done
        with each range before it asks for the next): no allocation per range, so the heap
        does not keep the freed block of one range next to the next one's."""
        if len(bounds) < 2:
            return
        gaps = self._gap_bytes()
        if gaps is not None and native.usable(gaps):
            yield from self._ranges_native(gaps, bounds, size, reuse)
            return
        cuts = torch.tensor(list(bounds), dtype=torch.int64, device=self.device)
        counts = [0] * (len(bounds) - 1)
        for part in self.slices(size):
            at = torch.searchsorted(part, cuts).tolist()
            for i in range(len(counts)):
                counts[i] += at[i + 1] - at[i]
        parts = self.slices(size)
        part = next(parts, None)
        used = 0  # of ``part``
        buf = torch.empty(max(counts), dtype=torch.int64, device=self.device) if reuse else None
        for i, count in enumerate(counts):
            out = (
                buf[:count]
                if buf is not None
                else torch.empty(count, dtype=torch.int64, device=self.device)
            )
            filled = 0
            while filled < count and part is not None:
                lo = used + int(torch.searchsorted(part[used:], cuts[i]))
                take = min(count - filled, part.numel() - lo)
                out[filled : filled + take] = part[lo : lo + take]
                filled += take
                used = lo + take
                if used == part.numel():
                    part, used = next(parts, None), 0
            assert filled == count
            yield out

    def _ranges_native(
        self, gaps: torch.Tensor, bounds: Sequence[int], size: int, reuse: bool
    ) -> Iterator[torch.Tensor]:
        """:meth:`ranges` through the C decoder: the counting pass decodes into one reused
        buffer, the second decodes each range's positions straight into its output (they are
        the next ``count`` positions of the sequence), so nothing else is allocated."""
        assert self.count >= 2
        lib = native.load()
        assert lib is not None
        esc = self._escapes_int64()
        gaps_ptr, esc_ptr, n_gaps = gaps.data_ptr(), esc.data_ptr(), self.count - 1
        cuts = torch.tensor(list(bounds), dtype=torch.int64)
        ranges = len(bounds) - 1
        counts = [0] * ranges
        below = 0  # positions under bounds[0]: skipped

        def tally(values: torch.Tensor) -> None:
            nonlocal below
            at = torch.searchsorted(values, cuts).tolist()
            below += at[0]
            for i in range(ranges):
                counts[i] += at[i + 1] - at[i]

        tally(torch.tensor([self.first], dtype=torch.int64))
        scratch = torch.empty(min(size, n_gaps), dtype=torch.int64)
        lo = e = 0
        prev = self.first
        while lo < n_gaps:
            m = min(scratch.numel(), n_gaps - lo)
            e += lib.ds_gaps_decode(gaps_ptr + lo, m, esc_ptr + 8 * e, prev, scratch.data_ptr())
            prev, lo = int(scratch[m - 1]), lo + m
            tally(scratch[:m])

        state = {"lo": 0, "e": 0, "prev": self.first, "started": False}

        def take(k: int, out: torch.Tensor) -> None:
            """The next ``k`` positions of the sequence into ``out[:k]``."""
            at = 0
            if k and not state["started"]:
                out[0] = self.first
                state["started"], at, k = True, 1, k - 1
            if k:
                state["e"] += lib.ds_gaps_decode(
                    gaps_ptr + state["lo"],
                    k,
                    esc_ptr + 8 * state["e"],
                    state["prev"],
                    out.data_ptr() + 8 * at,
                )
                state["lo"] += k
                state["prev"] = int(out[at + k - 1])

        while below:  # positions under the first range: decoded into the buffer, dropped
            k = min(below, scratch.numel())
            take(k, scratch)
            below -= k
        buf = torch.empty(max(counts), dtype=torch.int64) if reuse else None
        for count in counts:
            out = buf[:count] if buf is not None else torch.empty(count, dtype=torch.int64)
            take(count, out)
            yield out

    def union(self, indices: torch.Tensor) -> Positions:
        """These positions joined with sorted ``indices`` (a later version's), encoded again."""
        if indices.numel() == 0:
            return self
        old = self.indices()
        return Positions.of(torch.unique(torch.cat([old, indices.to(old.device, torch.int64)])))

    def _escapes_int64(self) -> torch.Tensor:
        """The escaped gaps as a contiguous int64 tensor for the C decoder (one zero when there
        are none: the kernel is always handed a valid pointer)."""
        if self.escapes is not None and self.escapes.numel():
            return self.escapes.to(torch.int64).contiguous()
        return torch.zeros(1, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        """Bytes held for this parameter's positions (the tensors, not the object)."""
        held = sum(
            t.numel() * t.element_size()
            for t in (self.gaps, self.escapes, self.wide)
            if t is not None
        )
        return held + (len(self.packed) if self.packed is not None else 0)

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        kind = "gaps8" if self.gaps is not None else ("wide" if self.wide is not None else "small")
        kind = "gaps8 packed" if self.packed is not None and self.gaps is None else kind
        return f"Positions(count={self.count}, {kind}, {self.nbytes} bytes)"


# A parameter's captured positions and, where its detection read them, the BF16 values at them
Handed = tuple[Positions, torch.Tensor | None]
