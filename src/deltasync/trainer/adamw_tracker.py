"""Snapshot-free change detection for ``torch.optim.AdamW`` / ``Adam``.

``AdamWTracker`` hooks the optimizer's ``step``: the post-hook records the hyperparameters and
step counts each param group actually used (a scheduler may change ``lr`` right after), and the
detection for that step runs lazily -- just before the next step mutates the state, or when
``changed()`` is asked. Detection inverts the step from the optimizer's own state with the
error bound of ``adamw_bound.py`` and ORs the possibly-changed elements into a 1-bit-per-element
bitset, so several steps per published version are covered. A parameter whose step count did
not advance (no gradient, a step skipped by ``GradScaler``) did not change.

FSDP2 (``fully_shard``) parameters and their optimizer states are DTensors: detection runs on
this rank's local shards, and indices are positions in the local shard (``shards`` says where
each sits in the full parameter; see ``params.py``).

Edits outside the optimizer (``params.OutOfBandWatch``): every parameter's version counter is recorded
after each step and at ``clear()``, and compared before the next step and at detection; a
parameter whose counter moved is reported changed in full for that version (``out_of_band``
names it, and a warning says so). Writes through ``.data`` bypass the counter: call
``mark_changed(name)``. The inversion also needs the optimizer state exactly as the step left
it: the post-hook seals each parameter's ``exp_avg`` and denominator state (the objects, weakly,
and their version counters), and detection checks the seal first. A state replaced or written
in between (``optimizer.load_state_dict``, a moment reset, ``state.clear()``) leaves the step
uninvertible, so the parameter is reported changed in full, with a warning.

Parameters the bound does not cover go through an exact bitwise snapshot
(:class:`SnapshotTracker`); ``fallback`` says which, why, and the bytes held, and construction
logs it (``strict=True`` raises :class:`~deltasync.errors.UnsupportedOptimizerError`
instead). Frozen parameters outside the optimizer are constants: no snapshot, only the
version check. Memory: 1 bit per covered element when several steps make one version, plus
2 bytes per fallback element.

This module knows optimizers, hooks and bitsets; it knows nothing about layouts or transport.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import re
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from deltasync.errors import UnsupportedOptimizerError
from deltasync.native.loader import overlapping, touching
from deltasync.native.ops import bf16_at
from deltasync.trainer.adamw_bound import StepHyper, invertible, kernel_scalars
from deltasync.trainer.detect import (
    GROUP_ELEMENTS,
    GROUP_NUMEL,
    CastBuffers,
    CastChunk,
    Chunk,
    Lookahead,
    bits_to_indices,
    bitset_bytes,
    chunk_items,
    detect_adamw_,
    detect_adamw_changes,
    detect_adamw_chunks,
    detect_adamw_group,
    detect_adamw_indices,
    join_chunks,
    small_enough,
)
from deltasync.trainer.params import (
    OutOfBandWatch,
    Version,
    Watched,
    is_dtensor,
    local_of,
    version_of,
    watch,
)
from deltasync.trainer.positions import Positions
from deltasync.trainer.protocol import CastSink, LocalShard
from deltasync.trainer.snapshot_tracker import SnapshotTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fallback:
    """Why a parameter takes the exact snapshot path, and the bytes its snapshot holds."""

    reason: str
    bytes: int

    def __str__(self) -> str:
        return f"{self.reason} ({self.bytes} bytes held)"


def _step_count(state: dict) -> float | None:
    step = state.get("step")
    if step is None:
        return None
    return float(step.item() if isinstance(step, torch.Tensor) else step)


# torch's own Adam/AdamW update (the class attribute is wrapped by the hook machinery)
_ADAM_STEPS = {inspect.unwrap(torch.optim.Adam.step), inspect.unwrap(torch.optim.AdamW.step)}


def _group_unsupported(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Why the bound does not cover this param group, or None if it does."""
    # (AdamW subclasses Adam from torch 2.7; both are named for the releases before)
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return f"optimizer {type(opt).__name__} is not torch.optim.Adam/AdamW"
    if inspect.unwrap(type(opt).step) not in _ADAM_STEPS:
        return (
            f"optimizer {type(opt).__name__} overrides step() of torch.optim.Adam/AdamW: what "
            "its step writes is not the update the bound inverts"
        )
    if group.get("capturable", False):
        return "capturable=True computes bias corrections in fp32 tensors"
    if group.get("differentiable", False):
        return "differentiable=True"
    if not float(group["eps"]) > 0:
        return f"eps={group['eps']} is not positive"
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    if lr * wd >= 1.0:
        return f"lr*weight_decay={lr * wd} >= 1"
    return None


def _param_unsupported(group: dict, p: torch.Tensor) -> str | None:
    """Why the bound does not cover this parameter of a covered group, or None. torch's fused
    kernel steps a parameter's storage from its first element, ignoring strides: for one
    that is not contiguous (a column slice of a wider buffer) it updates other elements than
    the parameter's, and writes memory outside it."""
    if group.get("fused") and not local_of(p).is_contiguous():
        return "fused=True steps a non-contiguous parameter by its storage, not its strides"
    return None


def _state_unsupported(group: dict, state: dict) -> str | None:
    """Why the bound does not cover the step that left ``state``, or None. torch's fused
    kernel walks the optimizer state by its storage too, ignoring its strides: a state laid
    out otherwise than contiguously (a checkpoint of a channels_last model loaded into a
    contiguous one) pairs each element with another element's moments, while the inversion
    reads them in logical order."""
    if group.get("fused") and any(
        isinstance(t, torch.Tensor) and t.dim() > 0 and not local_of(t).is_contiguous()
        for t in state.values()
    ):
        return "fused=True steps a non-contiguous optimizer state by its storage, not its strides"
    return None


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """Where ``t``'s storage is, or None for a tensor without a readable one (sparse, mkldnn,
    a wrapper subclass such as torchao's quantized optimizer states)."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def _where(p: torch.Tensor) -> tuple[int, int, int]:
    """A parameter's object and the memory this process holds for it (address, elements):
    what decides which tracked parameters it may write. No reference to it is kept (a weak
    one would refuse ``torch.utils.swap_tensors``, and with it swap-tensors loading)."""
    local = p
    if is_dtensor(p):  # its local shard as held (to_local() costs ~5 us, twice a step each)
        local = getattr(p, "_local_tensor", None)
        if local is None:
            local = local_of(p)
    return id(p), local.data_ptr(), local.numel()


def _untracked(
    opt: torch.optim.Optimizer, tracked: Collection[int]
) -> list[tuple[str, torch.Tensor, int]]:
    """The parameters in ``opt``'s param groups whose ids are not in ``tracked``, as
    ``(description, local tensor, owner)`` items for :func:`touching`: one sharing memory
    with a tracked parameter (``nn.Parameter(actor.weight.detach()[:4])``) writes it when
    stepped, and nothing names the tracked one."""
    return [
        (f"parameter {i} of param group {gi}, not given to the tracker", local_of(p), id(p))
        for gi, group in enumerate(opt.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in tracked
    ]


def _moments(state: dict) -> Iterator[tuple[torch.Tensor, tuple[torch.device, int] | None]]:
    """Each local tensor of an optimizer state but its step count (0-dim moments too: a scalar
    parameter's), with its :func:`_storage_key`."""
    for key, t in state.items():
        if isinstance(t, torch.Tensor) and (t.dim() > 0 or key != "step"):
            t = local_of(t) if is_dtensor(t) else t
            yield t, _storage_key(t)


_UNUSABLE_STATE = (
    "its Adam moments are not fp32 tensors of its local shape on its device (offloaded, "
    "low-precision or missing)"
)


# the values in a cause's text (a scheduled lr, a step count): the warning is once per cause
_VALUES = re.compile(r"=\S*|\d+(?:\.\d*)?(?:e[+-]?\d+)?")


@functools.lru_cache(maxsize=256)
def _cause(why: str) -> str:
    """The cause ``why`` names, its numbers and ``=values`` left out: the key its warning is
    logged once for, so that a scheduled lr or a step count does not make a new cause each
    step, while two texts that differ in words (the two fused ones) stay two causes."""
    return _VALUES.sub("", why)


def _note(why: dict[str, tuple[str, list[str]]], cause: str, detail: str, name: str) -> None:
    """Record that ``name`` goes in full for ``cause`` (the first ``detail`` kept)."""
    why.setdefault(cause, (detail, []))[1].append(name)


def _hyper_text(group: dict, step: float) -> str:
    """A param group's step hyperparameters, for messages."""
    keys = ("lr", "betas", "eps", "weight_decay")
    return ", ".join(f"{k}={group.get(k)}" for k in keys) + f", step={step:g}"


def _hyper(opt: torch.optim.Optimizer, group: dict, step: int) -> StepHyper:
    beta1, beta2 = group["betas"]
    return StepHyper(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled=bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))),
        step=step,
    )


class _Seal(NamedTuple):
    """The optimizer state a recorded step left for one parameter: its moment tensors (weak
    references: a replaced state is not kept alive) and their write counters. The bound
    inverts that step from exactly this state and from nothing else."""

    m: weakref.ref
    v: weakref.ref
    counters: tuple[Version, Version]

    @classmethod
    def of(cls, m: torch.Tensor, v: torch.Tensor) -> _Seal:
        return cls(weakref.ref(m), weakref.ref(v), (version_of(m), version_of(v)))

    def holds(self, m: object, v: object) -> bool:
        """Whether ``m`` and ``v`` are the sealed tensors, unwritten since (a dead reference
        is never the state held: a freed tensor's address may be reused)."""
        return (
            isinstance(m, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and self.m() is m
            and self.v() is v
            and (version_of(m), version_of(v)) == self.counters
        )


class StateSeal:
    """The optimizer state of parameters as it was when taken; ``moved()`` names those whose
    state was replaced or written in place since (see :meth:`AdamWTracker.seal_state`)."""

    def __init__(
        self, seals: dict[str, _Seal], moments: Callable[[str], tuple[object, object]]
    ) -> None:
        """Args:
        seals: per parameter, its state when taken.
        moments: a parameter's state tensors as the optimizer holds them now.
        """
        self._seals, self._moments = seals, moments

    def moved(self) -> tuple[str, ...]:
        return tuple(n for n, seal in self._seals.items() if not seal.holds(*self._moments(n)))


Change = tuple[str, torch.Tensor, torch.Tensor | None]
# The largest parameter whose changes ``iter_capture`` reads with values (int64 indices and
# BF16 values: at most 10 bytes per element of it, 10 MiB here), so a capture's values stay
# bounded whatever the budget crossing parameter is.
VALUE_CAPTURE_MAX = 1 << 20


def _state_usable(p: torch.Tensor, m: object, v: object) -> bool:
    """Whether the detection kernels can read these Adam states next to the local param:
    fp32, the param's local shape and device (e.g. not offloaded elsewhere)."""
    if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    ml, vl = local_of(m), local_of(v)
    return all(
        t.dtype == torch.float32 and tuple(t.shape) == tuple(p.shape) and t.device == p.device
        for t in (ml, vl)
    )


def _capture_chunks(
    chunks: Iterable[Chunk], device: torch.device, values_max: int
) -> tuple[Positions, torch.Tensor | None]:
    """One parameter's detected chunks as :class:`Positions` (encoded as they come) and the
    chunks' values joined, unless they hold none or more than ``values_max`` (those are
    dropped as soon as the count passes it: the consumer reads them itself)."""
    kept: list[torch.Tensor] | None = [] if values_max else None
    held = 0

    def positions() -> Iterator[torch.Tensor]:
        nonlocal kept, held
        for idx, vals in chunks:
            if kept is not None and vals is not None:
                held += vals.numel()
                if held <= values_max:
                    kept.append(vals)
                else:
                    kept = None
            yield idx

    got = Positions.from_chunks(positions(), device=device)
    if not kept:
        return got, None
    return got, (torch.cat(kept) if len(kept) > 1 else kept[0])


class _Together(NamedTuple):
    """A detection group's answer as the consumer takes it: each member's detection (as its
    own job gives it) and BF16 bits (or None), and the buffer the bits are views of."""

    members: dict[str, tuple[Any, torch.Tensor | None]]
    shared: torch.Tensor | None


class _WithBits(NamedTuple):
    """A small parameter's detection, as its job without a sink gives it, and the BF16 bits
    of all its elements (None where the kernel could not cast them)."""

    detection: tuple[Any, torch.Tensor | None]
    bits: torch.Tensor | None


def _with_bits(
    args: tuple, want_values: bool, as_positions: bool, buffers: CastBuffers
) -> _WithBits:
    (item,) = chunk_items(*args, values=want_values, cast=buffers)  # a small parameter: 1 chunk
    idx, vals, bits = item()
    return _WithBits(_small_result(idx, vals, want_values, as_positions), bits)


def _small_result(
    idx: torch.Tensor, vals: torch.Tensor | None, want_values: bool, as_positions: bool
) -> tuple[torch.Tensor | Positions, torch.Tensor | None]:
    """A small parameter's detection as its job gives it: ``(indices, values)`` when its
    values are wanted, else ``(Positions or indices, None)``."""
    if want_values:
        return idx, vals
    return (Positions.of(idx) if as_positions else idx), None


def _hand_bits(
    sink: CastSink,
    name: str,
    start: int,
    bits: torch.Tensor | None,
    buffers: CastBuffers | None,
) -> bool:
    """Give ``sink`` one chunk's bits (then the buffer back to ``buffers``, unless None: a
    view of a buffer others still use), or tell it they will not all come; True if given."""
    if bits is None:
        sink.fail(name)
        return False
    try:
        sink.feed(name, start, bits)
    finally:
        if buffers is not None:
            buffers.give(bits)
    return True


def _feeding(
    sink: CastSink, name: str, items: Iterable[CastChunk], buffers: CastBuffers
) -> Iterator[Chunk]:
    """A parameter's chunks without their bits, which go to ``sink`` in order as they pass."""
    start, ok = 0, True
    for idx, vals, bits in items:
        if ok:
            ok = _hand_bits(sink, name, start, bits, buffers)
            start += 0 if bits is None else bits.numel()
        elif bits is not None:
            buffers.give(bits)
        yield idx, vals


def _closure_then(args: tuple, kwargs: dict, check: Callable[[], None]) -> tuple[tuple, dict]:
    """The step's arguments (``args[0]`` is the optimizer) with its closure (positional or
    keyword; None: none) replaced by one that runs it, then ``check()``."""
    positional = len(args) > 1
    closure = args[1] if positional else kwargs.get("closure")

    def closure_then_check():
        loss = None if closure is None else closure()
        check()
        return loss

    if positional:
        return (args[0], closure_then_check, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_check}


# torch keeps Adam's step count in float32: from here ``count + 1 == count``.
_STEP_COUNT_EXACT = 2**24
# The group index of a parameter listed twice in the param groups (stepped twice a step()).
_LISTED_TWICE = -1


def _any_optimizer_hooks(tracker: AdamWTracker) -> list[Any]:
    """Hooks before and after every optimizer's step, in this process, that tell ``tracker``
    (held weakly: a tracker dropped without ``close()`` is not kept alive by them)."""
    ref = weakref.ref(tracker)

    def before(opt, args, kwargs) -> None:
        alive = ref()
        if alive is not None:
            alive._foreign_starts(opt)

    def after(opt, args, kwargs) -> None:
        alive = ref()
        if alive is not None:
            alive._foreign_step(opt)

    return [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]


def _first_post_hook(opt: torch.optim.Optimizer, hook: Callable) -> Any:
    """Register ``hook`` to run first after each step, right after the update: a post-hook
    registered earlier that writes a parameter or changes a hyperparameter then acts after
    the step is recorded (its write is seen as one outside the optimizer), never inside it."""
    handle = opt.register_step_post_hook(hook)
    hooks = getattr(opt, "_optimizer_step_post_hooks", None)
    if hasattr(hooks, "move_to_end"):
        hooks.move_to_end(handle.id, last=False)
    else:  # another torch: ordered as registered
        log.warning(
            "AdamWTracker: cannot order its post-step hook first on this torch; build the "
            "tracker before registering post-step hooks that write parameters"
        )
    return handle


class AdamWTracker:
    """Which BF16 elements changed since the last ``clear()``, without a snapshot.

    ``changed()`` maps a parameter name to a sorted, unique, 1-D int64 tensor of row-major flat
    indices (into the local shard, for an FSDP2 parameter) containing every element whose BF16
    bits differ from those at the last ``clear()`` (or construction), possibly with a few
    extra elements. Unchanged params are omitted.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_params: Iterable[tuple[str, torch.Tensor]],
        *,
        threads: int | None = None,
        strict: bool = False,
        track_frozen: bool = False,
    ) -> None:
        """Args:
            optimizer: the optimizer stepping (some of) the parameters.
            named_params: ``model.named_parameters()``: plain tensors or FSDP2 DTensors.
            threads: C kernel threads for detection (None: torch's intra-op thread count).
            strict: raise :class:`UnsupportedOptimizerError` instead of falling back to a
                snapshot for any parameter the bound does not cover.
            track_frozen: snapshot frozen parameters (``requires_grad=False``, in no param
                group) too; by default they are constants whose in-place edits the version
                check catches.

        Raises:
            UnsupportedOptimizerError: with ``strict=True``, naming each uncovered parameter.
            ConfigError: a bad ``named_params`` entry or an unsupported DTensor placement.
        """
        self._opt = optimizer
        self._threads = threads
        self._watched: dict[str, Watched] = watch(named_params)
        self._order = list(self._watched)
        group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        reasons: dict[str, str] = {}
        self._covered: dict[str, tuple[torch.Tensor, int]] = {}
        constant: list[str] = []
        for name, w in self._watched.items():
            p = w.param
            gi = group_of.get(id(p))
            reason = None
            if gi is None:
                if not p.requires_grad and not track_frozen:
                    constant.append(name)
                    continue
                reason = "not in the optimizer (may be changed outside it)"
            elif p.dtype != torch.float32:
                reason = f"dtype {p.dtype} is not float32"
            else:
                group = optimizer.param_groups[gi]
                reason = _group_unsupported(optimizer, group) or _param_unsupported(group, p)
            if reason is None:
                self._covered[name] = (p, gi)
            else:
                reasons[name] = reason
        # views of one storage (one tensor under two names, tied weights, is one parameter):
        # the inversion of one cannot see what the other's update writes into it
        shared = overlapping(
            (n, self._watched[n].local(), id(p)) for n, (p, _) in self._covered.items()
        )
        for name, other in shared.items():
            del self._covered[name]
            reasons[name] = (
                f"shares memory with parameter {other!r}, which the optimizer also steps: "
                "each one's update writes the other"
            )
        # one that shares memory with a parameter off the bound (a snapshot-path one another
        # optimizer steps, or a constant): whatever steps that one writes this one, and a fused
        # step does so without moving a version counter or naming this parameter
        beside = touching(
            ((n, self._watched[n].local(), id(p)) for n, (p, _) in self._covered.items()),
            (
                (n, w.local(), id(w.param))
                for n, w in self._watched.items()
                if n not in self._covered
            ),
        )
        for name, other in beside.items():
            del self._covered[name]
            reasons[name] = (
                f"shares memory with parameter {other!r}, which is off the bound (another "
                "optimizer may step it: a fused step writes this one without moving its version "
                "counter)"
            )
        # one that shares memory with a parameter this optimizer steps but the tracker was not
        # given: that one's update writes this one inside the same step, where a moved version
        # counter is taken as the step's own and a fused update moves none
        tracked_ids = {id(w.param) for w in self._watched.values()}
        unseen = touching(
            ((n, self._watched[n].local(), id(p)) for n, (p, _) in self._covered.items()),
            _untracked(optimizer, tracked_ids),
        )
        for name, other in unseen.items():
            del self._covered[name]
            reasons[name] = (
                f"shares memory with {other}, which the optimizer also steps: its update "
                "writes this one"
            )
        # a constant that shares memory with another parameter: whatever steps that one (this
        # optimizer, another, or this one after add_param_group) writes the constant, and a
        # fused step does so without moving the version counter that would have told
        aliased = touching(
            ((n, self._watched[n].local(), id(self._watched[n].param)) for n in constant),
            [
                *((n, w.local(), id(w.param)) for n, w in self._watched.items()),
                *_untracked(optimizer, tracked_ids),
            ],
        )
        for name, other in aliased.items():
            constant.remove(name)
            reasons[name] = (
                f"frozen, but shares memory with parameter {other!r}, which an optimizer may "
                "step (a fused step writes it without moving its version counter)"
            )
        if strict and reasons:
            listed = "; ".join(f"{n}: {r}" for n, r in list(reasons.items())[:5])
            raise UnsupportedOptimizerError(
                f"{len(reasons)} parameter(s) are outside the AdamW bound ({listed}); use "
                "torch.optim.AdamW/Adam with fp32 parameters, capturable=False, eps > 0, "
                "contiguous parameters under fused=True, or pass strict=False to snapshot them "
                "(2 bytes per element)"
            )
        self.constant: tuple[str, ...] = tuple(constant)
        # constants the optimizer steps since (add_param_group after this tracker was built):
        # sent in full for every step of theirs, seen by their step counts (see _check_groups)
        self._adopted: list[str] = []
        self._name_of = {id(w.param): n for n, w in self._watched.items()}
        # where the optimizer's parameters this tracker was not given are (see _where: an id
        # may be reused), and the tracked ones off the snapshot path that one added since
        # shares memory with (sent in full for every step: see _check_untracked)
        self._untracked_at = {
            _where(p)
            for g in optimizer.param_groups
            for p in g["params"]
            if id(p) not in self._name_of
        }
        self._aliased: set[str] = set()
        # per other optimizer (by id): where its untracked parameters were, and the tracked
        # ones sharing memory with them (see _aliased_by)
        self._foreign_aliases: dict[int, tuple[tuple[tuple[int, int, int], ...], list[str]]] = {}
        self._snapshot = SnapshotTracker({n: self._watched[n] for n in self._order if n in reasons})
        self.fallback: dict[str, Fallback] = {
            n: Fallback(r, self._watched[n].local_bytes()) for n, r in reasons.items()
        }
        if self.fallback:
            total = sum(f.bytes for f in self.fallback.values())
            log.warning(
                "AdamWTracker: %d parameter(s) take the exact snapshot path, holding %d bytes "
                "(+100%% of their BF16 size): %s",
                len(self.fallback),
                total,
                "; ".join(f"{n}: {f.reason}" for n, f in list(self.fallback.items())[:8]),
            )
        if self.constant:
            log.info(
                "AdamWTracker: %d frozen parameter(s) outside the optimizer are constants "
                "(no snapshot; in-place edits are caught by their version counters)",
                len(self.constant),
            )
        # Bitsets are allocated only for params that take a second step before changed()/clear()
        # (several steps per version). With one step per version detection runs straight into
        # indices and the tracker holds no per-element memory between versions. clear() zeroes
        # a bitset and keeps it (the next multi-step version reuses it); until a step is folded
        # into it again it is *clean*, and a single step is detected as if it were not there.
        self._bits: dict[str, torch.Tensor] = {}
        self._clean: set[str] = set()
        self._steps_before: dict[str, float | None] = {}
        # Each covered (and adopted) parameter's step count as the last step this tracker saw
        # (or a load_state_dict) left it (see _unseen_steps), and how many updates it saw.
        self._seen: dict[str, float | None] = {n: self._count_of(n) for n in self._covered}
        self._updates: dict[str, int] = dict.fromkeys(self._watched, 0)
        # id(optimizer) -> its tracked params, from its pre-step hook to its post-step hook
        self._foreign_open: dict[int, list[str]] = {}
        # (name, hyper, key of the denominator state); hyper None means: mark every element
        self._pending: list[tuple[str, StepHyper | None, str]] = []
        self._seals: dict[str, _Seal] = {}  # the state each pending step left (see _vouch)
        # Edits outside the optimizer; the snapshot path compares bits and needs no counter.
        self._oob = OutOfBandWatch(
            {n: w for n, w in self._watched.items() if n not in self.fallback}
        )
        # Called first by the pre-step hook (hold_steps): an overlapped sender's detection
        # may still be reading this tracker on another thread.
        self._holds: dict[int, Callable[[], None]] = {}
        self._hold_keys = itertools.count()
        self._window_checked = True  # set by the check right before each update
        self._warned_unchecked = False
        self._warned_step_count = False
        self._warned_whole: set[str] = set()  # the causes of whole sends logged so far
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            _first_post_hook(optimizer, self._post_step),
            *_any_optimizer_hooks(self),
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]

    # -- where things are --------------------------------------------------------------------

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

    # -- versions ----------------------------------------------------------------------------

    @property
    def out_of_band(self) -> tuple[str, ...]:
        """Parameters changed outside the optimizer since the last ``clear()`` (reported in
        full), in ``named_params`` order."""
        self._unseen_steps()
        self._oob.check()
        marked = self._snapshot.marked
        return tuple(n for n in self._order if n in self._oob or n in marked)

    def mark_changed(self, *names: str) -> None:
        """Report these parameters changed in full for this version: the remedy for writes the
        version counter cannot see (through ``.data``, or by code holding another alias)."""
        for name in names:
            if name not in self._watched:
                raise KeyError(f"{name!r} is not a tracked parameter")
            self._oob.mark(name)  # counted for a read window; flagged when on the bound
            if name in self.fallback:
                # its snapshot's baseline may already hold the write (a clear() after it, at
                # the end of an overlapped version's detection): reported in full
                self._snapshot.mark_changed(name)

    def marks(self) -> int:
        """How many ``mark_changed`` marks were made so far (never reset): an overlapped
        sender's read window counts the marks made while its version reads the params as
        writes there (see :class:`~deltasync.trainer.params.ReadWindow`)."""
        return self._oob.marks.count

    def marked_since(self, marks: int) -> set[str]:
        """The parameters marked changed after the ``marks``-th mark (see :meth:`marks`)."""
        return self._oob.marks.since(marks)

    # -- hooks -------------------------------------------------------------------------------

    def hold_steps(
        self, optimizer: torch.optim.Optimizer, wait: Callable[[], None]
    ) -> Callable[[], None] | None:
        """Make every step of ``optimizer`` call ``wait()`` before this tracker's own pre-step
        hook reads or changes its state, so a detection pass may continue on another thread
        after its caller returned (an overlapped sender: ``wait`` returns once that pass and
        everything reading the parameters has ended).

        Returns:
            A function that removes the hold, or None when ``optimizer`` is not the optimizer
            this tracker hooks (then nothing orders its steps after ``wait``).
        """
        if optimizer is not self._opt:
            return None
        key = next(self._hold_keys)
        self._holds[key] = wait
        return lambda: self._holds.pop(key, None)

    def _pre_step(self, opt, args, kwargs) -> tuple[tuple, dict] | None:
        for wait in list(self._holds.values()):  # a detection on another thread ends first
            wait()
        self._check_groups(opt)
        # Edits since the last step or clear() must be seen before this step moves the
        # counters again (a param edited, then stepped); so must a step never seen.
        self._unseen_steps()
        self._oob.check()
        self._vouch()
        self._finalize()  # the state is about to change: invert the previous step now
        for name in (*self._covered, *self._adopted):
            self._steps_before[name] = self._seen[name]
        self._window_checked = False
        if not self._covered:
            return None  # every parameter on the snapshot path: its bits are compared
        # Adam's step calls its closure right before its update: the last point where a
        # write is not the update's (the closure's own, or a pre-hook registered after this
        # one). Without a closure, one that only checks. (A covered parameter means torch's
        # own Adam/AdamW step, which takes one.)
        return _closure_then(args, kwargs, self._check_before_update)

    def _check_before_update(self) -> None:
        """Right before Adam's update: any counter that moved since the pre-step hook is a
        write that is not the update's."""
        self._oob.check()
        self._window_checked = True

    def _check_groups(self, opt: torch.optim.Optimizer) -> None:
        """Where each parameter is in the optimizer's param groups now: before a step (for
        the step counts) and right after its update (the groups the update read: a pre-step
        hook registered after this tracker, or the closure, may have changed them since). A
        parameter moved to another group (``add_param_group`` after removing it elsewhere, a
        group deleted) is inverted with its new group's hyperparameters; one in no group is not
        this optimizer's to step; one listed twice (``_LISTED_TWICE``) is stepped twice a
        step, which no inversion of one step covers; and a constant the optimizer now steps
        (``add_param_group`` after this tracker was built: progressive unfreezing) is sent in
        full for every step of it (warned once; a new tracker detects it sparsely). Its step
        count says when, not its version counter: a fused step does not move that."""
        group_of: dict[int, int] = {}
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                group_of[id(p)] = _LISTED_TWICE if id(p) in group_of else gi
        for name, (p, gi) in self._covered.items():
            now = group_of.get(id(p))
            if now != gi:
                self._covered[name] = (p, now)
        self._check_untracked(opt)
        added = [n for n in self.constant if id(self._watched[n].param) in group_of]
        if added:
            self.constant = tuple(n for n in self.constant if n not in added)
            self._adopted.extend(added)
            self._seen.update({n: self._count_of(n) for n in added})
            log.warning(
                "AdamWTracker: %d frozen parameter(s) were added to the optimizer after the "
                "tracker was built (%s): each is reported changed in full for every version "
                "it is stepped in; build a new AdamWTracker over the optimizer to detect them "
                "sparsely",
                len(added),
                ", ".join(repr(n) for n in added[:5]),
            )

    def _check_untracked(self, opt: torch.optim.Optimizer) -> None:
        """A parameter this tracker was not given, added to the optimizer since it was built,
        that shares memory with a tracked one off the snapshot path: its update writes the
        tracked one inside the step (a moved counter is taken as the step's own; a fused
        update moves none), so that one is sent in full for every step from now on (warned
        once; a new tracker puts it on the snapshot path)."""
        fresh = {
            at
            for g in opt.param_groups
            for p in g["params"]
            if id(p) not in self._name_of and (at := _where(p)) not in self._untracked_at
        }
        if not fresh:
            return
        self._untracked_at |= fresh
        fresh_ids = {at[0] for at in fresh}
        hit = touching(
            (
                (n, w.local(), id(w.param))
                for n, w in self._watched.items()
                if n not in self.fallback and n not in self._aliased
            ),
            [e for e in _untracked(opt, self._name_of) if e[2] in fresh_ids],
        )
        if hit:
            self._aliased.update(hit)
            log.warning(
                "AdamWTracker: %d tracked parameter(s) share memory with a parameter added to "
                "the optimizer since the tracker was built, which it was not given (%s): each "
                "is reported changed in full for every step; build a new AdamWTracker to put "
                "them on the exact snapshot path",
                len(hit),
                ", ".join(f"{n!r}: {o}" for n, o in list(hit.items())[:5]),
            )

    def _tracked_in(self, opt: torch.optim.Optimizer) -> list[str]:
        """The tracked parameters in ``opt``'s param groups, and those sharing memory with
        one of its parameters this tracker was not given (a critic's
        ``nn.Parameter(actor.weight.detach()[:4])``: its fused step writes them without
        moving a version counter)."""
        names = (self._name_of.get(id(p)) for g in opt.param_groups for p in g["params"])
        found = [n for n in names if n is not None]
        return found + [n for n in self._aliased_by(opt) if n not in found]

    def _aliased_by(self, opt: torch.optim.Optimizer) -> list[str]:
        """The tracked parameters sharing memory with a parameter in ``opt``'s groups that
        this tracker was not given; kept while those parameters stay where they were (a
        critic's optimizer steps every training step, and finding them anew took ~20 ms a
        step for 600 tracked and 600 untracked parameters on this 2-core VM)."""
        at = tuple(
            _where(p) for g in opt.param_groups for p in g["params"] if id(p) not in self._name_of
        )
        if not at:
            return []
        was, names = self._foreign_aliases.get(id(opt), ((), []))
        if was == at:
            return names
        hit = touching(
            ((n, w.local(), id(w.param)) for n, w in self._watched.items()),
            _untracked(opt, self._name_of),
        )
        names = [n for n in self._order if n in hit]
        self._foreign_aliases[id(opt)] = (at, names)
        return names

    def _foreign_starts(self, opt: torch.optim.Optimizer) -> None:
        """Another optimizer is about to step: its tracked parameters stay on record until
        its post-step hook marks them (a step interrupted between its update and that hook
        is then still seen, by :meth:`_unseen_steps`). A record, not a mark: the step may
        yet wait for a version in flight (its barrier runs after this global hook)."""
        if opt is not self._opt:
            self._foreign_open[id(opt)] = self._tracked_in(opt)

    def _foreign_step(self, opt: torch.optim.Optimizer) -> None:
        """Another optimizer stepped: each tracked parameter in its groups is reported changed
        in full (its version counter would say so, but a fused step does not move it)."""
        if opt is self._opt:
            return
        self._foreign_moments(opt)
        for name in self._tracked_in(opt):
            self._oob.mark(name, "stepped by another optimizer than the tracked one")
        self._foreign_open.pop(id(opt), None)

    def _foreign_moments(self, opt: torch.optim.Optimizer) -> None:
        """Another optimizer stepped: a pending step whose moments share memory with that
        optimizer's state (a shallow copy of one's state into the other) was rewritten since
        its inversion's state was taken, and a fused step moves no version counter that the
        seal would see: it goes in full."""
        pending = {n for n, h, _ in self._pending if h is not None and n in self._covered}
        if not pending:
            return
        ours = [
            (n, t, "ours")
            for n in pending
            for t, key in _moments(self._opt.state.get(self._covered[n][0], {}))
            if key is not None
        ]
        theirs: list[tuple[str, torch.Tensor, object]] = []
        opaque = False
        for group in opt.param_groups:
            for q in group["params"]:
                for t, key in _moments(opt.state.get(q, {})):
                    if key is None:
                        opaque = True
                    else:
                        theirs.append((str(id(q)), t, "theirs"))
        hit = pending if opaque else set(touching(ours, theirs))
        if hit:
            self._pending[:] = [(n, None if n in hit else h, k) for n, h, k in self._pending]
            self._warn_whole(
                {"foreign state": ("its moments share memory with another optimizer's", hit)}
            )

    def _sharing_state(self, opt: torch.optim.Optimizer, stepped) -> set[str]:
        """The stepped names on the bound whose optimizer state overlaps another parameter's
        that this step wrote (a shallow copy or a slice of one's state for another in model
        surgery): with the single-tensor and fused paths a later parameter's update rewrote
        it after an earlier one's used it, so the state no longer holds what either step
        used, and both go in full. Keyed by storage, then by extent (views at other offsets
        overlap too); one tensor under two names (tied weights) has one state and never
        counts; a parameter off the bound or not tracked at all writes the state it shares as
        well (when it has a gradient); a state tensor without a readable storage may overlap
        anything."""
        stepped_ids = {id(self._covered[n][0]) for n in stepped if n in self._covered}
        if not stepped_ids:
            return set()
        covered_ids = {id(p) for p, _ in self._covered.values()}
        by_storage: dict[tuple[torch.device, int], list[tuple[str, torch.Tensor, int]]] = {}
        opaque: set[int] = set()  # owners of state tensors without a readable storage
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in stepped_ids and (id(p) in covered_ids or p.grad is None):
                    continue  # not stepped by this step (one off the bound: by its gradient)
                for t, key in _moments(opt.state.get(p, {})):
                    if key is None:
                        opaque.add(id(p))
                    else:
                        by_storage.setdefault(key, []).append((str(id(p)), t, id(p)))
        owners: set[str] = set()
        for found in by_storage.values():
            if len({owner for _, _, owner in found}) > 1:
                owners.update(overlapping(found))
        shared = set()
        for n in stepped:
            if n in self._covered:
                p = self._covered[n][0]
                if str(id(p)) in owners or opaque - {id(p)}:
                    shared.add(n)
        return shared

    def _post_step(self, opt, args, kwargs) -> None:
        if self._covered and not self._window_checked:
            # A pre-step hook after this one replaced the step's arguments and dropped the
            # checking closure: a write just before the update cannot be told from the
            # update's own, so every parameter whose counter moved in the step goes in full.
            if not self._warned_unchecked:
                self._warned_unchecked = True
                log.warning(
                    "AdamWTracker: a pre-step hook replaced the step's arguments without the "
                    "closure the tracker hands step(): every parameter written in such a step "
                    "is reported changed in full; let the hook pass on the closure it was given"
                )
            self._oob.check()
        self._check_groups(opt)  # as the update read them: nothing ran between the two
        stepped = []
        # Recorded as seen once every stepped parameter's step is pending: an interrupt in
        # this hook leaves the counts as they were, so the next check sends them in full.
        counts: dict[str, float | None] = {}
        for name in self._adopted:
            counts[name] = after = self._count_of(name)
            if after is None:
                continue
            moved = after != self._steps_before.get(name)
            if (
                not moved
                and after >= _STEP_COUNT_EXACT
                and self._watched[name].param.grad is not None
            ):
                self._warn_step_count()  # past 2^24 a float32 count no longer moves
                moved = True  # it may have stepped (a fused step moves no version counter)
            if moved:
                stepped.append(name)
                self._oob.mark(name, "stepped by the optimizer, which the tracker does not cover")
        for name in self._aliased:  # written by an untracked parameter's update
            self._oob.mark(name, "written by a parameter the tracker was not given")
        group_hyper: dict[int, tuple[dict, str | None]] = {}
        whole_why: dict[str, tuple[str, list[str]]] = {}  # cause -> (first detail, names)
        for name, (p, gi) in self._covered.items():
            if gi is None:
                continue  # in no param group now: not this optimizer's to step
            state = opt.state.get(p, {})
            counts[name] = after = _step_count(state)
            before = self._steps_before.get(name)
            if after is None or after == before:
                if after is None or after < _STEP_COUNT_EXACT or p.grad is None:
                    continue  # no gradient or a skipped (inf/nan) step: the param did not move
                self._warn_step_count()  # past 2^24 a float32 count no longer moves
                whole = True  # it may have stepped
            else:  # more than one update in this step(): not a step the bound can invert
                whole = gi == _LISTED_TWICE or after - (before or 0) != 1
            stepped.append(name)
            if whole:
                if gi == _LISTED_TWICE:
                    _note(whole_why, "listed twice", "it is listed in two param groups", name)
                elif after != before:  # (past 2^24, where it cannot move, warned above)
                    _note(
                        whole_why,
                        "count jumped",
                        f"its step count went from {before or 0:g} to {after:g} in one step()",
                        name,
                    )
                self._pending.append((name, None, "exp_avg_sq"))
                continue
            if gi not in group_hyper:
                group = opt.param_groups[gi]
                group_hyper[gi] = (group, _group_unsupported(opt, group))
            group, bad = group_hyper[gi]
            v_key = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
            m, v = state.get("exp_avg"), state.get(v_key)
            why = (
                bad
                or _param_unsupported(group, p)  # fused may be set since (a reload)
                or _state_unsupported(group, state)
                or (None if _state_usable(local_of(p), m, v) else _UNUSABLE_STATE)
                or (None if after == int(after) else f"its step count {after} is not whole")
            )
            ok = why is None
            hyper = _hyper(opt, group, int(after)) if ok else None
            # Anything the bound cannot vouch for is marked entirely changed: never a miss.
            if hyper is not None and not invertible(hyper):
                hyper = ok = None
                why = f"its step leaves the error bound no margin ({_hyper_text(group, after)})"
            if why is not None:  # one cause per text without its values: a scheduled lr is one
                _note(whole_why, _cause(why), why, name)
            self._pending.append((name, hyper, v_key))
            if ok:
                self._seals[name] = _Seal.of(m, v)
        shared = self._sharing_state(opt, stepped)
        if shared:
            self._pending[:] = [(n, None if n in shared else h, k) for n, h, k in self._pending]
            for name in sorted(shared):
                _note(whole_why, "shared state", "its moments share memory with another's", name)
        self._warn_whole(whole_why)
        # The step's own writes are not out of band, and only the params it stepped are
        # written by it: any other counter that moved (a frozen param added to the optimizer
        # after this tracker was built, a step hook's edit) is seen at the next check.
        self._oob.record(stepped)
        for name in stepped:
            self._updates[name] += 1
        self._seen.update(counts)

    def _count_of(self, name: str) -> float | None:
        covered = self._covered.get(name)
        p = covered[0] if covered is not None else self._watched[name].param
        return _step_count(self._opt.state.get(p, {}))

    def _unseen_steps(self) -> None:
        """Flag in full each parameter the optimizer stepped since the last step this tracker
        saw: a step interrupted between its update and the post-step hooks (Ctrl-C, a
        preemption handler's exception, an error in a later param group). Its pending step
        was never recorded, and a fused update moves no version counter; the step count
        moves. A flag, not a mark: found by detection itself, it is in the version read.
        (``optimizer.load_state_dict`` moves the counts without an update: its hooks check
        before the load and take the loaded counts after it. A count gone, the state cleared,
        is flagged too, unless the step the tracker saw last is still pending (its seal sends
        it whole): a step may have come before the clear.) The counts are taken as seen
        once every flag is made: an interrupt in between leaves them to the next check."""
        for names in list(self._foreign_open.values()):  # another optimizer's step cut short
            for name in names:
                self._oob.flag(name, "stepped by another optimizer whose step did not finish")
        self._foreign_open.clear()
        for name in self._aliased:  # a step of the untracked one cut short writes it too
            self._oob.flag(name, "written by a parameter the tracker was not given")
        counts = {name: self._count_of(name) for name in (*self._covered, *self._adopted)}
        pending = {entry[0] for entry in self._pending}  # a clear after them: the seal's
        for name, now in counts.items():
            was = self._seen.get(name)
            if name in self._seen and now != was and (now is not None or name not in pending):
                self._oob.flag(
                    name,
                    f"stepped by the optimizer without the tracker seeing the step (step "
                    f"count {was} -> {now}: a step interrupted after its update?)"
                    if now is not None
                    else "left without optimizer state (cleared after a step the tracker may "
                    "not have seen)",
                )
        self._seen.update(counts)

    def _before_load(self, opt, state_dict) -> None:
        """``optimizer.load_state_dict`` is about to replace the step counts: a step not seen
        before it is flagged now (the loaded counts would hide it)."""
        self._unseen_steps()

    def _after_load(self, opt) -> None:
        """The loaded step counts are the ones the next step starts from."""
        self._seen.update({n: self._count_of(n) for n in (*self._covered, *self._adopted)})

    def updates_seen(self, name: str) -> int:
        """How many optimizer updates of ``name`` this tracker has seen (never reset): a read
        window's record of a parameter, since a fused update moves no version counter."""
        return self._updates.get(name, 0)

    def _warn_whole(self, why: Mapping[str, tuple[str, Collection[str]]]) -> None:
        """Log, once per cause, that parameters were sent in full for a step the bound cannot
        invert: exact still, but their every element goes out, and an operator wondering why
        a version grew to dense size needs the cause and the names."""
        for cause, (detail, names) in why.items():
            if cause in self._warned_whole:
                continue
            self._warned_whole.add(cause)
            shown = sorted(names)
            log.warning(
                "AdamWTracker: %d parameter(s) reported changed in full for this step because "
                "%s (%s%s); the sync stays exact, only larger. Logged once per cause",
                len(shown),
                detail,
                ", ".join(repr(n) for n in shown[:5]),
                ", ..." if len(shown) > 5 else "",
            )

    def _warn_step_count(self) -> None:
        if not self._warned_step_count:
            self._warned_step_count = True
            log.warning(
                "AdamWTracker: the optimizer's step count reached 2^24, where a float32 count "
                "no longer moves: a step cannot be told from a skipped one, so every parameter "
                "with a gradient is reported changed in full"
            )

    def _moments(self, name: str, v_key: str | None = None) -> tuple[object, object]:
        """``name``'s ``exp_avg`` and denominator state as the optimizer holds them now (None
        where it holds none)."""
        p, gi = self._covered[name]
        if v_key is None:
            groups = self._opt.param_groups
            amsgrad = gi is not None and 0 <= gi < len(groups) and groups[gi].get("amsgrad", False)
            v_key = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
        state = self._opt.state.get(p, {})
        return state.get("exp_avg"), state.get(v_key)

    def _seal_of(self, name: str) -> _Seal | None:
        m, v = self._moments(name)
        if not (isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)):
            return None  # no state yet: no step of it to detect
        return _Seal.of(m, v)

    def seal_state(self) -> StateSeal:
        """The optimizer state detection reads, sealed now: an overlapped sender takes it when
        its version starts reading (with the params' counters) and asks ``moved()`` before it
        commits, because an ``optimizer.load_state_dict`` or a moment reset while detection
        reads makes the inversion read another state than the step left. With the counters'
        own checks, a version's read window costs ~4 us a parameter (0.24 ms for the 47 of
        the small preset, 1.6 ms for Qwen3-0.6B's 310, against 0.05 / 0.28 without)."""
        seals = {n: seal for n in self._covered if (seal := self._seal_of(n)) is not None}
        return StateSeal(seals, self._moments)

    def _vouch(self) -> None:
        """Unvouch every pending step whose optimizer state is no longer the one it left
        (replaced, cleared or written in place since): inverting it from another state could
        miss elements, so the parameter is reported changed in full instead."""
        for i, (name, hyper, v_key) in enumerate(self._pending):
            if hyper is None:
                continue
            seal = self._seals.get(name)
            if seal is not None and seal.holds(*self._moments(name, v_key)):
                continue
            self._pending[i] = (name, None, v_key)
            log.warning(
                "parameter %r: its optimizer state was replaced or written after the step "
                "being detected (optimizer.load_state_dict, a moment reset); that step cannot "
                "be inverted, so all %d local elements are reported changed for this version",
                name,
                self._watched[name].shard.local_numel,
            )

    # -- detection ---------------------------------------------------------------------------

    def _state(self, name: str, v_key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, _ = self._covered[name]
        state = self._opt.state[p]
        return local_of(p), local_of(state["exp_avg"]), local_of(state[v_key])

    def _fold(self, name: str, hyper: StepHyper | None, v_key: str) -> None:
        """OR one pending step's mask into the param's bitset (allocating it if needed)."""
        self._clean.discard(name)
        local = self._watched[name].local()
        bits = self._bits.get(name)
        if bits is None:
            bits = torch.zeros(bitset_bytes(local.numel()), dtype=torch.uint8, device=local.device)
            self._bits[name] = bits
        if hyper is None:
            bits.fill_(0xFF)
            return
        p, m, v = self._state(name, v_key)
        detect_adamw_(p, m, v, kernel_scalars(hyper), bits, threads=self._threads)

    def _finalize(self) -> None:
        for entry in self._pending:
            self._fold(*entry)
        self._pending.clear()

    def _everything(self, name: str, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        local = self._watched[name].local()
        idx = torch.arange(local.numel(), dtype=torch.int64, device=local.device)
        return idx, (local.reshape(-1).to(torch.bfloat16).cpu() if values else None)

    def _detect(
        self, name: str, pending: tuple[str, StepHyper | None, str] | None, values: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._folded(name):
            if pending is not None:
                self._fold(*pending)
                # folded: from now on the bitset holds this step (a stream abandoned before
                # reaching a parameter leaves its step pending, for the next ask)
                if pending in self._pending:
                    self._pending.remove(pending)
            local = self._watched[name].local()
            idx = bits_to_indices(self._bits[name], local.numel())
            return idx, (bf16_at(local, idx, trusted=True) if values else None)
        if pending is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bfloat16)
        _, hyper, v_key = pending
        if hyper is None:
            return self._everything(name, values)
        args = (*self._state(name, v_key), kernel_scalars(hyper))
        if values:
            return detect_adamw_changes(*args, threads=self._threads)
        return detect_adamw_indices(*args, threads=self._threads), None

    def _iter(
        self,
        values: bool,
        positions: bool = False,
        values_below: int = 0,
        values_max: int = 0,
        sink: CastSink | None = None,
    ) -> Iterator[Change]:
        """The change stream behind every public iterator. ``positions``: a one-step
        parameter's chunks go straight into :class:`Positions`; ``values_below`` (with
        ``positions``): while fewer changed elements than that were seen, a parameter of at
        most :data:`VALUE_CAPTURE_MAX` elements comes as int64 indices with its values
        instead (see :meth:`iter_capture`); ``values_max`` (with ``positions``): so does
        every such parameter of at most that many elements, and a parameter detected in chunks
        comes as ``Positions`` with the values its chunks read, unless it has more than that
        many changed elements. One-step CPU parameters are detected ahead
        on the detection threads, a few work items at a time across parameter boundaries
        (:class:`Lookahead`: a small parameter is one item, a large one an item per chunk).
        ``sink``: such a parameter, held whole and wanted by it, also has every chunk cast
        to BF16 by the kernel that tests it, handed to ``sink`` in order (see
        :meth:`iter_capture`)."""
        self._unseen_steps()
        self._oob.check()
        self._vouch()
        pending = {e[0]: e for e in self._pending}
        # A pending step stays pending (its inputs are unchanged until the next step), so
        # asking twice gives the same answer; one folded into its parameter's bitset leaves
        # the list as it is folded (_detect), never before.
        snap = {n: (i, v) for n, i, v in self._snapshot.iter_changes()} if self.fallback else {}
        seen = 0  # changed elements handed over so far (the values budget)

        def wants_values(name: str) -> bool:
            numel = self._watched[name].shard.local_numel
            return values or (
                numel <= VALUE_CAPTURE_MAX and (seen < values_below or numel <= values_max)
            )

        chunked = {n for n in self._order if self._chunked_step(n, pending)}
        buffers = CastBuffers() if sink is not None else None

        def casts(name: str) -> bool:
            shard = self._watched[name].shard
            whole = shard.local_numel == math.prod(shard.global_shape)
            return sink is not None and whole and shard.local_numel > 0 and sink.wants(name)

        def job(key: str | tuple[str, ...]) -> list[Callable[[], Any]]:
            if isinstance(key, tuple):  # small parameters in one kernel call
                group = [
                    (*self._state(n, pending[n][2]), kernel_scalars(pending[n][1])) for n in key
                ]
                want = [wants_values(n) for n in key]  # decided at submission, as below
                cast = buffers if casts(key[0]) else None  # a group is cast whole or not

                def together() -> _Together:
                    got = detect_adamw_group(group, cast=cast)
                    return _Together(
                        {
                            n: (_small_result(idx, vals, w, positions), bits)
                            for n, w, (idx, vals, bits) in zip(key, want, got.found, strict=True)
                        },
                        got.shared,
                    )

                return [together]
            name = key
            _, hyper, v_key = pending[name]
            args = (*self._state(name, v_key), kernel_scalars(hyper))
            if name in chunked:  # its chunks, joined or encoded by the consumer
                return chunk_items(
                    *args,
                    values=values or bool(positions and values_max),
                    cast=buffers if casts(name) else None,
                )
            if casts(name):  # one item: its detection as below, and its bits for the sink
                assert buffers is not None
                return [lambda: _with_bits(args, wants_values(name), positions, buffers)]
            if wants_values(name):  # decided at submission; the consumer re-checks the budget
                return [lambda: detect_adamw_changes(*args, threads=1)]
            if positions:
                return [lambda: (Positions.of(detect_adamw_indices(*args, threads=1)), None)]
            return [lambda: (detect_adamw_indices(*args, threads=1), None)]

        keys, group_of = self._work_keys(pending, chunked, casts)
        ahead = Lookahead(keys, job, threads=self._threads or torch.get_num_threads())
        groups: dict[tuple[str, ...], _Together | None] = {}

        def taken(name: str) -> Any:
            """``name``'s detection from the threads (None: not submitted)."""
            key = group_of.get(name)
            if key is not None:  # its group's, taken with its first member
                if key not in groups:
                    got = ahead.take(key)
                    if got is None and not ahead.threaded:  # one thread: the one call, here
                        (item,) = job(key)
                        got = item()
                    groups[key] = got
                together = groups[key]
                if together is None:
                    return None
                got, bits = together.members.pop(name)
                if casts(name):  # the group's bits, one view of one buffer each
                    assert sink is not None and buffers is not None
                    _hand_bits(sink, name, 0, bits, None)
                    if not together.members and together.shared is not None:
                        buffers.give(together.shared)  # every member hashed
                return got
            if name not in chunked:
                got = ahead.take(name)
                if isinstance(got, _WithBits):
                    assert sink is not None and buffers is not None
                    _hand_bits(sink, name, 0, got.bits, buffers)
                    got = got.detection
                return got
            items = ahead.take_items(name)  # its chunks: encoded as they come, or joined
            if items is None:
                return None
            if casts(name):
                assert sink is not None and buffers is not None
                items = _feeding(sink, name, items, buffers)
            if positions and not values:
                return _capture_chunks(items, self._watched[name].local().device, values_max)
            return join_chunks(list(items), values=values)

        try:
            for name in self._order:
                vals: torch.Tensor | None
                if name in self._oob:
                    want = values  # the whole parameter: its values are read where routed
                    idx, vals = self._everything(name, values)
                elif name in self._covered:
                    want = wants_values(name)
                    got = taken(name)
                    if got is None:
                        got = self._detect_one(
                            name,
                            pending.get(name),
                            want,
                            positions,
                            values_max,
                            sink if casts(name) else None,
                            buffers,
                        )
                    if isinstance(got[0], Positions):
                        seen += len(got[0])
                        if len(got[0]):
                            yield name, got[0], got[1]  # type: ignore[misc]
                        continue
                    idx, vals = got
                elif name in snap:
                    idx, vals = snap[name]
                    want = wants_values(name)
                else:
                    continue  # a constant, unedited
                seen += idx.numel()
                if not idx.numel():
                    continue
                if positions and not want:
                    yield name, Positions.of(idx), None  # type: ignore[misc]
                else:
                    yield name, idx, vals
        finally:
            ahead.close()

    def _work_keys(
        self, pending: dict, chunked: set[str], casts: Callable[[str], bool]
    ) -> tuple[list[str | tuple[str, ...]], dict[str, tuple[str, ...]]]:
        """What goes to the detection threads, in order: each chunked parameter and each
        small one-step parameter by name, except that runs of neighbouring small ones of at
        most :data:`GROUP_NUMEL` elements, all cast for a sink or none, go as one group of up
        to :data:`GROUP_ELEMENTS` elements; and each grouped name's group."""
        keys: list[str | tuple[str, ...]] = []
        group_of: dict[str, tuple[str, ...]] = {}
        run: list[str] = []
        held = 0
        cast_run = False

        def close() -> None:
            nonlocal held
            if len(run) > 1:
                key = tuple(run)
                keys.append(key)
                group_of.update(dict.fromkeys(key, key))
            else:
                keys.extend(run)
            run.clear()
            held = 0

        for name in self._order:
            if name in chunked:
                close()
                keys.append(name)
            elif self._small_step(name, pending):
                numel = self._watched[name].shard.local_numel
                if numel > GROUP_NUMEL:
                    close()
                    keys.append(name)
                    continue
                if held + numel > GROUP_ELEMENTS or (run and casts(name) != cast_run):
                    close()
                cast_run = casts(name)
                run.append(name)
                held += numel
        close()
        return keys, group_of

    def _folded(self, name: str) -> bool:
        """Whether ``name``'s changes since the last clear() are (partly) in its bitset."""
        return name in self._bits and name not in self._clean

    def _plain_step(self, name: str, pending: dict) -> bool:
        """Whether ``name``'s detection is one plain step on a CPU tensor (the kernel's
        work items can run ahead on the detection threads: :class:`Lookahead`)."""
        if name in self._oob or name not in self._covered or self._folded(name):
            return False
        entry = pending.get(name)
        return (
            entry is not None
            and entry[1] is not None
            and self._watched[name].param.device.type == "cpu"
        )

    def _small_step(self, name: str, pending: dict) -> bool:
        """A plain step in a single kernel call."""
        return self._plain_step(name, pending) and small_enough(
            self._watched[name].shard.local_numel
        )

    def _chunked_step(self, name: str, pending: dict) -> bool:
        """A plain step in several kernel calls (above :data:`VALUE_CAPTURE_MAX`, so a
        capture hands it over as positions)."""
        numel = self._watched[name].shard.local_numel
        return (
            self._plain_step(name, pending)
            and not small_enough(numel)
            and numel > VALUE_CAPTURE_MAX
        )

    def _detect_one(
        self,
        name: str,
        entry: tuple[str, StepHyper | None, str] | None,
        want: bool,
        positions: bool,
        values_max: int = 0,
        sink: CastSink | None = None,
        buffers: CastBuffers | None = None,
    ) -> tuple[torch.Tensor | Positions, torch.Tensor | None]:
        """One covered parameter on the caller's thread: ``(Positions, values or None)`` when
        its chunks went straight into the encoding (values as :func:`_capture_chunks` keeps
        them), else ``(int64 indices, values or None)``. ``sink``: the kernel's casts of a
        one-step parameter go to it (else it is never fed this parameter)."""
        one_step = not self._folded(name) and entry is not None and entry[1] is not None
        if sink is not None and buffers is None:
            buffers = CastBuffers()
        if positions and not want and one_step:
            # One step per version: the kernel's chunks go straight into Positions.
            assert entry is not None
            _, hyper, v_key = entry
            local = self._watched[name].local()
            chunks = detect_adamw_chunks(
                *self._state(name, v_key),
                kernel_scalars(hyper),
                threads=self._threads,
                values=bool(values_max) and local.numel() > VALUE_CAPTURE_MAX,
                cast=buffers if sink is not None else None,
            )
            if sink is not None:
                assert buffers is not None
                chunks = _feeding(sink, name, chunks, buffers)
            return _capture_chunks(chunks, local.device, values_max)
        if sink is not None and one_step:
            # Indices (and values) wanted whole: the chunks joined, their casts fed on the way.
            assert entry is not None and buffers is not None
            _, hyper, v_key = entry
            chunks = detect_adamw_chunks(
                *self._state(name, v_key),
                kernel_scalars(hyper),
                threads=self._threads,
                values=want,
                cast=buffers,
            )
            return join_chunks(list(_feeding(sink, name, chunks, buffers)), values=want)
        return self._detect(name, entry, want)

    def iter_changes(
        self, *, sink: CastSink | None = None
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """The :class:`~deltasync.trainer.Tracker` stream: ``(name, indices, bf16 values)`` per
        changed param, in ``named_params`` order, detected lazily one param at a time, the
        values read by the detection pass itself. ``sink``: as in :meth:`iter_capture` (the
        kernel's casts of every parameter held whole and detected in one optimizer step, in
        order, on the consuming thread); the items are the same with or without it."""
        for name, idx, vals in self._iter(values=True, sink=sink):
            assert vals is not None
            yield name, idx, vals

    def iter_changed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, indices)`` one parameter at a time, in ``named_params`` order, so a
        publisher can encode and ship each while the next is still being detected."""
        for name, idx, _ in self._iter(values=False):
            yield name, idx

    def iter_positions(self) -> Iterator[tuple[str, Positions]]:
        """Like :meth:`iter_changed`, each parameter's positions encoded compactly
        (:class:`Positions`, about 1 byte per changed element) as detection hands them over
        chunk by chunk: what an overlapped sender keeps, without the int64 positions of a
        whole parameter ever existing (one optimizer step per version; with a bitset, a
        snapshot or an edit outside the optimizer the parameter's indices are built first,
        as in :meth:`iter_changed`)."""
        for name, pos, _ in self._iter(values=False, positions=True):
            yield name, pos

    def iter_capture(
        self, values_below: int, *, values_max: int = 0, sink: CastSink | None = None
    ) -> Iterator[tuple[str, torch.Tensor | Positions, torch.Tensor | None]]:
        """:meth:`iter_positions`, except that while fewer than ``values_below`` changed
        elements were seen, a parameter of at most :data:`VALUE_CAPTURE_MAX` elements comes
        as ``(name, sorted int64 indices, BF16 values)``, the values read by detection itself
        (as :meth:`iter_changes` gives them); the others as ``(name, Positions, None)``.
        With ``values_max`` every parameter of at most :data:`VALUE_CAPTURE_MAX` (and at most
        ``values_max``) elements comes with its values too, and a larger one as ``(name,
        Positions, BF16 values)`` where it is detected in chunks (one optimizer step) and has
        at most ``values_max`` changed elements: the values its detection kernel wrote as it
        flagged each element, while the block was in cache.

        A small delta then never pays for encoding its positions, decoding them again and
        a second, cache-cold read of its values (an overlapped sender publishing it on the
        caller's thread); a large one holds values for at most ``values_below`` plus
        :data:`VALUE_CAPTURE_MAX` elements' worth of parameters, plus ``values_max`` for the
        parameter being handed over (what the consumer keeps beyond that is its own budget).

        Args:
            values_below: the budget of changed elements captured with values (0: none).
            values_max: the most changed elements a chunked parameter's values are handed
                over for (0: positions only for them).
            sink: takes the BF16 bits of every parameter it wants that is held whole and
                detected by the kernel in one optimizer step, cast by the kernel from the
                values its test reads (no second read of the parameter), each parameter's
                chunks in order, on the caller's thread as the items pass; a parameter whose
                bits cannot all come is failed (``sink.fail``) or never fed.

        Returns:
            One item per changed parameter, in ``named_params`` order.
        """
        for arg, value in (("values_below", values_below), ("values_max", values_max)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{arg} must be a non-negative int, got {value!r}")
        yield from self._iter(
            values=False,
            positions=True,
            values_below=values_below,
            values_max=values_max,
            sink=sink,
        )

    def changed(self) -> dict[str, torch.Tensor]:
        return dict(self.iter_changed())

    def iter_changed_values(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Like :meth:`iter_changed`, plus the params' current BF16 values at those indices
        (exactly ``p.reshape(-1)[indices].to(torch.bfloat16)``), read by the detection pass
        itself while each chunk is in cache: one pass over the params instead of two."""
        return self.iter_changes()

    def changed_values(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (indices, bf16 values)}``; the same indices as :meth:`changed`."""
        return {name: (idx, vals) for name, idx, vals in self.iter_changes()}

    def clear(self) -> None:
        self._pending.clear()  # steps before the new baseline no longer matter
        for bits in self._bits.values():
            bits.zero_()  # kept: a caller with several steps per version will need it again
        self._clean = set(self._bits)
        self._snapshot.clear()
        self._oob.clear()

    def close(self) -> None:
        """Remove the optimizer hooks, once a detection still reading this tracker on another
        thread (an overlapped sender's, which holds the steps) has ended: without the hooks
        the next step would not wait for it."""
        for wait in list(self._holds.values()):
            wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def memory_bytes(self) -> int:
        """Host/device bytes this tracker holds (bitsets + fallback snapshot)."""
        return sum(b.numel() for b in self._bits.values()) + self._snapshot.snapshot_bytes()
