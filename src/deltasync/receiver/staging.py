"""Staging: everything a pull does BEFORE the first write into live tensors.

- :func:`check_chain`: the chain starts where the tensors are (an anchor, or a delta whose
  base is the local version) and every later step builds on the one before; a wrong base is
  refused here, before anything is fetched;
- :func:`fetch_blob`: one blob's bytes, checked against its manifest entry (present, exact
  size, digest), as ``pull`` and ``inspect`` read them too; it reads the size the manifest
  lists, so every caller first bounds that size (:func:`blob_bound` of the local tensors, or
  :func:`numel_blob_bound` of the shard's size in the layout record);
  :func:`check_blob_in_parts` makes the same checks a part at a time, keeping no bytes
  (the reads of a spill, below, without the file);
- :func:`spill_plan`, :func:`spill_blob`: a chain whose blobs exceed the pull's staged
  budget keeps its largest blobs out of memory: each is fetched in ranges into a private
  unlinked file (its size and digest checked as it streams; then read by the pull from that
  file alone, never from the store again), or held in memory as before when the file cannot
  be written;
- :func:`open_version`: fetch this shard's blobs of one version and verify each against the
  manifest (present, exact size, xxh3-128 digest) and then its own digest, header and trailer
  (:class:`deltasync.format.decode.BlobRecords` with the shard's expected tensor specs,
  version, base and shard; writer id), without decoding the records: a pull reads them one
  tensor at a time (verify before write, then the scatter), and every record is validated by
  the first of those reads, before any write;
- :func:`fetch_version`: the same, decoded whole and merged per tensor
  (:func:`deltasync.format.merge_writers`); an anchor must then hold values for every local
  tensor.

The engine keeps serving during all of this; only the final scatter pauses it. This module
knows manifests, blobs and TensorUpdate; it never touches live tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from typing import BinaryIO

import torch
import xxhash

from deltasync.commit import BlobEntry, Manifest, blob_digest
from deltasync.commit.model import blob_hasher
from deltasync.errors import (
    BaseVersionMismatchError,
    BlobLimitError,
    BlobMismatchError,
    DigestMismatchError,
    FormatError,
    KeyNotFoundError,
    ManifestError,
    MissingBlobError,
    ObjectTooLargeError,
    StoreError,
    TruncatedBlobError,
)
from deltasync.format import TensorSpec, TensorUpdate, merge_writers
from deltasync.format.decode import BlobRecords, restated
from deltasync.format.merge import check_anchor_complete
from deltasync.format.section import FileSpan
from deltasync.format.wire import DIGEST_SIZE, MAX_RECORDS
from deltasync.scratch import scratch_file
from deltasync.store import Store

log = logging.getLogger(__name__)

SPILL_PART = 4 << 20  # bytes per ranged read of a blob being spilled to its file
SPILL_MIN = 1 << 20  # a pull that spills spills every blob from this size (a file each)


def check_chain(manifests: Sequence[Manifest], from_version: int | None, shard: str) -> None:
    """Refuse a chain that does not start at ``from_version`` (None: only an anchor can start
    it) or whose steps do not follow each other, or that does not define ``shard``."""
    if not manifests:
        raise ManifestError("empty chain: nothing to apply")
    prev = from_version
    for i, m in enumerate(manifests):
        if shard not in m.shard_digests:
            raise ManifestError(
                f"version {m.version} does not define receiver shard {shard!r} (it has "
                f"{list(m.shard_digests)[:8]}): this store is published for another layout"
            )
        if m.kind == "anchor":
            if i:
                raise ManifestError(f"anchor {m.version} in the middle of a chain: plan it first")
        elif prev is None:
            raise BaseVersionMismatchError(
                f"delta version {m.version} (base {m.base_version}) cannot be applied on tensors "
                "that hold no verified version; restore an anchor first"
            )
        elif m.base_version != prev:
            raise BaseVersionMismatchError(
                f"delta version {m.version} applies on base {m.base_version}, but the tensors "
                f"hold version {prev}; refusing it before any write (replay the versions in "
                "between or restore the newest anchor)"
            )
        prev = m.version


def fetch_blob(store: Store, manifest: Manifest, entry: BlobEntry) -> bytes:
    """The bytes of one blob of ``manifest``, checked against its entry: present, exactly the
    listed size, the listed digest. Nothing is decoded here."""
    where = f"version {manifest.version} blob {entry.key!r}"
    try:
        data = store.get(entry.key, max_bytes=entry.size)  # refused by its size, unread
    except KeyNotFoundError:
        raise _missing(where) from None
    except ObjectTooLargeError:
        raise _too_large(where, entry.size) from None
    if len(data) != entry.size:
        raise _wrong_size(where, len(data), entry.size)
    if blob_digest(data) != entry.digest:
        raise _wrong_digest(where, entry.digest)
    return data


def check_blob_in_parts(store: Store, manifest: Manifest, entry: BlobEntry, part: int) -> None:
    """:func:`fetch_blob`'s checks (same errors), reading the blob ``part`` bytes at a time and
    keeping none of them (``deltasync inspect`` only needs the digest)."""
    _stream_into(store, manifest, entry, part, None)


def spill_plan(blobs: Sequence[BlobEntry], budget: int) -> set[str]:
    """Keys of the ``blobs`` (a chain's, of one shard) that a pull spills to files: none when
    they fit ``budget`` bytes together (the in-memory path, unchanged); else every blob of
    SPILL_MIN bytes or more (a catch-up's deltas too: held, they were the largest part of its
    peak after the anchor's), and then the largest of the smaller ones until those left in
    memory fit the budget."""
    held = sum(b.size for b in blobs)
    if held <= budget:
        return set()
    out = {b.key for b in blobs if b.size >= SPILL_MIN}
    held -= sum(b.size for b in blobs if b.key in out)
    for b in sorted(blobs, key=lambda b: b.size, reverse=True):
        if held <= budget:
            break
        if b.key not in out:
            out.add(b.key)
            held -= b.size
    return out


class _SpillFailed(Exception):
    """The spill file could not be written (ENOSPC, EDQUOT, a read-only dir): the cause."""


def spill_blob(
    store: Store,
    manifest: Manifest,
    entry: BlobEntry,
    directory: str,
    files: contextlib.ExitStack,
    *,
    part: int | None = None,
) -> FileSpan | bytes:
    """One blob of ``manifest``, with :func:`fetch_blob`'s checks (same errors), fetched
    ``part`` bytes (default SPILL_PART) at a time into a private unlinked file in
    ``directory``, whose closing ``files`` owns: the store's object is read once, and the
    pull reads the file this process wrote and hashed, so a store object changed meanwhile
    cannot reach the tensors.
    A file that cannot be written, or a dir without room for it and
    :data:`deltasync.scratch.HEADROOM` more (the pull's journal and state file are written
    there while the file is open), falls back to :func:`fetch_blob` (in memory, as a pull
    within budget), with a warning naming the dir and the remedy."""
    try:
        # unbuffered: a write error (ENOSPC) is raised by the write that meets it
        f = scratch_file(directory, entry.size, buffering=0)
    except OSError as exc:
        return _held_instead(store, manifest, entry, directory, exc)
    try:
        sealed = _stream_into(store, manifest, entry, SPILL_PART if part is None else part, f)
    except _SpillFailed as exc:
        f.close()
        return _held_instead(store, manifest, entry, directory, exc.__cause__)
    except BaseException:
        f.close()
        raise
    if not sealed:
        # Its own trailer digest does not match though the manifest's did (the writer's
        # fault): the checked bytes, in memory, whose checks name the fault as for a blob
        # fetched in memory (a blob read from its file is not hashed again).
        with f:
            return bytes(FileSpan(f, 0, entry.size))
    files.callback(f.close)
    return FileSpan(f, 0, entry.size)


def _stream_into(
    store: Store, manifest: Manifest, entry: BlobEntry, part: int, f: BinaryIO | None
) -> bool:
    """Read the blob ``part`` bytes at a time with fetch_blob's checks (raised as it raises
    them), writing it into ``f`` unless None; return whether the blob's own digest (xxh3-128
    of all but its last DIGEST_SIZE bytes, which hold it) matches too, computed in the same
    pass (True without ``f``: a blob only checked is never decoded from these bytes)."""
    where = f"version {manifest.version} blob {entry.key!r}"
    h = blob_hasher()
    own, tail = xxhash.xxh3_128(), b""
    try:
        size = store.size(entry.key)
        if size > entry.size:
            raise _too_large(where, entry.size)
        for start in range(0, size, part):
            n = min(part, size - start)
            try:
                data = store.get_range(entry.key, start, n)
            except KeyNotFoundError:
                raise
            except StoreError as exc:
                # A range past the object's end (every store raises that, never answers
                # short): the object changed size since it was measured, replaced or cut
                # short in storage; named as fetch_blob names it, not as a store fault.
                now = store.size(entry.key)
                if now == size:
                    raise
                raise _wrong_size(where, now, entry.size) from exc
            if len(data) != n:  # a store that answers a short range: the object shrank
                raise _wrong_size(where, start + len(data), entry.size)
            h.update(data)
            if f is None:
                continue
            sealed_at = size - DIGEST_SIZE  # the blob's own digest covers the bytes before it
            own.update(memoryview(data)[: max(0, sealed_at - start)])
            tail += data[max(0, sealed_at - start) :]
            view = memoryview(data)
            try:
                while view:
                    view = view[f.write(view) :]
            except OSError as exc:
                raise _SpillFailed() from exc
    except KeyNotFoundError:
        raise _missing(where) from None
    if size != entry.size:
        raise _wrong_size(where, size, entry.size)
    if h.hexdigest() != entry.digest:
        raise _wrong_digest(where, entry.digest)
    return f is None or (size >= DIGEST_SIZE and own.digest() == tail)


def _held_instead(
    store: Store,
    manifest: Manifest,
    entry: BlobEntry,
    directory: str,
    exc: BaseException | str | None,
) -> bytes:
    log.warning(
        "version %d blob %r: cannot spill it to a temporary file in %r (%s); holding it in "
        "memory instead (%d more bytes at the pull's peak). Free space in that dir (the "
        "receiver's state dir), or let this process write there",
        manifest.version,
        entry.key,
        directory,
        exc,
        entry.size,
    )
    return fetch_blob(store, manifest, entry)


def _missing(where: str) -> MissingBlobError:
    return MissingBlobError(
        f"{where} is listed in the committed manifest but missing from the store "
        "(deleted by retention or never uploaded); nothing was applied"
    )


def _too_large(where: str, listed: int) -> FormatError:
    return FormatError(
        f"{where} is larger than the manifest's {listed} bytes: extended in storage, "
        f"or replaced by another blob; not read, nothing was applied. {_REMEDY}"
    )


def _wrong_size(where: str, size: int, listed: int) -> FormatError:
    cls = TruncatedBlobError if size < listed else FormatError
    return cls(
        f"{where} is {size} bytes but the manifest says {listed}: "
        f"{'truncated' if size < listed else 'extended'} in storage or transit, or replaced "
        f"by another blob; nothing was applied. {_REMEDY}"
    )


def _wrong_digest(where: str, listed: str) -> DigestMismatchError:
    return DigestMismatchError(
        f"{where} does not match the manifest's digest {listed}: corrupted, or replaced by "
        f"another blob (a replay or a racing publisher); nothing was applied. {_REMEDY}"
    )


# What to do about a damaged blob: damage in transit is gone at the next pull; damage in
# storage stays in every chain through the version until an anchor after it.
_REMEDY = (
    "Pull again (damage in transit); damaged in storage, the blob keeps every receiver below "
    "this version until the trainer publishes an anchor past it (step_published(v, "
    "anchor=True)) or the blob is restored"
)


# What blob_bound allows beyond the elements: a record head (name, shape) per tensor, and
# the blob's framing (header, ids, segment heads, trailer, digest).
_RECORD_HEAD_BYTES = 4096
_FRAMING_BYTES = 1 << 20
# The widest value a record holds (fp32), for a bound that does not know the dtypes.
_WIDEST_VALUE_BYTES = 4


def blob_bound(specs: Mapping[str, TensorSpec]) -> int:
    """The most bytes a blob for the local tensors ``specs`` can take, compressed or not:
    each element at most once, with its value and an 8-byte index, each tensor's record head
    (name, shape), and the blob's framing."""
    elements = sum(
        math.prod(s.shape) * (torch.empty((), dtype=s.dtype).element_size() + 8)
        for s in specs.values()
    )
    return elements + _RECORD_HEAD_BYTES * len(specs) + _FRAMING_BYTES


def version_blob_bound(specs: Mapping[str, TensorSpec], blobs: int) -> int:
    """The most bytes ``blobs`` blobs of one version for the local tensors ``specs`` can take
    together: the writers of a version list disjoint elements (each element once in all, as
    :func:`blob_bound` counts it), and each blob has its own record heads and framing. Each
    blob is held until the version's blobs are all read, so their sum is what a pull holds."""
    return blob_bound(specs) + max(blobs - 1, 0) * (
        _RECORD_HEAD_BYTES * len(specs) + _FRAMING_BYTES
    )


def numel_blob_bound(numel: int) -> int:
    """:func:`blob_bound` for a shard known only by its element count (a manifest's layout
    record), as readers that have no tensor specs know it: every element at the widest
    value with its index, and a record head per tensor, of which a blob holds at most one
    per element and at most MAX_RECORDS. Looser than :func:`blob_bound` of the same shard, and
    never below it when each of the shard's tensors holds an element."""
    heads = _RECORD_HEAD_BYTES * min(numel, MAX_RECORDS)
    return numel * (_WIDEST_VALUE_BYTES + 8) + heads + _FRAMING_BYTES


def open_version(
    store: Store,
    manifest: Manifest,
    shard: str,
    specs: Mapping[str, TensorSpec],
    *,
    max_decompressed_bytes: int = 1 << 36,
    narrow_indices: bool = False,
    spill: Collection[str] = (),
    spill_dir: str | None = None,
    files: contextlib.ExitStack | None = None,
) -> tuple[list[BlobRecords], int]:
    """This shard's blobs of ``manifest``, fetched and verified (size, digest, header, trailer,
    writer id) but not decoded: their records are read by iterating them (against ``specs``;
    with ``narrow_indices``, int32 indices where a tensor allows), and the bytes fetched.
    The blobs whose keys are in ``spill`` are fetched into private files in ``spill_dir``
    (:func:`spill_blob`), closed by ``files``."""
    out: list[BlobRecords] = []
    fetched = 0
    base = -1 if manifest.kind == "anchor" else manifest.base_version
    bound = blob_bound(specs)
    max_decompressed_bytes = min(max_decompressed_bytes, bound)
    entries = manifest.blobs_for(shard)
    listed, total = sum(e.size for e in entries), version_blob_bound(specs, len(entries))
    if len(entries) > 1 and listed > total:  # one blob: its own bound below names it
        # each blob below passes its own bound, but all of them are held at once: an unsigned
        # manifest listing many writers' blobs would otherwise cost that many shards of memory
        raise BlobLimitError(
            f"version {manifest.version} lists {len(entries)} blobs of shard {shard!r} "
            f"totalling {listed} bytes, more than the blobs of one version can hold together "
            f"({total} bytes: every element once, with its index, and each blob's framing); "
            "none was read, nothing was applied. The manifest or the layout is not this "
            "receiver's"
        )
    for entry in entries:
        where = f"version {manifest.version} blob {entry.key!r}"
        if entry.size > bound:
            # the manifest's size is all an unsigned store vouches for: never read more than
            # a blob of this shard can hold
            raise BlobLimitError(
                f"{where} is listed at {entry.size} bytes, more than any blob of shard "
                f"{shard!r} can hold ({bound} bytes: every element once, with its index); "
                "not read, nothing was applied. The manifest or the layout is not this "
                "receiver's"
            )
        if entry.key in spill:
            assert spill_dir is not None and files is not None, "a spill needs a dir and owner"
            data: FileSpan | bytes = spill_blob(store, manifest, entry, spill_dir, files)
        else:
            data = fetch_blob(store, manifest, entry)
        fetched += len(data)
        try:
            records = BlobRecords(
                data,
                expected=specs,
                version=manifest.version,
                base_version=base,
                shard=shard,
                max_decompressed_bytes=max_decompressed_bytes,
                narrow_indices=narrow_indices,
            )
        except BlobLimitError:
            raise  # a limit of this receiver's (max_decompressed_bytes), named as such
        except FormatError as exc:
            # Its bytes are the ones the manifest lists: fetching it again gives them again.
            raise restated(
                exc,
                where,
                ". These bytes match the manifest's digest, so the publisher (or someone who "
                "rewrote the manifest too) stored them so: the version cannot be applied; "
                "nothing was applied",
            ) from exc
        if records.header.writer != entry.writer:
            raise BlobMismatchError(
                f"{where} was written by {records.header.writer!r}, the manifest says "
                f"{entry.writer!r}: a blob copied from another writer; nothing was applied"
            )
        out.append(records)
    return out, fetched


def fetch_version(
    store: Store,
    manifest: Manifest,
    shard: str,
    specs: Mapping[str, TensorSpec],
    *,
    max_decompressed_bytes: int = 1 << 36,
) -> tuple[list[TensorUpdate], int]:
    """Verified, decoded updates of ``shard`` in ``manifest`` (one per local tensor) and the
    bytes fetched: the whole version decoded at once (a pull streams it instead, see
    :func:`open_version`)."""
    blobs, fetched = open_version(
        store, manifest, shard, specs, max_decompressed_bytes=max_decompressed_bytes
    )
    merged = merge_writers(manifest.version, [list(b) for b in blobs])
    if manifest.kind == "anchor":
        check_anchor_complete(manifest.version, {u.name for u in merged}, specs, shard)
    return merged, fetched
