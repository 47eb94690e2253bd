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
import sys

from deltasync.errors import DeltaSyncError, error_line

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
