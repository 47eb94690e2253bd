"""The orchestrator: for each system, spawn its roles, sync the same versions, verify, collect.

Per (system, learning rate) it spawns one trainer and one receiver per distinct shard, joined in
a gloo group, on a fresh local store in a temporary directory that also holds every role's
state and is removed when the run ends, however it ends. After a bootstrap (version 0, untimed) and warm-up
versions, it runs ``steps`` measured versions on each path: the shared store unthrottled, behind
each emulated link rate, and in-cluster. Every receiver's state digest must equal the trainer's
expected digest of ``split(bf16(trainer))`` at every version, or the run is not exact; those
expected digests are kept per version (``SystemRun.expected``) so that the caller can check
that every system ran on the same versions. A version whose roles fail (a receiver refusing
it, a trainer error) is recorded as not exact and ends that system's run, which returns what
it measured so far.

This module knows processes and bookkeeping; it knows nothing about what systems ship.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
from dataclasses import dataclass, field

from deltasync.errors import ConfigError
from deltasync.validate import check_int, check_number
from deltasync_bench.compare.roles import RoleSpec, receiver_main, trainer_main
from deltasync_bench.compare.workload import Workload
from deltasync_examples.harness import (
    FAILED_JOIN_S,
    ChildFailedError,
    ChildGoneError,
    close_all,
    recv_all,
    spawn,
)

PATH_KINDS = ("store", "cluster")


@dataclass(frozen=True, kw_only=True)
class PathSpec:
    kind: str  # "store" or "cluster"
    gbps: float | None = None  # the store's emulated link; None: unthrottled

    def __post_init__(self) -> None:
        if self.kind not in PATH_KINDS:
            raise ConfigError(f"PathSpec.kind must be one of {PATH_KINDS}, got {self.kind!r}")
        if self.gbps is not None:
            check_number("PathSpec", "gbps", self.gbps)  # None, not 0, is "unthrottled"

    @property
    def label(self) -> str:
        if self.kind == "cluster":
            return "in-cluster (gloo)"
        return "store (unthrottled)" if self.gbps is None else f"store @ {self.gbps:g} Gbit/s"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    workload: Workload
    systems: tuple[str, ...] = ("dense", "snapshot", "deltasync")
    paths: tuple[PathSpec, ...] = (
        PathSpec(kind="store"),
        PathSpec(kind="store", gbps=1.0),
        PathSpec(kind="cluster"),
    )
    engine: str = "vllm"
    tp: int = 2
    ep: int = 1
    warmup: int = 1
    steps: int = 2
    threads: int = 1
    timeout_s: float = 1800.0
    fwd_bwd_s: float = 0.5  # the stand-in forward/backward after each sync
    fwd_bwd_on: str = "cpu"  # "cpu": it computes; "device": the host waits (a GPU trainer)

    def __post_init__(self) -> None:
        check_int("RunConfig", "steps", self.steps, lo=1)
        check_int("RunConfig", "warmup", self.warmup, lo=0)
        check_int("RunConfig", "tp", self.tp, lo=1)
        check_int("RunConfig", "ep", self.ep, lo=1)
        check_int("RunConfig", "threads", self.threads, lo=1)
        check_number("RunConfig", "timeout_s", self.timeout_s, unit="seconds")
        check_number("RunConfig", "fwd_bwd_s", self.fwd_bwd_s, positive=False, unit="seconds")
        if self.fwd_bwd_on not in ("cpu", "device"):
            raise ConfigError(
                f"RunConfig.fwd_bwd_on must be 'cpu' or 'device', got {self.fwd_bwd_on!r}"
            )
        if not self.systems:
            raise ConfigError("RunConfig.systems names no system")
        labels = [p.label for p in self.paths]
        if len(set(labels)) != len(labels):  # records are matched to their path by label
            raise ConfigError(f"RunConfig.paths repeats a path: {labels}")


@dataclass
class SyncRecord:
    system: str
    path: str
    version: int
    total_s: float
    trainer_stall_s: float
    transfer_s: float
    receiver_pause_s: float
    bytes: int
    trainer_peak_rss_bytes: int
    trainer_overhead_bytes: int
    receiver_peak_rss_bytes: int
    receiver_overhead_bytes: int
    shard_bytes: int
    exact: bool
    changed_elements: int | None = None
    phases: dict | None = None  # the trainer's own breakdown, where the system reports one
    trainer_overhead_s: float = 0.0  # wall of a training step with sync minus without
    detect_s: float | None = None  # the system's change detection alone (None: it has none)
    barrier_s: float = 0.0  # the next optimizer step's wait for a background publish
    # of trainer_overhead_bytes, what the trainer held before the sync began (what the system
    # keeps between versions, and heap it could not give back): the rest is the sync's own
    trainer_kept_bytes: int = 0
    max_shard_elements: int | None = None  # elements sent to the busiest receiver shard
    expected: dict[str, str] = field(default_factory=dict)  # {shard: digest} of the truth
    # Where the latency went, seconds from the end of the optimizer step (store path: the
    # version visible, the slowest receiver's stage / verify / pause; see _timeline).
    timeline: dict | None = None


@dataclass
class SystemRun:
    system: str
    model_bf16_bytes: int = 0
    records: list[SyncRecord] = field(default_factory=list)
    exact: bool = True
    # {version: {shard: digest}} of the dense split of the trainer's BF16 params after each
    # version (0: the bootstrap): every system must have run on the same ones
    expected: dict[int, dict[str, str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # what made it not exact, one line each
    # the largest receiver's peak above interpreter + torch in its first pull (version 0
    # whole), over its shard's bytes; the largest of the rounds once pooled
    bootstrap_rx_mem: float | None = None

    def fail(self, message: str, log=print) -> None:
        self.exact = False
        self.failures.append(message)
        log(f"  NOT EXACT: {message}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Roles:
    """One trainer (rank 0) and ``n_receivers`` receivers, spawned and ready."""

    def __init__(self, cfg: RunConfig, system: str, store_root: str, n_receivers: int) -> None:
        port, world = _free_port(), 1 + n_receivers
        self.timeout_s = cfg.timeout_s
        self.children = []
        for rank in range(world):
            spec = RoleSpec(
                system=system,
                workload=cfg.workload,
                engine=cfg.engine,
                tp=cfg.tp,
                ep=cfg.ep,
                store_root=store_root,
                rank=rank,
                world_size=world,
                port=port,
                threads=cfg.threads,
                fwd_bwd_s=cfg.fwd_bwd_s,
                fwd_bwd_on=cfg.fwd_bwd_on,
            )
            role = "trainer" if rank == 0 else f"receiver rank {rank}"
            self.children.append(
                spawn(
                    trainer_main if rank == 0 else receiver_main,
                    spec,
                    name=f"bench {system} {role}",
                )
            )
        recv_all(self.children, self.timeout_s)  # a role that fails to start raises here

    def recv(self, rank: int) -> dict:
        return self.children[rank].recv(self.timeout_s)

    def call(self, rank: int, *cmd) -> dict:
        return self.children[rank].call(*cmd, timeout_s=self.timeout_s)

    def send(self, rank: int, *cmd) -> None:
        self.children[rank].send(*cmd)

    def recv_all(self, ranks: range) -> list[dict]:
        return recv_all([self.children[r] for r in ranks], self.timeout_s)

    def close(self, join_s: float = 10.0) -> None:
        close_all(self.children, join_s=join_s)


def run_system(cfg: RunConfig, system: str, n_receivers: int, log=print) -> SystemRun:
    out = SystemRun(system=system)
    with tempfile.TemporaryDirectory(prefix=f"deltasync-bench-{system}-") as root:
        # the store one level down: the systems keep their roles' state beside it, in ``root``
        roles = _Roles(cfg, system, os.path.join(root, "store"), n_receivers)
        finished = False
        try:
            boot = roles.call(0, "bootstrap")
            out.model_bf16_bytes = boot["model_bf16_bytes"]
            out.expected[0] = boot["expected"]
            for r in range(1, 1 + n_receivers):
                got = roles.call(r, "bootstrap")
                if got["digest"] != boot["expected"][got["shard"]]:
                    out.fail(f"{system} v0 (bootstrap): receiver {got['shard']} wrong", log)
                mem = got["overhead_bytes"] / max(got["shard_bytes"], 1)
                out.bootstrap_rx_mem = max(mem, out.bootstrap_rx_mem or 0.0)
            if not out.exact:
                return out
            version = 0
            plan = [(PathSpec(kind="store"), False)] * cfg.warmup
            for path in cfg.paths:
                plan += [(path, True)] * cfg.steps
            for path, measured in plan:
                version += 1  # noqa: SIM113 - numbering runs on across systems
                try:
                    rec = _one_version(roles, system, path, version, n_receivers)
                except (ChildFailedError, ChildGoneError, TimeoutError) as exc:
                    # a receiver refused the version, or a role failed: the roles' state is
                    # unknown from here, so this system's run ends with what it measured
                    log(f"  {system} v{version} ({path.label}): {exc}")
                    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    where = path.label + ("" if measured else ", warm-up")
                    out.fail(f"{system} v{version} ({where}): failed: {first}", log)
                    break
                out.expected[version] = rec.expected
                if not rec.exact:
                    out.fail(
                        f"{system} v{version} ({path.label}{'' if measured else ', warm-up'}): "
                        "receiver state differs from the dense split of the trainer's BF16 params",
                        log,
                    )
                if measured:
                    out.records.append(rec)
                if measured or not rec.exact:
                    log(
                        f"  {system:9s} {path.label + ('' if measured else ' warm-up'):22s} "
                        f"v{version:<3d} total {rec.total_s:7.3f}s "
                        f"stall {rec.trainer_stall_s:6.3f}s pause {rec.receiver_pause_s:6.3f}s "
                        f"{rec.bytes / 2**20:9.2f} MiB exact={rec.exact} trainer +mem "
                        f"{rec.trainer_overhead_bytes / 2**20:.1f} MiB (kept "
                        f"{rec.trainer_kept_bytes / 2**20:.1f})"
                        + "".join(f" {k} {v:.3f}s" for k, v in (rec.phases or {}).items())
                        + " |"
                        + "".join(f" {k} {v:.3f}s" for k, v in (rec.timeline or {}).items())
                    )
            finished = True
        finally:  # a Ctrl-C or SIGTERM (raised by the CLI) lands here too: stop, then remove
            roles.close(join_s=10.0 if finished else FAILED_JOIN_S)
    return out


def _one_version(roles: _Roles, system: str, path: PathSpec, version: int, n: int) -> SyncRecord:
    args = (version, path.kind, path.gbps)
    if path.kind == "cluster":  # collective: every role enters the exchange together
        roles.send(0, "step", *args)
        for r in range(1, 1 + n):
            roles.send(r, "pull", *args)
        tr, *rx = roles.recv_all(range(1 + n))  # one failed role raises, none hangs
        transfer = max(x["t_recv"] - tr["t_exchange"] + x["transfer_s"] for x in rx)
    else:
        # Receivers wait for the version to appear in the store (polling metadata, which the
        # emulated link does not charge) while the trainer syncs and runs on; each pulls
        # through its own link.
        roles.send(0, "step", *args)
        for r in range(1, 1 + n):
            roles.send(r, "pull", *args)
        tr, *rx = roles.recv_all(range(1 + n))
        transfer = max(x["transfer_s"] for x in rx)
    for r, x in enumerate(rx, start=1):  # after the timed part, see roles.py
        x["digest"] = roles.call(r, "check")["digest"]
    expected = roles.call(0, "expected")["expected"]
    timeline = _timeline(tr, rx)
    exact = all(x["digest"] == expected[x["shard"]] for x in rx)
    return SyncRecord(
        system=system,
        path=path.label,
        version=version,
        total_s=max(x["t_done"] for x in rx) - tr["t0"],
        trainer_stall_s=tr["stall_s"],
        transfer_s=transfer,
        receiver_pause_s=max(x["pause_s"] for x in rx),
        bytes=tr["bytes"],
        trainer_peak_rss_bytes=tr["peak_rss"],
        trainer_overhead_bytes=tr["overhead_bytes"],
        trainer_kept_bytes=tr["kept_bytes"],
        receiver_peak_rss_bytes=max(x["peak_rss"] for x in rx),
        receiver_overhead_bytes=max(x["peak_rss"] - x["rss_base"] for x in rx),
        shard_bytes=max(x["shard_bytes"] for x in rx),
        exact=exact,
        changed_elements=tr.get("changed_elements"),
        phases=tr.get("phases"),
        trainer_overhead_s=tr["overhead_s"],
        detect_s=tr["detect_s"],
        barrier_s=tr["barrier_s"],
        max_shard_elements=tr.get("shard_elements"),
        timeline=timeline,
        expected=expected,
    )


def _timeline(tr: dict, rx: list[dict]) -> dict[str, float]:
    """A version's latency, taken apart: when the version became visible to the last receiver
    (store path) and the slowest receiver's stage, verify and pause (each where the system
    reports it), seconds; the rest of a receiver's time is its waits and records. With them,
    the CPU seconds the version cost: the trainer's sync (all its threads, less its
    forward/backward alone), every receiver's pull together, and the forward/backward's own,
    in the window (``cpu_bound_s``: their sum over the cores, a bound under which no pipelining
    takes the latency when the run is CPU-bound)."""
    done = max(x["t_done"] for x in rx)
    in_window = max(0.0, min(tr["t_fb"], done) - tr["t1"])  # the forward/backward's part of it
    out: dict[str, float] = {
        "sync_cpu_s": tr["sync_cpu_s"],
        "rx_cpu_s": sum(x["cpu_s"] for x in rx),
        "fwd_bwd_cpu_s": tr["fwd_bwd_cpu_s"] * in_window / max(tr["fwd_bwd_with_s"], 1e-9),
    }
    cores = len(os.sched_getaffinity(0))
    out["cpu_bound_s"] = (out["sync_cpu_s"] + out["rx_cpu_s"] + out["fwd_bwd_cpu_s"]) / cores
    seen = [x["seen_at"] for x in rx if x.get("seen_at") is not None]
    if seen:
        out["visible_s"] = max(seen) - tr["t0"]
    for key in ("stage_s", "verify_s", "pause_s"):
        got = [x[key] for x in rx if x.get(key) is not None]
        if got:
            out[key] = max(got)
    return out


def medians(records: list[SyncRecord]) -> dict:
    def med(attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in records)

    keys = [
        "total_s",
        "trainer_stall_s",
        "transfer_s",
        "receiver_pause_s",
        "bytes",
        "trainer_peak_rss_bytes",
        "trainer_overhead_bytes",
        "trainer_kept_bytes",
        "receiver_peak_rss_bytes",
        "receiver_overhead_bytes",
        "shard_bytes",
        "trainer_overhead_s",
        "barrier_s",
    ]
    out = {k: med(k) for k in keys}
    for k in ("changed_elements", "detect_s", "max_shard_elements"):
        got = [getattr(r, k) for r in records if getattr(r, k) is not None]
        out[k] = statistics.median(got) if got else None
    out["latency_s"] = out["total_s"]  # end of the optimizer step -> every receiver verified
    keys = {k for r in records for k in (r.timeline or {})}
    out["timeline"] = {
        k: statistics.median(r.timeline[k] for r in records if k in (r.timeline or {}))
        for k in sorted(keys)
    }
    out["exact"] = all(r.exact for r in records)
    return out
