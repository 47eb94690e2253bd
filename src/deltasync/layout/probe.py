"""Learn one receiver shard's layout from the engine's own weight loader.

``probe_shard(loader, canonical)`` drives ``loader.load_weights`` (the ``Iterable[(name,
tensor)]`` entry point vLLM and SGLang models have, and :mod:`~deltasync.layout.hf_loader`
gives a transformers model) with checkpoint tensors whose values identify every element, reads
every parameter back, and compresses where each canonical element landed into the same
:class:`~deltasync.layout.blocks.Block` maps the hand-written rules build.

How an element is identified: the canonical tensors are fed in *rounds* (whole loader groups,
about ``ProbeConfig.round_elements`` elements each, so memory stays bounded by the round, not
the model; each tensor is built chunk by chunk as the loader asks for it). Within a round
every element has an id (its offset in the round's tensors laid end to end). Pass ``k`` feeds
bits ``14k .. 14k+13`` of the id as a BF16 *integer* (sign, 7 significand bits, one of 64
exponents from 2^7 up: exact in BF16, never zero), so a loader that only moves elements
delivers them unchanged; every parameter is zero-filled first, so 0 means "no canonical element
here" (padding, or another round's). Two passes cover a round of 2^28 elements. A final
*check* pass feeds a fixed pseudo-random BF16 pattern per id (both signs, 32 exponents around
1.0, all significand bits) and every read-back element must equal, bit for bit, the pattern of
the id the passes decoded. A loader that scales, offsets, casts to a narrower type, quantizes,
sums or shuffles bytes fails one of these checks; the round is then bisected down to the
loader groups at fault, whose tensors are refused (:class:`LayoutProbeError` naming each, with
the reason), never placed.

The probe overwrites every parameter of the model it is given: run it on a freshly built model
(or before the real weights are loaded). It knows nothing about model families or engines
beyond the ``load_weights`` / ``named_parameters`` shape, and does no file I/O; turning shard
probes into a table and caching them is :mod:`~deltasync.layout.probed`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from deltasync.errors import LayoutError
from deltasync.layout.blocks import Block, numel, view_cols, view_rows

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


class LayoutProbeError(LayoutError):
    """The probe cannot learn a layout: a loader transforms values, or elements go nowhere.

    ``refused`` maps each canonical tensor at fault to the reason.
    """

    def __init__(self, message: str, refused: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.refused: dict[str, str] = dict(refused or {})


class WeightLoader(Protocol):
    """What the probe needs of an engine model: its loader and its parameters."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """How the probe feeds the loader.

    ``round_elements``: canonical elements fed per round (a loader group larger than this is
    one round of its own); bounds the probe's extra memory at about 6 bytes per element of the
    round plus 4-8 bytes per element of the parameters it touches.
    ``max_blocks_per_tensor``: a canonical tensor that lands in more blocks than this on one
    shard is refused (its elements are shuffled, e.g. transposed, not moved as rows/columns).
    ``chunk_elements``: parameters are read back this many elements at a time.
    """

    round_elements: int = 1 << 25
    max_blocks_per_tensor: int = 1 << 16
    chunk_elements: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("round_elements", "max_blocks_per_tensor", "chunk_elements"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"ProbeConfig.{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class ShardProbe:
    """What one shard's loader did with the canonical tensors.

    ``local_shapes``: every parameter the shard holds (storage names, aliases left out);
    ``placements``: canonical name -> ``(local name, Block)`` pieces (canonical tensors this
    shard holds none of, e.g. other EP ranks' experts, are absent); ``aliases``: parameter
    names that are the same storage as another (tied ``lm_head.weight``); ``padding``: per
    local tensor, elements no canonical element landed in.
    """

    local_shapes: dict[str, Shape]
    placements: dict[str, tuple[tuple[str, Block], ...]]
    aliases: dict[str, str] = field(default_factory=dict)
    padding: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    passes: int = 0

    def dropped(self, canonical: Iterable[str]) -> list[str]:
        """Canonical tensors of which this shard holds no element."""
        return [n for n in canonical if n not in self.placements]


# ---------------------------------------------------------------------- element values

# A pass carries 14 bits of each element's id as a BF16 integer: sign, 7 significand bits and
# one of 64 exponents that make it an integer (2^7 .. 2^70 times 1.m). Every such value is
# exact in BF16 and in float32, never zero, never NaN/inf; zero is the "nothing landed" mark.
PAYLOAD_BITS = 14
_EXP0 = 134  # biased exponent of 2^7: with 7 significand bits the value is an integer


def _build_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.arange(1 << PAYLOAD_BITS, dtype=torch.int32)
    u = ((p >> 13) << 15) | ((_EXP0 + ((p >> 7) & 63)) << 7) | (p & 127)
    enc = torch.where(u >= 1 << 15, u - (1 << 16), u).to(torch.int16)
    dec = torch.full((1 << 16,), -1, dtype=torch.int32)
    dec[enc.to(torch.int32) & 0xFFFF] = p
    # Check patterns: fixed pseudo-random finite normal BF16 values (sign, 7 significand
    # bits, 32 exponents around 1.0), so a loader that rescales, offsets, rounds or reorders
    # bytes cannot keep them all.
    g = torch.Generator().manual_seed(20261201)
    r = torch.randperm(1 << 13, generator=g).to(torch.int32)
    c = ((r >> 12) << 15) | ((112 + ((r >> 7) & 31)) << 7) | (r & 127)
    check = torch.where(c >= 1 << 15, c - (1 << 16), c).to(torch.int16)
    return enc, dec, check


_ENC, _DEC, _CHECK = _build_tables()
_CHECK_MASK = (1 << 13) - 1


def pass_values(ids: torch.Tensor, k: int) -> torch.Tensor:
    """Pass ``k``'s BF16 value for each id: bits ``14k .. 14k+13`` of the id, as an integer."""
    return _ENC.index_select(0, (ids >> (PAYLOAD_BITS * k)) & ((1 << PAYLOAD_BITS) - 1)).view(
        torch.bfloat16
    )


def decode_payload(bits: torch.Tensor) -> torch.Tensor:
    """The 14-bit payload of each read-back BF16 value (int16 bits), or -1 if none fits."""
    return _DEC.index_select(0, bits.to(torch.int32) & 0xFFFF)


def check_bits(ids: torch.Tensor) -> torch.Tensor:
    """The check pass's BF16 bit pattern (as int16) for each id."""
    return _CHECK.index_select(0, ids & _CHECK_MASK)


def _passes_for(total: int) -> int:
    return max(1, -(-max(1, (total - 1).bit_length()) // PAYLOAD_BITS))


# ---------------------------------------------------------------------- parameters


def loader_params(loader: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The loader's parameters (storage names) and aliases (a name sharing another's storage)."""
    if hasattr(loader, "named_parameters"):
        try:
            items = list(loader.named_parameters(remove_duplicate=False))
        except TypeError:
            items = list(loader.named_parameters())
    elif hasattr(loader, "params"):
        items = list(loader.params().items())
    else:
        raise LayoutError(
            f"{type(loader).__name__} has neither named_parameters() nor params(): "
            "the probe cannot read its weights back"
        )
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, p in items:
        t = p.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen.setdefault(key, name)
        params[name] = t
    return params, aliases


def default_groups(names: Sequence[str]) -> list[list[str]]:
    """Tensors a loader needs in one call: a layer's experts (fused loaders stack them all)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(re.sub(r"\.experts\.\d+\..*$", ".experts", n), []).append(n)
    return list(groups.values())


def _rounds(
    groups: list[list[str]], canonical: Mapping[str, Shape], budget: int
) -> Iterator[list[list[str]]]:
    """Consecutive groups, about ``budget`` elements per round (a larger group alone)."""
    current: list[list[str]] = []
    size = 0
    for g in groups:
        n = sum(numel(canonical[x]) for x in g)
        if current and size + n > budget:
            yield current
            current, size = [], 0
        current.append(g)
        size += n
    if current:
        yield current


# ---------------------------------------------------------------------- one round


@dataclass
class _Touched:
    """Read-back state of one parameter that received elements in the current round."""

    ids: torch.Tensor  # id per element (int32/int64), valid where ``covered``
    covered: torch.Tensor  # bool


class _Round:
    def __init__(self, probe: _ShardProber, names: list[str]) -> None:
        self.p = probe
        self.names = names
        sizes = [numel(probe.canonical[n]) for n in names]
        self.offsets = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int64)
        self.total = int(self.offsets[-1])
        self.id_dtype = torch.int32 if self.total < 2**31 else torch.int64
        self.passes = _passes_for(self.total)
        self.faults: dict[str, list[str]] = {}  # param -> what went wrong there

    def _feed(self, values) -> None:
        chunk = self.p.config.chunk_elements

        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            # One tensor at a time, built chunk by chunk: no int64 id array of a whole tensor.
            for i, n in enumerate(self.names):
                start, size = int(self.offsets[i]), numel(self.p.canonical[n])
                out = torch.empty(size, dtype=torch.bfloat16)
                for lo in range(0, size, chunk):
                    hi = min(size, lo + chunk)
                    ids = torch.arange(start + lo, start + hi, dtype=self.id_dtype)
                    out[lo:hi] = values(ids)
                yield n, out.reshape(self.p.canonical[n])
                del out

        try:
            with torch.no_grad():
                self.p.loader.load_weights(gen())
        except Exception as exc:
            raise LayoutProbeError(
                f"the engine's load_weights failed while probing {_describe(self.names)}: "
                f"{type(exc).__name__}: {exc}",
                {n: f"load_weights raised {type(exc).__name__}" for n in self.names},
            ) from exc

    def _fault(self, param: str, what: str) -> None:
        self.faults.setdefault(param, []).append(what)

    def run(self) -> dict[str, _Touched]:
        chunk = self.p.config.chunk_elements
        touched: dict[str, _Touched] = {}
        for k in range(self.passes):
            self._feed(lambda ids, k=k: pass_values(ids, k))
            params, _ = loader_params(self.p.loader)
            if k == 0:
                for name, t in params.items():
                    if t.numel() and torch.count_nonzero(t):
                        if t.dtype != torch.bfloat16:
                            self._fault(name, f"it is {t.dtype}, not torch.bfloat16")
                            continue
                        touched[name] = _Touched(
                            ids=torch.zeros(t.numel(), dtype=self.id_dtype),
                            covered=torch.zeros(t.numel(), dtype=torch.bool),
                        )
            for name, st in touched.items():
                if name in self.faults:
                    continue
                flat = params[name].reshape(-1).view(torch.int16)
                for lo in range(0, flat.numel(), chunk):
                    bits = flat[lo : lo + chunk]
                    nz = bits != 0
                    if k == 0:
                        st.covered[lo : lo + chunk] = nz
                    elif not torch.equal(nz, st.covered[lo : lo + chunk]):
                        self._fault(name, f"pass {k} wrote other elements than pass 0")
                        break
                    payload = decode_payload(bits)
                    if bool(((payload < 0) & nz).any()):
                        self._fault(name, f"pass {k} read back values that are not the ones fed")
                        break
                    payload.clamp_(min=0)
                    if k:
                        payload <<= PAYLOAD_BITS * k
                    st.ids[lo : lo + chunk] |= payload.to(self.id_dtype)
        for name, st in touched.items():
            ids = st.ids[st.covered]
            if ids.numel() and int(ids.max()) >= self.total:
                self._fault(name, "decoded element ids beyond the tensors fed")
        # Check pass: every element must come back as the exact bit pattern of its decoded id.
        self._feed(lambda ids: check_bits(ids).view(torch.bfloat16))
        params, _ = loader_params(self.p.loader)
        for name, st in touched.items():
            if name in self.faults:
                continue
            got = params[name].reshape(-1).view(torch.int16)
            for lo in range(0, got.numel(), chunk):
                cov = st.covered[lo : lo + chunk]
                g = got[lo : lo + chunk]
                want = check_bits(st.ids[lo : lo + chunk])
                bad = (g != want) & cov
                if bool(bad.any()) or bool((g[~cov] != 0).any()):
                    self._fault(
                        name,
                        "the check pass read back different bits (the loader "
                        "transforms values: scales, casts, quantizes, sums or permutes)",
                    )
                    break
        # Leave every parameter this round wrote zero again for the next round.
        with torch.no_grad():
            for name in set(touched) | set(self.faults):
                params[name].zero_()
        return touched


def _describe(names: Sequence[str]) -> str:
    if len(names) <= 3:
        return ", ".join(repr(n) for n in names)
    return f"{names[0]!r} ... {names[-1]!r} ({len(names)} tensors)"


# ---------------------------------------------------------------------- compression


@dataclass
class _Runs:
    """Row runs of one parameter: contiguous elements of one source row in one dest row."""

    src: list[np.ndarray] = field(default_factory=list)  # canonical ordinal
    src_row: list[np.ndarray] = field(default_factory=list)
    src_col: list[np.ndarray] = field(default_factory=list)
    dst_row: list[np.ndarray] = field(default_factory=list)
    dst_col: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)


def _row_runs(
    runs: _Runs,
    covered: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    ordinals: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: int,
    chunk: int,
) -> None:
    # Runs never cross a destination row, so row-aligned chunks do not change them.
    step = max(1, chunk // dst_cols) * dst_cols
    for lo in range(0, covered.numel(), step):
        pos = torch.nonzero(covered[lo : lo + step]).squeeze(1)
        if pos.numel():
            _chunk_runs(runs, pos + lo, ids, offsets, ordinals, src_cols, dst_cols)


def _chunk_runs(
    runs: _Runs,
    pos: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    ordinals: torch.Tensor,
    src_cols: torch.Tensor,
    dst_cols: int,
) -> None:
    # 1. Flat segments: where destination position and element id both step by one (a whole
    #    row-major copy is one segment), cut where the source tensor changes.
    gid = ids.index_select(0, pos).to(torch.int64)
    cut = torch.ones_like(pos, dtype=torch.bool)
    cut[1:] = (pos[1:] != pos[:-1] + 1) | (gid[1:] != gid[:-1] + 1)
    starts = torch.nonzero(cut).squeeze(1)
    ends = torch.cat([starts[1:], torch.tensor([pos.numel()])])
    seg_pos, seg_gid = pos.index_select(0, starts), gid.index_select(0, starts)
    seg_len = ends - starts
    t = torch.searchsorted(offsets, seg_gid, right=True) - 1
    t_last = torch.searchsorted(offsets, seg_gid + seg_len - 1, right=True) - 1
    if bool((t != t_last).any()):  # a segment running from one tensor into the next
        p_l, g_l, n_l = [], [], []
        for p0, g0, n0, a, z in zip(
            seg_pos.tolist(),
            seg_gid.tolist(),
            seg_len.tolist(),
            t.tolist(),
            t_last.tolist(),
            strict=True,
        ):
            while a < z:
                k = int(offsets[a + 1]) - g0
                p_l.append(p0), g_l.append(g0), n_l.append(k)
                p0, g0, n0, a = p0 + k, g0 + k, n0 - k, a + 1
            p_l.append(p0), g_l.append(g0), n_l.append(n0)
        seg_pos, seg_gid, seg_len = (torch.tensor(x, dtype=torch.int64) for x in (p_l, g_l, n_l))
        t = torch.searchsorted(offsets, seg_gid, right=True) - 1
    f = seg_gid - offsets.index_select(0, t)
    cs = src_cols.index_select(0, t)
    sp, sf, sn = seg_pos.numpy(), f.numpy(), seg_len.numpy()
    st, scs = t.numpy(), cs.numpy()
    # 2. Row runs: a segment breaks where a destination row or a source row ends.
    d_room = dst_cols - sp % dst_cols
    s_room = scs - sf % scs
    one = (sn <= d_room) & (sn <= s_room)  # the common case: the segment is one run already
    parts = [(sp[one], sf[one], sn[one], st[one], scs[one])]
    for i in np.flatnonzero(~one).tolist():
        p0, f0, n0, c = int(sp[i]), int(sf[i]), int(sn[i]), int(scs[i])
        d_cuts = np.arange((-p0) % dst_cols or dst_cols, n0, dst_cols)
        s_cuts = np.arange((-f0) % c or c, n0, c)
        rel = np.concatenate([[0], np.union1d(d_cuts, s_cuts)]).astype(np.int64)
        lens = np.diff(np.append(rel, n0))
        parts.append((p0 + rel, f0 + rel, lens, np.full(len(rel), st[i]), np.full(len(rel), c)))
    p_all, f_all, n_all, t_all, c_all = (np.concatenate([x[j] for x in parts]) for j in range(5))
    s_row = f_all // c_all
    d_row = p_all // dst_cols
    runs.src.append(ordinals.numpy()[t_all])
    runs.src_row.append(s_row)
    runs.src_col.append(f_all - s_row * c_all)
    runs.dst_row.append(d_row)
    runs.dst_col.append(p_all - d_row * dst_cols)
    runs.length.append(n_all)


def _blocks(
    runs: _Runs, names: list[str], canonical: Mapping[str, Shape], dst_shape: Shape
) -> dict[str, list[Block]]:
    """Merge row runs that continue each other row after row into rectangles."""
    if not runs.src:
        return {}
    src, s_row, s_col, d_row, d_col, ln = (
        np.concatenate(getattr(runs, a))
        for a in ("src", "src_row", "src_col", "dst_row", "dst_col", "length")
    )
    order = np.lexsort((d_row, ln, s_col, d_col, src))
    src, s_row, s_col, d_row, d_col, ln = (a[order] for a in (src, s_row, s_col, d_row, d_col, ln))
    new = np.ones(len(src), dtype=bool)
    new[1:] = (
        (src[1:] != src[:-1])
        | (d_col[1:] != d_col[:-1])
        | (s_col[1:] != s_col[:-1])
        | (ln[1:] != ln[:-1])
        | (d_row[1:] != d_row[:-1] + 1)
        | (s_row[1:] != s_row[:-1] + 1)
    )
    starts = np.flatnonzero(new)
    rows = np.diff(np.append(starts, len(src)))
    dcols = view_cols(dst_shape)
    out: dict[str, list[Block]] = {}
    for i, r in zip(starts.tolist(), rows.tolist(), strict=True):
        name = names[int(src[i])]
        out.setdefault(name, []).append(
            Block(
                src_cols=view_cols(canonical[name]),
                dst_cols=dcols,
                src_row=int(s_row[i]),
                dst_row=int(d_row[i]),
                rows=int(r),
                src_col=int(s_col[i]),
                dst_col=int(d_col[i]),
                cols=int(ln[i]),
            )
        )
    return out


# ---------------------------------------------------------------------- the shard probe


class _ShardProber:
    def __init__(self, loader: Any, canonical: Mapping[str, Shape], config: ProbeConfig) -> None:
        self.loader = loader
        self.canonical = dict(canonical)
        self.config = config
        self.names = list(self.canonical)
        self.ordinal = {n: i for i, n in enumerate(self.names)}

    def run(self) -> ShardProbe:
        t0 = time.perf_counter()
        params, aliases = loader_params(self.loader)
        with torch.no_grad():
            for t in params.values():
                t.zero_()
        groups_fn = getattr(self.loader, "probe_groups", None)
        groups = groups_fn(self.names) if groups_fn is not None else default_groups(self.names)
        runs: dict[str, _Runs] = {}
        refused: dict[str, str] = {}
        passes = 0
        for part in _rounds(groups, self.canonical, self.config.round_elements):
            names = [n for g in part for n in g]
            passes += self._probe(names, part, runs, refused)
        if refused:
            raise LayoutProbeError(
                "the engine's loader does not move these tensors' elements unchanged, so no "
                "layout can be learned for them: "
                + "; ".join(f"{n}: {why}" for n, why in refused.items()),
                refused,
            )
        params, aliases = loader_params(self.loader)
        placements: dict[str, list[tuple[str, Block]]] = {}
        padding: dict[str, int] = {}
        for local, t in params.items():
            if not t.numel():
                continue
            blocks = _blocks(runs.get(local, _Runs()), self.names, self.canonical, tuple(t.shape))
            held = 0
            for name, bl in blocks.items():
                placements.setdefault(name, []).extend((local, b) for b in bl)
                held += sum(b.size for b in bl)
            padding[local] = t.numel() - held
        too_many = {
            n: f"it lands in {len(p)} blocks (> {self.config.max_blocks_per_tensor}): its "
            "elements are shuffled, not moved as rows or columns"
            for n, p in placements.items()
            if len(p) > self.config.max_blocks_per_tensor
        }
        if too_many:
            raise LayoutProbeError(
                "layout not expressible as blocks: "
                + "; ".join(f"{n}: {why}" for n, why in too_many.items()),
                too_many,
            )
        local_shapes = {n: tuple(t.shape) for n, t in params.items() if t.numel()}
        untouched = [n for n, pad in padding.items() if pad == numel(local_shapes[n])]
        if untouched:
            log.info(
                "probe: %d parameter(s) received no checkpoint element: %s",
                len(untouched),
                _describe(untouched),
            )
        seconds = time.perf_counter() - t0
        log.info("probe: %d canonical tensors, %d passes, %.2f s", len(self.names), passes, seconds)
        return ShardProbe(
            local_shapes=local_shapes,
            placements={n: tuple(p) for n, p in placements.items()},
            aliases=aliases,
            padding=padding,
            seconds=seconds,
            passes=passes,
        )

    def _probe(
        self,
        names: list[str],
        groups: list[list[str]],
        runs: dict[str, _Runs],
        refused: dict[str, str],
    ) -> int:
        rnd = _Round(self, names)
        touched = rnd.run()
        if rnd.faults:
            if len(groups) > 1:  # bisect the round's groups to find the ones at fault
                half = len(groups) // 2
                return (
                    rnd.passes
                    + 1
                    + sum(
                        self._probe([n for g in part for n in g], part, runs, refused)
                        for part in (groups[:half], groups[half:])
                    )
                )
            why = "; ".join(f"{p}: {', '.join(w)}" for p, w in rnd.faults.items())
            for n in names:
                refused[n] = why
            return rnd.passes + 1
        ordinals = torch.tensor([self.ordinal[n] for n in names], dtype=torch.int64)
        src_cols = torch.tensor([view_cols(self.canonical[n]) for n in names], dtype=torch.int64)
        params, _ = loader_params(self.loader)
        for local, st in touched.items():
            shape = tuple(params[local].shape)
            _row_runs(
                runs.setdefault(local, _Runs()),
                st.covered,
                st.ids,
                rnd.offsets,
                ordinals,
                src_cols,
                view_cols(shape),
                self.config.chunk_elements,
            )
        assert all(view_rows(self.canonical[n]) >= 0 for n in names)
        return rnd.passes + 1


def probe_shard(
    loader: WeightLoader | Any,
    canonical: Mapping[str, Shape],
    *,
    config: ProbeConfig | None = None,
) -> ShardProbe:
    """Learn where ``loader`` puts every element of the ``canonical`` checkpoint tensors.

    Args:
        loader: an engine model (or adapter) with ``load_weights(Iterable[(name, tensor)])``
            and ``named_parameters()`` (or ``params()``), holding one shard. Its parameters are
            overwritten.
        canonical: checkpoint tensor names and shapes, in checkpoint order.
        config: round size and limits (:class:`ProbeConfig`).

    Returns:
        The shard's :class:`ShardProbe`.

    Raises:
        LayoutProbeError: some tensors' elements do not arrive unchanged (each named, with the
            reason), or are shuffled beyond row/column blocks.
    """
    return _ShardProber(loader, canonical, config or ProbeConfig()).run()
