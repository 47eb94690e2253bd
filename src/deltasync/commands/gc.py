"""``deltasync gc STORE``: delete what retention allows, from outside the trainer.

    deltasync gc STORE [--keep N] [--receiver-ttl S] [--orphan-grace S]
        [--forget-receivers-after S] [--dry-run] [--json] [--key-file F] [--s3-endpoint URL ...]

Runs the retention a publisher's ``gc()`` runs (:func:`deltasync.commit.collect_garbage`):
never a version a live receiver still needs, never the newest anchor and the chain after it,
never the newest committed version; plus the leftovers no manifest vouches for (losing
attempts, versions older than the newest committed one that were never committed). Manifests
that do not verify (with ``--key-file``: also unsigned ones) are never touched, and a store
holding signed manifests is refused without ``--key-file`` (rc 2, nothing deleted). An attempt that
never committed is deleted only once its newest key is ``--orphan-grace`` seconds old: a
trainer's manifest write whose outcome it could not learn may still land and name its blobs
(the store's clock says when a key was written; a store that cannot say keeps them). ``--keep``,
``--receiver-ttl`` and ``--orphan-grace`` default to :class:`~deltasync.PublisherConfig`'s; pass
the trainer's own values. The registrations of receivers without a heartbeat for
``--forget-receivers-after`` seconds (a day by default; never less than ``--receiver-ttl`` and
``--orphan-grace``) are deleted too: a receiver that comes back registers again on its next
pull. ``--dry-run`` prints the plan and deletes nothing. A path that is not a deltasync store
is refused (rc 2), as by ``inspect``.
"""

from __future__ import annotations

import argparse
import math

from deltasync.commands.apps import emit_json_line
from deltasync.commands.inspect_store import (
    EXIT_NOT_A_STORE,
    add_store_arguments,
    open_deltasync_store,
    read_key,
    reader_may_leave,
)
from deltasync.errors import ConfigError, KeyNotFoundError, ManifestError, SignatureError


def _check(args: argparse.Namespace) -> None:
    if args.keep < 1:
        raise ConfigError(
            f"--keep must be >= 1 (the newest version is always kept), got {args.keep}"
        )
    if not (math.isfinite(args.receiver_ttl) and args.receiver_ttl > 0):
        raise ConfigError(
            f"--receiver-ttl must be a finite number of seconds > 0, got {args.receiver_ttl}"
        )
    if not (math.isfinite(args.orphan_grace) and args.orphan_grace >= 0):
        raise ConfigError(
            f"--orphan-grace must be a finite number of seconds >= 0, got {args.orphan_grace}"
        )
    if not args.forget_receivers_after > 0:  # also NaN; inf: never
        raise ConfigError(
            "--forget-receivers-after must be a number of seconds > 0 (inf: never), got "
            f"{args.forget_receivers_after}"
        )


def _run(args: argparse.Namespace) -> int:
    from deltasync.commit import Catalog, collect_garbage

    _check(args)
    key = read_key(args)  # a bad key file is named before the store is touched
    store = open_deltasync_store(args, "gc")
    if store is None:
        return EXIT_NOT_A_STORE  # nothing was deleted
    catalog = Catalog(store, signing_key=key)
    if key is None:
        _refuse_a_signed_store_without_its_key(args, catalog)
    plan = collect_garbage(
        store,
        catalog,
        keep_versions=args.keep,
        receiver_ttl_s=args.receiver_ttl,
        dry_run=args.dry_run,
        orphan_grace_s=args.orphan_grace,
        forget_receivers_after_s=args.forget_receivers_after,
    )
    latest = catalog.latest()
    if latest is not None and plan.committed is None and not _verifies(catalog, latest):
        # Retention plans from verified manifests only: none verifies, so nothing a version
        # holds was deleted, and never will be. Said, not hidden behind a log line and rc 0.
        raise SignatureError(
            f"no committed version of {args.store!r} verifies (LATEST names version {latest})"
            + (
                " under the key in --key-file: a wrong key, or a store signed with another"
                if key is not None
                else ": its manifests do not parse (damaged, or written by another release)"
            )
            + f". No version is deleted until one does; {len(plan.keys)} key(s) "
            + ("would be" if args.dry_run else "were")
            + " deleted (registrations of receivers gone for long)"
        )
    if args.json:
        with reader_may_leave():
            emit_json_line(
                {
                    "dry_run": args.dry_run,
                    "committed": plan.committed,
                    "versions": list(plan.versions),
                    "keys": list(plan.keys),
                    "deferred": list(plan.deferred),
                    "receivers": list(plan.receivers),
                },
                sort_keys=True,
            )
        return 0
    with reader_may_leave():  # `gc | head`: what was deleted is deleted, rc 0
        _print_plan(args, plan)
    return 0


def _verifies(catalog, version: int) -> bool:
    """Whether ``version``'s manifest verifies now. LATEST is read again after the plan: a
    version committed while gc ran (a trainer's first commit, after the plan found none) is
    no sign of a store where nothing verifies. A store failure is raised as itself."""
    try:
        catalog.manifest(version, fresh=True)
    except (ManifestError, KeyNotFoundError):
        return False
    return True


def _refuse_a_signed_store_without_its_key(args: argparse.Namespace, catalog) -> None:
    """Without a key every manifest that parses counts, so one planted by anyone who can write
    to the store (an unsigned anchor named newest) would plan the deletion of versions the
    keyed receivers still need. A store whose manifests are signed is collected with its key."""
    from deltasync.errors import DeltaSyncError, KeyNotFoundError

    for version in reversed(catalog.versions()):
        try:
            signed = catalog.manifest(version).signature is not None
        except (DeltaSyncError, KeyNotFoundError):
            continue  # not planned from either
        if signed:
            raise ConfigError(
                f"{args.store!r} holds signed manifests (version {version}): pass the "
                "trainer's --key-file, so gc plans only from manifests that verify (without it, "
                "a manifest anyone with write access planted would count). Nothing was deleted"
            )


def _print_plan(args: argparse.Namespace, plan) -> None:
    verb = "would delete" if args.dry_run else "deleted"
    versions = ", ".join(map(str, plan.versions)) or "none"
    print(f"{verb} {len(plan.keys)} key(s); versions removed whole: {versions}")
    for key in plan.keys:
        print(f"  {key}")
    if plan.deferred:
        kept = ", ".join(map(str, plan.deferred))
        print(
            f"kept attempt(s) that never committed, younger than {args.orphan_grace:g} s: "
            f"version(s) {kept}"
        )
    if plan.receivers:
        print(
            f"{'would forget' if args.dry_run else 'forgot'} {len(plan.receivers)} "
            "registration(s) of receivers without a heartbeat for over "
            f"{max(args.forget_receivers_after, args.receiver_ttl, args.orphan_grace):g} s: "
            + ", ".join(plan.receivers)
        )


def register(sub: argparse._SubParsersAction) -> None:
    from deltasync.commit.retention import (
        FORGET_RECEIVERS_AFTER_S,
        KEEP_VERSIONS,
        ORPHAN_GRACE_S,
        RECEIVER_TTL_S,
    )

    p = sub.add_parser(
        "gc",
        help="delete what retention allows (old versions, abandoned attempts) from a store",
        description="Delete what retention allows from a deltasync store: versions no live "
        "receiver needs beyond the newest --keep, leftovers of attempts that never "
        "committed, and registrations of receivers dead for --forget-receivers-after. "
        "Refuses a path that is not a store.",
    )
    add_store_arguments(p)
    p.add_argument(
        "--keep",
        type=int,
        default=KEEP_VERSIONS,
        help=f"keep at least the N newest versions (default: {KEEP_VERSIONS})",
    )
    p.add_argument(
        "--receiver-ttl",
        type=float,
        default=RECEIVER_TTL_S,
        help="a receiver whose record is older than this many seconds is not live (default: "
        f"{RECEIVER_TTL_S:g})",
    )
    p.add_argument(
        "--orphan-grace",
        type=float,
        default=ORPHAN_GRACE_S,
        help="delete an attempt that never committed only once its newest key is this many "
        f"seconds old: its manifest may still land (default: {ORPHAN_GRACE_S:g})",
    )
    p.add_argument(
        "--forget-receivers-after",
        type=float,
        default=FORGET_RECEIVERS_AFTER_S,
        help="delete the registration of a receiver without a heartbeat for this many seconds "
        "(never less than --receiver-ttl and --orphan-grace; it registers again on its next "
        f"pull; inf: never; default: {FORGET_RECEIVERS_AFTER_S:g})",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument("--json", action="store_true", help="print one JSON line instead")
    p.set_defaults(func=_run)
