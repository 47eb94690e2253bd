"""The sparse wire format: one self-checking blob per (version, receiver shard, writer).

Data flow through this package::

    build.py    live tensors  -> TensorUpdate   (full_updates, sparse_update)
    encode.py   TensorUpdates -> blob bytes     (gap coding, byte planes, zstd, xxh3-128);
                BlobWriter streams a blob segment by segment, encode_blob is one segment,
                encode_blobs one blob per shard on a few threads
    decode.py   blob bytes    -> DecodedBlob    (digest, header; reader.py: every record);
                BlobRecords reads a blob record by record
    merge.py    several writers' / versions' TensorUpdates -> one per tensor; iter_chain
                streams a chain's records one tensor at a time (TensorPieces)
    apply.py    TensorUpdates -> live tensors   (validate all, then scatter in place);
                apply_pieces writes one tensor's pieces of a chain

wire.py holds the byte layout (documented byte by byte in docs/wire-format.md), updates.py the
in-memory records, section.py the numpy plane kernels and the zstd frame handling, stash.py
the unlinked file a verify parks a chain's large sparse pieces in.

The package knows nothing about storage, manifests, layouts of models or processes.
"""

from deltasync.errors import BlobBaseMismatchError, BlobLimitError, InvalidUpdateError
from deltasync.format.apply import (
    PauseContext,
    apply_pieces,
    apply_updates,
    check_targets_writable,
    inside_pause,
)
from deltasync.format.build import full_updates, sparse_update
from deltasync.format.decode import BlobRecords, decode_blob
from deltasync.format.encode import BlobWriter, encode_blob, encode_blobs
from deltasync.format.merge import (
    NamedOnce,
    Records,
    TensorPieces,
    fold_chain,
    iter_chain,
    merge_writers,
)
from deltasync.format.updates import (
    BlobHeader,
    DecodedBlob,
    TensorSpec,
    TensorUpdate,
    check_tensors_match,
    check_tensors_still_match,
)
from deltasync.format.wire import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "BlobBaseMismatchError",
    "BlobHeader",
    "BlobLimitError",
    "BlobRecords",
    "BlobWriter",
    "DecodedBlob",
    "InvalidUpdateError",
    "NamedOnce",
    "PauseContext",
    "Records",
    "TensorPieces",
    "TensorSpec",
    "TensorUpdate",
    "apply_pieces",
    "apply_updates",
    "check_targets_writable",
    "check_tensors_match",
    "check_tensors_still_match",
    "decode_blob",
    "encode_blob",
    "encode_blobs",
    "fold_chain",
    "full_updates",
    "inside_pause",
    "iter_chain",
    "merge_writers",
    "sparse_update",
]
