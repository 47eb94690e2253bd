"""``deltasync pull``: a sidecar keeping ``DIR/<shard>.safetensors`` at the newest version.

    deltasync pull STORE --engine E --tp N [--ep M] --shard ID --dir DIR [--config CONFIG.json]
        [--receiver-id ID] [--key-file F] [--once | --interval S [--iterations K]]

For engines that reload weights from disk. The sidecar holds the shard in memory as a
:class:`~deltasync.receiver.Receiver` (bootstrap from the newest anchor, then deltas), and after
each new version writes the file atomically (temporary file, fsync, rename, directory fsync)
with the version and state digest in its safetensors metadata. Only the file is durable: on
start the sidecar loads it and its metadata, verifies the digest, and continues from there
(a crash between a pull and the file write just repeats that pull).

With ``--config`` the tensors are checked against the engine layout of that model; without
it, their names and shapes come from the newest anchor's blobs for the shard.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from deltasync.atomic import write_atomic
from deltasync.commands.inspect_store import add_store_arguments, open_store_from_args, read_key
from deltasync.errors import ConfigError, DeltaSyncError

META_VERSION = "deltasync_version"
META_DIGEST = "deltasync_state_digest"
META_SHARD = "deltasync_shard"


def _specs(args, store, key):
    from deltasync.commit import Catalog
    from deltasync.format import TensorSpec, decode_blob

    if args.config:
        from deltasync.layout import ReceiverLayout
        from deltasync.layout.files import load_config

        layout = ReceiverLayout.build(load_config(args.config), args.engine, args.tp, args.ep)
        return layout.local_specs(args.shard)
    catalog = Catalog(store, signing_key=key)
    latest = catalog.latest()
    if latest is None:
        raise ConfigError("the store has no committed version yet; pass --config to start early")
    anchor = catalog.chain(None, latest)[0]
    specs: dict[str, TensorSpec] = {}
    for entry in anchor.blobs_for(args.shard):
        for u in decode_blob(store.get(entry.key), shard=args.shard).updates:
            specs[u.name] = TensorSpec(shape=u.shape, dtype=u.dtype)
    if not specs:
        raise ConfigError(
            f"the newest anchor (version {anchor.version}) has no blobs for shard {args.shard!r}; "
            f"shards: {list(anchor.shards)}"
        )
    return dict(sorted(specs.items()))


def _load(path: Path, specs):
    """Tensors and (version, digest) from the file, or zeros and None."""
    import torch
    from safetensors import safe_open

    if not path.exists():
        return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}, None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    if set(tensors) != set(specs):
        raise ConfigError(
            f"{str(path)!r} holds tensors {sorted(set(tensors) ^ set(specs))[:5]} that the "
            "shard's layout does not (or lacks them): it belongs to another shard or model"
        )
    try:
        held = (int(meta[META_VERSION]), meta[META_DIGEST])
    except (KeyError, ValueError):
        held = None
    return tensors, held


def _write(path: Path, tensors, version: int, digest: str, shard: str) -> None:
    from safetensors.torch import save_file

    meta = {META_VERSION: str(version), META_DIGEST: digest, META_SHARD: shard}
    contiguous = {n: t.contiguous() for n, t in tensors.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata=meta))


def _run(args: argparse.Namespace) -> int:
    from deltasync.receiver import LocalState, Receiver, ReceiverConfig, StateDir

    if args.interval <= 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {args.interval}")
    store = open_store_from_args(args)
    key = read_key(args)
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = _specs(args, store, key)
    path = out_dir / f"{args.shard}.safetensors"
    tensors, held = _load(path, specs)
    receiver_id = args.receiver_id or f"pull-{args.shard}"

    # The in-memory tensors are exactly the file: seed the receiver's state from it and drop
    # any journal of an earlier sidecar process (its half-applied tensors died with it).
    state_dir = out_dir / f".{args.shard}.deltasync"
    if state_dir.exists():
        shutil.rmtree(state_dir)
    if held is not None:
        StateDir(state_dir).write_state(LocalState(
            receiver=receiver_id, shard=args.shard, version=held[0], state_digest=held[1]
        ))  # fmt: skip
    receiver = Receiver(
        store, shard=args.shard, tensors=tensors, state_dir=str(state_dir),
        config=ReceiverConfig(receiver_id=receiver_id, signing_key=key), specs=specs,
    )  # fmt: skip
    if receiver.dirty:
        print(f"{path}: contents do not match its recorded version; restoring an anchor")
    done = 0
    while True:
        try:
            report = receiver.pull()
            if report.changed or not path.exists():
                _write(path, receiver.tensors, receiver.version, receiver.state_digest, args.shard)
            print(
                f"version {report.version} (from {report.previous_version}, applied "
                f"{list(report.chain)}): {report.bytes_fetched} bytes, "
                f"{report.elements_written} elements, pause {report.pause_s * 1e3:.2f} ms, "
                f"total {report.total_s * 1e3:.1f} ms -> {path}",
                flush=True,
            )
        except DeltaSyncError as exc:
            if args.once:
                raise
            print(f"deltasync pull: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        done += 1
        if args.once or (args.iterations and done >= args.iterations):
            return 0
        time.sleep(args.interval)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="sidecar: keep DIR/<shard>.safetensors at the newest committed version",
        description="Keep a local safetensors copy of one receiver shard current: bootstrap "
        "from the newest anchor, then apply deltas; the file is replaced atomically.",
    )
    add_store_arguments(p)
    p.add_argument("--engine", choices=("hf", "vllm"), default="vllm", help="receiver convention")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (1 = off)")
    p.add_argument("--shard", required=True, help="receiver shard id, e.g. tp0 or tp1-ep0")
    p.add_argument("--dir", required=True, help="directory of <shard>.safetensors")
    p.add_argument("--config", help="transformers config.json (checks the layout)")
    p.add_argument("--receiver-id", help="id in acks and registrations (default pull-<shard>)")
    p.add_argument("--once", action="store_true", help="pull once and exit")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between pulls")
    p.add_argument("--iterations", type=int, default=0, help="stop after K pulls (0 = never)")
    p.set_defaults(func=_run)
