"""``deltasync inspect STORE``: a read-only diagnostic of what is committed on a store.

    deltasync inspect STORE [--last N] [--json] [--key-file F] [--s3-endpoint URL ...]

refuses a path that is not a deltasync store (rc 2, nothing created), then prints the newest
version's layout (engine, TP, EP, model fingerprint) and lineage (run id), and one row per
(version, receiver shard): a status with its reason, kind, base, run id, blob bytes, elements
sent, density (elements sent / the shard's elements, both from the manifest: no blob is
decoded) and the receivers that acknowledged it (an ack naming another state digest than the
manifest's is listed apart: a trainer does not count it); then the registered receivers
(with the anchor each is restoring, if one). Statuses:

- ``ok``: the manifest verifies and every blob is present with its size and digest;
- ``corrupt`` / ``truncated`` / ``missing blob``: a blob does not match its manifest entry;
- ``gap``: a delta whose base version has no manifest in the store, or one that does not
  parse or verify (receivers below it restore an anchor);
- ``unsigned`` / ``bad signature`` (with ``--key-file``), ``unreadable``: the manifest;
  ``unreadable`` also for a blob the store did not return (access refused, unreachable:
  nothing is known about its bytes), and for a delta whose base manifest it did not return
  (nothing is known of the chain below);
- ``uncommitted``: a version directory without a manifest (an attempt in flight, or a crash).

With ``--key-file`` the header's newest committed version is the newest whose manifest
verifies with that key (what a receiver given it would follow), and a line says so when a
newer manifest is listed; without a key it is the newest manifest listed, unverified.

``--json`` prints one JSON line instead. The exit status is 0, 2 for a path that is not a
store, and 3 when ``--key-file`` is given, manifests are listed and none verifies with it
(everything is still printed). Blobs are read to check their sizes and digests, at
most 16 MiB at a time, and one listed larger than its shard's layout record allows is not read
at all (``corrupt``); nothing is written. The store options here are shared with ``deltasync
pull``. A closed output pipe ends it quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from deltasync.commands.apps import emit_json_line
from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    DigestMismatchError,
    KeyNotFoundError,
    ObjectTooLargeError,
    SignatureError,
    StoreError,
    TruncatedBlobError,
)

EXIT_NOT_A_STORE = 2
# With --key-file: manifests are listed and none verifies with the key (a wrong key, or a store
# another trainer signed): everything is still printed, and a script learns of it.
EXIT_NOTHING_VERIFIES = 3
# A blob above this is hashed from ranges of this size, so inspect's memory does not follow the
# sizes a manifest lists (one request per chunk on S3; a blob below it is one request).
HASH_CHUNK = 16 << 20


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store URL: a path, file:///abs/path or s3://bucket/prefix")
    p.add_argument("--key-file", help="file holding the HMAC signing key (raw bytes)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL for self-hosted servers")
    p.add_argument("--s3-region", default="us-east-1", help="S3 region (default: us-east-1)")
    p.add_argument(
        "--s3-addressing-style",
        default="auto",
        choices=("auto", "path", "virtual"),
        help="S3 addressing style (default: auto; path for most self-hosted servers)",
    )
    p.add_argument(
        "--s3-read-timeout",
        type=float,
        metavar="S",
        help="seconds one S3 read may stall before it fails (S3Config.read_timeout_s; default 60)",
    )
    p.add_argument(
        "--s3-retry-deadline",
        type=float,
        metavar="S",
        help="seconds from an S3 call's first attempt within which failed attempts are retried "
        "(S3Config.retry.deadline_s; default 30)",
    )
    p.add_argument(
        "--s3-ca-bundle",
        metavar="PEM",
        help="CA certificates to verify an https:// endpoint against, for a server with a "
        "private CA (S3Config.ca_bundle; default: botocore's bundle)",
    )


def local_path(url: str) -> Path | None:
    """The directory of a local store URL (None for other schemes)."""
    from deltasync.store.factory import url_scheme

    scheme = url_scheme(url)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):  # as open_store refuses it: never a directory
            raise ConfigError(
                f"file URL {url!r} names host {parts.netloc!r}; use file:///abs/path (three "
                "slashes) or a plain path"
            )
        return Path(unquote(parts.path))
    return Path(url) if scheme == "" else None


# Why a path can never become a store directory, however long one waits for it.
_NEVER = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EINVAL})


def local_store_exists(args: argparse.Namespace, *, waiting: bool = False) -> bool:
    """Whether the local store directory ``args.store`` names is there yet (False: nothing
    there). ConfigError for a path that cannot be one (a name too long, a parent that is a
    file, something else in its place): waiting for it would be forever. ``waiting``: an error
    a wait may cure (a network filesystem's EIO or ESTALE, a permission being fixed) also
    reads as not there yet."""
    path = local_path(args.store)
    assert path is not None, "a local store URL"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte
        if waiting and isinstance(exc, OSError) and exc.errno not in _NEVER:
            return False
        raise ConfigError(
            f"{args.store!r} cannot be a store directory ({getattr(exc, 'strerror', None) or exc}); "
            "nothing was created"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"{args.store!r} is not a directory: not a deltasync store (nothing was created)"
        )
    return True


def check_store_flags(args: argparse.Namespace) -> None:
    """ConfigError for ``--s3-*`` flags given with a store URL that is not ``s3://`` (a
    ``s3:/bucket`` one slash short would be a local directory waited for forever)."""
    from deltasync.store.factory import url_scheme

    given = [
        flag
        for flag, value in (
            ("--s3-endpoint", args.s3_endpoint),
            ("--s3-read-timeout", args.s3_read_timeout),
            ("--s3-retry-deadline", args.s3_retry_deadline),
            ("--s3-ca-bundle", args.s3_ca_bundle),
        )
        if value is not None
    ]
    if given and url_scheme(args.store) != "s3":  # as open_store routes it (``S3://`` too)
        raise ConfigError(
            f"{', '.join(given)} only apply to an s3:// store URL, and {args.store!r} is not "
            "one (s3://BUCKET/PREFIX)"
        )
    local_path(args.store)  # a file:// URL naming a host: refused before anything waits on it


def open_store_from_args(args: argparse.Namespace, *, must_exist: bool = False):
    """The store the arguments name; ``must_exist`` refuses a local path that is not an
    existing directory instead of creating it."""
    from deltasync.store import S3Config, open_store
    from deltasync.store.base import RetryPolicy
    from deltasync.store.factory import url_scheme

    check_store_flags(args)
    if must_exist and local_path(args.store) is not None and not local_store_exists(args):
        raise ConfigError(
            f"{args.store!r} is not a directory: not a deltasync store (nothing was created)"
        )
    s3 = None
    if url_scheme(args.store) == "s3":  # as open_store routes it (``S3://`` too)
        tuned: dict = {}
        if args.s3_read_timeout is not None:
            tuned["read_timeout_s"] = args.s3_read_timeout
        if args.s3_retry_deadline is not None:
            tuned["retry"] = RetryPolicy(deadline_s=args.s3_retry_deadline)
        if args.s3_ca_bundle is not None:
            tuned["ca_bundle"] = args.s3_ca_bundle
        s3 = S3Config(
            endpoint_url=args.s3_endpoint,
            region=args.s3_region,
            addressing_style=args.s3_addressing_style,
            **tuned,
        )
    return open_store(args.store, s3=s3)


def read_key(args: argparse.Namespace) -> bytes | None:
    if args.key_file is None:
        return None
    if not args.key_file.strip():
        # an unset variable in a script (--key-file "$KEY_FILE") must not turn checking off
        raise ConfigError(
            "--key-file is empty: give the signing key file's path, or leave the flag out for "
            "an unsigned store"
        )
    from deltasync.commit.signing import load_key_file

    # Warns when the file is readable by its group or others; refuses a too-short key.
    return load_key_file(args.key_file)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def is_store(store) -> bool:
    """Does ``store`` hold anything deltasync writes (LATEST, a version, a registration)?

    Only keys that parse as deltasync's count: a directory holding ``venv/`` or
    ``vacation.txt`` is not a store. Versions are listed under ``v0`` ... ``v9`` rather than
    ``v``, so a local listing never walks an unrelated tree (``gc /`` must not read ``/var``)."""
    from deltasync import names
    from deltasync.errors import ManifestError

    def parses(parse, key: str) -> bool:
        try:
            parse(key)
        except ManifestError:
            return False
        return True

    if store.exists(names.LATEST):
        return True
    for prefix in names.VERSION_DIGIT_PREFIXES:
        for key in store.list(prefix):
            vdir, sep, _ = key.partition("/")
            if sep and parses(names.parse_version_dir, vdir):
                return True
    return any(parses(names.parse_receiver_key, k) for k in store.list(names.RECEIVERS_PREFIX))


def _blob_status(store, manifest, shard: str) -> tuple[str, str]:
    """(status, reason) of ``shard``'s blobs in ``manifest``, each read and checked as a
    receiver would (size, digest), never decoded: a blob the manifest lists larger than its
    layout record's shard can hold is not read, a large one is hashed in chunks."""
    from deltasync.errors import MissingBlobError
    from deltasync.receiver.staging import check_blob_in_parts, fetch_blob, numel_blob_bound

    rec = manifest.layout.shards.get(shard) if manifest.layout is not None else None
    bound = None if rec is None else numel_blob_bound(rec.numel)
    for entry in manifest.blobs_for(shard):
        if bound is not None and entry.size > bound:
            return "corrupt", (
                f"{entry.key} is listed at {entry.size} bytes, more than any blob of shard "
                f"{shard!r} of {rec.numel} elements can hold ({bound} bytes); not read"
            )
        try:
            if entry.size <= HASH_CHUNK:
                fetch_blob(store, manifest, entry)
            else:
                check_blob_in_parts(store, manifest, entry, HASH_CHUNK)
        except MissingBlobError:
            return "missing blob", f"{entry.key} is not in the store"
        except StoreError as exc:  # refused or unreachable: says nothing about the bytes
            return "unreadable", f"{type(exc).__name__}: {exc}"
        except TruncatedBlobError as exc:
            return "truncated", str(exc)
        except DigestMismatchError as exc:
            return "corrupt", str(exc)
        except DeltaSyncError as exc:
            return "corrupt", f"{type(exc).__name__}: {exc}"
    return "ok", ""


def collect(store, *, last: int, signing_key: bytes | None) -> dict:
    """Everything ``inspect`` shows, as plain data (also what ``--json`` prints)."""
    from deltasync.commit import Catalog

    catalog = Catalog(store, signing_key=signing_key)
    dirs = catalog.version_dirs()
    committed = catalog.versions()
    every = sorted(set(dirs) | set(committed))
    shown = every[-last:] if last else every
    rows = []
    head_layout = head_run = None
    verified = _newest_verified(catalog, committed) if signing_key is not None else None
    failed: dict[int, str] = {}  # versions whose manifest did not read or verify: why
    unreached: set[int] = set()  # of those, the ones the store did not return (an outage)

    def manifest_failed(v: int, exc: BaseException) -> None:
        failed[v] = f"{type(exc).__name__}: {exc}"
        # a manifest gone since the listing is missing, one too large to be one does not
        # parse: both a gap
        if isinstance(exc, StoreError) and not isinstance(
            exc, (KeyNotFoundError, ObjectTooLargeError)
        ):
            unreached.add(v)

    def base_status(base: int) -> tuple[str, str] | None:
        """(status, reason) of a delta on ``base`` that cannot be vouched for: a ``gap`` when
        the base's manifest is missing, does not parse or does not verify (receivers below
        it restore an anchor), ``unreadable`` when the store did not return it (refused,
        unreachable: nothing is known of the chain below). None when it reads and verifies
        (a base above the shown rows was read already; one below them is read once)."""
        if base not in committed:
            return "gap", f"base version {base} has no manifest"
        if base not in failed and base < shown[0]:
            try:
                catalog.manifest(base)
            except (DeltaSyncError, KeyNotFoundError) as exc:
                manifest_failed(base, exc)
        if base in unreached:
            return "unreadable", (
                f"base version {base}'s manifest could not be read from the store, so nothing "
                f"is known of the chain below: {failed[base]}"
            )
        if base in failed:
            return "gap", f"base version {base}'s manifest does not verify or read: {failed[base]}"
        return None

    for v in shown:
        if v not in committed:
            rows.append(
                {
                    "version": v,
                    "status": "uncommitted",
                    "reason": "a version directory without a manifest",
                }
            )
            continue
        try:
            m = catalog.manifest(v)
        except SignatureError as exc:
            status = "unsigned" if "unsigned" in str(exc) else "bad signature"
            rows.append({"version": v, "status": status, "reason": str(exc)})
            manifest_failed(v, exc)
            continue
        except (DeltaSyncError, KeyNotFoundError) as exc:
            rows.append({"version": v, "status": "unreadable", "reason": str(exc)})
            manifest_failed(v, exc)
            continue
        head_layout = m.layout.to_dict() if m.layout is not None else None
        head_run = m.run_id
        acks = catalog.acks(v)
        below = base_status(m.base_version) if m.kind == "delta" else None
        for shard in m.shards:
            blobs = m.blobs_for(shard)
            status, reason = _blob_status(store, m, shard)
            if status == "ok" and below is not None:
                status, reason = below
            counts = [b.elements for b in blobs]
            elements = None if any(c is None for c in counts) else sum(counts)
            numel = None
            if m.layout is not None and shard in m.layout.shards:
                numel = m.layout.shards[shard].numel
            density = elements / numel if elements is not None and numel else None
            rows.append(
                {
                    "version": v,
                    "status": status,
                    "reason": reason,
                    "kind": m.kind,
                    "base": m.base_version,
                    "run_id": m.run_id,
                    "shard": shard,
                    "bytes": sum(b.size for b in blobs),
                    "elements": elements,
                    "density": density,
                    **_acks_of(acks, m, shard),
                    "signed": m.signature is not None,
                }
            )
    now = time.time()
    receivers = [
        {
            "receiver": r.receiver,
            "shard": r.shard,
            "version": r.version,
            "run_id": r.run_id,
            "age_s": round(now - r.updated_at, 1),
            # the anchor it is restoring (retention keeps it and every version after it)
            "restoring": r.restoring,
        }
        for r in catalog.receivers().values()
    ]
    newest_listed = committed[-1] if committed else None
    return {
        "latest": catalog.read_latest(),
        # with a key, committed means what a receiver holding that key would take
        "newest_committed": newest_listed if signing_key is None else verified,
        "newest_listed": newest_listed,
        "verified_with_key": signing_key is not None,
        "versions": len(committed),
        "layout": head_layout,
        "run_id": head_run,
        "rows": rows,
        "receivers": receivers,
    }


def _acks_of(acks: dict, manifest, shard: str) -> dict[str, list[str]]:
    """The receivers that acknowledged ``shard`` of ``manifest``'s version in its lineage:
    ``acks``, those whose state digest is the manifest's (the ones a trainer counts), and
    ``acks_wrong_digest``, those that name another state (a receiver on another layout, or
    broken)."""
    expected = manifest.shard_digests.get(shard)
    ours = [
        (r, a.state_digest == expected)
        for r, a in acks.items()
        if a.shard == shard and a.run_id in (None, manifest.run_id)
    ]
    return {
        "acks": sorted(r for r, same in ours if same),
        "acks_wrong_digest": sorted(r for r, same in ours if not same),
    }


def _newest_verified(catalog, committed: list[int]) -> int | None:
    """The newest version whose manifest verifies with the catalog's key (None: no manifest
    does): the version a receiver given that key would follow."""
    for v in reversed(committed):
        try:
            catalog.manifest(v)
        except (DeltaSyncError, KeyNotFoundError):
            continue
        return v
    return None


def _print_table(info: dict) -> None:
    print(
        f"LATEST={info['latest']}  newest committed={info['newest_committed']}  "
        f"committed versions stored={info['versions']}  run={info['run_id']}"
    )
    if info["verified_with_key"] and info["newest_committed"] != info["newest_listed"]:
        newest = info["newest_committed"]
        print(
            f"warning: the newest manifest listed is version {info['newest_listed']}, but "
            + (
                "no manifest verifies with this key"
                if newest is None
                else f"the newest that verifies with this key is version {newest}"
            )
            + ": receivers given this key follow only manifests that verify (check the key "
            "file, or what wrote the store)"
        )
    lay = info["layout"]
    if lay is not None:
        print(
            f"layout: engine {lay['engine']} tp={lay['tp']} ep={lay['ep']} model "
            f"{lay['model']} shards {list(lay['shards'])}"
        )
    head = (
        f"{'version':>8}  {'kind':<6}  {'base':>6}  {'shard':<12}  {'bytes':>10}  "
        f"{'elements':>9}  {'density':>8}  {'status':<12}  acks"
    )
    print(head)
    for row in info["rows"]:
        if "shard" not in row:
            print(f"{row['version']:>8}  {row['status']}: {row['reason']}")
            continue
        base = "-" if row["base"] is None else str(row["base"])
        d = row["density"]
        dens = "?" if d is None else f"{100 * d:.2f}%"
        elems = "?" if row["elements"] is None else str(row["elements"])
        acks = ",".join(row["acks"]) or "-"
        if row["acks_wrong_digest"]:
            acks += f" (another state digest: {','.join(row['acks_wrong_digest'])})"
        print(
            f"{row['version']:>8}  {row['kind']:<6}  {base:>6}  {row['shard']:<12}  "
            f"{_human(row['bytes']):>10}  {elems:>9}  {dens:>8}  {row['status']:<12}  {acks}"
        )
        if row["reason"]:
            print(f"{'':>10}{row['status']}: {row['reason']}")
    if info["receivers"]:
        print("receivers:")
        for r in info["receivers"]:
            other = r["run_id"] not in (None, info["run_id"])
            print(
                f"  {r['receiver']:<20} shard={r['shard']:<10} version={r['version']} "
                f"heartbeat {r['age_s']:.1f} s ago"
                + (f" (of run {r['run_id']}, not this store's lineage)" if other else "")
                + (f", restoring anchor {r['restoring']}" if r["restoring"] is not None else "")
            )


def open_deltasync_store(args: argparse.Namespace, command: str):
    """The existing deltasync store the arguments name, or None after saying on stderr why
    it is not one (the caller exits with ``EXIT_NOT_A_STORE``); nothing is created."""
    try:
        store = open_store_from_args(args, must_exist=True)
    except ConfigError as exc:
        print(f"deltasync {command}: {exc}", file=sys.stderr)
        return None
    if not is_store(store):
        print(
            f"deltasync {command}: {args.store!r} holds no LATEST, version or registration: not "
            f"a deltasync store (or an empty one){run_dir_hint(args)}",
            file=sys.stderr,
        )
        return None
    return store


def run_dir_hint(args: argparse.Namespace) -> str:
    """For a local path that is not a store but whose ``store/`` is one (the run directory of
    ``deltasync demo --store DIR`` or ``rl-demo --store DIR``): where the store is."""
    path = local_path(args.store)
    if path is None:
        return ""
    from deltasync.store import LocalStore

    inner = path / "store"
    try:
        if not inner.is_dir() or not is_store(LocalStore(inner, create=False)):
            return ""
    except (OSError, DeltaSyncError):
        return ""
    return f"; it is a run directory: its store is {str(inner)!r}"


def _run(args: argparse.Namespace) -> int:
    if args.last < 0:
        raise ConfigError(f"--last must be >= 0, got {args.last}")
    key = read_key(args)  # a bad key file is named before the store is touched
    store = open_deltasync_store(args, "inspect")
    if store is None:
        return EXIT_NOT_A_STORE
    info = collect(store, last=args.last, signing_key=key)
    with reader_may_leave():
        if args.json:
            emit_json_line(info, sort_keys=True)
        else:
            _print_table(info)
    nothing_verifies = info["verified_with_key"] and info["newest_committed"] is None
    if nothing_verifies and info["newest_listed"] is not None:
        return EXIT_NOTHING_VERIFIES
    return 0


@contextlib.contextmanager
def reader_may_leave(stream=None) -> Iterator[None]:
    """Output to a reader that went away (``| head``) is dropped, not a ``BrokenPipeError``
    traceback: what the command did stands, and the rest of its output goes to /dev/null."""
    stream = sys.stdout if stream is None else stream
    try:
        yield
        stream.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="diagnose a store: per version a status, kind, bytes, density, lineage, acks",
        description="Read-only diagnostic of a deltasync store: its layout and lineage, and per "
        "version and receiver shard a status (ok / corrupt / truncated / missing blob / gap / "
        "unsigned) with the reason, kind, base, bytes, elements sent, density and "
        "acknowledgements. Refuses a path that is not a store.",
    )
    add_store_arguments(p)
    p.add_argument("--last", type=int, default=20, help="show the N newest versions (0 = all)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.set_defaults(func=_run)
