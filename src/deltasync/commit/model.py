"""The manifest: the one record that makes a version visible.

A version exists for a receiver only once ``v{version}/MANIFEST.json`` is committed; blobs
without a manifest are ignored. The manifest lists every blob (receiver shard, writer, key,
size, digest, elements sent) and the digest of each receiver shard's full state after applying
the version, so a receiver can check, before it writes, that it will end where the trainer
meant it to.

A version is known by its lineage as well as its number:

- ``run_id``: a token chosen when a lineage starts (the first anchor of a store, or an
  anchor of a publisher that could not verify its baseline against the store), carried by
  every later version of that lineage. It names when the lineage started
  (:func:`new_run_id`: ``r`` + milliseconds + ``-`` + a random part), so runs are ordered
  (:func:`run_started_ms`; None for a run id of the releases before, which were random);
- ``base_digests`` (deltas): each shard's state digest of the base version, i.e. the exact
  state the delta applies to. A receiver uses its local state as the base only when its
  version AND its digest are the ones named here.

``layout`` (:class:`LayoutRecord`) records the receiver layout the version was built for
(engine, TP, EP, a fingerprint of the model config, and per shard fingerprints of its tensor
specs and of its placements (which block of which canonical tensor lands where) and its
element count), so a receiver built for another layout, or for the same tensors placed
differently, is refused before it fetches anything, and ``inspect`` computes density without reading a blob.

Parsing is strict because the store may be shared with (or written by) someone hostile: every
key must be exactly ``names.blob_key(version, shard, writer)`` (so no path traversal), sizes
are bounded by :class:`ManifestLimits`, blob digests are 64 hex characters (BLAKE2b-256) and
state digests 32 (xxh3-128), unknown fields and duplicate JSON keys are rejected. A Manifest
object is valid by construction.

This module knows nothing about stores, tensors or signing keys (see ``signing.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from deltasync import names
from deltasync.commit.canonical import (
    SIGNATURE_RE,
    canonical_json,
    check_blob_digest,
    check_choice,
    check_digest,
    check_int,
    check_time,
    expect_fields,
    strict_loads,
)
from deltasync.commit.planning import ChainLink, VersionInfo
from deltasync.errors import ConfigError, ManifestError
from deltasync.format import TensorSpec

KINDS = ("delta", "anchor")
MAX_FORMAT_VERSION = 2**16 - 1


def blob_hasher() -> Any:
    """The streaming hasher of :func:`blob_digest` (``update`` chunk by chunk, ``hexdigest``)."""
    return hashlib.blake2b(digest_size=32)


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex BLAKE2b-256 of a blob's bytes, as listed in the manifest. Collision resistant (unlike
    the xxh3-128 transit digest in the blob's trailer), so a signature over the manifest binds
    every blob byte."""
    h = blob_hasher()
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class ManifestLimits:
    """Bounds a reader enforces before trusting a manifest."""

    max_manifest_bytes: int = 64 * 2**20
    max_blobs: int = 1_000_000
    max_blob_bytes: int = 64 * 2**30

    def __post_init__(self) -> None:
        for name in ("max_manifest_bytes", "max_blobs", "max_blob_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ManifestLimits.{name} must be an int >= 1, got {value!r}")


DEFAULT_LIMITS = ManifestLimits()
_MAX_SIZE = 2**63 - 1  # what the type allows; readers apply ManifestLimits on top


@dataclass(frozen=True, kw_only=True)
class BlobEntry:
    """One blob of a version: the changes ``writer`` sends to receiver shard ``shard``."""

    shard: str
    writer: str
    key: str
    size: int
    digest: str
    elements: int | None = None  # elements the blob carries (density); None: not recorded

    def check(self, version: int, *, what: str = "blob") -> None:
        names.check_token("shard", self.shard)
        names.check_token("writer", self.writer)
        expected = names.blob_key(version, self.shard, self.writer)
        if self.key != expected:
            raise ManifestError(
                f"{what} key {self.key!r} is not the key of version {version}, shard "
                f"{self.shard!r}, writer {self.writer!r} (expected {expected!r})"
            )
        check_int(self.size, what=f"{what} {self.key!r} size", lo=1, hi=_MAX_SIZE)
        check_blob_digest(self.digest, what=f"{what} {self.key!r} digest")
        if self.elements is not None:
            check_int(self.elements, what=f"{what} {self.key!r} elements", lo=0, hi=_MAX_SIZE)

    def to_dict(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "shard": self.shard,
            "writer": self.writer,
            "key": self.key,
            "size": self.size,
            "digest": self.digest,
        }
        if self.elements is not None:
            obj["elements"] = self.elements
        return obj

    @classmethod
    def from_dict(cls, obj: Any, *, what: str = "blob") -> BlobEntry:
        expect_fields(
            obj,
            what=what,
            required={"shard", "writer", "key", "size", "digest"},
            optional={"elements"},
        )
        for f in ("shard", "writer", "key"):
            if not isinstance(obj[f], str):
                raise ManifestError(f"{what} field {f!r} must be a string, got {obj[f]!r}")
        return cls(
            shard=obj["shard"],
            writer=obj["writer"],
            key=obj["key"],
            size=obj["size"],
            digest=obj["digest"],
            elements=obj.get("elements"),
        )


_RUN_ID = re.compile(r"r([0-9a-f]{12})-[0-9a-f]{16}")


def new_run_id(after: str | None = None) -> str:
    """A new lineage's run id: ``r``, the start in milliseconds since the epoch (12 hex
    digits), ``-`` and 16 random hex digits. ``after``: the run id the store's newest version
    carries, if one was read; the new run starts after it even where this machine's clock is
    behind the one that started it (runs stay ordered by their start)."""
    start = time.time_ns() // 1_000_000
    before = run_started_ms(after) if after is not None else None
    if before is not None:
        start = max(start, before + 1)
    return f"r{start:012x}-{secrets.token_hex(8)}"


def run_started_ms(run_id: str) -> int | None:
    """When the run of ``run_id`` started (ms since the epoch), or None for a run id that
    does not say (one of the releases before :func:`new_run_id`)."""
    match = _RUN_ID.fullmatch(run_id)
    return None if match is None else int(match[1], 16)


def _fingerprint(obj: Any) -> str:
    """32 hex characters of BLAKE2b over canonical JSON: a stable name for a description."""
    return hashlib.blake2b(canonical_json(obj), digest_size=16).hexdigest()


def specs_fingerprint(specs: Mapping[str, TensorSpec]) -> str:
    """Fingerprint of one shard's tensor specs (names, dtypes, shapes; order-insensitive)."""
    return _fingerprint(
        sorted(
            [name, str(s.dtype).removeprefix("torch."), [int(d) for d in s.shape]]
            for name, s in specs.items()
        )
    )


def placements_fingerprint(table: Any, shard: str) -> str:
    """Fingerprint of where one shard's elements come from: every block of every canonical
    tensor placed in ``shard`` (canonical name, local name, the block's geometry) and the
    shard's aliases, order-insensitive. ``table`` is read through ``placements`` (canonical
    name -> placements with ``shard``, ``local``, ``block``) and ``aliases`` (this package
    does not import layouts). Two tables that place every element alike but cut it into
    other blocks get different fingerprints: a refusal, never a silent mismatch."""
    rows = []
    for name, pls in table.placements.items():
        for p in pls:
            if p.shard != shard:
                continue
            b = p.block
            geometry = (b.src_cols, b.dst_cols, b.src_row, b.dst_row, b.rows)
            rows.append(
                [str(name), str(p.local), *map(int, (*geometry, b.src_col, b.dst_col, b.cols))]
            )
    aliases = sorted([str(a), str(t)] for a, t in table.aliases.get(shard, {}).items())
    return _fingerprint({"blocks": sorted(rows), "aliases": aliases})


def model_fingerprint(fields: Mapping[str, Any]) -> str:
    """Fingerprint of a model config's fields (values that are not JSON are named by str)."""

    def plain(v: Any) -> Any:
        if isinstance(v, (bool, int, str)) or v is None:
            return v
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        return str(v)

    return _fingerprint({str(k): plain(v) for k, v in fields.items()})


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """One receiver shard as the publisher's layout built it."""

    specs: str  # specs_fingerprint of its local tensors
    numel: int  # elements it holds (the denominator of density)
    # placements_fingerprint of its blocks (None: a manifest written before it was recorded)
    placements: str | None = None


@dataclass(frozen=True, kw_only=True)
class LayoutRecord:
    """The receiver layout a version was built for: engine convention, TP, EP, the model
    config's fingerprint and every shard's specs fingerprint and size."""

    engine: str
    tp: int
    ep: int
    model: str
    shards: Mapping[str, ShardRecord]

    def __post_init__(self) -> None:
        names.check_token("layout engine", self.engine)
        check_int(self.tp, what="layout tp", lo=1, hi=2**20)
        check_int(self.ep, what="layout ep", lo=1, hi=2**20)
        check_digest(self.model, what="layout model fingerprint", parts=False)
        if not isinstance(self.shards, Mapping) or not self.shards:
            raise ManifestError("layout shards must be a non-empty object")
        for shard, rec in self.shards.items():
            names.check_token("shard", shard)
            if not isinstance(rec, ShardRecord):
                raise ManifestError(f"layout shard {shard!r} is not a ShardRecord")
            check_digest(rec.specs, what=f"layout shard {shard!r} specs fingerprint", parts=False)
            if rec.placements is not None:
                check_digest(
                    rec.placements,
                    what=f"layout shard {shard!r} placements fingerprint",
                    parts=False,
                )
            check_int(rec.numel, what=f"layout shard {shard!r} numel", lo=0, hi=_MAX_SIZE)
        object.__setattr__(
            self, "shards", types.MappingProxyType(dict(sorted(self.shards.items())))
        )

    @classmethod
    def build(
        cls,
        *,
        engine: str,
        tp: int,
        ep: int,
        model_fields: Mapping[str, Any],
        shard_specs: Mapping[str, Mapping[str, TensorSpec]],
        shard_placements: Mapping[str, str] | None = None,
    ) -> LayoutRecord:
        """The record of a layout, from plain values (the caller reads them off its layout;
        ``shard_placements``: each shard's :func:`placements_fingerprint`)."""
        shards = {}
        for shard, specs in shard_specs.items():
            numel = 0
            for s in specs.values():
                n = 1
                for d in s.shape:
                    n *= int(d)
                numel += n
            shards[shard] = ShardRecord(
                specs=specs_fingerprint(specs),
                numel=numel,
                placements=(shard_placements or {}).get(shard),
            )
        return cls(
            engine=engine, tp=tp, ep=ep, model=model_fingerprint(model_fields), shards=shards
        )

    @classmethod
    def of(cls, layout: Any) -> LayoutRecord:
        """The record of a :class:`deltasync.layout.ReceiverLayout` (read through its
        ``engine``, ``tp``, ``ep``, ``spec``, ``shards()``, ``local_specs()`` and ``table``;
        this package does not import layouts)."""
        spec = layout.spec
        fields = (
            {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
            if dataclasses.is_dataclass(spec)
            else {"spec": repr(spec)}
        )
        return cls.build(
            engine=layout.engine,
            tp=layout.tp,
            ep=layout.ep,
            model_fields=fields,
            shard_specs={s.id: layout.local_specs(s.id) for s in layout.shards()},
            shard_placements=(
                None
                if getattr(layout, "table", None) is None
                else {s.id: placements_fingerprint(layout.table, s.id) for s in layout.shards()}
            ),
        )

    def describe(self) -> str:
        return f"engine {self.engine} tp={self.tp} ep={self.ep} model {self.model[:12]}"

    def fingerprint(self, **also: Any) -> str:
        """Fingerprint of this record (and of ``also``, e.g. the trainer's parameter shapes):
        what writers that must agree on the layout compare."""
        return _fingerprint({"layout": self.to_dict(), **also})

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "tp": self.tp,
            "ep": self.ep,
            "model": self.model,
            "shards": {
                s: {"specs": r.specs, "numel": r.numel}
                | ({} if r.placements is None else {"placements": r.placements})
                for s, r in self.shards.items()
            },
        }

    @classmethod
    def from_dict(cls, obj: Any) -> LayoutRecord:
        expect_fields(
            obj, what="manifest layout", required={"engine", "tp", "ep", "model", "shards"}
        )
        if not isinstance(obj["engine"], str):
            raise ManifestError(f"manifest layout engine must be a string, got {obj['engine']!r}")
        if not isinstance(obj["shards"], dict):
            raise ManifestError("manifest layout shards must be a JSON object")
        shards = {}
        for shard, rec in obj["shards"].items():
            expect_fields(
                rec,
                what=f"manifest layout shard {shard!r}",
                required={"specs", "numel"},
                optional={"placements"},
            )
            shards[shard] = ShardRecord(
                specs=rec["specs"], numel=rec["numel"], placements=rec.get("placements")
            )
        return cls(
            engine=obj["engine"], tp=obj["tp"], ep=obj["ep"], model=obj["model"], shards=shards
        )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A committed version. ``base_version`` is None for anchors (full state) and the version
    the delta applies on top of for deltas; ``base_digests`` (deltas only) is every shard's
    state digest of that base, ``run_id`` the lineage. Blobs are kept sorted by (shard, writer)
    and writers sorted, so equal manifests have equal canonical bytes."""

    version: int
    base_version: int | None
    kind: str
    format_version: int
    created_at: float
    writers: tuple[str, ...]
    blobs: tuple[BlobEntry, ...]
    shard_digests: Mapping[str, str]
    run_id: str
    base_digests: Mapping[str, str] = field(default_factory=dict)
    layout: LayoutRecord | None = None
    signature: str | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        check_int(self.version, what="manifest version", lo=0, hi=names.MAX_VERSION)
        check_choice(self.kind, what="manifest kind", choices=KINDS)
        if self.kind == "anchor":
            if self.base_version is not None:
                raise ManifestError(
                    f"anchor manifest {self.version} must have base_version null, "
                    f"got {self.base_version!r}"
                )
        elif self.version == 0:
            raise ManifestError("version 0 cannot be a delta: there is nothing before it")
        else:
            check_int(
                self.base_version,
                what=f"delta manifest {self.version} base_version",
                lo=0,
                hi=self.version - 1,
            )
        check_int(self.format_version, what="manifest format_version", lo=1, hi=MAX_FORMAT_VERSION)
        object.__setattr__(
            self, "created_at", check_time(self.created_at, what="manifest created_at")
        )

        if not isinstance(self.writers, (tuple, list)) or not self.writers:
            raise ManifestError(f"manifest {self.version} writers must be a non-empty list")
        writers = tuple(sorted(names.check_token("writer", w) for w in self.writers))
        if len(set(writers)) != len(writers):
            raise ManifestError(f"manifest {self.version} lists a writer twice: {list(writers)}")
        object.__setattr__(self, "writers", writers)

        if not isinstance(self.shard_digests, Mapping) or not self.shard_digests:
            raise ManifestError(f"manifest {self.version} shard_digests must be a non-empty object")
        digests = {}
        for shard, digest in self.shard_digests.items():
            names.check_token("shard", shard)
            digests[shard] = check_digest(digest, what=f"shard_digests[{shard!r}]")
        object.__setattr__(
            self, "shard_digests", types.MappingProxyType(dict(sorted(digests.items())))
        )
        if not isinstance(self.blobs, (tuple, list)):
            raise ManifestError(f"manifest {self.version} blobs must be a list")
        seen = set()
        for i, blob in enumerate(self.blobs):
            if not isinstance(blob, BlobEntry):
                raise ManifestError(f"manifest {self.version} blobs[{i}] is not a BlobEntry")
            blob.check(self.version, what=f"blobs[{i}]")
            if blob.writer not in writers:
                raise ManifestError(
                    f"blob {blob.key!r} names writer {blob.writer!r}, not in writers"
                )
            if blob.shard not in digests:
                raise ManifestError(
                    f"blob {blob.key!r} is for shard {blob.shard!r}, which has no shard digest"
                )
            if (blob.shard, blob.writer) in seen:
                raise ManifestError(f"blob {blob.key!r} is listed twice")
            seen.add((blob.shard, blob.writer))
        object.__setattr__(
            self, "blobs", tuple(sorted(self.blobs, key=lambda b: (b.shard, b.writer)))
        )

        names.check_token("run_id", self.run_id)
        if not isinstance(self.base_digests, Mapping):
            raise ManifestError(f"manifest {self.version} base_digests must be an object")
        if self.kind == "anchor" and self.base_digests:
            raise ManifestError(f"anchor manifest {self.version} must have empty base_digests")
        if self.kind == "delta" and set(self.base_digests) != set(digests):
            raise ManifestError(
                f"delta manifest {self.version} base_digests name shards "
                f"{sorted(self.base_digests)[:8]}, its shard_digests {sorted(digests)[:8]}: every "
                "shard's base state must be named"
            )
        base = {
            s: check_digest(d, what=f"base_digests[{s!r}]") for s, d in self.base_digests.items()
        }
        object.__setattr__(self, "base_digests", types.MappingProxyType(dict(sorted(base.items()))))
        if self.layout is not None:
            if not isinstance(self.layout, LayoutRecord):
                raise ManifestError(f"manifest {self.version} layout is not a LayoutRecord")
            if set(self.layout.shards) != set(digests):
                raise ManifestError(
                    f"manifest {self.version} layout names shards {sorted(self.layout.shards)[:8]}, "
                    f"its shard_digests {sorted(digests)[:8]}"
                )

        if self.signature is not None and (
            not isinstance(self.signature, str) or not SIGNATURE_RE.match(self.signature)
        ):
            raise ManifestError(
                f"manifest {self.version} signature must be 64 lowercase hex characters "
                f"(HMAC-SHA256), got {self.signature!r}"
            )

    def check_limits(self, limits: ManifestLimits) -> None:
        """Raise ManifestError if the manifest is larger than a reader is willing to trust."""
        if len(self.blobs) > limits.max_blobs:
            raise ManifestError(
                f"manifest {self.version} lists {len(self.blobs)} blobs, more than the limit "
                f"of {limits.max_blobs}"
            )
        for blob in self.blobs:
            if blob.size > limits.max_blob_bytes:
                raise ManifestError(
                    f"blob {blob.key!r} claims {blob.size} bytes, more than the limit of "
                    f"{limits.max_blob_bytes} (ManifestLimits.max_blob_bytes)"
                )

    # --- views --------------------------------------------------------------------------

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(self.shard_digests)

    def blobs_for(self, shard: str) -> tuple[BlobEntry, ...]:
        return tuple(b for b in self.blobs if b.shard == shard)

    @property
    def info(self) -> VersionInfo:
        """What chain and retention planning need from this manifest."""
        return VersionInfo(self.version, self.kind, self.base_version)

    def link(self, shard: str) -> ChainLink:
        """What lineage-aware chain planning needs from this manifest for ``shard``."""
        return ChainLink(
            version=self.version,
            kind=self.kind,
            base=self.base_version,
            base_digest=self.base_digests.get(shard),
            digest=self.shard_digests[shard],
            run_id=self.run_id,
        )

    @property
    def total_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    def unsigned(self) -> Manifest:
        return replace(self, signature=None) if self.signature is not None else self

    # --- JSON ---------------------------------------------------------------------------

    def to_dict(self, *, include_signature: bool = True) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "version": self.version,
            "base_version": self.base_version,
            "kind": self.kind,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "writers": list(self.writers),
            "blobs": [b.to_dict() for b in self.blobs],
            "shard_digests": dict(self.shard_digests),
            "run_id": self.run_id,
            "base_digests": dict(self.base_digests),
        }
        if self.layout is not None:
            obj["layout"] = self.layout.to_dict()
        if include_signature and self.signature is not None:
            obj["signature"] = self.signature
        return obj

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys, no whitespace): what is stored and signed."""
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(
        cls,
        data: bytes | str,
        *,
        limits: ManifestLimits = DEFAULT_LIMITS,
        expected_version: int | None = None,
    ) -> Manifest:
        """Parse and validate; ``expected_version`` also rejects a manifest stored under
        another version's key (a replayed or misplaced manifest)."""
        obj = strict_loads(data, what="manifest", max_bytes=limits.max_manifest_bytes)
        expect_fields(
            obj,
            what="manifest",
            required={
                "version",
                "base_version",
                "kind",
                "format_version",
                "created_at",
                "writers",
                "blobs",
                "shard_digests",
                "run_id",
                "base_digests",
            },
            optional={"signature", "layout"},
        )
        if not isinstance(obj["blobs"], list):
            raise ManifestError("manifest blobs must be a JSON list")
        if len(obj["blobs"]) > limits.max_blobs:
            raise ManifestError(
                f"manifest lists {len(obj['blobs'])} blobs, more than the limit of "
                f"{limits.max_blobs}"
            )
        if not isinstance(obj["writers"], list):
            raise ManifestError("manifest writers must be a JSON list")
        for f in ("shard_digests", "base_digests"):
            if not isinstance(obj[f], dict):
                raise ManifestError(f"manifest {f} must be a JSON object")
        if not isinstance(obj["run_id"], str):
            raise ManifestError(f"manifest run_id must be a string, got {obj['run_id']!r}")
        blobs = tuple(
            BlobEntry.from_dict(b, what=f"blobs[{i}]") for i, b in enumerate(obj["blobs"])
        )
        manifest = cls(
            version=obj["version"],
            base_version=obj["base_version"],
            kind=obj["kind"],
            format_version=obj["format_version"],
            created_at=obj["created_at"],
            writers=tuple(obj["writers"]),
            blobs=blobs,
            shard_digests=obj["shard_digests"],
            run_id=obj["run_id"],
            base_digests=obj["base_digests"],
            layout=None if obj.get("layout") is None else LayoutRecord.from_dict(obj["layout"]),
            signature=obj.get("signature"),
        )
        manifest.check_limits(limits)
        if expected_version is not None and manifest.version != expected_version:
            raise ManifestError(
                f"manifest stored for version {expected_version} describes version "
                f"{manifest.version}: replayed or misplaced manifest, refusing it"
            )
        return manifest
