"""``deltasync demo``: the main job on embedded defaults (local store, CPU, two receivers)."""

from __future__ import annotations

import argparse

from deltasync.jsonline import emit_json_line


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a small Qwen3 with AdamW and sync two TP=2 receivers every step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--store", default=None, help="directory for the store (default: a temp dir)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from deltasync.demo.run import DemoConfig, run

    res = run(DemoConfig(steps=args.steps, lr=args.lr, store=args.store))
    emit_json_line(res, sort_keys=True)
    return 0 if res["exact"] else 1
