"""The background half of an overlapped in-cluster send: one worker thread, the version in
flight, and the optimizer barrier.

``ClusterSender(overlap=True)`` captures a version's changes on the caller's thread and hands
the rest (routing, digests, encoding, the preflight, the exchange, the joint commit) to the one
thread here. Two moments of that work matter to the trainer:

- *released*: the background no longer reads the parameters (routing has gathered every value
  it needs and the expected digests are computed). The optimizer's next step may change the
  parameters only after this, so the optimizer's pre-step hook waits for it and nothing else;
- *done*: the version committed jointly or failed. The next ``sync`` waits for this, because
  versions go out one at a time and each one's base is the previous one's commit.

Every collective of the send runs on this one thread, in order, so the exchange's process
group is only ever used from here while a version is in flight (gloo and NCCL both require
that a group's collectives are issued in the same order on every rank; the trainer's own
collectives must use other groups). The CUDA runtime's current device is per thread, and a new
thread starts on device 0, so the worker takes the submitting thread's current device first:
NCCL's tensors then live where the caller's do.

This module knows threads, futures and the optimizer's hook API; it knows nothing about
payloads, tensors or ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from deltasync.cluster.reports import SendReport
from deltasync.interrupts import interrupts_deferred
from deltasync.trainer.handoff import run_into
from deltasync.trainer.step_barrier import Hold, StepBarrier

if TYPE_CHECKING:
    from deltasync.trainer.params import ReadWindow


class PendingSend:
    """A version captured by ``ClusterSender(overlap=True)`` and sent in the background.

    ``captured_s`` is how long the caller was blocked for detection and capture (or only their
    start when detection goes on in the background, see ``detected()``); a version after a
    small delta (``inline_below``) runs on the caller's thread and is done when ``sync``
    returns. ``released()``
    says whether the background stopped reading the parameters, ``done()`` whether it finished;
    ``result()`` waits and returns the :class:`SendReport` (or raises the send's error; the
    sender still raises :class:`~deltasync.errors.SendFailedError` at its next call)."""

    def __init__(self, version: int, captured_s: float) -> None:
        self.version = version
        self.captured_s = captured_s
        self.finished_at: float | None = None  # time.time() when the commit (or failure) ended
        # the writes to the parameters it can see while it reads them (None: settled)
        self.reads: ReadWindow | None = None
        self._detected = threading.Event()
        self._released = threading.Event()
        self._future: Future[SendReport] = Future()

    def end_detection(self) -> None:
        """Detection has ended (ok or failed; called by the capture)."""
        self._detected.set()

    def detected(self) -> bool:
        """Whether detection has ended (it may go on after ``sync`` returned); the sender's
        carry holds the version's positions from then on."""
        return self._detected.is_set()

    def wait_detected(self, timeout: float | None = None) -> bool:
        return self._detected.wait(timeout)

    def release(self) -> None:
        """The background reads the parameters no more (called from the worker)."""
        self._released.set()

    def released(self) -> bool:
        return self._released.is_set()

    def wait_released(self) -> None:
        self._released.wait()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SendReport:
        return self._future.result(timeout)


def current_cuda_device() -> int | None:
    """The caller's current CUDA device, or None where CUDA is not in use (never initialises
    CUDA on a CPU-only job)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


class Background:
    """One worker thread for the versions of one sender, and the barrier on ``optimizers``."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        thread_name: str,
        hold: Hold | None = None,
        settle: Callable[[PendingSend], None] | None = None,
    ) -> None:
        """``hold``: a tracker's ``hold_steps``, when it offers one: the barrier then runs
        first in the tracker's own pre-step hook (:attr:`held`: the caller may let detection
        go on after it returns), else it is a pre-step hook of its own. ``settle``: called by
        the barrier with the version in flight once it reads nothing more and its detection
        has ended, before the step."""
        self._settle = settle
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._inflight: PendingSend | None = None
        self.barrier_wait_s = 0.0  # how long the last optimizer step waited for the background
        self._waited: PendingSend | None = None  # the version the barrier last waited for
        self._steps = StepBarrier(optimizers, self.barrier, hold)

    @property
    def held(self) -> bool:
        """Whether the tracker runs the barrier before its own pre-step hook."""
        return self._steps.held

    @property
    def in_flight(self) -> PendingSend | None:
        return self._inflight

    def submit(self, pending: PendingSend, work: Callable[[PendingSend], SendReport]) -> None:
        """Run ``work(pending)`` on the worker; ``pending`` is released when ``work`` releases
        it or ends, and done when it ends."""
        assert self._inflight is None, "settle the version in flight first"
        device = current_cuda_device()

        def run() -> SendReport:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                return work(pending)
            finally:
                pending.release()  # a failure before the release must not hold the barrier
                pending.finished_at = time.time()

        with interrupts_deferred():  # what runs is what is in flight
            pending._future = self._pool.submit(run)
            self._inflight = pending

    def run_here(self, pending: PendingSend, work: Callable[[PendingSend], SendReport]) -> None:
        """Run ``work(pending)`` on the caller's thread, with :meth:`submit`'s contract: its
        error is kept for the sender's next call, the version is in flight until taken."""
        assert self._inflight is None, "settle the version in flight first"
        self._inflight = pending
        try:
            run_into(
                pending._future, lambda: work(pending), f"the send of version {pending.version}"
            )
        finally:
            pending.release()
            pending.finished_at = time.time()

    def barrier(self) -> None:
        """The optimizer's pre-step hook: the step may change the parameters (and the
        optimizer's state) only once the version in flight no longer reads them and its
        detection has ended (a send that failed early does not stop a detection still
        running). Errors wait for the sender's next call."""
        pending = self._inflight
        if pending is None:
            self.barrier_wait_s = 0.0
            return
        if pending is self._waited:  # another optimizer's step after the one that waited
            return
        t = time.perf_counter()
        pending.wait_released()
        pending.wait_detected()
        self.barrier_wait_s = time.perf_counter() - t
        self._waited = pending
        if self._settle is not None:
            self._settle(pending)

    def settled(self, pending: PendingSend) -> None:
        """``pending`` is no longer in flight: the caller has its result and settled it."""
        if self._inflight is pending:
            self._inflight = None

    def close(self) -> None:
        self._steps.remove()
        self._pool.shutdown(wait=True)
