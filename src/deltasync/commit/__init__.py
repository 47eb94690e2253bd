"""The commit protocol both sides of the storage path share: what a committed version is and
how it becomes one.

- pure: the manifest (:mod:`~deltasync.commit.model`), its canonical JSON and signature, the
  small records (writer markers, receiver registrations, acks, ``LATEST``) and the planning
  rules over versions (chain, retention, anchors);
- over a :class:`~deltasync.store.Store`: :class:`Catalog` (the one read model of what is
  committed, and the waits for acks and bounded staleness on it),
  :mod:`~deltasync.commit.committer` (writer markers, the manifest commit, ``LATEST``) and
  :mod:`~deltasync.commit.retention` (what is safe to delete).

The publisher and the receiver both build on this package and never on each other. It knows
keys, records and manifests; it knows nothing about tensors, layouts or applying.
"""

from deltasync.commit.catalog import Catalog
from deltasync.commit.model import KINDS, BlobEntry, Manifest, ManifestLimits, blob_digest
from deltasync.commit.planning import VersionInfo, plan_chain, plan_retention, should_anchor
from deltasync.commit.records import (
    AckRecord,
    ReceiverRecord,
    WriterAbandoned,
    WriterMarker,
    decode_latest,
    encode_latest,
)
from deltasync.commit.retention import GcPlan, collect_garbage, plan_deletions
from deltasync.commit.signing import check_signature, sign, signing_bytes, verify

__all__ = [
    "KINDS",
    "AckRecord",
    "BlobEntry",
    "Catalog",
    "GcPlan",
    "Manifest",
    "ManifestLimits",
    "ReceiverRecord",
    "VersionInfo",
    "WriterAbandoned",
    "WriterMarker",
    "blob_digest",
    "check_signature",
    "collect_garbage",
    "decode_latest",
    "encode_latest",
    "plan_chain",
    "plan_deletions",
    "plan_retention",
    "should_anchor",
    "sign",
    "signing_bytes",
    "verify",
]
