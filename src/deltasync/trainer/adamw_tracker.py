"""Snapshot-free change detection for ``torch.optim.AdamW`` / ``Adam``.

``AdamWTracker`` hooks the optimizer's ``step``: the post-hook records the hyperparameters and
step counts each param group actually used (a scheduler may change ``lr`` right after), and the
detection for that step runs lazily -- just before the next step mutates the state, or when
``changed()`` is asked. Detection inverts the step from the optimizer's own state with the
error bound of ``adamw_bound.py`` and ORs the possibly-changed elements into a 1-bit-per-element
bitset, so several steps per published version are covered. A parameter whose step count did
not advance (no gradient, a step skipped by ``GradScaler``) did not change.

Parameters the bound does not cover go through an exact bitwise snapshot
(:class:`SnapshotTracker`); ``fallback`` says which and why. Memory: 1 bit per covered element
plus 2 bytes per fallback element.

This module knows optimizers, hooks and bitsets; it knows nothing about layouts or transport.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from deltasync.native.ops import bf16_at
from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
from deltasync.trainer.detect import (
    bits_to_indices,
    bitset_bytes,
    detect_adamw_,
    detect_adamw_changes,
    detect_adamw_indices,
)
from deltasync.trainer.snapshot_tracker import SnapshotTracker, named_unique


def _step_count(state: dict) -> float | None:
    step = state.get("step")
    if step is None:
        return None
    return float(step.item() if isinstance(step, torch.Tensor) else step)


def _group_unsupported(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Why the bound does not cover this param group, or None if it does."""
    if not isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam in torch >= 2.6
        return f"optimizer {type(opt).__name__} is not torch.optim.Adam/AdamW"
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


class AdamWTracker:
    """Which BF16 elements changed since the last ``clear()``, without a snapshot.

    ``changed()`` maps a parameter name to a sorted, unique, 1-D int64 tensor of row-major flat
    indices containing every element whose BF16 bits differ from those at the last ``clear()``
    (or construction), possibly with a few extra elements. Unchanged params are omitted.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_params: Iterable[tuple[str, torch.Tensor]],
        *,
        threads: int | None = None,
    ) -> None:
        self._opt = optimizer
        self._threads = threads
        params = named_unique(named_params)
        self._order = list(params)
        self._params = params
        group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        self.fallback: dict[str, str] = {}
        self._covered: dict[str, tuple[torch.Tensor, int]] = {}
        for name, p in params.items():
            gi = group_of.get(id(p))
            reason = None
            if gi is None:
                reason = "not in the optimizer (may be changed outside it)"
            elif p.dtype != torch.float32:
                reason = f"dtype {p.dtype} is not float32"
            else:
                reason = _group_unsupported(optimizer, optimizer.param_groups[gi])
            if reason is None:
                self._covered[name] = (p, gi)
            else:
                self.fallback[name] = reason
        self._snapshot = SnapshotTracker((n, params[n]) for n in self._order if n in self.fallback)
        # Bitsets are allocated only for params that take a second step before changed()/clear()
        # (several steps per version). With one step per version detection runs straight into
        # indices and the tracker holds no per-element memory between versions.
        self._bits: dict[str, torch.Tensor] = {}
        self._steps_before: dict[str, float | None] = {}
        # (name, hyper, key of the denominator state); hyper None means: mark every element
        self._pending: list[tuple[str, StepHyper | None, str]] = []
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    # -- hooks ---------------------------------------------------------------------------------

    def _pre_step(self, opt, args, kwargs) -> None:
        self._finalize()  # the state is about to change: invert the previous step now
        for name, (p, _) in self._covered.items():
            self._steps_before[name] = _step_count(opt.state.get(p, {}))

    def _post_step(self, opt, args, kwargs) -> None:
        group_hyper: dict[int, tuple[dict, str | None]] = {}
        for name, (p, gi) in self._covered.items():
            state = opt.state.get(p, {})
            after = _step_count(state)
            if after is None or after == self._steps_before.get(name):
                continue  # no gradient or a skipped (inf/nan) step: the param did not move
            if gi not in group_hyper:
                group = opt.param_groups[gi]
                group_hyper[gi] = (group, _group_unsupported(opt, group))
            group, bad = group_hyper[gi]
            v_key = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
            m, v = state.get("exp_avg"), state.get(v_key)
            ok = (
                bad is None
                and m is not None
                and v is not None
                and m.dtype == torch.float32
                and v.dtype == torch.float32
                and m.shape == p.shape
                and v.shape == p.shape
                and after == int(after)
            )
            # Anything the bound cannot vouch for is marked entirely changed: never a miss.
            self._pending.append((name, _hyper(opt, group, int(after)) if ok else None, v_key))

    # -- detection -----------------------------------------------------------------------------

    def _fold(self, name: str, hyper: StepHyper | None, v_key: str) -> None:
        """OR one pending step's mask into the param's bitset (allocating it if needed)."""
        p, _ = self._covered[name]
        bits = self._bits.get(name)
        if bits is None:
            bits = self._bits[name] = torch.zeros(
                bitset_bytes(p.numel()), dtype=torch.uint8, device=p.device
            )
        if hyper is None:
            bits.fill_(0xFF)
            return
        state = self._opt.state[p]
        detect_adamw_(
            p.detach(),
            state["exp_avg"],
            state[v_key],
            kernel_scalars(hyper),
            bits,
            threads=self._threads,
        )

    def _finalize(self) -> None:
        for entry in self._pending:
            self._fold(*entry)
        self._pending.clear()

    def _detect(
        self, name: str, pending: tuple[str, StepHyper | None, str] | None, values: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        p, _ = self._covered[name]
        if name in self._bits:
            if pending is not None:
                self._fold(*pending)
            idx = bits_to_indices(self._bits[name], p.numel())
            return idx, (bf16_at(p.detach(), idx, trusted=True) if values else None)
        if pending is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bfloat16)
        _, hyper, v_key = pending
        if hyper is None:
            idx = torch.arange(p.numel(), dtype=torch.int64, device=p.device)
            return idx, (p.detach().reshape(-1).to(torch.bfloat16).cpu() if values else None)
        state = self._opt.state[p]
        args = (p.detach(), state["exp_avg"], state[v_key], kernel_scalars(hyper))
        if values:
            return detect_adamw_changes(*args, threads=self._threads)
        return detect_adamw_indices(*args, threads=self._threads), None

    def _iter(self, values: bool) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        pending = {e[0]: e for e in self._pending}
        # A pending step stays pending (its inputs are unchanged until the next step), so
        # asking twice gives the same answer; folded ones are dropped from the list.
        self._pending = [e for e in self._pending if e[0] not in self._bits]
        snap = self._snapshot.changed() if self.fallback else {}
        for name in self._order:
            if name in self._covered:
                idx, vals = self._detect(name, pending.get(name), values)
            else:
                idx = snap.get(name)
                vals = None
                if idx is not None and values:
                    vals = bf16_at(self._params[name].detach(), idx, trusted=True)
            if idx is not None and idx.numel():
                yield name, idx, vals

    def iter_changed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, indices)`` one parameter at a time, in ``named_params`` order, so a
        publisher can encode and ship each while the next is still being detected."""
        for name, idx, _ in self._iter(values=False):
            yield name, idx

    def changed(self) -> dict[str, torch.Tensor]:
        return dict(self.iter_changed())

    def iter_changes(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """The :class:`~deltasync.trainer.Tracker` stream: ``(name, indices, bf16 values)`` per
        changed param, in ``named_params`` order, detected lazily one param at a time, the
        values read by the detection pass itself."""
        for name, idx, vals in self._iter(values=True):
            assert vals is not None
            yield name, idx, vals

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
        self._snapshot.clear()

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def memory_bytes(self) -> int:
        """Host/device bytes this tracker holds (bitsets + fallback snapshot)."""
        return sum(b.numel() for b in self._bits.values()) + self._snapshot.snapshot_bytes()
