"""``deltasync pull``: a sidecar keeping ``DIR/<shard>.safetensors`` at the newest version.

    deltasync pull STORE --shard ID --dir DIR [--engine E] [--tp N] [--ep M] [--config CONFIG.json]
        [--receiver-id ID] [--key-file F] [--once | --interval S [--iterations K]]

For engines that reload weights from disk. The file holds the shard's tensors under the
receiver layout's local names: with ``--engine hf`` an HF-format checkpoint file (what
transformers' ``from_pretrained`` and engines loading HF safetensors read); with ``--engine
vllm`` the vLLM worker's own (fused) parameter names for that TP/EP rank, which deltasync's
vLLM backend or a loader that copies tensors by parameter name reloads (vLLM's own safetensors
loader expects HF checkpoint names).

The sidecar holds the shard in memory as a :class:`~deltasync.receiver.Receiver` (bootstrap
from the newest anchor, then deltas), and after each new verified version writes the file
atomically (temporary file, fsync, rename, directory fsync; mode from the umask, so the
engine's user can read it) with the version, run id and state digest in its safetensors
metadata, before it acks or registers that version: the store never shows the sidecar at a
version its file does not hold (a write that fails is retried by the next pull, and until it
lands the records keep the version the file holds). The file is written by the sidecar itself
(the safetensors format: a header, then each tensor's bytes, no copy of the shard), so a kill
mid-write leaves only its own temporary file, which the next sidecar on that file sweeps once
nothing has written it for 5 minutes (at its start and before every pull: a younger one may be
a write in progress). A file edited, replaced or removed behind the sidecar (``--dir`` too)
is rewritten from the verified tensors in memory before the next pull; while that rewrite
fails (a full disk), the sidecar's registration is withdrawn, since the file no longer holds
the version it names. Only the file is durable: on start the sidecar loads it and its
metadata, verifies the digest, and continues from there (a crash between a pull and the file
write just repeats that pull); the version the metadata claims is registered only once the
store commits it as held (or a pull verified it).

Started before the trainer's first commit (the normal order), it waits (for a local store, also
for its directory to appear: the sidecar never creates it; with ``--once`` a missing store is
refused). It registers with the
store only once it holds a verified version, and while it restores an anchor (naming the
anchor and no version, so that gc keeps what it fetches; a bounded-staleness trainer waits for
that restore as for any receiver's); a failed restore or first pull removes its registration,
so a bounded-staleness trainer waits on a sidecar that cannot pull only while each restore
attempt runs (one SIGKILLed mid-restore: until its registration expires); repeated errors back
off (up to 60 s)
with one line per change of state; SIGINT/SIGTERM end it cleanly (rc 0) between pulls, and
``--iterations K`` ends it after K pulls (rc 1 when the last one failed). One sidecar (one
process) keeps a state dir: a second one started on the same ``--dir`` and shard waits, with
one line naming the first one's pid, until that one is gone.

Its default receiver id (:func:`default_receiver_id`) is ``pull-<shard>-<random>``, made at its
first start and recorded in its state dir in ``--dir``: replicas of one shard (each with its own
``--dir``) get their own, so none overwrites another's registration and acks (under one id, a
lagging replica was hidden behind another's heartbeat, and a bounded-staleness trainer did not
wait for it), and a restarted sidecar, in a new container too, takes over its own. Where
``--dir`` does not survive a restart, pass ``--receiver-id``: a new id at each start leaves the
old one's registration counted as a lagging receiver until ``receiver_ttl_s`` passes.

The layout is checked against the store before anything is fetched: the manifests record the
engine, TP, EP and model fingerprint they were built for. With ``--config`` the tensor specs
come from that model's layout; without it from the newest anchor's blobs, read as a receiver
reads them (size and digest against the manifest, decompression capped relative to the blob
size, every tensor complete), each refused unread when the manifest lists it larger than a
blob of the shard's recorded element count can be. A version listing a parts digest of the
shard (several writers published it without the full state) is checked with the receiver
layout, which only ``--config`` gives (the store records the model's fingerprint, not its
config): without it the sidecar refuses such a store before anything is fetched
(ReceiverLayoutRequiredError, rc 2, naming ``--config``), and a running one stops the same way
when such a version appears.

Every argument is checked before anything is written (the store, ``--dir``, the state
directory): ``--interval`` finite, > 0 and at most a day, ``--iterations`` >= 0, ``--tp``
and ``--ep`` >= 1, the shard and receiver ids safe names (an empty ``--receiver-id`` is
refused, not defaulted), the key file readable, ``--config`` a model config, ``--dir`` a
directory or missing, and ``DIR/<shard>.safetensors`` not a directory; a refusal is a
ConfigError (rc 2) naming the argument. A ``DIR/<shard>.safetensors`` that cannot be used (truncated, not safetensors, a
symlink or other non-file, metadata out of range) is the sidecar's own file gone bad: it is
reported on stderr and replaced from the newest anchor. One holding another layout's tensors,
or another shard's (its metadata names it: TP ranks' files have the same names and shapes), is
refused (it may be another model's weights or another sidecar's file, not this one's to
overwrite).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import stat
import sys
import threading
from pathlib import Path

from deltasync import names
from deltasync.atomic import process_umask, sweep_stale_temps, write_atomic
from deltasync.commands.inspect_store import (
    add_store_arguments,
    check_store_flags,
    local_path,
    local_store_exists,
    open_store_from_args,
    read_key,
    reader_may_leave,
    run_dir_hint,
)
from deltasync.errors import (
    ApplyError,
    BlobLimitError,
    ConfigError,
    DeltaSyncError,
    LayoutMismatchError,
    ReceiverLayoutRequiredError,
)
from deltasync.interrupts import stops_handled_by

META_VERSION = "deltasync_version"
META_DIGEST = "deltasync_state_digest"
META_RUN = "deltasync_run_id"
MAX_BACKOFF_S = 60.0
# The longest --interval: a sidecar that pulls less than daily is a mistake (a typo'd unit, or
# inf), and threading.Event.wait overflows on a timeout beyond the platform's time_t.
MAX_INTERVAL_S = 86400.0
# An anchor blob decompresses to at most this many times its stored size (BF16 weights
# compress ~1.1-1.5x; zero-filled padding far more); a bigger claim is refused, not allocated.
MAX_EXPANSION = 256


class _Stop:
    """SIGINT/SIGTERM set this; the loop ends between pulls. A signal the process started
    with ignored (SIGINT in a script's background job) stays ignored."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:
        self.signal = signum
        self.event.set()


def _check_layout(args, head) -> None:
    """Refuse a store published for another engine/TP/EP than asked, before any fetch."""
    rec = head.layout
    if rec is None:
        return
    asked = (args.engine, args.tp, args.ep)
    if (rec.engine, rec.tp, rec.ep) != asked or args.shard not in rec.shards:
        raise LayoutMismatchError(
            f"the store's version {head.version} was published for {rec.describe()} (shards "
            f"{list(rec.shards)[:8]}); this sidecar was asked for engine {args.engine} "
            f"tp={args.tp} ep={args.ep} shard {args.shard!r}. Nothing was fetched: pass the "
            "publisher's --engine/--tp/--ep and one of its shards"
        )


def _config_layout(args):
    """With ``--config``: (the receiver layout, the shard's local specs); else None.

    Read while the arguments are checked: a bad config file is a refusal, not an error the
    loop retries with backoff forever.
    """
    if not args.config:
        return None
    from deltasync.layout import ReceiverLayout
    from deltasync.layout.files import load_config

    try:
        layout = ReceiverLayout.build(load_config(args.config), args.engine, args.tp, args.ep)
        return layout, layout.local_specs(args.shard)
    except ConfigError:
        raise
    except DeltaSyncError as exc:
        raise ConfigError(f"--config {args.config!r}: {exc}") from None


def _check_parts(args, head, configured) -> None:
    """Refuse, before any fetch, a version whose digest of the shard is a parts digest
    (several writers published it without the full state) when no ``--config`` was given:
    a parts digest is checked with the receiver layout, which only the model config gives
    (the store records its fingerprint, not the config)."""
    from deltasync.layout.digest import is_parts_digest

    listed = head.shard_digests.get(args.shard)
    if configured is None and listed is not None and is_parts_digest(listed):
        raise ReceiverLayoutRequiredError(
            _PARTS_NEED_CONFIG.format(version=head.version, shard=args.shard)
        )


_PARTS_NEED_CONFIG = (
    "version {version} lists a parts digest of shard {shard!r} (several writers published it "
    "without the full state), which is checked with the receiver layout; the store records "
    "only the model's fingerprint, so the sidecar needs the model: nothing was fetched or "
    "written. Pass --config (the model's config.json)"
)


def _specs(args, store, catalog, head, configured):
    """(None, the shard's specs) learned from the newest anchor's blobs, or ``configured``.

    Nothing is known of the shard but what the anchor's manifest records, so each blob is
    read only up to what a shard of the layout record's element count can hold
    (:func:`~deltasync.receiver.staging.numel_blob_bound`); an anchor without that record
    cannot be bounded and is refused.
    """
    from deltasync.commit.model import specs_fingerprint
    from deltasync.format import TensorSpec, decode_blob
    from deltasync.receiver.staging import fetch_blob, numel_blob_bound

    if configured is not None:
        return configured
    anchor = catalog.shard_chain(args.shard, None, head)[0]
    rec = anchor.layout.shards.get(args.shard) if anchor.layout is not None else None
    if rec is None:
        raise ConfigError(
            f"anchor version {anchor.version} records no layout for shard {args.shard!r}, so "
            "the size of its blobs cannot be bounded before they are read; nothing was "
            "fetched: pass --config"
        )
    bound = numel_blob_bound(rec.numel)
    for entry in anchor.blobs_for(args.shard):
        if entry.size > bound:
            # the manifest's size is what fetch_blob reads: bound it before anything is read
            raise BlobLimitError(
                f"anchor version {anchor.version} blob {entry.key!r} is listed at {entry.size} "
                f"bytes, more than any blob of shard {args.shard!r} of {rec.numel} elements "
                f"can hold ({bound} bytes by the manifest's layout record); nothing was "
                "fetched. The manifest is damaged or not the publisher's: pass --config"
            )
    specs: dict[str, TensorSpec] = {}
    budget = 0  # bytes the anchor's blobs may decompress to, in all
    for entry in anchor.blobs_for(args.shard):
        data = fetch_blob(store, anchor, entry)
        decoded = decode_blob(
            data,
            version=anchor.version,
            base_version=-1,
            shard=args.shard,
            max_decompressed_bytes=max(1 << 20, MAX_EXPANSION * len(data)),
        )
        for u in decoded.updates:
            if u.nnz != u.numel and len(anchor.writers) == 1:
                raise ConfigError(
                    f"anchor version {anchor.version} blob {entry.key!r} holds {u.nnz} of the "
                    f"{u.numel} elements of {u.name!r}: an incomplete anchor cannot define the "
                    "shard; pass --config"
                )
            specs[u.name] = TensorSpec(shape=u.shape, dtype=u.dtype)
        budget += MAX_EXPANSION * len(data)
    if not specs:
        raise ConfigError(
            f"the newest anchor (version {anchor.version}) has no blobs for shard {args.shard!r}; "
            f"shards: {list(anchor.shards)}"
        )
    numel = sum(math.prod(s.shape) for s in specs.values())
    if numel * 2 > budget:  # BF16: the tensors would be bigger than the blobs could hold
        raise ConfigError(
            f"anchor version {anchor.version} declares {numel} elements for shard {args.shard!r}, "
            "more than its blobs can hold; refusing to allocate them (pass --config)"
        )
    if rec.numel != numel or rec.specs != specs_fingerprint(specs):
        raise ConfigError(
            f"anchor version {anchor.version}'s blobs for shard {args.shard!r} ({numel} "
            f"elements) disagree with its manifest's layout record ({rec.numel} elements): a "
            "damaged or foreign anchor; pass --config"
        )
    return None, dict(sorted(specs.items()))


def _unusable(path: Path, why: str) -> None:
    """One stderr line per start: the file is replaced, but a user should learn it went bad."""
    _say(f"deltasync pull: {path}: {why}; replacing it from the newest anchor", err=True)


def _file_kind(path: Path) -> int | None:
    """The ``lstat`` mode of ``path`` (None: missing); a directory there is refused.

    The file is the sidecar's and is replaced by a rename, which replaces a symlink or any
    other non-directory entry itself (never what a link points to) but cannot replace a
    directory: that needs the user, so it is a ConfigError naming the path.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot inspect {str(path)!r}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(
            f"{str(path)!r} is a directory where the sidecar keeps the shard's safetensors "
            "file: remove it, or pass another --dir"
        )
    return mode


def _load(path: Path, specs, *, receiver_id: str, shard: str):
    """Tensors and the LocalState the file's metadata records (version None: start over).

    A file that cannot be used is the sidecar's own file gone bad (a crash of another tool,
    a disk error, a hand edit, a link someone put there): it is reported and the receiver
    starts from nothing, so its first pull restores the newest anchor and the write replaces
    the file. The metadata is checked by building the LocalState here, as the state file is
    checked when read: a version the store cannot name or an unsafe run id is the same as no
    metadata, not an error every restart would repeat. Only a file holding other tensors than
    the shard's layout (names, shapes or dtypes) is refused, before anything is written: it may
    be another model's weights, not ours to overwrite.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    from deltasync.errors import ManifestError
    from deltasync.format.updates import check_tensors_match
    from deltasync.receiver import LocalState

    nothing = LocalState(receiver=receiver_id, shard=shard, version=None, state_digest=None)

    def zeros():
        return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}

    mode = _file_kind(path)
    if mode is None:
        return zeros(), nothing
    if not stat.S_ISREG(mode):  # a symlink, FIFO, socket, device: never opened (may block)
        _unusable(path, "not a regular file (a symlink or special file)")
        return zeros(), nothing
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        _unusable(path, f"not a readable safetensors file ({exc})")
        return zeros(), nothing
    try:  # names, shapes and dtypes, before anything (the state directory) is written
        check_tensors_match(tensors, specs, what=repr(str(path)), hint="the shard's names")
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}: the file belongs to another shard or model; move it away or pass another "
            "--dir. Nothing was written"
        ) from None
    if meta.get(names.META_SHARD, shard) != shard:  # same names and shapes: another TP rank's
        raise ConfigError(
            f"{str(path)!r} holds shard {meta[names.META_SHARD][:128]!r}, not {shard!r} (its "
            "deltasync metadata): it is another sidecar's file; move it away or pass another "
            "--dir. Nothing was written"
        )
    if META_VERSION not in meta:
        return tensors, nothing  # not written by the sidecar: verified from an anchor
    try:
        state = LocalState.from_obj(
            {
                "receiver": receiver_id,
                "shard": shard,
                "version": int(meta[META_VERSION]),
                "state_digest": meta.get(META_DIGEST),
                "dirty": False,
                **({"run_id": meta[META_RUN]} if META_RUN in meta else {}),
            }
        )
    except (ValueError, ManifestError) as exc:
        _unusable(path, f"its deltasync metadata is invalid ({exc})")
        return tensors, nothing
    return tensors, state


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a file replaced or written since: device, inode, size and modification
    time in nanoseconds (None: no file there)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _ShardFile:
    """The sidecar's file, and the identity it had when the sidecar last wrote or read it:
    a file edited, replaced or removed behind the sidecar is told by its identity and
    rewritten from the verified tensors in memory, not left wrong until the next version."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.known = _identity(path)

    def write(self, tensors, version: int, digest: str, shard: str, run_id: str | None) -> None:
        _write(self.path, tensors, version, digest, shard, run_id)
        self.known = _identity(self.path)

    def changed(self) -> bool:
        return _identity(self.path) != self.known

    def keep(self, receiver, shard: str) -> bool:
        """Rewrite the file from the verified tensors in memory if it was edited, replaced or
        removed behind the sidecar (True: it was). A rewrite that fails withdraws the
        sidecar's registration first (the file no longer holds the version it names; a
        heartbeat of it would keep a trainer counting this receiver as current) and raises;
        the next pull retries it before anything else.

        While the tensors hold a newer version that persisting failed to write, they cannot
        rewrite the version the file named: the receiver is invalidated instead (it reports
        no version, its registration withdrawn), and the next pull replays that version's
        journal and writes the file with it."""
        version = receiver.version
        if version is None or not self.changed():
            return False
        pending = receiver.unpersisted_version
        if pending is not None:
            receiver.invalidate(
                f"{self.path} no longer holds version {version} (edited, replaced or removed "
                f"behind the sidecar) while the tensors hold version {pending}, not yet "
                "written there"
            )
            return False
        try:
            self.write(receiver.tensors, version, receiver.state_digest, shard, receiver.run_id)
        except ApplyError as exc:
            receiver.deregister()
            raise ApplyError(
                f"{self.path} no longer holds version {version} (edited, replaced or removed "
                f"behind the sidecar), and rewriting it failed: {exc.__cause__ or exc}. The "
                "sidecar's registration is withdrawn until the rewrite lands; it retries"
            ) from exc
        return True


_SAFETENSORS_DTYPES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.int32": "I32",
    "torch.int64": "I64",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float64": "F64",
}


def _safetensors_chunks(tensors, meta: dict[str, str]):
    """The safetensors file of ``tensors`` as chunks: its header, then each tensor's bytes
    as a view of its memory (no copy of the shard, and no temp file of safetensors' own,
    which a kill would leave where no sweep looks)."""
    import torch

    header: dict[str, object] = {"__metadata__": meta}
    offset, order = 0, sorted(tensors)
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[str(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the tensors start 8-byte aligned
    yield len(data).to_bytes(8, "little") + data
    for name in order:
        yield tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().data


def _write(path: Path, tensors, version: int, digest: str, shard: str, run_id: str | None):
    meta = {META_VERSION: str(version), META_DIGEST: digest, names.META_SHARD: shard}
    if run_id is not None:
        meta[META_RUN] = run_id
    umask = process_umask()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # --dir removed behind the sidecar
        # readable by the engine's user, as the umask allows
        write_atomic(path, _safetensors_chunks(tensors, meta), mode=0o666 & ~umask)
    except OSError as exc:  # a full disk, permissions, a directory that cannot be made
        raise ApplyError(
            f"could not write version {version} of shard {shard!r} to {path} "
            f"({type(exc).__name__}: {exc.strerror or exc}). Free space or fix the "
            "directory's permissions: the sidecar retries"
        ) from exc


def _say(line: str, *, err: bool = False) -> None:
    """One line of the sidecar's log. A log reader that went away costs the log, not the
    sidecar: its real output is the file and the acks."""
    stream = sys.stderr if err else sys.stdout
    with reader_may_leave(stream):
        print(line, file=stream, flush=True)


def _start(args, store, config, configured, stop: _Stop):
    """Wait for the first commit, check the layout, load the file: the Receiver."""
    from deltasync.commit import Catalog
    from deltasync.receiver import Receiver, StateDir
    from deltasync.receiver.store_receiver import check_published_for

    catalog = Catalog(store, signing_key=config.signing_key)
    waited = False
    while True:
        head = catalog.head()
        if head is not None:
            break
        if args.once:
            raise ConfigError(
                f"the store has no committed version yet (nothing to pull){run_dir_hint(args)}"
            )
        if not waited:
            _say(
                f"deltasync pull: waiting for the first committed version in {args.store}"
                f"{run_dir_hint(args)}"
            )
            waited = True
        if stop.event.wait(args.interval):
            return None, None
    _check_layout(args, head)
    _check_parts(args, head, configured)
    layout, specs = _specs(args, store, catalog, head, configured)
    check_published_for(head, args.shard, specs, layout)  # --config's model, before any write
    out_dir = Path(args.dir)
    path = out_dir / f"{args.shard}.safetensors"
    tensors, state = _load(path, specs, receiver_id=config.receiver_id, shard=args.shard)
    file = _ShardFile(path)  # what was loaded: its identity from here
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, no permission (checked early; raced)
        raise ConfigError(
            f"cannot create --dir {args.dir!r}: {exc.strerror or exc}; pass a directory "
            "(created if missing) the sidecar may write"
        ) from None
    # The in-memory tensors are exactly the file: seed the receiver's state from it and drop
    # any journal of an earlier sidecar process (its half-applied tensors died with it).
    state_dir = StateDir(out_dir / f".{args.shard}.deltasync")
    state_dir.lock(  # before anything of it is written
        f"this sidecar of {str(path)!r}", "Stop the other sidecar, or pass another --dir"
    )
    sweep_stale_temps([path])  # a shard file's worth per write a kill cut short
    state_dir.clear_journal()
    state_dir.write_state(state)

    def persist(tensors, held) -> None:  # before the ack: the file is what engines read
        file.write(tensors, held.version, held.state_digest, args.shard, held.run_id)

    receiver = Receiver(
        store,
        shard=args.shard,
        tensors=tensors,
        state_dir=str(state_dir.path),
        config=config,
        specs=specs,
        layout=layout,
        register=False,
        persist=persist,
    )
    if receiver.dirty:
        _say(f"{path}: contents do not match its recorded version; restoring an anchor")
    _say(
        f"deltasync pull: {path} for shard {args.shard!r} of {head.layout.describe() if head.layout else 'an unrecorded layout'}"
        f" (run {head.run_id}); engines reload it from disk (see `deltasync pull --help`)"
    )
    return receiver, file


def default_receiver_id(shard: str, directory: str | os.PathLike[str]) -> str:
    """The id the sidecar of ``shard`` writing into ``directory`` acks and registers as when
    ``--receiver-id`` is not given: the one its state dir there records (a restarted sidecar,
    in a new container too, takes over its own registration; one that ran under the former
    default ``pull-<shard>`` keeps it), else a new ``pull-<shard>-<random>``, recorded there by
    its first start. See the module docstring."""
    recorded = _recorded_receiver(Path(directory) / f".{shard}.deltasync", shard)
    if recorded is not None:
        return recorded
    name = f"pull-{shard}-{secrets.token_hex(4)}"
    if len(name) > names.MAX_TOKEN:  # a long shard id
        name = f"pull-{secrets.token_hex(8)}"
    return name


def _recorded_receiver(state_dir: Path, shard: str) -> str | None:
    """The receiver id ``state_dir``'s state file records for ``shard``, if one can be read
    (read only: nothing is written before every argument is checked)."""
    from deltasync.atomic import read_record
    from deltasync.errors import LocalStateError, ManifestError
    from deltasync.receiver import LocalState

    try:
        state = LocalState.from_obj(read_record(state_dir / names.STATE_FILE, follow_links=False))
    except (LocalStateError, ManifestError, OSError):  # none yet, or not one to trust
        return None
    return state.receiver if state.shard == shard else None


def _check_args(args: argparse.Namespace):
    """Check every argument before anything is written: (the ReceiverConfig, ``--config``'s
    layout and specs or None).

    A refusal after the store, ``--dir`` or the state directory was touched would leave a
    stray directory, or a state file for a receiver that never ran; so the key file is read,
    the receiver id checked (by building the ReceiverConfig) and ``--config`` read before the
    store is opened, and the paths are only looked at here.
    """
    from deltasync import names
    from deltasync.errors import ManifestError
    from deltasync.receiver import ReceiverConfig

    if not (math.isfinite(args.interval) and 0 < args.interval <= MAX_INTERVAL_S):
        raise ConfigError(
            f"--interval must be a number of seconds > 0 and <= {MAX_INTERVAL_S:.0f} (a day), "
            f"got {args.interval}"
        )
    if args.iterations < 0:
        raise ConfigError(
            f"--iterations must be >= 0 (0 = pull until stopped), got {args.iterations}"
        )
    check_store_flags(args)
    try:
        names.check_token("--shard", args.shard)
    except ManifestError as exc:
        raise ConfigError(str(exc)) from None
    for flag, value in (("--tp", args.tp), ("--ep", args.ep)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (the publisher's {flag}), got {value}")
    if args.receiver_id is not None and not args.receiver_id.strip():
        # an unset variable in a script (--receiver-id "$ID") must not become the default id
        raise ConfigError(
            "--receiver-id is empty: give the id this sidecar acks as, or leave the flag out "
            f"for the default {default_receiver_id(args.shard, args.dir)}"
        )
    config = ReceiverConfig(
        receiver_id=args.receiver_id or default_receiver_id(args.shard, args.dir),
        signing_key=read_key(args),
    )
    remedy = (
        f"pass the directory that holds (or will hold) {args.shard}.safetensors; it is "
        "created if missing"
    )
    try:
        st = os.stat(args.dir)
    except FileNotFoundError:
        st = None  # created once the store has a version
    except OSError as exc:  # ENOTDIR: a parent is a file; EACCES
        raise ConfigError(f"--dir {args.dir!r} cannot be used ({exc.strerror}): {remedy}") from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"--dir {args.dir!r} is not a directory: {remedy}")
        _file_kind(Path(args.dir) / f"{args.shard}.safetensors")  # a directory there: refused
    return config, _config_layout(args)


def _open_store(args: argparse.Namespace, stop: _Stop):
    """The store; None when stopped while waiting for a local store's directory to appear.

    Never creates a local store's directory: a typo would leave a stray directory and a
    sidecar waiting on it forever. With ``--once`` a missing directory is refused; a loop
    (started before the trainer, the normal order) waits for the trainer to create it.
    """
    if local_path(args.store) is not None and not args.once and not local_store_exists(args):
        _say(f"deltasync pull: waiting for the store directory {args.store} to be created")
        while not local_store_exists(args, waiting=True):
            if stop.event.wait(args.interval):
                return None
    return open_store_from_args(args, must_exist=True)


def _run(args: argparse.Namespace) -> int:
    config, configured = _check_args(args)
    stop = _Stop()
    with stops_handled_by(stop):
        return _loop(args, config, configured, stop)


def _loop(args: argparse.Namespace, config, configured, stop: _Stop) -> int:
    store = _open_store(args, stop)
    if store is None:
        _say("deltasync pull: stopped before the store was created")
        return 0
    receiver = file = None
    done = failures = 0
    last_error = None
    while not stop.event.is_set():
        try:
            if receiver is None:  # the start is retried like a pull: a damaged store heals
                receiver, file = _start(args, store, config, configured, stop)
                if receiver is None:
                    _say("deltasync pull: stopped before the first commit")
                    return 0
            # Temp files of writes killed shortly before this start (kept then: they could be
            # a write in progress) go once they are STALE_TEMP_S old; otherwise each would
            # hold a shard's worth of --dir for as long as this sidecar runs.
            sweep_stale_temps([file.path])
            # The file first: the pull heartbeats the registration of the version held
            rewritten = file.keep(receiver, args.shard)
            report = receiver.pull()  # writes the file (persist) before acking the version
            if file.keep(receiver, args.shard) or rewritten:  # also written during the pull
                _say(
                    f"{file.path}: edited, replaced or removed behind the sidecar; rewritten "
                    f"with version {report.version}"
                )
            if last_error is not None:
                _say(f"deltasync pull: recovered after {failures} failed attempt(s)")
            if report.changed or done == 0 or last_error is not None:
                _say(
                    f"version {report.version} (from {report.previous_version}, applied "
                    f"{list(report.chain)}): {report.bytes_fetched} bytes, "
                    f"{report.elements_written} elements, pause {report.pause_s * 1e3:.2f} ms, "
                    f"total {report.total_s * 1e3:.1f} ms -> {file.path}"
                )
            failures, last_error = 0, None
        except ReceiverLayoutRequiredError as exc:
            # a later version a receiver without the layout cannot check: name the flag
            raise ReceiverLayoutRequiredError(
                f"{exc}. For this sidecar: nothing was written; restart it with --config "
                "(the model's config.json)"
            ) from None
        except ConfigError:
            raise  # a bad argument: waiting does not change it
        except LayoutMismatchError:
            raise  # another layout: waiting does not change it
        except DeltaSyncError as exc:
            if receiver is not None and (receiver.version is None or receiver.dirty):
                receiver.deregister()  # never leave a registration without a verified version
            if args.once:
                raise
            failures += 1
            line = f"{type(exc).__name__}: {exc}"
            if line != last_error:  # one line per change of state, not one per attempt
                _say(f"deltasync pull: {line} (retrying with backoff)", err=True)
                last_error = line
        done += 1
        if args.once or (args.iterations and done >= args.iterations):
            break
        delay = (
            min(MAX_BACKOFF_S, args.interval * 2 ** min(failures, 16))
            if failures
            else args.interval
        )
        if stop.event.wait(delay):
            break
    if stop.signal is not None:
        _say(f"deltasync pull: stopped by signal {signal.Signals(stop.signal).name}")
        return 0
    if last_error is not None:  # --iterations ran out while failing: a script must see it
        _say(
            f"deltasync pull: stopped after {done} pull(s), the last {failures} of them failed "
            f"({last_error})",
            err=True,
        )
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="sidecar: keep DIR/<shard>.safetensors at the newest committed version",
        description="Keep a local safetensors copy of one receiver shard current: wait for the "
        "first commit, bootstrap from the newest anchor, then apply deltas; the file is "
        "replaced atomically after each verified version. With --engine hf the file is an "
        "HF-format checkpoint (transformers from_pretrained, engines loading HF safetensors); "
        "with --engine vllm it holds the vLLM worker's own parameter names for that rank "
        "(reload it with deltasync's vLLM backend or a by-name loader).",
    )
    add_store_arguments(p)
    p.add_argument("--engine", choices=("hf", "vllm"), default="vllm", help="receiver convention")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (1 = off)")
    p.add_argument("--shard", required=True, help="receiver shard id, e.g. tp0 or tp1-ep0")
    p.add_argument("--dir", required=True, help="directory of <shard>.safetensors")
    p.add_argument(
        "--config",
        help="transformers config.json (checks the layout; a regular file of at most 4 MiB)",
    )
    p.add_argument(
        "--receiver-id",
        help="id in acks and registrations (default pull-<shard>-<random>, made at the first "
        "start and kept in --dir)",
    )
    p.add_argument("--once", action="store_true", help="pull once and exit")
    p.add_argument(
        "--interval",
        type=float,
        default=5.0,
        help=f"seconds between pulls, > 0 and at most {MAX_INTERVAL_S:.0f} (a day); default 5",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="stop after K >= 0 pulls (0 = never); exit 1 if the last one failed",
    )
    p.set_defaults(func=_run)
