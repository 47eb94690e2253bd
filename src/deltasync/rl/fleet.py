"""Fleet: the rollout worker processes, one pipe each, and killing/restarting them.

Each worker has its own duplex pipe; nothing is shared between workers. (A shared
``multiprocessing.Queue`` does not survive SIGKILL: a worker killed while holding the queue's
lock, e.g. blocked in ``get``, leaves it locked for every other process.) The trainer assigns
each request to a live worker, round-robin, and remembers which requests each worker holds, so
a killed worker's requests are reassigned. Tensors cross the pipes as numpy arrays (pickled
by value): torch's shared-memory tensor passing needs the sending process alive at receipt.

This module knows processes and pipes; nothing about RL beyond the request ids it tracks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import numpy as np

from deltasync.rl.worker import WorkerArgs, worker_main


class WorkerGone(Exception):
    """Internal: the pipe of a worker closed (it exited or was killed)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"rollout worker {index} is gone")
        self.index = index


class Fleet:
    def __init__(self, base_args: list[WorkerArgs]) -> None:
        self._ctx = mp.get_context("spawn")
        self._args = {a.index: a for a in base_args}
        self._procs: dict[int, mp.process.BaseProcess] = {}
        self._conns: dict[int, Connection] = {}
        self.held: dict[int, dict[int, dict]] = {}  # worker -> request id -> request
        self.restarts = 0
        self._turn = 0

    # --- processes --------------------------------------------------------------------

    def start(self, index: int, refs: dict[int, np.ndarray]) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(self._args[index], child), daemon=True)
        proc.start()
        child.close()  # only the worker holds it: the trainer sees EOF when the worker dies
        self._procs[index], self._conns[index] = proc, parent
        self.held[index] = {}
        for v, bits in sorted(refs.items()):
            parent.send(("ref", v, bits))

    def start_all(self, refs: dict[int, np.ndarray]) -> None:
        for index in self._args:
            self.start(index, refs)

    def kill(self, index: int) -> list[dict]:
        """SIGKILL worker ``index``; returns the requests it held (not answered)."""
        proc = self._procs.pop(index)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self._conns.pop(index).close()
        return list(self.held.pop(index).values())

    def restart(self, index: int, refs: dict[int, np.ndarray]) -> None:
        args = self._args[index]
        self._args[index] = replace(args, incarnation=args.incarnation + 1)
        self.restarts += 1
        self.start(index, refs)

    def alive(self) -> list[int]:
        return sorted(self._procs)

    def stop(self) -> None:
        for conn in self._conns.values():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self._procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns.values():
            conn.close()
        self._procs.clear()
        self._conns.clear()

    # --- messages ---------------------------------------------------------------------

    def assign(self, request: dict) -> int:
        """Send ``request`` to the next live worker (round-robin); returns its index."""
        live = self.alive()
        index = live[self._turn % len(live)]
        self._turn += 1
        self.held[index][request["id"]] = request
        self._conns[index].send(("request", request))
        return index

    def broadcast_ref(self, version: int, bits: np.ndarray) -> None:
        for conn in self._conns.values():
            conn.send(("ref", version, bits))

    def request_check(self, index: int, version: int) -> None:
        self._conns[index].send(("check", version))

    def receive(self, timeout: float) -> list[dict]:
        """Messages that arrived within ``timeout`` seconds. Raises WorkerGone for a worker
        whose pipe closed (the caller decides whether that was expected)."""
        by_conn = {conn: i for i, conn in self._conns.items()}
        out = []
        for conn in wait(list(by_conn), timeout):
            index = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise WorkerGone(index) from None
            if msg["kind"] == "trajectories":
                msg["request"] = self.held.get(index, {}).pop(msg["id"], None)
            out.append(msg)
        return out
