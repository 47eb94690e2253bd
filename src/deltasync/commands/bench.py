"""``deltasync bench [compare|detect] ...``: the benchmark programs of ``deltasync_bench``.

Each benchmark declares its own flags (``add_arguments``) and runs through ``main``. When the
benchmarks are not installed, the commands still parse (they take any arguments) and fail when
run with an error that says how to install them.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from deltasync.commands.apps import import_app
from deltasync.errors import ApplicationMissingError

# name -> (module under deltasync_bench, help)
_BENCHES = {
    "compare": ("compare_bench", "dense refit vs snapshot delta vs deltasync (the default)"),
    "detect": ("detect_bench", "detection + codec throughput vs the memory-bandwidth floor"),
}


def _module(name: str) -> ModuleType | ApplicationMissingError:
    try:
        return import_app(f"deltasync_bench.{_BENCHES[name][0]}", "bench")
    except ApplicationMissingError as exc:
        return exc


def register(sub: argparse._SubParsersAction) -> None:
    help_ = "run a benchmark (prints a table, ends with one JSON line)"
    compare = _module("compare")
    if isinstance(compare, ApplicationMissingError):
        # No option prefixes: any arguments parse (into `rest`); running reports the remedy.
        p = sub.add_parser("bench", help=help_, prefix_chars="\x00")
        p.add_argument("rest", nargs="*")
        p.set_defaults(func=_raiser(compare))
        return
    p = sub.add_parser("bench", help=help_)
    inner = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (_, bench_help) in _BENCHES.items():
        module = _module(name)
        q = inner.add_parser(name, help=bench_help)
        if isinstance(module, ApplicationMissingError):  # a partial install
            q.set_defaults(func=_raiser(module))
            continue
        module.add_arguments(q)
        q.set_defaults(func=module.main)
    # plain `deltasync bench [--preset ...]` runs the comparison
    compare.add_arguments(p)
    p.set_defaults(func=compare.main)


def _raiser(exc: ApplicationMissingError):
    def run(args: argparse.Namespace) -> int:
        raise exc

    return run
