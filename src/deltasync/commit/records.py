"""The small JSON records of the commit protocol, besides the manifest itself.

- ``LATEST``: the newest committed version (a hint; the manifest is the truth);
- writer marker (``v{n}/writers/{writer}.json``): writer ``w`` finished every blob it sends
  for version n (possibly none), listing them, so the committer can build the manifest
  without listing the store and without trusting blobs nobody vouched for;
- abandoned notice (``v{n}/writers/{writer}.abandoned``, several writers): writer w's attempt
  at version n failed and will not be finished; the committer, and the writers waiting on the
  committer's, stop waiting instead of waiting out their timeout;
- ack (``acks/v{n}/{receiver}.json``): receiver r applied version n and its shard digest
  matched;
- receiver registration (``receivers/{receiver}.json``): a live receiver, its shard, the
  version it holds and, while it restores one, the anchor it is fetching, refreshed as a
  heartbeat; retention keeps what these still need.

The store may be shared with someone hostile, so:

- with a signing key, every record carries a ``mac`` (HMAC-SHA256 under the key and a tag of
  its kind, :mod:`deltasync.commit.signing`) and ``from_json(..., signing_key=key)`` refuses
  one that does not verify; without a key records are advisory (anyone who can write the
  store can forge them, see docs/security.md);
- timestamps in the future (beyond :data:`MAX_CLOCK_SKEW_S`) are refused: a heartbeat dated
  next year must not keep a receiver "live" forever;
- acks and registrations keep the fields a later release added (:data:`MAX_LATER_FIELDS`
  at most, named like this module's own; the MAC covers them) and this release ignores them,
  so a store written to by receivers of the next release is still read right (a registration
  refused for a new field would count as absent, and retention would stop protecting what
  that receiver holds). A later release adds to these two records only fields that are safe
  to ignore; anything else is a new record. Manifests, writer markers and ``LATEST`` refuse
  unknown fields: what they say decides what is written;
- every parse error is a ManifestError naming the record; sizes are bounded
  (:data:`MAX_RECORD_BYTES`, :data:`MAX_MARKER_BYTES`, :data:`MAX_LATEST_BYTES`; pass them as
  ``Store.get(..., max_bytes=...)``) and numbers range-checked before use.

Each record round-trips through canonical JSON. This module knows nothing about stores:
callers put and get the bytes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from deltasync import names
from deltasync.commit.canonical import (
    canonical_json,
    check_digest,
    check_int,
    check_mac,
    check_time,
    expect_fields,
    parsing,
    show,
    show_names,
    strict_loads,
)
from deltasync.commit.model import BlobEntry
from deltasync.commit.signing import check_record_mac, record_mac
from deltasync.errors import ManifestError

MAX_LATEST_BYTES = 4096
MAX_RECORD_BYTES = 64 * 2**10  # an ack or a receiver registration
MAX_MARKER_BYTES = 16 * 2**20  # a writer marker lists one entry per shard it sent to
# A record may be dated this far ahead of the reader's clock (hosts' clocks differ a little);
# anything later is refused, so a future heartbeat cannot stay live or pin retention.
MAX_CLOCK_SKEW_S = 300.0
# Fields of a later release an ack or a registration may carry (kept, signed, ignored here).
MAX_LATER_FIELDS = 16
# An abandoned notice's reason (the error that ended the attempt, cut to this length).
MAX_REASON_CHARS = 1000
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def encode_latest(version: int, run_id: str | None = None) -> bytes:
    """``LATEST``: the newest committed version and (when known) its lineage's run id."""
    obj: dict[str, Any] = {
        "version": check_int(version, what="LATEST version", lo=0, hi=names.MAX_VERSION)
    }
    if run_id is not None:
        obj["run_id"] = names.check_token("LATEST run_id", run_id)
    return canonical_json(obj)


def _latest_obj(data: bytes | str) -> dict[str, Any]:
    with parsing("LATEST"):
        obj = strict_loads(data, what="LATEST", max_bytes=MAX_LATEST_BYTES)
        expect_fields(obj, what="LATEST", required={"version"}, optional={"run_id"})
        check_int(obj["version"], what="LATEST version", lo=0, hi=names.MAX_VERSION)
        if "run_id" in obj:
            names.check_token("LATEST run_id", obj["run_id"])
        return obj


def decode_latest(data: bytes | str) -> int:
    return _latest_obj(data)["version"]


def decode_latest_run(data: bytes | str) -> str | None:
    """The run id ``LATEST`` records, or None when it has none."""
    return _latest_obj(data).get("run_id")


def _check_not_future(value: float, *, what: str, now: float | None) -> None:
    now = time.time() if now is None else now
    if value > now + MAX_CLOCK_SKEW_S:
        raise ManifestError(
            f"{what} {value:.0f} lies {value - now:.0f} s in the future (more than the "
            f"{MAX_CLOCK_SKEW_S:.0f} s of clock skew allowed): a forged or broken record"
        )


def _strings(obj: dict[str, Any], fields: tuple[str, ...], *, what: str) -> None:
    for f in fields:
        if not isinstance(obj[f], str):
            raise ManifestError(f"{what} {f} must be a string, got {show(obj[f])}")


def _check_later(later: Mapping[str, Any], known: frozenset[str], *, what: str) -> None:
    """Fields of a later release: named like ours, none of ours, at most MAX_LATER_FIELDS."""
    if len(later) > MAX_LATER_FIELDS:
        raise ManifestError(
            f"{what} has {len(later)} fields this release does not know (at most "
            f"{MAX_LATER_FIELDS}): {show_names(later)}"
        )
    for name in later:
        if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name) or name in known:
            raise ManifestError(
                f"{what} field {show(name)} is not a field name (lower-case letters, digits "
                "and _, at most 64) or is one of the record's own"
            )
    if later:
        # kept to be written again under the MAC: a value JSON parses but canonical JSON
        # cannot write (1e999 parses as inf; nesting just under the parser's depth limit)
        # is a malformed record, never a ValueError or RecursionError from its reader
        try:
            canonical_json(dict(later))
        except (ValueError, TypeError, RecursionError) as exc:
            raise ManifestError(
                f"{what} fields {show_names(later)} cannot be written as canonical JSON "
                f"({type(exc).__name__}: {show(str(exc))})"
            ) from None


class _Signed:
    """What the three records share: a ``mac`` over the canonical JSON of the other fields.

    Acks and registrations also carry ``later``: fields a later release wrote, kept as read
    (under the MAC, in the JSON again) and otherwise ignored."""

    KIND = ""
    FIELDS: frozenset[str] = frozenset()  # the JSON fields this release knows, "mac" included
    mac: str | None

    def _fields(self) -> dict[str, Any]:  # the JSON object without ``mac``
        raise NotImplementedError

    def _keep_later(self) -> None:
        """``later`` checked, and held as a copy of its own."""
        later = getattr(self, "later", {})
        if not isinstance(later, Mapping):
            raise ManifestError(f"{self.KIND} later must be a mapping, got {show(later)}")
        _check_later(later, self.FIELDS, what=self.KIND)
        object.__setattr__(self, "later", dict(later))

    def _check_mac_field(self) -> None:
        if self.mac is not None:
            check_mac(self.mac, what=f"{self.KIND} mac")

    def signed(self, signing_key: bytes):
        """A copy carrying the MAC of this record under ``signing_key``."""
        return replace(self, mac=record_mac(self.KIND, canonical_json(self._fields()), signing_key))

    def to_json(self, signing_key: bytes | None = None) -> bytes:
        """Canonical JSON; signed first when ``signing_key`` is given."""
        rec = self.signed(signing_key) if signing_key is not None else self
        obj = rec._fields()
        if rec.mac is not None:
            obj["mac"] = rec.mac
        return canonical_json(obj)

    def verify(self, signing_key: bytes | None, *, what: str) -> None:
        """With a key, raise SignatureError unless ``mac`` authenticates this record."""
        check_record_mac(
            self.KIND, canonical_json(self._fields()), self.mac, signing_key, what=what
        )

    @classmethod
    def _parse_dated(
        cls,
        data: bytes | str,
        *,
        required: set[str],
        dated: str,
        signing_key: bytes | None,
        now: float | None,
        what: str,
    ):
        """An ack or a registration from JSON: fields checked, ``receiver``, ``shard``,
        ``run_id``, ``request`` and ``restoring_run_id`` strings, the ``dated`` time not in
        the future (``now``: the reader's clock), then the MAC with ``signing_key`` (over the
        fields of a later release too, kept in ``later``)."""
        with parsing(what):
            obj = strict_loads(data, what=what, max_bytes=MAX_RECORD_BYTES)
            later = {}
            if isinstance(obj, dict):
                later = {k: obj.pop(k) for k in [k for k in obj if k not in cls.FIELDS]}
            expect_fields(obj, what=what, required=required, optional=cls.FIELDS - required)
            _strings(obj, ("receiver", "shard"), what=what)
            _strings(
                obj,
                tuple(
                    f for f in ("run_id", "request", "restoring_run_id") if obj.get(f) is not None
                ),
                what=what,
            )
            record = cls(**obj, later=later)
            _check_not_future(getattr(record, dated), what=f"{what} {dated}", now=now)
            # inside: its canonical JSON is written again here (a SignatureError stays one)
            record.verify(signing_key, what=what)
        return record


@dataclass(frozen=True, kw_only=True)
class WriterMarker(_Signed):
    """Writer ``writer`` has stored all its blobs of ``version``; ``blobs`` may be empty.

    ``base_version`` (-1: an anchor), ``num_writers`` and ``layout`` (the fingerprint of the
    receiver layout and trainer parameters it routed for) say what the writer built its blobs
    for, so the committer never joins the parts of writers that disagree (None: not stated,
    as by a hand-made marker; the publisher always states them).

    ``part_digests`` (``{shard: 32 hex}``, every shard of the layout): this writer's part
    digest of each receiver shard (:mod:`deltasync.layout.part_digests`) as the version
    leaves it, stated by each of several writers publishing without the full state; the
    committer joins them into each shard's parts digest. None: not stated."""

    KIND = "writer marker"

    version: int
    writer: str
    blobs: tuple[BlobEntry, ...]
    created_at: float
    base_version: int | None = None
    num_writers: int | None = None
    layout: str | None = None
    part_digests: Mapping[str, str] | None = None
    mac: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_int(self.version, what="writer marker version", lo=0, hi=names.MAX_VERSION)
        if self.part_digests is not None:
            if not isinstance(self.part_digests, Mapping) or not self.part_digests:
                raise ManifestError(
                    f"writer marker of {self.writer!r} part_digests must be a non-empty object, "
                    f"got {show(self.part_digests)}"
                )
            parts = {}
            for shard, digest in self.part_digests.items():
                names.check_token("shard", shard)
                parts[shard] = check_digest(
                    digest, what=f"writer marker part_digests[{shard!r}]", parts=False
                )
            object.__setattr__(self, "part_digests", dict(sorted(parts.items())))
        if self.layout is not None:
            check_digest(self.layout, what="writer marker layout fingerprint", parts=False)
        names.check_token("writer", self.writer)
        if self.base_version is not None:
            check_int(
                self.base_version, what="writer marker base_version", lo=-1, hi=self.version - 1
            )
        if self.num_writers is not None:
            check_int(self.num_writers, what="writer marker num_writers", lo=1, hi=1 << 20)
        object.__setattr__(
            self, "created_at", check_time(self.created_at, what="writer marker created_at")
        )
        self._check_mac_field()
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

    def _fields(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "writer": self.writer,
            "created_at": self.created_at,
            "blobs": [b.to_dict() for b in self.blobs],
        }
        if self.base_version is not None:
            out["base_version"] = self.base_version
        if self.num_writers is not None:
            out["num_writers"] = self.num_writers
        if self.layout is not None:
            out["layout"] = self.layout
        if self.part_digests is not None:
            out["part_digests"] = dict(self.part_digests)
        return out

    @classmethod
    def from_json(
        cls, data: bytes | str, *, signing_key: bytes | None = None, what: str = "writer marker"
    ) -> WriterMarker:
        """Parse and validate; with ``signing_key``, also require a valid MAC."""
        with parsing(what):
            obj = strict_loads(data, what=what, max_bytes=MAX_MARKER_BYTES)
            expect_fields(
                obj,
                what=what,
                required={"version", "writer", "created_at", "blobs"},
                optional={"mac", "base_version", "num_writers", "layout", "part_digests"},
            )
            if not isinstance(obj["blobs"], list):
                raise ManifestError(f"{what} blobs must be a JSON list")
            if "part_digests" in obj and not isinstance(obj["part_digests"], dict):
                raise ManifestError(f"{what} part_digests must be a JSON object")
            _strings(obj, ("writer",), what=what)
            marker = cls(
                version=obj["version"],
                writer=obj["writer"],
                created_at=obj["created_at"],
                base_version=obj.get("base_version"),
                num_writers=obj.get("num_writers"),
                layout=obj.get("layout"),
                part_digests=obj.get("part_digests"),
                blobs=tuple(
                    BlobEntry.from_dict(b, what=f"blobs[{i}]") for i, b in enumerate(obj["blobs"])
                ),
                mac=obj.get("mac"),
            )
        marker.verify(signing_key, what=what)
        return marker


@dataclass(frozen=True, kw_only=True)
class WriterAbandoned(_Signed):
    """Writer ``writer``'s attempt at ``version`` failed (``reason``) and will not be finished:
    no marker of it counts from now on. Written only while that version is not committed."""

    KIND = "writer abandoned"

    version: int
    writer: str
    reason: str
    created_at: float
    mac: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_int(self.version, what="abandoned notice version", lo=0, hi=names.MAX_VERSION)
        names.check_token("writer", self.writer)
        if not isinstance(self.reason, str) or len(self.reason) > MAX_REASON_CHARS:
            raise ManifestError(
                f"abandoned notice reason must be a string of at most {MAX_REASON_CHARS} "
                f"characters, got {show(self.reason)}"
            )
        object.__setattr__(
            self, "created_at", check_time(self.created_at, what="abandoned notice created_at")
        )
        self._check_mac_field()

    @property
    def key(self) -> str:
        return names.writer_abandoned_key(self.version, self.writer)

    def _fields(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "writer": self.writer,
            "reason": self.reason,
            "created_at": self.created_at,
        }

    @classmethod
    def from_json(
        cls, data: bytes | str, *, signing_key: bytes | None = None, what: str = "abandoned notice"
    ) -> WriterAbandoned:
        """Parse and validate; with ``signing_key``, also require a valid MAC."""
        with parsing(what):
            obj = strict_loads(data, what=what, max_bytes=MAX_RECORD_BYTES)
            expect_fields(
                obj,
                what=what,
                required={"version", "writer", "reason", "created_at"},
                optional={"mac"},
            )
            _strings(obj, ("writer", "reason"), what=what)
            notice = cls(**obj)
        notice.verify(signing_key, what=what)
        return notice


@dataclass(frozen=True, kw_only=True)
class AckRecord(_Signed):
    """Receiver ``receiver`` (holding ``shard``) applied ``version`` of lineage ``run_id`` and
    verified ``state_digest``; ``pause_s``/``total_s`` are what it measured (for inspect).
    ``run_id`` is None in acks written before lineages were recorded in them."""

    KIND = "ack"
    FIELDS = frozenset(
        {
            "version",
            "receiver",
            "shard",
            "state_digest",
            "created_at",
            "run_id",
            "pause_s",
            "total_s",
            "mac",
        }
    )

    version: int
    receiver: str
    shard: str
    state_digest: str
    created_at: float
    run_id: str | None = None
    pause_s: float | None = None
    total_s: float | None = None
    mac: str | None = field(default=None, compare=False)
    later: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_int(self.version, what="ack version", lo=0, hi=names.MAX_VERSION)
        names.check_token("receiver", self.receiver)
        names.check_token("shard", self.shard)
        check_digest(self.state_digest, what="ack state_digest")
        if self.run_id is not None:
            names.check_token("ack run_id", self.run_id)
        object.__setattr__(self, "created_at", check_time(self.created_at, what="ack created_at"))
        for f in ("pause_s", "total_s"):
            value = getattr(self, f)
            if value is not None:
                object.__setattr__(self, f, check_time(value, what=f"ack {f}"))
        self._keep_later()
        self._check_mac_field()

    @property
    def key(self) -> str:
        return names.ack_key(self.version, self.receiver)

    def _fields(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "version": self.version,
            "receiver": self.receiver,
            "shard": self.shard,
            "state_digest": self.state_digest,
            "created_at": self.created_at,
        }
        for f in ("run_id", "pause_s", "total_s"):
            if getattr(self, f) is not None:
                obj[f] = getattr(self, f)
        return {**self.later, **obj}

    @classmethod
    def from_json(
        cls,
        data: bytes | str,
        *,
        signing_key: bytes | None = None,
        now: float | None = None,
        what: str = "ack",
    ) -> AckRecord:
        """Parse and validate (``now``: the reader's clock, for the future-date check); with
        ``signing_key``, also require a valid MAC."""
        return cls._parse_dated(
            data,
            required={"version", "receiver", "shard", "state_digest", "created_at"},
            dated="created_at",
            signing_key=signing_key,
            now=now,
            what=what,
        )


@dataclass(frozen=True, kw_only=True)
class ReceiverRecord(_Signed):
    """A registered receiver: which shard it holds, the version it has (None before its
    first version) and that version's lineage ``run_id``, and when it last said so (its
    heartbeat). ``request``: the engine request it was last handed
    (:meth:`~deltasync.Receiver.answering`) when the record names no version or one verified
    since that request came, so that the request's sender can tell a registration that
    answers it from one an earlier request left (SGLang's ``check_taken``); else None, as
    where no engine hook names requests.

    A store reset starts a new lineage whose version numbers repeat the old one's; a receiver
    still holding the old lineage's version says so truthfully, and the lineage tells a reader
    that it holds nothing of the new one (:meth:`version_in`). ``run_id`` is None in records
    written before lineages were recorded in them (and when ``version`` is None).

    ``restoring`` and ``restoring_run_id``: the anchor (version and lineage) the receiver is
    restoring, from the start of that restore until it holds the version it leads to (or the
    pull fails); both None otherwise, and in records of releases before them. Retention keeps
    that anchor and every version after it while the registration is live
    (:meth:`restoring_in`), so that a slow fetch is not deleted under the receiver by anchors
    published meanwhile. They say nothing about the version held: bounded staleness and acks
    read ``version`` only."""

    KIND = "receiver record"
    FIELDS = frozenset(
        {
            "receiver",
            "shard",
            "version",
            "updated_at",
            "run_id",
            "request",
            "restoring",
            "restoring_run_id",
            "mac",
        }
    )

    receiver: str
    shard: str
    version: int | None
    updated_at: float
    run_id: str | None = None
    request: str | None = None
    restoring: int | None = None
    restoring_run_id: str | None = None
    mac: str | None = field(default=None, compare=False)
    later: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        names.check_token("receiver", self.receiver)
        names.check_token("shard", self.shard)
        if self.version is not None:
            check_int(self.version, what="receiver version", lo=0, hi=names.MAX_VERSION)
        if self.run_id is not None:
            names.check_token("receiver run_id", self.run_id)
        if self.request is not None:
            names.check_token("receiver request", self.request)
        if (self.restoring is None) != (self.restoring_run_id is None):
            raise ManifestError(
                "receiver restoring and restoring_run_id name an anchor together: both or "
                f"neither, got {show(self.restoring)} and {show(self.restoring_run_id)}"
            )
        if self.restoring is not None:
            check_int(self.restoring, what="receiver restoring", lo=0, hi=names.MAX_VERSION)
            names.check_token("receiver restoring_run_id", self.restoring_run_id)
        object.__setattr__(
            self, "updated_at", check_time(self.updated_at, what="receiver updated_at")
        )
        self._keep_later()
        self._check_mac_field()

    @property
    def key(self) -> str:
        return names.receiver_key(self.receiver)

    def is_live(self, now: float, ttl_s: float) -> bool:
        """Live if its heartbeat is at most ``ttl_s`` old. A heartbeat up to
        MAX_CLOCK_SKEW_S ahead of ``now`` counts as fresh (clock skew); one further in the
        future is not live: it would otherwise stay live forever."""
        age = now - self.updated_at
        return -MAX_CLOCK_SKEW_S <= age <= ttl_s

    def version_in(self, run_id: str) -> int | None:
        """The version this receiver holds of lineage ``run_id``: None when it holds none or
        one of another lineage (the old one, after a store reset). A record without a
        lineage (written before they were recorded) is taken at its word."""
        if self.run_id is not None and self.run_id != run_id:
            return None
        return self.version

    def restoring_in(self, run_id: str) -> int | None:
        """The anchor of lineage ``run_id`` this receiver is restoring: None when it restores
        none, or one of another lineage (nothing of ``run_id`` it needs)."""
        if self.restoring_run_id != run_id:
            return None
        return self.restoring

    def _fields(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "receiver": self.receiver,
            "shard": self.shard,
            "version": self.version,
            "updated_at": self.updated_at,
        }
        if self.run_id is not None:
            obj["run_id"] = self.run_id
        if self.request is not None:
            obj["request"] = self.request
        if self.restoring is not None:
            obj["restoring"] = self.restoring
            obj["restoring_run_id"] = self.restoring_run_id
        return {**self.later, **obj}

    @classmethod
    def from_json(
        cls,
        data: bytes | str,
        *,
        signing_key: bytes | None = None,
        now: float | None = None,
        what: str = "receiver record",
    ) -> ReceiverRecord:
        """Parse and validate (``now``: the reader's clock, for the future-date check); with
        ``signing_key``, also require a valid MAC."""
        return cls._parse_dated(
            data,
            required={"receiver", "shard", "version", "updated_at"},
            dated="updated_at",
            signing_key=signing_key,
            now=now,
            what=what,
        )
