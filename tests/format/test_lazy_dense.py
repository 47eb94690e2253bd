"""A large dense record read lazily (``BlobRecords.lazily``: a verify pass's read) hashes to
the same digest as the record read whole, with and without later sparse pieces on top, from
bytes and from a file, at levels 0 and 1, closed and open segments, one-shot and streamed
sections, with chunk boundaries at awkward places; a lazy record read after its stream moved
on raises; every check still runs (a malformed blob is refused read lazily as read whole).

Differential throughout: the materialized records (a plain read) are the reference.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from deltasync.errors import FormatError
from deltasync.format import (
    BlobRecords,
    TensorSpec,
    TensorUpdate,
    encode_blob,
    iter_chain,
    merge,
    section,
)
from deltasync.format.section import (
    CHUNK,
    READ_ONE_SHOT_MAX,
    FileSpan,
    read_words,
    read_words_in_place,
)
from deltasync.format.updates import LazyDense
from deltasync.layout.verify import chain_state_digest

from format_testkit import reseal

BF16 = torch.bfloat16
STREAMED = READ_ONE_SHOT_MAX // 2 + 4097  # a dense BF16 record whose section streams (odd)
SMALL = 40_001  # a dense record of a held (one-shot) section (odd)


def _bf16(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int16).view(BF16)


def _anchor(sizes: dict[str, int]) -> list[TensorUpdate]:
    return [
        TensorUpdate(name=k, shape=(n,), dtype=BF16, indices=None, values=_bf16(n, 10 + i))
        for i, (k, n) in enumerate(sizes.items())
    ]


def _delta(sizes: dict[str, int], seed: int) -> list[TensorUpdate]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in sizes.items():
        idx = torch.randperm(n, generator=g)[: max(1, n // 97)].sort().values
        out.append(
            TensorUpdate(
                name=k, shape=(n,), dtype=BF16, indices=idx, values=_bf16(idx.numel(), seed + n)
            )
        )
    return out


def _blob(updates, version: int, base: int, level: int, open_segments: bool) -> bytes:
    return encode_blob(
        updates,
        version=version,
        base_version=base,
        shard="tp0",
        writer="w00000",
        level=level,
        open_segments=open_segments,
    )


def _in_file(blob: bytes) -> FileSpan:
    f = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 - the span holds it open
    f.write(blob)
    return FileSpan(f)


def _digests(blobs: list[bytes], specs, *, file: bool, lazy_min: int | None, chunk: int) -> str:
    steps = []
    for k, blob in enumerate(blobs):
        records = BlobRecords(_in_file(blob) if file else blob, expected=specs)
        stream = records if lazy_min is None else records.lazily(lazy_min)
        steps.append((k, "anchor" if k == 0 else "delta", [stream]))
    tensors = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in specs.items()}
    return chain_state_digest(tensors, iter_chain(steps, specs), chunk=chunk)


SIZES = {"embed": STREAMED, "small": 7, "mid": SMALL, "head": STREAMED + 1}


# open segments are zstd frames only: no uncompressed (level 0) blob has them
FORMS = [(0, False), (1, False), (1, True)]


@pytest.mark.parametrize(("level", "open_segments"), FORMS)
@pytest.mark.parametrize("deltas", [0, 2])
@pytest.mark.parametrize("chunk", [1 << 20, 65_537, 4096])
def test_a_lazily_hashed_dense_record_gives_the_materialized_digest(
    level, open_segments, deltas, chunk
):
    specs = {k: TensorSpec(shape=(n,), dtype=BF16) for k, n in SIZES.items()}
    blobs = [_blob(_anchor(SIZES), 0, -1, level, open_segments)]
    blobs += [
        _blob(_delta(SIZES, 100 + v), v, v - 1, level, open_segments) for v in range(1, deltas + 1)
    ]
    want = _digests(blobs, specs, file=False, lazy_min=None, chunk=chunk)
    for file in (False, True):
        # every dense record lazy (even the 7-element one), and only the large ones
        for lazy_min in (1, SMALL * 2 + 1):
            got = _digests(blobs, specs, file=file, lazy_min=lazy_min, chunk=chunk)
            assert got == want, (file, lazy_min)


def test_a_lazy_record_reads_the_same_words_as_a_plain_read():
    ups = _anchor(SIZES)
    blob = _blob(ups, 0, -1, 1, False)
    for source in (blob, _in_file(blob)):
        for u, want in zip(BlobRecords(source).lazily(1), ups, strict=True):
            assert isinstance(u, LazyDense)
            got = torch.cat([c.clone() for c in u.chunks(65_535)])
            assert torch.equal(got.view(torch.int16), want.values.view(torch.int16)), u.name


@pytest.mark.parametrize("file", [False, True])
@pytest.mark.parametrize("level", [0, 1])
def test_a_lazy_record_read_after_its_stream_moved_on_raises(file, level):
    blob = _blob(_anchor(SIZES), 0, -1, level, False)
    records = iter(BlobRecords(_in_file(blob) if file else blob).lazily(1))
    first = next(records)
    second = next(records)  # the stream moved past ``first``
    with pytest.raises(FormatError, match="moved on"):
        first.materialized()
    with pytest.raises(FormatError, match="moved on"):
        next(first.chunks(1024))
    assert torch.equal(second.values.view(torch.int16), _anchor(SIZES)[1].values.view(torch.int16))
    with pytest.raises(FormatError, match="moved on"):
        second.materialized()  # readable once
    # half read, then the stream moves on: the rest is skipped, the next record is right
    third = next(records)
    chunks = third.chunks(1000)
    next(chunks)
    fourth = next(records)
    with pytest.raises(FormatError, match="moved on"):
        next(chunks)
    want = _anchor(SIZES)[3].values.view(torch.int16)
    assert torch.equal(fourth.values.view(torch.int16), want)
    assert list(records) == []  # the end-of-blob checks pass


def test_a_read_ahead_lazy_record_is_held_whole_by_the_lockstep(monkeypatch):
    """An anchor and a delta of dense records listing their tensors in opposite orders: the
    lockstep reads the delta's second record ahead of its turn and holds it read whole
    (a lazy record is unreadable once its stream moves on); the digest is the plain one."""
    sizes = {"x": STREAMED, "y": STREAMED + 5}
    specs = {k: TensorSpec(shape=(n,), dtype=BF16) for k, n in sizes.items()}
    anchor = _blob(_anchor(sizes), 0, -1, 1, False)
    dense = [
        TensorUpdate(name=k, shape=(n,), dtype=BF16, indices=None, values=_bf16(n, 50 + n))
        for k, n in reversed(sizes.items())
    ]
    delta = _blob(dense, 1, 0, 1, False)
    held = []
    real = merge.materialized
    monkeypatch.setattr(merge, "materialized", lambda u: held.append(u.name) or real(u))
    tensors = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in specs.items()}

    def steps(wrap):
        return [
            (0, "anchor", [wrap(BlobRecords(anchor))]),
            (1, "delta", [wrap(BlobRecords(_in_file(delta)))]),
        ]

    want = chain_state_digest(tensors, iter_chain(steps(lambda r: r), specs))
    assert held == ["y"]  # plain records go through the same call (returned as they are)
    held.clear()
    got = chain_state_digest(tensors, iter_chain(steps(lambda r: r.lazily(1)), specs), chunk=5000)
    assert got == want
    assert held == ["y"]


def test_a_damaged_blob_is_refused_read_lazily_as_read_whole():
    """A byte changed at many places of a compressible anchor's frames (digest resealed, so
    only the structural and zstd checks can refuse it): read lazily, the blob is refused
    wherever the plain read refuses it, and elsewhere hashes to the plain read's digest:
    never a digest of other bytes."""
    g = torch.Generator().manual_seed(3)
    ups = [
        TensorUpdate(
            name=k,
            shape=(n,),
            dtype=BF16,
            indices=None,
            values=(torch.randn(n, generator=g) * 0.02).to(BF16),
        )
        for k, n in SIZES.items()
    ]
    specs = {k: TensorSpec(shape=(n,), dtype=BF16) for k, n in SIZES.items()}
    clean = _blob(ups, 0, -1, 1, False)

    def outcome(blob, lazy_min):
        try:
            return ("ok", _digests([blob], specs, file=True, lazy_min=lazy_min, chunk=65_536))
        except FormatError:
            return ("refused",)

    refused = 0
    for k in range(1, 48):
        blob = bytearray(clean)
        blob[len(blob) * k // 48] ^= 0x5A
        blob = reseal(bytes(blob))
        plain = outcome(blob, None)
        assert outcome(blob, 1) == plain, k
        refused += plain[0] == "refused"
    assert refused  # a position reaches a check (most change values zstd cannot tell)


# --- the write pass: 2-byte words decoded in place, no low-plane scratch -----------------


def _planes(words: np.ndarray) -> bytes:
    b = words.view(np.uint8).reshape(-1, 2)
    return b[:, 0].tobytes() + b[:, 1].tobytes()


def _source(data: bytes):
    view, at = memoryview(data), [0]

    def source(buf: memoryview, what: str) -> None:
        buf[:] = view[at[0] : at[0] + len(buf)]
        at[0] += len(buf)

    return source, at


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize(
    "n", [1, 2, 3, 4, 5, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK + 3, 3 * CHUNK]
)
def test_words_decoded_in_place_equal_read_words(n, join, monkeypatch):
    if not join:  # the numpy path of a host without the C kernel
        monkeypatch.setattr(section, "can_join_planes", lambda out, width: False)
    rng = np.random.default_rng(n)
    words = rng.integers(-(1 << 15), 1 << 15, size=n, dtype=np.int64).astype("<i2")
    data = _planes(words) + b"next"
    want = np.empty(n, dtype="<i2")
    source, at = _source(data)
    read_words(source, want, 2, "w")
    assert at[0] == 2 * n
    got = np.full(n, 0x5A5A, dtype="<i2")  # whatever the live tensor held before
    source, at = _source(data)
    read_words_in_place(source, got, "w")
    assert at[0] == 2 * n  # exactly its planes: the next record starts where it should
    assert np.array_equal(got, want) and np.array_equal(got, words)


# (elements, chunk asked for): every size against chunks of a page, CHUNK and beyond, and tiny
# chunks against tiny records and across one CHUNK boundary (7 does not divide CHUNK); tiny
# chunks over the largest records only repeated those crossings, a Python call per element
SIZES_AND_CHUNKS = [
    *(
        (n, m)
        for n in (1, 3, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 5)
        for m in (4096, CHUNK, 3 * CHUNK)
    ),
    *((n, m) for n in (1, 3) for m in (1, 7)),
    (CHUNK + 1, 7),
]


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize(("n", "m"), SIZES_AND_CHUNKS)
def test_lazy_words_equal_read_words(n, m, join, monkeypatch):
    if not join:
        monkeypatch.setattr(section, "can_join_planes", lambda out, width: False)
    rng = np.random.default_rng(n + m)
    words = rng.integers(-(1 << 15), 1 << 15, size=n, dtype=np.int64).astype("<i2")
    data = _planes(words) + b"tail"
    reader = section.SectionReader(memoryview(data), len(data), False, "s")
    lazy = reader.lazy_words(n, "w")
    got = np.concatenate([c.copy() for c in lazy.chunks(m)])
    assert np.array_equal(got, words)
    assert reader.read(4, "tail") == b"tail"
    reader.finish()
