"""Format 2 segments: a blob streamed segment by segment by BlobWriter decodes to the same
updates as one segment, and every way a segment or the trailer can disagree is refused."""

from __future__ import annotations

import pytest
import torch
import xxhash

from deltasync.errors import FormatError, TruncatedBlobError
from deltasync.format import BlobWriter, InvalidUpdateError, decode_blob, encode_blob, sparse_update

from format_testkit import assemble, same_update, split_blob, totals

HEAD = dict(version=3, base_version=2, shard="tp1", writer="w00002")


def updates(n: int = 5) -> list:
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(n):
        new = torch.randn(64, 33, generator=g).to(torch.bfloat16)
        idx = torch.randperm(new.numel(), generator=g)[: 40 + k].sort().values
        out.append(sparse_update(f"layer{k}.weight", new, idx))
    return out


def streamed(groups: list[list], level: int = 1) -> tuple[list[bytes], BlobWriter]:
    chunks: list[bytes] = []
    writer = BlobWriter(chunks.append, **HEAD, level=level)
    for group in groups:
        writer.segment(group)
    writer.finish()
    return chunks, writer


@pytest.mark.parametrize("level", [0, 1])
def test_a_blob_streamed_in_segments_decodes_to_the_same_updates(level):
    ups = updates()
    chunks, writer = streamed([ups[:2], [], ups[2:3], ups[3:]], level)
    blob = b"".join(chunks)
    assert writer.segments == 3 and writer.records == 5  # the empty batch wrote nothing
    # the trailer's transit digest (xxh3-128); the manifest lists BLAKE2b-256 (blob_digest)
    assert writer.size == len(blob) and writer.digest == xxhash.xxh3_128_hexdigest(blob)
    decoded = decode_blob(blob, version=3, base_version=2, shard="tp1")
    assert all(same_update(a, b) for a, b in zip(decoded.updates, ups, strict=True))
    # the header goes out before any record is known, and nothing is held back
    assert chunks[0][:4] == b"DSYB" and len(chunks[0]) == 28 + 3 + 6
    assert b"".join(streamed([ups[:2], ups[2:3], ups[3:]], level)[0]) == blob  # deterministic


def test_encode_blob_is_one_segment_of_the_streaming_writer():
    ups = updates()
    chunks, _ = streamed([ups])
    assert encode_blob(ups, **HEAD) == b"".join(chunks)


def test_the_writer_refuses_a_tensor_in_two_segments_and_stays_usable():
    ups = updates(3)
    chunks: list[bytes] = []
    writer = BlobWriter(chunks.append, **HEAD)
    writer.segment(ups[:2])
    with pytest.raises(InvalidUpdateError, match="appears twice"):
        writer.segment([ups[2], ups[0]])
    writer.segment(ups[2:])  # the refused batch left no trace
    writer.finish()
    decoded = decode_blob(b"".join(chunks))
    assert [u.name for u in decoded.updates] == [u.name for u in ups]
    with pytest.raises(InvalidUpdateError, match="already finished"):
        writer.segment(ups[:1])


def two_segment_blob() -> bytes:
    ups = updates(3)
    return b"".join(streamed([ups[:2], ups[2:]])[0])


def reassembled(blob: bytes, *, segments=None, **trailer) -> bytes:
    head, ids, segs, _ = split_blob(blob)
    segs = segs if segments is None else segments(segs)
    fields = totals(segs)
    fields.update(trailer)
    return assemble(head, ids, segs, fields)


def test_split_and_reassemble_is_the_identity():
    blob = two_segment_blob()
    assert reassembled(blob) == blob


def test_a_tensor_repeated_in_a_later_segment_is_refused():
    blob = reassembled(two_segment_blob(), segments=lambda s: [s[0], s[0]])
    with pytest.raises(FormatError, match="appears twice"):
        decode_blob(blob)


def test_a_segment_without_records_is_refused():
    def empty_second(segs):
        fields, section = segs[1]
        return [segs[0], ({**fields, "record_count": 0}, section)]

    with pytest.raises(FormatError, match="at least one record"):
        decode_blob(reassembled(two_segment_blob(), segments=empty_second))


@pytest.mark.parametrize(
    "trailer, error, match",
    [
        (dict(segment_count=3), TruncatedBlobError, "header runs past"),
        (dict(segment_count=1), FormatError, "unaccounted|end at byte"),
        (dict(total_records=4), FormatError, "unaccounted"),
        (dict(total_records=2), TruncatedBlobError, "only"),
        (dict(total_raw=10**6), FormatError, "unaccounted"),
        (dict(total_raw=100), TruncatedBlobError, "cannot fit|only"),
        (dict(body_len=1), FormatError, "trailer declares"),
        (dict(end_magic=b"DSYX"), FormatError, "trailer magic"),
        (dict(segment_count=7, total_records=5), TruncatedBlobError, "7 segments cannot fit"),
    ],
)
def test_a_trailer_that_disagrees_with_the_segments_is_refused(trailer, error, match):
    with pytest.raises(error, match=match):
        decode_blob(reassembled(two_segment_blob(), **trailer))


def test_a_segment_longer_than_the_body_is_refused_before_reading_it():
    def long_first(segs):
        fields, section = segs[0]
        return [({**fields, "section_len": 1 << 60}, section), segs[1]]

    with pytest.raises(TruncatedBlobError, match="only"):
        decode_blob(reassembled(two_segment_blob(), segments=long_first))


def test_a_blob_cut_between_segments_is_truncated_not_misread():
    blob = two_segment_blob()
    _head, ids, segs, _ = split_blob(blob)
    cut = 28 + len(ids) + 20 + len(segs[0][1])  # right after the first segment
    with pytest.raises(TruncatedBlobError, match="cut short"):
        decode_blob(blob[:cut])
    # a cut blob resealed by someone hostile still has no trailer to agree with
    body = blob[:cut]
    with pytest.raises(FormatError):
        decode_blob(body + xxhash.xxh3_128_digest(body))
