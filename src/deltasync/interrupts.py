"""A Ctrl-C held off for the few statements that hand work to a thread and record it.

A ``KeyboardInterrupt`` is raised on the main thread between any two bytecodes, including
inside ``ThreadPoolExecutor.submit`` (which may start a thread and wait for it) and between a
submit and the line that records what was submitted. Landing there, it leaves work running
that nothing knows about, or work recorded that nothing runs: a thread that waits forever for
input no one sends, a version "in flight" whose detection never starts. Neither can be undone
after the fact, so the senders run those few statements under :func:`interrupts_deferred`: a
SIGINT that arrives meanwhile is delivered, to the handler that was installed, as the block
ends. Everything longer (detection, encoding, uploads, waits) stays interruptible.

Only the main thread runs Python's signal handlers, so elsewhere the block is a no-op; a
handler Python did not install (``signal.getsignal`` is ``None``) is left alone too.

This module knows signals and threads: nothing about trackers, versions or stores.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT until the block ends, then deliver it as it would have been delivered
    (``KeyboardInterrupt`` under Python's default handler). Nests."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:
        yield
        return
    held: list[tuple[int, FrameType | None]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            _deliver(previous, *held[0])


def _deliver(handler, signum: int, frame: FrameType | None) -> None:
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action, now that it is installed again
        return
    handler(signum, frame)
