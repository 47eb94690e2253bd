"""The application commands: ``deltasync demo``, ``rl-demo``, ``bench`` and ``cluster-worker``.

Each is a thin projection of an application's config dataclass. The library does not depend
on its applications: they live outside the package (the repository's ``examples/`` and
``bench/``, installed beside it as ``deltasync_examples`` and ``deltasync_bench``), and a
command imports its application only when it runs (:func:`import_app`). When one is missing (a
wheel built without them, a checkout on ``PYTHONPATH=src``), the command still parses and fails
with a typed error that says how to get it, instead of an ImportError traceback.

Every command ends with one machine-readable JSON line (:func:`emit_json_line`), which tests,
benchmarks and users' scripts parse, also when several ranks of one job share a stdout pipe.
``demo``, ``rl-demo``, ``bench`` and ``cluster-worker`` end with it also when their run fails
or is stopped (:func:`_run_app`): the summary so far, marked failed (``exact`` /
``probe_exact`` false) with an ``error``, or ``"interrupted": true`` and the ``signal``. Only
a refused configuration (``ConfigError``: nothing ran) prints none.

Exit statuses: 0 done (and exact); 1 ran, not exact; 2 a typed error (a bad flag, a process
of the run gone or failed); 130 stopped by SIGINT (Ctrl-C), 143 by SIGTERM (128 + the signal,
as a shell reports a process the signal killed), after the run stopped its processes and
removed its temporary directory.

    deltasync demo [--steps N] [--lr LR] [--store DIR] [--link-gbps G] [--small]
    deltasync rl-demo [--steps N] [--workers W] [--engine tp|hf] [--tp T] ...
    deltasync bench [compare|detect|fsdp|first-pull] ...
    torchrun --standalone --nproc-per-node=3 -m deltasync cluster-worker --tp 2

This module knows the applications' names and flags, nothing about what they do inside.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

from deltasync.cluster.roles import DEFAULT_DP_MODE, DP_MODES
from deltasync.errors import ApplicationMissingError, ConfigError, DeltaSyncError, error_line
from deltasync.interrupts import stops_handled_by

_FOLDERS = {"deltasync_examples": "examples/", "deltasync_bench": "bench/"}


def import_app(module: str, command: str) -> ModuleType:
    """Import ``module`` (e.g. ``deltasync_examples.demo.run``) for ``deltasync COMMAND``.

    Args:
        module: the application module's dotted name.
        command: the CLI command that needs it (named in the error).

    Returns:
        The imported module.

    Raises:
        ApplicationMissingError: its top-level package is not installed.
    """
    package = module.split(".", 1)[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".", 1)[0] != package:
            raise  # the application is there; something it imports is not
        raise ApplicationMissingError(
            f"`deltasync {command}` needs the {package} package ({_FOLDERS.get(package, '')} in "
            f"the deltasync repository), which is not installed; from a clone run "
            f"`pip install -e .` (or `make setup`) there"
        ) from exc


def emit_json_line(obj: Any, *, sort_keys: bool = False) -> None:
    """Write ``json.dumps(obj) + "\\n"`` to stdout as one ``write(2)`` (after flushing what
    ``print`` buffered, so the order of this process's output is kept).

    Several ranks of one job (torchrun, ``mp.spawn``) share one stdout pipe. ``print(s)`` is not
    one write: CPython writes the text and the ``"\\n"`` separately (always when unbuffered, and
    often when flushing), so two ranks finishing together would produce ``{...}{...}\\n\\n``. A
    single write of at most ``PIPE_BUF`` (4096) bytes to a pipe is atomic on POSIX, so lines from
    different processes never mix; longer lines are still one call, but the kernel may split them.

    Args:
        obj: anything ``json.dumps`` takes.
        sort_keys: passed to ``json.dumps``.
    """
    data = (json.dumps(obj, sort_keys=sort_keys) + "\n").encode()
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured (pytest capsys, StringIO)
        sys.stdout.write(data.decode())
        sys.stdout.flush()
        return
    view = memoryview(data)
    while view:  # a pipe or file takes it whole; the loop is for signals and odd files
        view = view[os.write(fd, view) :]


class _Stop:
    """SIGINT/SIGTERM during an application's run: recorded, then raised in the main thread as
    ``KeyboardInterrupt``, so that every ``finally`` on the way out runs (the run's processes
    stopped, its temporary directory removed) before the command reports the stop. Under
    Python's default action a SIGTERM ends the process where it lands, with none of that.
    A signal the process started with ignored (SIGINT in a script's background job) stays
    ignored, as it is while the command's modules load."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame) -> None:
        if self.signum is None:  # the first signal is the one reported
            self.signum = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _run_app(
    command: str,
    body: Callable[[], int],
    *,
    base: dict,
    failed: dict,
    sort_keys: bool = False,
) -> int:
    """Run an application (``body``, returning the exit status) so that it always ends with
    one JSON line.

    A typed error (other than a ConfigError: nothing ran) prints the summary the error carries
    (``.summary``, else ``base``) updated with ``failed`` and the ``error``, then propagates
    (exit 2). SIGINT or SIGTERM stops the run: its cleanup runs, one line on stderr says so,
    the JSON line says ``"interrupted": true`` and the ``signal``, and the status is 128 + the
    signal (130, 143). A ``failures`` list in the summary gets the error's line too.

    Args:
        command: the command's name, in the messages.
        body: the run.
        base: the summary when the error carries none.
        failed: fields that mark the summary failed (``{"exact": False}``).
        sort_keys: as the command's own JSON line.

    Returns:
        ``body``'s status, or 128 + the signal that stopped it.
    """
    stop = _Stop()
    with stops_handled_by(stop):
        try:
            return body()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and stop.signum is None:
                stop.signum = signal.SIGINT  # raised before the handler was in place
            if stop.signum is None and (
                not isinstance(exc, DeltaSyncError) or isinstance(exc, ConfigError)
            ):
                raise
            summary = {**base, **(getattr(exc, "summary", None) or {}), **failed}
            if stop.signum is not None:  # whatever surfaced, the signal is why the run ended
                name = signal.Signals(stop.signum).name
                line = f"stopped by signal {name}"
                summary.update(interrupted=True, signal=name, error=line)
            else:
                line = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                summary["error"] = line
            if isinstance(summary.get("failures"), list):
                summary["failures"] = [*summary["failures"], line]
            emit_json_line(summary, sort_keys=sort_keys)
            if stop.signum is None:
                raise
            print(f"deltasync {command}: {line}", file=sys.stderr, flush=True)
            return 128 + stop.signum


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo``, ``bench``, ``rl-demo`` and ``cluster-worker`` to the CLI's subparsers."""
    _register_demo(sub)
    _register_bench(sub)
    _register_rl_demo(sub)
    _register_cluster_worker(sub)


# --- deltasync demo: the main job on embedded defaults (local store, CPU, two receivers) ------


def _register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train a small Qwen3 with AdamW and sync two TP=2 receivers every step"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument(
        "--store",
        default=None,
        help="run directory: a local directory, absent or empty, for the store (DIR/store, "
        "what `deltasync inspect` and `pull` take) and the receivers' state (kept; default: a "
        "temp dir, removed at exit; a URL is refused)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=1.0,
        help="each process reaches the store through an emulated link of this many Gbit/s "
        "(default 1; 0: the local disk at memory speed)",
    )
    p.add_argument(
        "--small", action="store_true", help="a two-layer model (a quick check, ~10x faster)"
    )
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    demo = import_app("deltasync_examples.demo.run", "demo")
    policy = demo.PolicyConfig.small() if args.small else demo.PolicyConfig()
    cfg = demo.DemoConfig(
        steps=args.steps,
        lr=args.lr,
        store=args.store,
        link_gbps=args.link_gbps,
        policy=policy,
    )

    def body() -> int:
        res = demo.run(cfg)
        emit_json_line(res, sort_keys=True)
        return 0 if res["exact"] else 1

    return _run_app(
        "demo", body, base={"steps": cfg.steps}, failed={"exact": False}, sort_keys=True
    )


# --- deltasync bench [compare|detect|fsdp|first-pull]: the benchmark programs of deltasync_bench --------------

# name -> (module under deltasync_bench, help)
_BENCHES = {
    "compare": ("compare_bench", "dense refit vs snapshot delta vs deltasync (the default)"),
    "detect": ("detect_bench", "detection + codec throughput vs the memory-bandwidth floor"),
    "fsdp": ("fsdp_bench", "FSDP2 writers on the store path: the full_state gather per version"),
    "first-pull": ("first_pull_bench", "a receiver's first pull: peak memory over its shard"),
}


def _bench_module(name: str) -> ModuleType | ApplicationMissingError:
    try:
        return import_app(f"deltasync_bench.{_BENCHES[name][0]}", "bench")
    except ApplicationMissingError as exc:
        return exc


def _register_bench(sub: argparse._SubParsersAction) -> None:
    # Each benchmark declares its own flags (``add_arguments``) and runs through ``main``.
    help_ = "run a benchmark (prints a table, ends with one JSON line)"
    compare = _bench_module("compare")
    if isinstance(compare, ApplicationMissingError):
        # No option prefixes: any arguments parse (into `rest`); running reports the remedy.
        p = sub.add_parser("bench", help=help_, prefix_chars="\x00")
        p.add_argument("rest", nargs="*")
        p.set_defaults(func=_raiser(compare))
        return
    p = sub.add_parser("bench", help=help_)
    inner = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (_, bench_help) in _BENCHES.items():
        module = _bench_module(name)
        q = inner.add_parser(name, help=bench_help)
        if isinstance(module, ApplicationMissingError):  # a partial install
            q.set_defaults(func=_raiser(module))
            continue
        module.add_arguments(q)
        q.set_defaults(func=_bench_runner(module))
    # plain `deltasync bench [--preset ...]` runs the comparison
    compare.add_arguments(p)
    p.set_defaults(func=_bench_runner(compare))


def _bench_runner(module: ModuleType):
    # A benchmark's JSON line is sorted, with ``exact`` and (compare) ``failures``.
    def run(args: argparse.Namespace) -> int:
        return _run_app(
            "bench",
            lambda: module.main(args),
            base={"failures": []},
            failed={"exact": False},
            sort_keys=True,
        )

    return run


def _raiser(exc: ApplicationMissingError):
    def run(args: argparse.Namespace) -> int:
        raise exc

    return run


# --- deltasync rl-demo: online GRPO with rollout worker processes synced by deltasync --------


def _register_rl_demo(sub: argparse._SubParsersAction) -> None:
    # Prints one line per step and ends with one JSON line: ``steps``, ``versions``,
    # ``reward_first``, ``reward_last``, ``probe_exact``, ``max_staleness`` (observed), and
    # details. Exit status 0 when every probe was bit-exact; on a mismatch, a worker gone or
    # failed, the JSON line (``probe_exact`` false, ``error``) is still printed, then the
    # error, and the status is 2; stopped by SIGINT/SIGTERM: 130/143 (see the module doc).
    p = sub.add_parser(
        "rl-demo",
        help="online GRPO on a toy task; rollout workers pull deltas and prove exact logits",
    )
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (= published versions)")
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes")
    p.add_argument(
        "--engine",
        choices=("tp", "hf"),
        default="tp",
        help="tp: vLLM-convention TP shards; hf: the transformers model",
    )
    p.add_argument(
        "--tp", type=int, default=None, help="TP ranks per worker (tp engine; default 2)"
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="versions a trajectory may lag the policy it trains",
    )
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--letters", default="abcd", help="alphabet of the strings to reverse")
    p.add_argument("--length", type=int, default=3, help="length of the strings to reverse")
    p.add_argument(
        "--kill-worker-at",
        type=int,
        default=None,
        help="SIGKILL worker 0 after publishing this version (fault injection)",
    )
    p.add_argument(
        "--restart-after", type=int, default=2, help="versions later the killed worker is restarted"
    )
    p.add_argument(
        "--store",
        default=None,
        help="run directory: a local directory, absent or empty, the store its DIR/store "
        "(kept; default: a fresh temp dir, removed at exit; a URL is refused)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="longest single wait, seconds")
    p.add_argument("--quiet", action="store_true", help="print only the JSON line")
    p.set_defaults(func=_run_rl_demo)


def _run_rl_demo(args: argparse.Namespace) -> int:
    rl = import_app("deltasync_examples.rl", "rl-demo")
    tp = args.tp if args.tp is not None else (2 if args.engine == "tp" else 1)
    cfg = rl.RLConfig(
        steps=args.steps,
        workers=args.workers,
        engine=args.engine,
        tp=tp,
        max_staleness=args.max_staleness,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        lr=args.lr,
        seed=args.seed,
        task=rl.ReverseTask(letters=args.letters, length=args.length),
        kill_worker_at=args.kill_worker_at,
        restart_after=args.restart_after,
        store=args.store,
        timeout_s=args.timeout,
    )

    def log(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    def body() -> int:
        summary = rl.run_rl(cfg, log=log)
        emit_json_line(summary)
        if not summary["probe_exact"]:
            print("deltasync rl-demo: probe logits were not bit-exact", file=sys.stderr)
            return 2
        return 0

    return _run_app("rl-demo", body, base={"steps": cfg.steps}, failed={"probe_exact": False})


# --- deltasync cluster-worker: one rank of an in-cluster sync job, under torchrun ------------


def _register_cluster_worker(sub: argparse._SubParsersAction) -> None:
    # Ranks 0..writers-1 train FSDP-style shards with real AdamW steps and send every version;
    # the others are receivers (--tp shards x --replicas). Each rank prints one JSON line with
    # its median timings per delta version and its bitwise check; rank 0 also a summary line.
    p = sub.add_parser(
        "cluster-worker", help="one rank of an in-cluster sync job (run under torchrun)"
    )
    p.add_argument("--config", help="transformers config.json of a Qwen3/Qwen3-MoE (default: tiny)")
    p.add_argument("--tp", type=int, default=2, help="receiver tensor-parallel size (default: 2)")
    p.add_argument("--writers", type=int, default=1, help="FSDP trainer ranks (default: 1)")
    p.add_argument("--replicas", type=int, default=1, help="DP replicas of each shard (default: 1)")
    p.add_argument("--dp-mode", choices=DP_MODES, default=DEFAULT_DP_MODE)
    p.add_argument("--versions", type=int, default=10, help="delta versions after the anchor")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: 1e-5)")
    p.add_argument(
        "--digest-every",
        type=int,
        default=1,
        help="send expected digests every K versions (default: 1; 0 = never)",
    )
    p.add_argument("--timeout-s", type=float, default=60.0, help="every wait's timeout")
    p.add_argument("--chunk-mib", type=int, default=64, help="exchange chunk size in MiB")
    p.add_argument(
        "--part-kib",
        type=int,
        default=2048,
        help="stream an overlapped delta's blobs in parts of this many KiB, one exchange each "
        "(default: 2048; 0 = one exchange)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-check", action="store_true", help="skip the final bitwise check")
    p.set_defaults(func=_run_cluster_worker)


def _run_cluster_worker(args: argparse.Namespace) -> int:
    from deltasync import ClusterConfig, ExchangeConfig

    app = import_app("deltasync_examples.cluster_job", "cluster-worker")
    model = dict(app.TINY_QWEN3)
    if args.config:
        from deltasync.layout.files import load_config_dict

        model = load_config_dict(args.config)  # LayoutError naming the file, never a hang
    job = app.ClusterJob(
        model=model,
        tp=args.tp,
        writers=args.writers,
        replicas=args.replicas,
        dp_mode=args.dp_mode,
        versions=args.versions,
        lr=args.lr,
        check=not args.no_check,
        threads=args.threads,
        cluster=ClusterConfig(
            exchange=ExchangeConfig(timeout_s=args.timeout_s, max_chunk_bytes=args.chunk_mib << 20),
            commit_timeout_s=args.timeout_s,
            digest_every=args.digest_every,
            part_bytes=args.part_kib << 10,
        ),
    )

    def run() -> int:
        summary = app.run_cluster_sync(None, job)
        summary.pop("reports")
        emit_json_line(summary)
        if summary["rank"] == 0:
            med = summary["median_delta"]
            # What the trainer waited for: with the overlapped sender only the capture and the
            # next step's barrier (median_step), not the exchange and commit behind them.
            step = summary.get("median_step") or {}
            if "overhead_s" in step:
                waited = step["overhead_s"]
            else:
                waited = sum(med[k] for k in ("detect_s", "build_s", "encode_s"))
            print(
                f"cluster-worker: {job.versions} deltas, {job.writers} writer(s) -> tp={job.tp} x "
                f"{job.replicas} replica(s) ({summary['dp_mode']}): "
                f"median sync {med['total_s'] * 1e3:.1f} ms "
                f"(trainer waited {waited * 1e3:.1f} ms, "
                f"transfer {med['transfer_s'] * 1e3:.1f} ms, commit {med['commit_s'] * 1e3:.1f} ms)",
                file=sys.stderr,
            )
        return 0 if summary["exact"] in (True, None) else 1

    # A SIGTERM (a launcher stopping the job: torchrun when another rank failed, a scheduler)
    # or Ctrl-C ends the run through its cleanup, with the JSON line marked interrupted, as
    # the other applications do; a typed error prints its JSON line too.
    try:
        status = _run_app(
            "cluster-worker",
            run,
            base={"rank": _launcher_rank(), "exact": None},
            failed={"exact": False},
        )
    except DeltaSyncError as exc:  # its JSON line is out (none for a refused config)
        print(error_line(exc), file=sys.stderr)
        status = 2
    except BaseException:  # a defect, not a typed error: its traceback, then the same exit
        traceback.print_exc()
        status = 1
    # Done on every rank, however the run ended: skip the interpreter's teardown, where the
    # still-open gloo group's threads made a finished, exact run abort now and then
    # ("terminate called without an active exception", seen about once in five runs on a
    # 2-core VM) and a rank that failed wait on them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _launcher_rank() -> int | None:
    """This process's rank as its launcher set it (``RANK``), for a JSON line written before
    the group exists; None when unset or not a plain decimal number (``int`` would also take
    ``"1_0"`` or ``" 1"``)."""
    value = os.environ.get("RANK", "")
    return int(value) if value.isascii() and value.isdigit() else None
