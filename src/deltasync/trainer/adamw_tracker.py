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

from collections.abc import Iterable
import torch

from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
from deltasync.trainer.detect import bits_to_indices, bitset_bytes, detect_adamw_
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
        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
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

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_params: Iterable[tuple[str, torch.Tensor]], *, threads: int | None = None) -> None:
        self._opt = optimizer
        self._threads = threads
        params = named_unique(named_params)
        self._order = list(params)
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
        self._bits = {n: torch.zeros(bitset_bytes(p.numel()), dtype=torch.uint8, device=p.device)
                      for n, (p, _) in self._covered.items()}
        self._steps_before: dict[str, float | None] = {}
        # (name, hyper, key of the denominator state); hyper None means: mark every element
        self._pending: list[tuple[str, StepHyper | None, str]] = []
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                       optimizer.register_step_post_hook(self._post_step)]

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
            ok = (bad is None and m is not None and v is not None and m.dtype == torch.float32
                  and v.dtype == torch.float32 and m.shape == p.shape and v.shape == p.shape
                  and after == int(after))
            # Anything the bound cannot vouch for is marked entirely changed: never a miss.
            self._pending.append((name, _hyper(opt, group, int(after)) if ok else None, v_key))

    # -- detection -----------------------------------------------------------------------------

    def _finalize(self) -> None:
        for name, hyper, v_key in self._pending:
            p, _ = self._covered[name]
            bits = self._bits[name]
            if hyper is None:
                bits.fill_(0xFF)
                continue
            state = self._opt.state[p]
            detect_adamw_(p.detach(), state["exp_avg"], state[v_key], kernel_scalars(hyper), bits,
                          threads=self._threads)
        self._pending.clear()

    def changed(self) -> dict[str, torch.Tensor]:
        self._finalize()
        snap = self._snapshot.changed()
        out: dict[str, torch.Tensor] = {}
        for name in self._order:
            if name in self._bits:
                p, _ = self._covered[name]
                idx = bits_to_indices(self._bits[name], p.numel())
                if idx.numel():
                    out[name] = idx
            elif name in snap:
                out[name] = snap[name]
        return out

    def clear(self) -> None:
        self._pending.clear()  # steps before the new baseline no longer matter
        for bits in self._bits.values():
            bits.zero_()
        self._snapshot.clear()

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def memory_bytes(self) -> int:
        """Host/device bytes this tracker holds (bitsets + fallback snapshot)."""
        return sum(b.numel() for b in self._bits.values()) + self._snapshot.snapshot_bytes()

