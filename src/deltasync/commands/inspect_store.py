"""``deltasync inspect STORE``: what is committed on a store, version by version.

    deltasync inspect STORE [--last N] [--json] [--key-file F] [--s3-endpoint URL ...]

prints one row per (version, receiver shard): kind, base, blob bytes, elements sent, density
(elements sent / the shard's elements, the latter read from the newest anchor's blobs), and
the receivers that acknowledged it; then the registered receivers. ``--json`` prints one JSON
line instead. It only reads. The store options here are shared with ``deltasync pull``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from deltasync.errors import ConfigError, DeltaSyncError
from deltasync.jsonline import emit_json_line


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="store URL: a path, file:///abs/path or s3://bucket/prefix")
    p.add_argument("--key-file", help="file holding the HMAC signing key (raw bytes)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL for self-hosted servers")
    p.add_argument("--s3-region", default="us-east-1", help="S3 region (default: us-east-1)")
    p.add_argument(
        "--s3-addressing-style", default="auto", choices=("auto", "path", "virtual"),
        help="S3 addressing style (default: auto; path for most self-hosted servers)",
    )  # fmt: skip


def open_store_from_args(args: argparse.Namespace):
    from deltasync.store import S3Config, open_store

    s3 = None
    if args.store.startswith("s3://"):
        s3 = S3Config(
            endpoint_url=args.s3_endpoint,
            region=args.s3_region,
            addressing_style=args.s3_addressing_style,
        )
    elif args.s3_endpoint:
        raise ConfigError("--s3-endpoint is only meaningful with an s3:// store URL")
    return open_store(args.store, s3=s3)


def read_key(args: argparse.Namespace) -> bytes | None:
    if not args.key_file:
        return None
    try:
        data = Path(args.key_file).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --key-file {args.key_file!r}: {exc}") from exc
    return data[:-1] if data.endswith(b"\n") else data


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shard_elements(store, catalog, versions: list[int]) -> dict[str, int]:
    """Elements of each shard, from the newest readable anchor (it names every local tensor;
    with several writers each names the same tensors, so each tensor counts once)."""
    from deltasync.format import decode_blob

    for v in reversed(versions):
        try:
            m = catalog.manifest(v)
            if m.kind != "anchor":
                continue
            out = {}
            for shard in m.shards:
                numel: dict[str, int] = {}
                for entry in m.blobs_for(shard):
                    for u in decode_blob(store.get(entry.key)).updates:
                        numel[u.name] = u.numel
                out[shard] = sum(numel.values())
            return out
        except DeltaSyncError:
            continue
    return {}


def collect(store, *, last: int, signing_key: bytes | None) -> dict:
    """Everything ``inspect`` shows, as plain data (also what ``--json`` prints)."""
    from deltasync.commit import Catalog
    from deltasync.format import decode_blob

    catalog = Catalog(store, signing_key=signing_key)
    versions = catalog.versions()
    shown = versions[-last:] if last else versions
    totals = _shard_elements(store, catalog, versions)
    rows = []
    for v in shown:
        try:
            m = catalog.manifest(v)
        except DeltaSyncError as exc:
            rows.append({"version": v, "error": f"{type(exc).__name__}: {exc}"})
            continue
        acks = catalog.acks(v)
        for shard in m.shards:
            blobs = m.blobs_for(shard)
            elements = 0
            for entry in blobs:
                try:
                    elements += decode_blob(store.get(entry.key)).total_elements()
                except DeltaSyncError:
                    elements = -1
                    break
            total = totals.get(shard)
            density = elements / total if total and elements >= 0 else None
            rows.append({
                "version": v, "kind": m.kind, "base": m.base_version, "shard": shard,
                "bytes": sum(b.size for b in blobs), "elements": elements, "density": density,
                "acks": sorted(r for r, a in acks.items() if a.shard == shard),
                "signed": m.signature is not None,
            })  # fmt: skip
    now = time.time()
    receivers = [
        {"receiver": r.receiver, "shard": r.shard, "version": r.version,
         "age_s": round(now - r.updated_at, 1)}
        for r in catalog.receivers().values()
    ]  # fmt: skip
    return {
        "latest": catalog.read_latest(),
        "newest_committed": versions[-1] if versions else None,
        "versions": len(versions),
        "rows": rows,
        "receivers": receivers,
    }


def _print_table(info: dict) -> None:
    print(
        f"LATEST={info['latest']}  newest committed={info['newest_committed']}  "
        f"committed versions stored={info['versions']}"
    )
    head = f"{'version':>8}  {'kind':<6}  {'base':>6}  {'shard':<12}  {'bytes':>10}  " \
           f"{'elements':>9}  {'density':>8}  acks"  # fmt: skip
    print(head)
    for row in info["rows"]:
        if "error" in row:
            print(f"{row['version']:>8}  unreadable: {row['error']}")
            continue
        base = "-" if row["base"] is None else str(row["base"])
        d = row["density"]
        dens = "?" if d is None or (isinstance(d, float) and math.isnan(d)) else f"{100 * d:.2f}%"
        elems = "?" if row["elements"] < 0 else str(row["elements"])
        acks = ",".join(row["acks"]) or "-"
        print(
            f"{row['version']:>8}  {row['kind']:<6}  {base:>6}  {row['shard']:<12}  "
            f"{_human(row['bytes']):>10}  {elems:>9}  {dens:>8}  {acks}"
        )
    if info["receivers"]:
        print("receivers:")
        for r in info["receivers"]:
            print(
                f"  {r['receiver']:<20} shard={r['shard']:<10} version={r['version']} "
                f"heartbeat {r['age_s']:.1f} s ago"
            )


def _run(args: argparse.Namespace) -> int:
    if args.last < 0:
        raise ConfigError(f"--last must be >= 0, got {args.last}")
    store = open_store_from_args(args)
    info = collect(store, last=args.last, signing_key=read_key(args))
    if args.json:
        emit_json_line(info, sort_keys=True)
    else:
        _print_table(info)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="list committed versions on a store: kinds, bytes, density, acks",
        description="Read-only view of a deltasync store: per version and receiver shard, the "
        "kind, base, bytes, elements sent, density and acknowledgements.",
    )
    add_store_arguments(p)
    p.add_argument("--last", type=int, default=20, help="show the N newest versions (0 = all)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.set_defaults(func=_run)
