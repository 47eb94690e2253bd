"""What a committed version is: the manifest, its signature, digests, the small commit
records, and the pure planning rules over versions (chain, retention, anchors).

Nothing in this package does I/O; callers move the bytes through a :mod:`deltasync.store`.
"""

from deltasync.manifest.model import KINDS, BlobEntry, Manifest, ManifestLimits, blob_digest
from deltasync.manifest.planning import VersionInfo, plan_chain, plan_retention, should_anchor
from deltasync.manifest.records import (
    AckRecord,
    ReceiverRecord,
    WriterMarker,
    decode_latest,
    encode_latest,
)
from deltasync.manifest.signing import check_signature, sign, signing_bytes, verify

__all__ = [
    "KINDS",
    "AckRecord",
    "BlobEntry",
    "Manifest",
    "ManifestLimits",
    "ReceiverRecord",
    "VersionInfo",
    "WriterMarker",
    "blob_digest",
    "check_signature",
    "decode_latest",
    "encode_latest",
    "plan_chain",
    "plan_retention",
    "should_anchor",
    "sign",
    "signing_bytes",
    "verify",
]
