"""``deltasync demo``: the main job on embedded defaults (local store, CPU, two receivers).

A thin projection of ``deltasync_examples.demo.DemoConfig``; the application is imported only
when the command runs.
"""

from __future__ import annotations

import argparse

from deltasync.commands.apps import import_app
from deltasync.jsonline import emit_json_line


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="train a small Qwen3 with AdamW and sync two TP=2 receivers every step"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--store", default=None, help="directory for the store (default: a temp dir)")
    p.add_argument(
        "--small", action="store_true", help="a two-layer model (a quick check, ~10x faster)"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    demo = import_app("deltasync_examples.demo.run", "demo")
    policy = demo.PolicyConfig.small() if args.small else demo.PolicyConfig()
    res = demo.run(demo.DemoConfig(steps=args.steps, lr=args.lr, store=args.store, policy=policy))
    emit_json_line(res, sort_keys=True)
    return 0 if res["exact"] else 1
