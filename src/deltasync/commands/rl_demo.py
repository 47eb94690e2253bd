"""``deltasync rl-demo``: online GRPO with rollout worker processes synced by deltasync.

    deltasync rl-demo [--steps N] [--workers W] [--engine tp|hf] [--tp T]
        [--max-staleness S] [--kill-worker-at V] [--store DIR] ...

Prints one line per step and ends with one JSON line: ``steps``, ``versions``,
``reward_first``, ``reward_last``, ``probe_exact``, ``max_staleness`` (observed), and details.
Exit status 0 when every probe was bit-exact; on a mismatch the JSON line (``probe_exact``
false) is still printed, then the error, and the status is 2. A thin projection of
:class:`deltasync_examples.rl.RLConfig`; the application is imported
only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from deltasync.commands.apps import import_app
from deltasync.jsonline import emit_json_line


def _run(args: argparse.Namespace) -> int:
    rl = import_app("deltasync_examples.rl", "rl-demo")
    cfg = rl.RLConfig(
        steps=args.steps,
        workers=args.workers,
        engine=args.engine,
        tp=args.tp,
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

    try:
        summary = rl.run_rl(cfg, log=log)
    except rl.ProbeMismatchError as exc:
        emit_json_line(exc.summary)
        raise
    emit_json_line(summary)
    if not summary["probe_exact"]:
        print("deltasync rl-demo: probe logits were not bit-exact", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--store", default=None, help="run directory (default: a fresh temp dir)")
    p.add_argument("--timeout", type=float, default=120.0, help="longest single wait, seconds")
    p.add_argument("--quiet", action="store_true", help="print only the JSON line")
    p.set_defaults(func=_dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    if args.tp is None:
        args.tp = 2 if args.engine == "tp" else 1
    return _run(args)
