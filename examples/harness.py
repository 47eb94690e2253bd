"""The one process-over-pipes harness: spawn a child, drive it with commands, get dict answers.

The parent holds a :class:`Child` per process (``spawn``); a command is a tuple
``(op, *args)`` sent on the child's own duplex pipe, an answer is a dict with ``ok``. A child
built on :func:`serve` answers ``{"ok": True, **handler(op, *args)}``, or, when the handler
raised, ``{"ok": False, "error", "trace"}`` and returns (the parent decides what happens next);
``("exit",)`` ends it. Children are spawned (each starts clean, whatever the parent imported),
and each has a pipe of its own: a shared queue would stay locked for everyone when a child
holding its lock is SIGKILLed. Children ignore SIGINT from birth: a Ctrl-C reaches the whole
foreground process group, and the parent alone owns the shutdown (it stops its children in its
``finally`` blocks, :func:`close_all`), so a child neither dies mid-command nor prints a
``KeyboardInterrupt`` traceback. A child that dies or stops answering is a typed error
(:class:`ChildGoneError`, :class:`ChildTimeoutError`) naming it and how it ended.

The demo's receivers, the benchmark's roles and the RL demo's rollout workers run on it (the
RL workers speak their own messages on the same pipes, see ``rl/fleet.py``).

This module knows processes and pipes; nothing about what the children do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any

from deltasync.errors import DeltaSyncError

# How long a failed or interrupted run waits for each child to take its stop command before
# killing it: a child in the middle of a command (a pull waiting for a version that will not
# come) answers only when that command ends.
FAILED_JOIN_S = 1.0


class ChildFailedError(DeltaSyncError, RuntimeError):
    """A child answered that its command failed; the message carries its error and trace."""


class ChildGoneError(DeltaSyncError, RuntimeError):
    """A child's pipe closed before it answered (it exited or was killed)."""


class ChildTimeoutError(DeltaSyncError, TimeoutError):
    """A child did not answer in time; the message names it and the wait."""


class Child:
    """The parent's handle on one spawned process and its pipe."""

    def __init__(self, process: mp.process.BaseProcess, conn: Connection, name: str) -> None:
        self.process, self.conn, self.name = process, conn, name

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def ended(self) -> str:
        """How the process ended, for an error about it (``killed by SIGKILL``, ``exit code
        1``); waits a moment to reap a child whose pipe just closed."""
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "its pipe closed; still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def gone(self) -> ChildGoneError:
        """The error for this child's closed pipe."""
        return ChildGoneError(f"{self.name} (pid {self.pid}) is gone ({self.ended()})")

    def send(self, *cmd: Any) -> None:
        try:
            self.conn.send(cmd)
        except OSError:  # BrokenPipeError: the child is gone
            raise self.gone() from None

    def recv(self, timeout_s: float | None = 600.0) -> dict:
        """The child's next answer; raises when it failed, closed its pipe, or stayed silent."""
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise ChildTimeoutError(f"{self.name} did not answer within {timeout_s} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise self.gone() from None
        if isinstance(msg, dict) and msg.get("ok") is False:
            raise ChildFailedError(
                f"{self.name} failed: {msg.get('error')}\n{msg.get('trace', '')}"
            )
        return msg

    def call(self, *cmd: Any, timeout_s: float | None = 600.0) -> dict:
        self.send(*cmd)
        return self.recv(timeout_s)

    def kill(self) -> None:
        """SIGKILL the child (fault injection) and reap it."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.conn.close()

    def close(self, stop: tuple = ("exit",), join_s: float = 10.0) -> None:
        """Ask the child to stop, wait for it, and kill it if it does not."""
        close_all([self], stop, join_s)


def close_all(children: list[Child], stop: tuple = ("exit",), join_s: float = 10.0) -> None:
    """Ask every child to stop, wait up to ``join_s`` for all of them together, then kill the
    ones still running (so a run ends within ``join_s`` + a few seconds however many children
    are stuck in a command). Pipes are closed only once their child is dead: a child never
    writes to a closed pipe."""
    for child in children:
        try:
            child.conn.send(stop)
        except OSError:
            pass  # already gone
    deadline = time.monotonic() + join_s
    for child in children:
        child.process.join(max(deadline - time.monotonic(), 0.0))
    for child in children:
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5)
        child.conn.close()


def recv_all(children: list[Child], timeout_s: float | None = 600.0) -> list[dict]:
    """One answer from each child, in order, waiting on all at once: a child that fails or dies
    raises at once, even while the others still wait (e.g. in a collective it never joins)."""
    answers: dict[int, dict] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    by_conn = {c.conn: i for i, c in enumerate(children)}
    while len(answers) < len(children):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready = [conn for conn in wait([c for c, i in by_conn.items() if i not in answers], left)]
        if not ready:
            silent = [children[i].name for i in range(len(children)) if i not in answers]
            raise ChildTimeoutError(f"{', '.join(silent)} did not answer within {timeout_s} s")
        for conn in ready:
            i = by_conn[conn]
            answers[i] = children[i].recv(None)
    return [answers[i] for i in range(len(children))]


def spawn(target: Callable[..., None], *args: Any, name: str, daemon: bool = True) -> Child:
    """Start ``target(*args, conn)`` in a fresh (spawned) process; ``conn`` is its pipe end.

    Args:
        target: a module-level function (spawned children import it by name).
        args: its arguments before ``conn`` (picklable).
        name: the process name, used in every error about it.
        daemon: end the child with the parent.

    Returns:
        The parent's :class:`Child` handle.
    """
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=target, args=(*args, child), daemon=daemon, name=name
    )
    with _sigint_ignored_in_children():
        proc.start()
    child.close()  # only the child holds it now: the parent sees EOF when the child dies
    return Child(proc, parent, name)


@contextmanager
def _sigint_ignored_in_children() -> Iterator[None]:
    """Children started in this block ignore SIGINT for life (an ignored signal stays ignored
    across exec, and Python then installs no KeyboardInterrupt handler), from their first
    instruction on, not only once their imports are done. SIGINT is blocked meanwhile, so a
    Ctrl-C in the block is delivered to the parent as it ends instead of being discarded (the
    children inherit the mask too: blocked and ignored, as they should be)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; such a child inherits the parent's
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def failure(exc: BaseException) -> dict:
    """The answer that reports ``exc`` to the parent."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def serve(conn: Connection, handler: Callable[..., dict], *, ready: Callable[[], dict]) -> None:
    """A child's loop: build with ``ready()`` (its answer is the first message), then answer
    every command with ``handler(op, *args)`` until ``("exit",)``; stop after a failure."""
    try:
        try:
            conn.send({"ok": True, **ready()})
        except BaseException as exc:  # report, then die: the parent tears the run down
            conn.send(failure(exc))
            return
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if cmd[0] == "exit":
                conn.send({"ok": True})
                return
            try:
                conn.send({"ok": True, **handler(*cmd)})
            except BaseException as exc:
                conn.send(failure(exc))
                return
    except OSError:
        return  # the parent closed the pipe or is gone: nobody is left to tell
