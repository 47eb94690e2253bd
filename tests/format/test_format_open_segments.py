"""Open segments (wire FLAG_OPEN_SEGMENTS): a writer streams a large segment's zstd frame out
as it is produced, its length left open and the frame ending it. Such a blob decodes to the
same updates as the closed one, its frame is the same bytes, its bytes reach the sink before
the segment ends, and every way an open segment can lie is refused."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import FormatError, TruncatedBlobError
from deltasync.format import BlobWriter, InvalidUpdateError, decode_blob, section, sparse_update
from deltasync.format.updates import PartedUpdate
from deltasync.format.wire import FLAG_OPEN_SEGMENTS, FLAG_ZSTD, OPEN_LEN, SEGMENT

from format_testkit import assemble, same_update, split_blob, totals

HEAD = dict(version=6, base_version=5, shard="tp1", writer="w00001")
SMALL = 2000  # the one-shot size the tests set: sections above it stream


def updates() -> list:
    """A small update, a large one (its section streams), a small one."""
    g = torch.Generator().manual_seed(11)
    out = []
    for k, (rows, density) in enumerate([(8, 0.3), (200, 0.4), (8, 0.3)]):
        new = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        idx = torch.nonzero(torch.rand(new.numel(), generator=g) < density).reshape(-1)
        out.append(sparse_update(f"layer{k}.weight", new, idx))
    return out


def write(groups: list[list], *, open_segments: bool, level: int = 1) -> tuple[list, BlobWriter]:
    chunks: list[bytes] = []
    writer = BlobWriter(chunks.append, **HEAD, level=level, open_segments=open_segments)
    for group in groups:
        writer.segment(group)
    writer.finish()
    return chunks, writer


@pytest.fixture(autouse=True)
def _small_one_shot(monkeypatch):
    monkeypatch.setattr(section, "ONE_SHOT_MAX", SMALL)


def test_an_open_blob_decodes_to_the_same_updates_and_frames_as_the_closed_one():
    ups = updates()
    groups = [ups[:1], ups[1:2], ups[2:]]
    chunks, writer = write(groups, open_segments=True)
    blob = b"".join(chunks)
    decoded = decode_blob(blob, version=6, base_version=5, shard="tp1")
    assert all(same_update(a, b) for a, b in zip(decoded.updates, ups, strict=True))
    closed = b"".join(write(groups, open_segments=False)[0])
    head, _, segs, trailer = split_blob(blob)
    c_head, _, c_segs, c_trailer = split_blob(closed)
    assert head["flags"] == FLAG_ZSTD | FLAG_OPEN_SEGMENTS and c_head["flags"] == FLAG_ZSTD
    # only the large segment is open; every frame is byte for byte the closed blob's
    assert [f["section_len"] == OPEN_LEN for f, _ in segs] == [False, True, False]
    assert [s for _, s in segs] == [s for _, s in c_segs]
    assert trailer == c_trailer and writer.body_len == trailer["body_len"]
    assert b"".join(write(groups, open_segments=True)[0]) == blob  # deterministic


def test_an_open_segment_reaches_the_sink_before_it_ends():
    """The frame goes out as zstd produces it: bytes arrive while the record's parts are
    still being read, not once the segment is complete."""
    g = torch.Generator().manual_seed(3)
    n = 1 << 17
    idx = torch.arange(n, dtype=torch.int64) * 3
    vals = torch.randn(n, generator=g).to(torch.bfloat16)
    sent_before_part: list[int] = []
    chunks: list[bytes] = []

    def parts():
        for a in range(0, n, 1 << 14):
            sent_before_part.append(sum(len(c) for c in chunks))
            yield idx[a : a + (1 << 14)], vals[a : a + (1 << 14)]

    update = PartedUpdate(
        name="w", shape=(3 * n,), dtype=torch.bfloat16, nnz=n, first=0, max_gap=3, parts=parts
    )
    writer = BlobWriter(chunks.append, **HEAD, open_segments=True)
    header = sum(len(c) for c in chunks)
    writer.segment([update])
    opened = chunks[1]
    assert SEGMENT.unpack(opened)[0] == OPEN_LEN  # the segment header went out first
    assert sent_before_part[-1] > header + SEGMENT.size  # frame bytes before the last part
    writer.finish()
    (back,) = decode_blob(b"".join(chunks)).updates
    assert torch.equal(back.indices, idx) and torch.equal(
        back.values.view(torch.int16), vals.view(torch.int16)
    )


def test_a_record_failing_inside_an_open_segment_leaves_the_blob_unfinishable():
    ups = updates()
    big = ups[1]
    bad = PartedUpdate(
        name=big.name,
        shape=big.shape,
        dtype=big.dtype,
        nnz=big.nnz + 1,  # one more than the parts give
        first=int(big.indices[0]),
        max_gap=int((big.indices[1:] - big.indices[:-1]).max()),
        parts=lambda: iter([(big.indices, big.values)]),
    )
    chunks: list[bytes] = []
    writer = BlobWriter(chunks.append, **HEAD, open_segments=True)
    with pytest.raises(InvalidUpdateError, match=big.name):
        writer.segment([bad])
    for later in (lambda: writer.segment(ups[:1]), writer.finish):
        with pytest.raises(InvalidUpdateError, match="cannot be finished"):
            later()


def test_without_compression_nothing_is_open():
    chunks, _ = write([updates()], open_segments=True, level=0)
    head, _, segs, _ = split_blob(b"".join(chunks))
    assert head["flags"] == 0 and segs[0][0]["section_len"] != OPEN_LEN


def _open_blob() -> tuple[dict, bytes, list, dict]:
    chunks, _ = write([updates()[:1], updates()[1:2]], open_segments=True)
    return split_blob(b"".join(chunks))


def test_open_segments_without_compression_are_refused():
    head, ids, segs, trailer = _open_blob()
    with pytest.raises(FormatError, match="open segments without compressing"):
        decode_blob(assemble({**head, "flags": FLAG_OPEN_SEGMENTS}, ids, segs, trailer))


def test_an_open_length_without_the_flag_is_refused():
    head, ids, segs, trailer = _open_blob()
    with pytest.raises(TruncatedBlobError, match="only"):
        decode_blob(assemble({**head, "flags": FLAG_ZSTD}, ids, segs, trailer))


def test_an_open_frame_cut_short_is_truncated_not_misread():
    head, ids, segs, _ = _open_blob()
    (f, s) = segs[1]
    cut = [segs[0], (f, s[: len(s) // 2])]
    with pytest.raises(TruncatedBlobError, match="zstd frame"):
        decode_blob(assemble(head, ids, cut, totals(cut)))


def test_bytes_after_an_open_frame_are_refused():
    head, ids, segs, _ = _open_blob()
    (f, s) = segs[1]
    padded = [segs[0], (f, s + b"\0" * 7)]
    with pytest.raises(FormatError, match=r"end at byte|unaccounted"):
        decode_blob(assemble(head, ids, padded, totals(padded)))
