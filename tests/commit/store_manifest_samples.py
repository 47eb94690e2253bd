"""Sample manifests shared by the manifest tests (imported by name: tests/store is on sys.path)."""

from __future__ import annotations

from deltasync import names
from deltasync.commit import BlobEntry, Manifest

D1 = "0123456789abcdef0123456789abcdef"
D2 = "fedcba9876543210fedcba9876543210"
# Blob digests are BLAKE2b-256 (64 hex characters); state digests xxh3-128 (32).
B1 = "0123456789abcdef" * 4
B2 = "fedcba9876543210" * 4


def blob(version: int, shard: str, writer: str, size: int = 1234, digest: str = B1) -> BlobEntry:
    return BlobEntry(
        shard=shard,
        writer=writer,
        key=names.blob_key(version, shard, writer),
        size=size,
        digest=digest,
    )


def make_manifest(**overrides) -> Manifest:
    fields = dict(
        version=7,
        base_version=6,
        kind="delta",
        format_version=1,
        created_at=1700000000.25,
        writers=("w00001", "w00000"),
        blobs=(blob(7, "tp1", "w00000"), blob(7, "tp0", "w00001"), blob(7, "tp0", "w00000")),
        shard_digests={"tp1": D2, "tp0": D1},
        run_id="run0",
        base_digests={"tp1": D1, "tp0": D2},
    )
    fields.update(overrides)
    if fields["kind"] == "anchor" and "base_digests" not in overrides:
        fields["base_digests"] = {}  # an anchor builds on nothing
    return Manifest(**fields)
