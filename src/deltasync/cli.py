"""The ``deltasync`` command line: a thin projection of the config dataclasses.

Each subcommand module under :mod:`deltasync.commands` exposes ``register(subparsers)``
(``apps`` registers the application commands: demo, bench, rl-demo, cluster-worker); this
module only wires them together and turns typed errors into a
one-line message and a non-zero exit status (2), and a Ctrl-C that a command does not handle
itself into one line and status 130. It knows nothing about what the commands do.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from deltasync.errors import DeltaSyncError, error_line
from deltasync.interrupts import interrupts_deferred

# (module under deltasync.commands) -- order is the order shown in --help.
_COMMAND_MODULES = ("apps", "layout", "inspect_store", "gc", "pull")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltasync",
        description="Sparse, bit-exact BF16 policy-weight sync from an RL trainer to rollout workers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod_name in _COMMAND_MODULES:
        importlib.import_module(f"deltasync.commands.{mod_name}").register(sub)
    return parser


# The commands whose last line is JSON in every case but a refused flag (README; apps.py:
# cluster-worker too), with what marks that line failed, as a later Ctrl-C's (apps._run_app).
_JSON_COMMANDS = {
    "demo": {"exact": False},
    "bench": {"exact": False, "failures": True},
    "rl-demo": {"probe_exact": False},
    "cluster-worker": {"exact": False},
}


def main(argv: list[str] | None = None) -> int:
    try:
        # Imports every command's modules: torch, seconds of it. A Ctrl-C is held until they
        # are loaded: one landing inside torch's C++ import code aborts the process.
        with interrupts_deferred():
            parser = build_parser()
    except KeyboardInterrupt:
        return _interrupted_while_starting(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except DeltaSyncError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the finally blocks on the way here have run
        print(f"deltasync {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def _interrupted_while_starting(argv: list[str]) -> int:
    """A Ctrl-C before the command began (while its modules load): one line on stderr and,
    for the commands that end with a JSON line, that line, as for a Ctrl-C later on."""
    command = next((a for a in argv if not a.startswith("-")), "")
    line = "stopped by signal SIGINT"
    marks = _JSON_COMMANDS.get(command)
    if marks is not None:
        doc: dict = {**marks, "interrupted": True, "signal": "SIGINT", "error": line}
        if command == "cluster-worker":  # its line names its rank (several share a stdout)
            rank = os.environ.get("RANK", "")
            doc["rank"] = int(rank) if rank.isascii() and rank.isdigit() else None
        if marks.get("failures"):
            doc["failures"] = [line]
        from deltasync.commands.apps import emit_json_line  # loaded: the interrupt was held

        emit_json_line(doc, sort_keys=command in ("demo", "bench"))
    name = f"deltasync {command}" if command else "deltasync"
    print(f"{name}: {line} while starting", file=sys.stderr)
    return 130
