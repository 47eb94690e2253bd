"""``deltasync bench [compare|detect] ...``: the benchmark programs (see ``deltasync.bench``)."""

from __future__ import annotations

import argparse
import importlib

# name -> (module under deltasync.bench, help)
_BENCHES = {
    "compare": ("compare_bench", "dense refit vs snapshot delta vs deltasync (the default)"),
    "detect": ("detect_bench", "detection + codec throughput vs the memory-bandwidth floor"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints a table, ends with one JSON line)")
    inner = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (mod, help_) in _BENCHES.items():
        module = importlib.import_module(f"deltasync.bench.{mod}")
        q = inner.add_parser(name, help=help_)
        module.add_arguments(q)
        q.set_defaults(func=module.main)
    # plain `deltasync bench [--preset ...]` runs the comparison
    compare = importlib.import_module("deltasync.bench.compare_bench")
    compare.add_arguments(p)
    p.set_defaults(func=compare.main)
