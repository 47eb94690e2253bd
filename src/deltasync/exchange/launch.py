"""Starting process groups: from a launcher's environment, or as local processes for tests.

``init_from_env`` is for programs started by ``torchrun`` (or anything that sets the same
variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Those variables are the
launcher's contract, read here and nowhere else; every other setting is an argument.

``spawn`` runs ``fn(rank, *args)`` in ``world_size`` local processes that see exactly that
environment, so a worker calls ``init_from_env()`` the same way under torchrun and in a test.
The parent hosts the rendezvous store itself on a port the kernel picks (127.0.0.1 only), as
torchrun's agent does, so there is no window in which another program could take the port.
Children start from a forkserver that has already imported torch, so a process costs tens of
milliseconds instead of a fresh torch import. A hard deadline kills every child still running.

This module knows nothing about the exchange protocol.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist

from deltasync.errors import ConfigError, SpawnError

_LOOPBACK = "127.0.0.1"
_REPORT_GRACE_S = 0.5  # a child flushes its report before exiting; this covers the pipe
_FAILURE_GRACE_S = 5.0  # after one child fails, the rest get this long before being killed


def init_from_env(*, backend: str | None = None, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Initialize the default process group from torchrun's variables and return it.

    backend: "gloo" or "nccl"; by default NCCL when CUDA is available, else gloo. With NCCL the
        current CUDA device is set to LOCAL_RANK first.
    timeout_s: the group's default timeout for operations that are not given their own.
    """
    env = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        value = os.environ.get(name)
        if not value:
            raise ConfigError(
                f"environment variable {name} is not set; start this program with torchrun "
                "(or deltasync.exchange.spawn), which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
            )
        env[name] = value
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD  # type: ignore[return-value]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float,
    may_die: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world_size`` processes; return their results in rank order.

    fn and args must be picklable (a module-level function). Each child has RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR=127.0.0.1 and MASTER_PORT set and should call ``init_from_env()``.
    may_die: ranks allowed to exit without a result (fault tests); their entry is None.
    Raises SpawnError when a child raises (with its traceback), exits unexpectedly, or is
    still running after ``timeout_s``; every child still alive is killed first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    # The parent hosts the store, as torchrun's agent does; children connect as clients.
    store = dist.TCPStore(_LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False)
    reports = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, store.port, reports, fn, args),
            name=f"deltasync-spawn-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, reports, timeout_s, set(may_die))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        reports.close()
        del store


def _collect(procs: list[Any], reports: Any, timeout_s: float, may_die: set[int]) -> list[Any]:
    n = len(procs)
    results: list[Any] = [None] * n
    errors: dict[int, str] = {}
    reported: set[int] = set()
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank not in exited_at and p.exitcode is not None:
                exited_at[rank] = now
        # A rank is pending until it reported, or exited long enough ago that no report is coming.
        pending = [
            r
            for r in range(n)
            if r not in reported and now - exited_at.get(r, now) < _REPORT_GRACE_S
        ]
        if not pending:
            break
        if now >= deadline:
            running = [r for r in pending if r not in exited_at]
            raise SpawnError(
                f"spawned ranks {running} still running after timeout_s={timeout_s:g} s "
                f"(or {_FAILURE_GRACE_S:g} s after another rank failed); killed them"
                f"{_error_text(errors)}"
            )
        try:
            rank, ok, value = reports.get(timeout=0.05)
        except queue.Empty:
            continue
        reported.add(rank)
        if ok:
            results[rank] = value
        else:
            errors[rank] = value
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    silent = {r: procs[r].exitcode for r in exited_at if r not in reported}
    unexpected = {r: code for r, code in silent.items() if r not in may_die}
    if unexpected or errors:
        died = "".join(
            f"\nrank {r} exited with code {c} without a result" for r, c in unexpected.items()
        )
        raise SpawnError(f"spawned processes failed:{died}{_error_text(errors)}")
    return results


def _error_text(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))


def _child(
    rank: int, world_size: int, port: int, reports: Any, fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_LOOPBACK,
        MASTER_PORT=str(port),
        # Connect to the parent's store instead of hosting one on rank 0 (torchrun's mode).
        TORCHELASTIC_USE_AGENT_STORE="True",
        # Keep gloo's own connections on loopback too.
        GLOO_SOCKET_IFNAME="lo",
    )
    try:
        report = (rank, True, fn(rank, *args))
    except BaseException:
        report = (rank, False, traceback.format_exc())
    reports.put(report)
    reports.close()
    reports.join_thread()
    # Skip interpreter teardown: a group left broken by a fault test must not hang the exit.
    os._exit(0)
