"""The barrier an overlapped sender puts before every step of the optimizers that write its
parameters.

An overlapped sender (``TrainerSync(overlap=True)``, ``ClusterSender(overlap=True)``) reads the
parameters, and the optimizer state detection inverts, after its call returned; the next step
of any optimizer that writes them must wait for it. The one optimizer a tracker hooks is held
through the tracker (``hold_steps``: the barrier runs first in the tracker's own pre-step hook,
before the tracker reads or changes its state), every other one by a pre-step hook of its own.
A loop with two optimizers (Muon for the matrices, AdamW for the rest) passes both: an
optimizer left out steps while the version reads, and that version is refused and sent again.

This module knows the optimizer's hook API; nothing of trackers' contents or publishing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from deltasync.errors import ConfigError

# A tracker's hold_steps: (optimizer, barrier) -> a remover, or None for another optimizer.
Hold = Callable[[torch.optim.Optimizer, Callable[[], None]], Callable[[], None] | None]


def optimizers_of(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, owner: str
) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer`` as a tuple of distinct optimizers (ConfigError naming ``owner`` for
    anything else)."""
    if optimizer is None:
        return ()
    given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ConfigError(
            f"{owner}.optimizer must be a torch.optim.Optimizer or a sequence of them, got "
            f"{type(optimizer).__name__}"
        )
    out: list[torch.optim.Optimizer] = []
    for opt in given:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"{owner}.optimizer holds a {type(opt).__name__}, not a torch.optim.Optimizer"
            )
        if all(opt is not o for o in out):
            out.append(opt)
    return tuple(out)


class StepBarrier:
    """``barrier()`` before every step of ``optimizers``, until :meth:`remove`."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        barrier: Callable[[], None],
        hold: Hold | None = None,
    ) -> None:
        """``hold``: the tracker's ``hold_steps``, when it offers one (and detection may go
        on after the sender's call returns)."""
        self.held = False  # the tracker runs the barrier before its own pre-step hook
        self._removers: list[Callable[[], None]] = []
        for opt in optimizers:
            unhold = hold(opt, barrier) if hold is not None else None
            if unhold is not None:
                self.held = True
                self._removers.append(unhold)
            else:
                handle = opt.register_step_pre_hook(lambda *_: barrier())
                self._removers.append(handle.remove)

    def remove(self) -> None:
        """Remove every hook (once)."""
        removers, self._removers = self._removers, []
        for remove in removers:
            remove()
