"""The small JSON records of the commit protocol, besides the manifest itself.

- ``LATEST``: the newest committed version (a hint; the manifest is the truth);
- writer marker (``v{n}/writers/{writer}.json``): writer ``w`` finished every blob it sends
  for version n (possibly none), listing them, so the committer can build the manifest
  without listing the store and without trusting blobs nobody vouched for;
- ack (``acks/v{n}/{receiver}.json``): receiver r applied version n and its shard digest
  matched;
- receiver registration (``receivers/{receiver}.json``): a live receiver, its shard and the
  version it holds, refreshed as a heartbeat; retention keeps what these still need.

Each record round-trips through canonical JSON and is validated strictly on the way in.
This module knows nothing about stores: callers put and get the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltasync import names
from deltasync.commit.canonical import (
    canonical_json,
    check_digest,
    check_int,
    check_time,
    expect_fields,
    strict_loads,
)
from deltasync.commit.model import BlobEntry
from deltasync.errors import ManifestError

_MAX_VERSION = 10**8 - 1
_MAX_RECORD_BYTES = 16 * 2**20


def encode_latest(version: int, run_id: str | None = None) -> bytes:
    """``LATEST``: the newest committed version and (when known) its lineage's run id."""
    obj: dict[str, Any] = {
        "version": check_int(version, what="LATEST version", lo=0, hi=_MAX_VERSION)
    }
    if run_id is not None:
        obj["run_id"] = names.check_token("LATEST run_id", run_id)
    return canonical_json(obj)


def _latest_obj(data: bytes | str) -> dict[str, Any]:
    obj = strict_loads(data, what="LATEST", max_bytes=4096)
    expect_fields(obj, what="LATEST", required={"version"}, optional={"run_id"})
    check_int(obj["version"], what="LATEST version", lo=0, hi=_MAX_VERSION)
    if "run_id" in obj:
        names.check_token("LATEST run_id", obj["run_id"])
    return obj


def decode_latest(data: bytes | str) -> int:
    return _latest_obj(data)["version"]


def decode_latest_run(data: bytes | str) -> str | None:
    """The run id ``LATEST`` records, or None when it has none."""
    return _latest_obj(data).get("run_id")


@dataclass(frozen=True, kw_only=True)
class WriterMarker:
    """Writer ``writer`` has stored all its blobs of ``version``; ``blobs`` may be empty."""

    version: int
    writer: str
    blobs: tuple[BlobEntry, ...]
    created_at: float

    def __post_init__(self) -> None:
        check_int(self.version, what="writer marker version", lo=0, hi=_MAX_VERSION)
        names.check_token("writer", self.writer)
        object.__setattr__(
            self, "created_at", check_time(self.created_at, what="writer marker created_at")
        )
        if not isinstance(self.blobs, (tuple, list)):
            raise ManifestError("writer marker blobs must be a list")
        shards = set()
        for i, blob in enumerate(self.blobs):
            if not isinstance(blob, BlobEntry):
                raise ManifestError(f"writer marker blobs[{i}] is not a BlobEntry")
            blob.check(self.version, what=f"writer {self.writer} blobs[{i}]")
            if blob.writer != self.writer:
                raise ManifestError(
                    f"writer marker of {self.writer!r} lists blob {blob.key!r} of writer "
                    f"{blob.writer!r}"
                )
            if blob.shard in shards:
                raise ManifestError(
                    f"writer marker of {self.writer!r} lists shard {blob.shard!r} twice"
                )
            shards.add(blob.shard)
        object.__setattr__(self, "blobs", tuple(sorted(self.blobs, key=lambda b: b.shard)))

    @property
    def key(self) -> str:
        return names.writer_marker_key(self.version, self.writer)

    def to_json(self) -> bytes:
        return canonical_json(
            {
                "version": self.version,
                "writer": self.writer,
                "created_at": self.created_at,
                "blobs": [b.to_dict() for b in self.blobs],
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> WriterMarker:
        obj = strict_loads(data, what="writer marker", max_bytes=_MAX_RECORD_BYTES)
        expect_fields(
            obj, what="writer marker", required={"version", "writer", "created_at", "blobs"}
        )
        if not isinstance(obj["blobs"], list):
            raise ManifestError("writer marker blobs must be a JSON list")
        if not isinstance(obj["writer"], str):
            raise ManifestError(f"writer marker writer must be a string, got {obj['writer']!r}")
        return cls(
            version=obj["version"],
            writer=obj["writer"],
            created_at=obj["created_at"],
            blobs=tuple(
                BlobEntry.from_dict(b, what=f"blobs[{i}]") for i, b in enumerate(obj["blobs"])
            ),
        )


@dataclass(frozen=True, kw_only=True)
class AckRecord:
    """Receiver ``receiver`` (holding ``shard``) applied ``version`` and verified
    ``state_digest``; ``pause_s``/``total_s`` are what it measured (for inspect)."""

    version: int
    receiver: str
    shard: str
    state_digest: str
    created_at: float
    pause_s: float | None = None
    total_s: float | None = None

    def __post_init__(self) -> None:
        check_int(self.version, what="ack version", lo=0, hi=_MAX_VERSION)
        names.check_token("receiver", self.receiver)
        names.check_token("shard", self.shard)
        check_digest(self.state_digest, what="ack state_digest")
        object.__setattr__(self, "created_at", check_time(self.created_at, what="ack created_at"))
        for f in ("pause_s", "total_s"):
            value = getattr(self, f)
            if value is not None:
                object.__setattr__(self, f, check_time(value, what=f"ack {f}"))

    @property
    def key(self) -> str:
        return names.ack_key(self.version, self.receiver)

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {
            "version": self.version,
            "receiver": self.receiver,
            "shard": self.shard,
            "state_digest": self.state_digest,
            "created_at": self.created_at,
        }
        for f in ("pause_s", "total_s"):
            if getattr(self, f) is not None:
                obj[f] = getattr(self, f)
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes | str) -> AckRecord:
        obj = strict_loads(data, what="ack", max_bytes=_MAX_RECORD_BYTES)
        expect_fields(
            obj,
            what="ack",
            required={"version", "receiver", "shard", "state_digest", "created_at"},
            optional={"pause_s", "total_s"},
        )
        for f in ("receiver", "shard"):
            if not isinstance(obj[f], str):
                raise ManifestError(f"ack {f} must be a string, got {obj[f]!r}")
        return cls(**obj)


@dataclass(frozen=True, kw_only=True)
class ReceiverRecord:
    """A registered receiver: which shard it holds, the version it has (None before its
    first version), and when it last said so (its heartbeat)."""

    receiver: str
    shard: str
    version: int | None
    updated_at: float

    def __post_init__(self) -> None:
        names.check_token("receiver", self.receiver)
        names.check_token("shard", self.shard)
        if self.version is not None:
            check_int(self.version, what="receiver version", lo=0, hi=_MAX_VERSION)
        object.__setattr__(
            self, "updated_at", check_time(self.updated_at, what="receiver updated_at")
        )

    @property
    def key(self) -> str:
        return names.receiver_key(self.receiver)

    def is_live(self, now: float, ttl_s: float) -> bool:
        """Live if its heartbeat is at most ``ttl_s`` old (clock skew counts as fresh)."""
        return now - self.updated_at <= ttl_s

    def to_json(self) -> bytes:
        return canonical_json(
            {
                "receiver": self.receiver,
                "shard": self.shard,
                "version": self.version,
                "updated_at": self.updated_at,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> ReceiverRecord:
        obj = strict_loads(data, what="receiver record", max_bytes=_MAX_RECORD_BYTES)
        expect_fields(
            obj, what="receiver record", required={"receiver", "shard", "version", "updated_at"}
        )
        for f in ("receiver", "shard"):
            if not isinstance(obj[f], str):
                raise ManifestError(f"receiver record {f} must be a string, got {obj[f]!r}")
        return cls(**obj)
