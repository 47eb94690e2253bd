"""Learn one receiver shard's layout from the engine's own weight loader.

``probe_shard(loader, canonical)`` drives ``loader.load_weights`` (the ``Iterable[(name,
tensor)]`` entry point vLLM and SGLang models have, and :mod:`~deltasync.layout.hf_model`
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
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from deltasync.errors import LayoutError, LayoutProbeError
from deltasync.layout.blocks import Block, numel, view_cols, view_rows
from deltasync.layout.probe_blocks import Runs, ShardProbe, merge_runs, row_runs

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


class WeightLoader(Protocol):
    """What the probe needs of an engine model: its loader and its parameters."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterable[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """How the probe feeds the loader.

    ``round_elements``: canonical elements fed per round (a loader group larger than this is
    one round of its own). The probe's own memory is about 2 bytes per element of the tensor
    being fed plus 5 bytes (9 past 2^31 elements) per element of the parameters the round
    writes, so a round bounds it unless one tensor (an embedding) is larger.
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
            "the probe cannot read its weights back; pass the engine's model (an nn.Module) or "
            "a loader with params()"
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
                    payload.clamp_(min=0)  # -1 where nothing landed
                    if k == 0:
                        st.ids[lo : lo + chunk] = payload
                    else:
                        payload = payload.to(self.id_dtype)  # int64 past 2^31 ids
                        payload <<= PAYLOAD_BITS * k
                        st.ids[lo : lo + chunk] |= payload
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
                if not bool(cov.all()):
                    want = torch.where(cov, want, 0)  # nothing may land where nothing did
                if not torch.equal(g, want):
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
        runs: dict[str, Runs] = {}
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
            if not t.numel():  # an EP rank past the experts: 0 rows, held as the rules hold it
                padding[local] = 0
                continue
            blocks = merge_runs(runs.get(local, Runs()), self.names, self.canonical, tuple(t.shape))
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
        local_shapes = {n: tuple(t.shape) for n, t in params.items()}
        untouched = [n for n, pad in padding.items() if pad and pad == numel(local_shapes[n])]
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
        runs: dict[str, Runs],
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
            row_runs(
                runs.setdefault(local, Runs()),
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
