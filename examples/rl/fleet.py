"""Fleet: the rollout worker processes, one pipe each, and killing/restarting them.

Each worker has its own duplex pipe; nothing is shared between workers. (A shared
``multiprocessing.Queue`` does not survive SIGKILL: a worker killed while holding the queue's
lock, e.g. blocked in ``get``, leaves it locked for every other process.) The trainer assigns
each request to a live worker, round-robin, and remembers which requests each worker holds, so
a killed worker's requests are reassigned. Tensors cross the pipes as numpy arrays (pickled
by value): torch's shared-memory tensor passing needs the sending process alive at receipt.

Processes and pipes come from :mod:`deltasync_examples.harness`; this module knows which
worker holds which request, nothing about RL beyond those ids.
"""

from __future__ import annotations

from dataclasses import replace
from multiprocessing.connection import wait

import numpy as np

from deltasync_examples.harness import Child, close_all, spawn
from deltasync_examples.rl.worker import WorkerArgs, worker_main


class WorkerGone(Exception):
    """Internal: the pipe of a worker closed (it exited or was killed)."""

    def __init__(self, index: int, ended: str = "") -> None:
        super().__init__(f"rollout worker {index} is gone" + (f" ({ended})" if ended else ""))
        self.index, self.ended = index, ended


class Fleet:
    def __init__(self, base_args: list[WorkerArgs]) -> None:
        self._args = {a.index: a for a in base_args}
        self._children: dict[int, Child] = {}
        self.held: dict[int, dict[int, dict]] = {}  # worker -> request id -> request
        self.restarts = 0
        self._turn = 0

    # --- processes --------------------------------------------------------------------

    def start(self, index: int, refs: dict[int, np.ndarray]) -> None:
        child = spawn(worker_main, self._args[index], name=f"rollout worker {index}")
        self._children[index] = child
        self.held[index] = {}
        for v, bits in sorted(refs.items()):
            child.send("ref", v, bits)

    def start_all(self, refs: dict[int, np.ndarray]) -> None:
        for index in self._args:
            self.start(index, refs)

    def kill(self, index: int) -> list[dict]:
        """SIGKILL worker ``index``; returns the requests it held (not answered)."""
        self._children.pop(index).kill()
        return list(self.held.pop(index).values())

    def restart(self, index: int, refs: dict[int, np.ndarray]) -> None:
        args = self._args[index]
        self._args[index] = replace(args, incarnation=args.incarnation + 1)
        self.restarts += 1
        self.start(index, refs)

    def alive(self) -> list[int]:
        return sorted(self._children)

    def stop(self, join_s: float = 10.0) -> None:
        """Stop every worker: ask, wait up to ``join_s`` for all together, kill the rest."""
        close_all(list(self._children.values()), stop=("stop",), join_s=join_s)
        self._children.clear()

    # --- messages ---------------------------------------------------------------------

    def assign(self, request: dict) -> int:
        """Send ``request`` to the next live worker (round-robin); returns its index."""
        live = self.alive()
        index = live[self._turn % len(live)]
        self._turn += 1
        self.held[index][request["id"]] = request
        self._children[index].send("request", request)
        return index

    def broadcast_ref(self, version: int, bits: np.ndarray) -> None:
        for child in self._children.values():
            child.send("ref", version, bits)

    def request_check(self, index: int, version: int) -> None:
        self._children[index].send("check", version)

    def receive(self, timeout: float) -> list[dict]:
        """Messages that arrived within ``timeout`` seconds. Raises WorkerGone for a worker
        whose pipe closed (the caller decides whether that was expected)."""
        by_conn = {child.conn: i for i, child in self._children.items()}
        out = []
        for conn in wait(list(by_conn), timeout):
            index = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                raise WorkerGone(index, self._children[index].ended()) from None
            if msg["kind"] == "trajectories":
                msg["request"] = self.held.get(index, {}).pop(msg["id"], None)
            out.append(msg)
        return out
