"""The manifest: the one record that makes a version visible.

A version exists for a receiver only once ``v{version}/MANIFEST.json`` is committed; blobs
without a manifest are ignored. The manifest lists every blob (receiver shard, writer, key,
size, digest) and the digest of each receiver shard's full state after applying the version,
so a receiver can check that it ended where the trainer meant it to.

Parsing is strict because the store may be shared with (or written by) someone hostile: every
key must be exactly ``names.blob_key(version, shard, writer)`` (so no path traversal), sizes
are bounded by :class:`ManifestLimits`, digests are 32 hex characters, unknown fields and
duplicate JSON keys are rejected. A Manifest object is valid by construction.

This module knows nothing about stores, tensors or signing keys (see ``signing.py``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from deltasync import names
from deltasync.commit.canonical import (
    SIGNATURE_RE,
    canonical_json,
    check_choice,
    check_digest,
    check_int,
    check_time,
    expect_fields,
    strict_loads,
)
from deltasync.commit.planning import VersionInfo
from deltasync.errors import ConfigError, ManifestError

KINDS = ("delta", "anchor")
MAX_FORMAT_VERSION = 2**16 - 1
_MAX_VERSION = 10**8 - 1


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex xxh3-128 of a blob's bytes, as listed in the manifest."""
    return xxhash.xxh3_128_hexdigest(data)


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
        check_digest(self.digest, what=f"{what} {self.key!r} digest")

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "writer": self.writer,
            "key": self.key,
            "size": self.size,
            "digest": self.digest,
        }

    @classmethod
    def from_dict(cls, obj: Any, *, what: str = "blob") -> BlobEntry:
        expect_fields(obj, what=what, required={"shard", "writer", "key", "size", "digest"})
        for f in ("shard", "writer", "key"):
            if not isinstance(obj[f], str):
                raise ManifestError(f"{what} field {f!r} must be a string, got {obj[f]!r}")
        return cls(
            shard=obj["shard"],
            writer=obj["writer"],
            key=obj["key"],
            size=obj["size"],
            digest=obj["digest"],
        )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A committed version. ``base_version`` is None for anchors (full state) and the version
    the delta applies on top of for deltas. Blobs are kept sorted by (shard, writer) and
    writers sorted, so equal manifests have equal canonical bytes."""

    version: int
    base_version: int | None
    kind: str
    format_version: int
    created_at: float
    writers: tuple[str, ...]
    blobs: tuple[BlobEntry, ...]
    shard_digests: Mapping[str, str]
    signature: str | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        check_int(self.version, what="manifest version", lo=0, hi=_MAX_VERSION)
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
        }
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
            },
            optional={"signature"},
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
        if not isinstance(obj["shard_digests"], dict):
            raise ManifestError("manifest shard_digests must be a JSON object")
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
            signature=obj.get("signature"),
        )
        manifest.check_limits(limits)
        if expected_version is not None and manifest.version != expected_version:
            raise ManifestError(
                f"manifest stored for version {expected_version} describes version "
                f"{manifest.version}: replayed or misplaced manifest, refusing it"
            )
        return manifest
