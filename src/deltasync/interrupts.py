"""A Ctrl-C (or a SIGTERM a framework handles) held off for the few statements that hand work
to a thread and record it.

A ``KeyboardInterrupt`` is raised on the main thread between any two bytecodes, including
inside ``ThreadPoolExecutor.submit`` (which may start a thread and wait for it) and between a
submit and the line that records what was submitted. Landing there, it leaves work running
that nothing knows about, or work recorded that nothing runs: a thread that waits forever for
input no one sends, a version "in flight" whose detection never starts. Neither can be undone
after the fact, so the senders run those few statements under :func:`interrupts_deferred`: a
SIGINT that arrives meanwhile is delivered, to the handler that was installed, as the block
ends. A SIGTERM is held the same way where a Python handler is installed for it (launchers and
RL frameworks install ones that raise or exit). Everything longer (detection, encoding,
uploads, waits) stays interruptible.

Only the main thread runs Python's signal handlers, so elsewhere the block is a no-op; a
handler Python did not install (``signal.getsignal`` is ``None``) is left alone too.

:func:`stops_handled_by` is the commands' other use of signals: SIGINT and SIGTERM handed to
a command's own stop handler for its run, one the process was started with ignored left so.

This module knows signals and threads: nothing about trackers, versions or stores.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT, and SIGTERM where a Python handler is installed for it, until the block
    ends, then deliver each held signal once, as it would have been delivered
    (``KeyboardInterrupt`` under Python's default SIGINT handler; a framework's SIGTERM handler
    that raises, or exits). Nests.

    A SIGTERM with the default action is not held: it ends the process where it lands, as
    nothing on the Python side could observe the half-done statements."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: dict[int, FrameType | None] = {}
    previous: dict[int, object] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is None or (signum != signal.SIGINT and not callable(handler)):
            continue
        previous[signum] = handler
        signal.signal(signum, lambda n, frame: held.setdefault(n, frame))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _deliver_all([(previous[n], n, frame) for n, frame in held.items()])


@contextmanager
def stops_handled_by(handler: Callable[[int, FrameType | None], object]) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``handler`` for the block, then back to what they were. Only
    the main thread may set handlers: elsewhere a no-op. A signal ignored when the block
    starts (SIGINT in a script's background job, which inherits it ignored) stays ignored: a
    Ctrl-C meant for the script is not the command's."""
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _deliver_all(held: list[tuple[object, int, FrameType | None]]) -> None:
    """Deliver each held signal in the order it arrived. A handler that raises ends the
    delivery: the signals after it are sent again, so Python runs their handlers next."""
    for i, (handler, signum, frame) in enumerate(held):
        try:
            _deliver(handler, signum, frame)
        except BaseException:
            for _, later, _ in held[i + 1 :]:
                os.kill(os.getpid(), later)
            raise


def _deliver(handler, signum: int, frame: FrameType | None) -> None:
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action, now that it is installed again
        return
    handler(signum, frame)
