"""The error bound that makes snapshot-free change detection a proof, not a heuristic.

What this module knows: the arithmetic of one (decoupled or L2) Adam/AdamW step as PyTorch
performs it in fp32 (``foreach=False``, ``foreach=True`` and ``fused=True``), and how far the
fp32 reconstruction of the pre-step parameter can be from the truth. What it does not know:
tensors, hooks, bitsets (see ``adamw_tracker.py`` and ``detect.py``).

The argument
------------
Let ``u = 2**-24`` (fp32 unit roundoff; every IEEE op in round-to-nearest returns
``fl(x) = x(1+d)`` with ``|d| <= u`` for normal results, and adds at most ``2**-150`` absolute
error for subnormal ones). After step ``t`` the optimizer holds ``p = θ_t``, ``m = m_t`` and
``v = v_t`` (``max_exp_avg_sq`` under amsgrad), exactly the values its update used. With
``c = 1 - lr*wd`` (decoupled weight decay; ``c = 1`` otherwise), ``bc1 = 1 - β1**t``,
``bc2 = 1 - β2**t`` (Python doubles) and the exact real update
``U = (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)``, every PyTorch implementation computes

    p1  = fl(θ_{t-1} * c)                  (skipped when wd == 0: then p1 = θ_{t-1})
    Uc  = U (1 + δ_U)                      (sqrt, /, +eps, /, * in some order; scalars
                                            rounded to fp32, FMA or not: |δ_U| <= 12u)
    θ_t = fl(p1 - Uc)                      (or an FMA of the same; one rounding)

Hence ``θ_{t-1} = (θ_t + Uc + e1) / (c (1 + δ_c))`` with ``|e1| <= u|θ_t|`` (the last
rounding) and ``|δ_c| <= 3u`` (the multiply, the rounding of ``c`` to fp32, and the fused
kernel's alternative ``p - p*(lr*wd)``).

We compute, in fp32, with the same scalars rounded to fp32 (``detect.c`` / ``detect.py``)

    û = (m / (sqrt(v)/bc2s + eps)) * step_size,   s = fl(θ_t + û),   r = fl(s * fl(1/c)).

``û`` differs from ``U`` by at most 12u relative (same operation count as above),
``s`` adds u|s|, and ``r`` adds 2u relative. Collecting terms, with ``|θ_t| <= |s| + |û|``:

    |θ_{t-1} - r| <= ((1 + 3 + 1 + 2 + 2) u |s| + (12 + 12 + 1 + 3) u |û|) / c + A
                 <= (2**-20 |s| + 2**-10 |û|) / c + A =: E

The two lines leave a factor of >= 1.7 on the |s| term (16u against 9u including the two
roundings of ``r ± E`` below) and of >= 500 on the |û| term (16384u against 28u). ``A``
covers subnormal arithmetic, including flush-to-zero/denormals-are-zero modes in which a
subnormal ``m`` or intermediate may be flushed: ``A = 2**-126 * 4 * (1 + step_size/eps) / c``.

Bias corrections. The above takes ``bc1`` and ``bc2`` as the optimizer's doubles. A step
compiled with ``torch.compile`` (and a tensor ``β``) evaluates them in fp32 tensors instead:
``β`` rounded to fp32, raised to ``t`` and subtracted from 1 in fp32. Against the double,
``1 - β**t`` is then off by at most ``d = |fl32(β)**t - β**t| + 8u max(...) + u`` (the
rounded ``β``'s power computed exactly in double, a pow within 8 ulp, the subtraction), a
relative ``δ = d / (bc - d)`` that for ``β2 = 0.999999`` reaches ~1e-2 at small ``t``, far
past the slack. ``U`` depends on them through ``1/bc1`` and ``sqrt(bc2)``, at most a relative
``sqrt(1 + δ2) / (1 - δ1) - 1``. The |û| term is therefore ``max(2**-10, 2 (28u + that))``:
the margin above holds it for common betas (``δ2 < 6e-4`` for ``β2 <= 0.999`` at every
``t``), and it grows only for extreme ones. Where it would pass ``MAX_REL_U`` the step is not
inverted (:func:`invertible`): the caller sends the whole tensor.

The true ``θ_{t-1}`` therefore lies in ``[r - E, r + E]``; computing ``fl(r - E)`` and
``fl(r + E)`` moves each end by at most ``u|r|``, which the slack above covers. BF16 rounding
(round to nearest even) is monotone, so if both computed ends and ``θ_t`` round to the same
BF16 bit pattern, every candidate for ``θ_{t-1}`` does too and the element provably did not
change. Otherwise it is reported (maybe an extra element, never a missed one). Non-finite
values are always reported. Bit patterns are compared as integers, so ``-0.0`` and ``+0.0``
differ, as they do on the receiver.

What the bound does not cover, and the tracker therefore sends through an exact bitwise
snapshot instead: non-fp32 parameters or states, ``capturable=True`` (bias corrections in fp32
tensors can be off by ~1000u at step 1), ``differentiable=True``, ``eps <= 0``, any optimizer
other than ``torch.optim.Adam``/``AdamW``, and parameters that are not in the optimizer.
``maximize`` and ``amsgrad`` are covered: the former only negates the gradient, the latter
stores the denominator state it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REL_S = 2.0**-20  # bound on |θ_{t-1} - r| per unit of |s|/c
REL_U = 2.0**-10  # bound per unit of |û|/c
_TINY = 2.0**-126
_U = 2.0**-24
MAX_REL_U = 0.25  # beyond it a step is not inverted: its tensor is sent whole
_UPDATE_ROUNDINGS = 28  # the |û| term's roundings in the argument above (12 + 12 + 1 + 3)


def _f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (as torch does with scalar arguments)."""
    import struct

    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclass(frozen=True, kw_only=True)
class StepHyper:
    """Hyperparameters of one optimizer step of one param group, recorded at step time."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    step: int  # the step count after the increment, as the optimizer used it


@dataclass(frozen=True)
class KernelScalars:
    """The fp32 scalars the detection kernel needs for one (param group, step count)."""

    bc2s: float
    eps: float
    step_size: float
    inv_c: float
    rel_s: float
    rel_u: float
    abs_e: float


def fp32_correction_error(beta: float, step: int) -> float:
    """Relative error, at most, of ``1 - beta**step`` evaluated in fp32 tensors (a compiled
    step) against the double the kernel's scalars use; ``inf`` where it is no bound at all."""
    exact = beta**step
    rounded = _f32(beta) ** step  # the fp32 beta's power, in double
    d = abs(rounded - exact) + 8.0 * _U * max(rounded, exact) + _U  # pow 8 ulp, then 1 - x
    bc = 1.0 - exact
    return d / (bc - d) if bc > d else math.inf


def rel_u(h: StepHyper) -> float:
    """The |û| term's factor for this step: ``REL_U``, or more where bias corrections
    evaluated in fp32 may be further off (module docstring); ``inf`` where nothing bounds
    them."""
    d1 = fp32_correction_error(h.beta1, h.step)
    d2 = fp32_correction_error(h.beta2, h.step)
    if not d1 < 1.0:
        return math.inf
    return max(REL_U, 2.0 * (_UPDATE_ROUNDINGS * _U + math.sqrt(1.0 + d2) / (1.0 - d1) - 1.0))


def invertible(h: StepHyper) -> bool:
    """Whether the bound holds for this step: a positive weight-decay factor and bias
    corrections whose fp32 evaluation keeps the |û| term within ``MAX_REL_U``."""
    c = 1.0 - h.lr * h.weight_decay if (h.decoupled and h.weight_decay != 0) else 1.0
    return c > 0.0 and math.isfinite(c) and rel_u(h) <= MAX_REL_U


def kernel_scalars(h: StepHyper) -> KernelScalars:
    bc1 = 1.0 - h.beta1**h.step
    bc2 = 1.0 - h.beta2**h.step
    step_size = h.lr / bc1
    c = 1.0 - h.lr * h.weight_decay if (h.decoupled and h.weight_decay != 0) else 1.0
    if not (c > 0.0) or not math.isfinite(c):
        # lr*wd >= 1 zeroes or flips the weights; inversion is meaningless. The caller checks
        # this before using the kernel and falls back to a snapshot.
        raise ValueError(f"weight-decay factor 1 - lr*wd = {c} is not positive")
    factor = rel_u(h)
    if not factor <= MAX_REL_U:  # the caller checks invertible() first
        raise ValueError(f"bias corrections at step {h.step} have no useful fp32 bound")
    inv_c = _f32(1.0 / c)
    # |step_size|: a negative lr (set by hand: only the constructor refuses one) must not
    # turn the subnormal allowance negative
    abs_e = _TINY * 4.0 * (1.0 + abs(step_size) / h.eps) / c if h.eps > 0 else math.inf
    return KernelScalars(
        bc2s=_f32(math.sqrt(bc2)),
        eps=_f32(h.eps),
        step_size=_f32(step_size),
        inv_c=inv_c,
        rel_s=REL_S,
        rel_u=_f32(factor),
        abs_e=_f32(abs_e) if math.isfinite(abs_e) and abs_e < 3.0e38 else math.inf,
    )
