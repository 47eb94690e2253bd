"""A chain verified with its large sparse pieces stashed in a file (format.stash) hashes to the
state the whole chain leaves, exactly as without a stash; the same chain written version by
version (each step's pieces alone, in chain order: the receiver's write pass) leaves that state
bit for bit; a held section is let go once its last record is read.

Chains: an anchor (dense and sparse records), then deltas of two writers each whose elements
overlap from version to version (later wins), a dense delta in the middle, empty records,
BF16, FP16 and FP32 tensors, one of no elements; blobs read from bytes and from a file, lazily
as a verify reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import tracemalloc

import pytest
import torch
from kit import assert_same_bits, random_update

from deltasync import scratch
from deltasync.errors import BlobMismatchError, LocalStateError
from deltasync.format import (
    BlobRecords,
    TensorSpec,
    TensorUpdate,
    apply_pieces,
    apply_updates,
    decode_blob,
    encode_blob,
    fold_chain,
    iter_chain,
    merge_writers,
)
from deltasync.format.section import FileSpan
from deltasync.format.stash import Stash, StashedPiece
from deltasync.layout.digest import state_digest
from deltasync.layout.verify import chain_state_digest

BF16 = torch.bfloat16
SPECS = {
    "emb": TensorSpec(shape=(300, 64), dtype=BF16),  # many verify chunks
    "h": TensorSpec(shape=(4000,), dtype=torch.float16),
    "f": TensorSpec(shape=(50, 30), dtype=torch.float32),
    "small": TensorSpec(shape=(40,), dtype=BF16),  # one chunk
    "none": TensorSpec(shape=(0, 8), dtype=BF16),  # no elements
}
CHUNK = 1000  # elements per verify chunk
VERSIONS = 6


def _numel(name: str) -> int:
    return int(torch.Size(SPECS[name].shape).numel())


def _dense(name: str, gen: torch.Generator) -> TensorUpdate:
    spec = SPECS[name]
    vals = torch.randn(_numel(name), generator=gen).to(spec.dtype)
    return TensorUpdate(name=name, shape=spec.shape, dtype=spec.dtype, indices=None, values=vals)


def _empty(name: str) -> TensorUpdate:
    spec = SPECS[name]
    idx = torch.zeros(0, dtype=torch.int64)
    vals = torch.zeros(0, dtype=spec.dtype)
    return TensorUpdate(name=name, shape=spec.shape, dtype=spec.dtype, indices=idx, values=vals)


def _blob(version: int, base: int, updates: list[TensorUpdate], writer: str) -> bytes:
    return encode_blob(updates, version=version, base_version=base, shard="tp0", writer=writer)


def _chain(seed: int) -> list[tuple[int, str, list[bytes]]]:
    """(version, kind, blobs): an anchor, then VERSIONS deltas of two disjoint writers whose
    elements come from one hot set (each element rewritten by several versions)."""
    gen = torch.Generator().manual_seed(seed)
    anchor = [_dense("emb", gen), random_update(SPECS, "h", gen, 0.5), _dense("f", gen)]
    anchor += [_dense("small", gen), _dense("none", gen)]
    steps = [(0, "anchor", [_blob(0, -1, anchor, "w00000")])]
    hot = {n: torch.rand(_numel(n), generator=gen) < 0.3 for n in SPECS}
    for v in range(1, VERSIONS + 1):
        writers: list[list[TensorUpdate]] = [[], []]
        for name in ("emb", "h", "f", "small"):
            if name == "f" and v == 3:
                writers[0].append(_dense("f", gen))  # a dense delta in the middle
                continue
            if name == "small" and v % 2:
                writers[1].append(_empty("small"))  # an empty record
                continue
            even = torch.zeros(_numel(name), dtype=torch.bool)
            even[::2] = True
            for w, half in enumerate((even, ~even)):
                writers[w].append(random_update(SPECS, name, gen, 0.6, keep=hot[name] & half))
        steps.append(
            (
                v,
                "delta",
                [_blob(v, v - 1, writers[0], "w00000"), _blob(v, v - 1, writers[1], "w00001")],
            )
        )
    return steps


def _live(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in SPECS.items()}


def _folded(live, steps) -> dict[str, torch.Tensor]:
    """The reference: decode everything, merge writers, fold, scatter."""
    out = {n: t.clone() for n, t in live.items()}
    decoded = [
        (kind, merge_writers(v, [decode_blob(b).updates for b in blobs]))
        for v, kind, blobs in steps
    ]
    apply_updates(fold_chain(decoded, SPECS), out)
    return out


@pytest.fixture(params=["bytes", "file"])
def read(request):
    """How the blobs are read: from their bytes, or from a file (a receiver's spill)."""
    files = []

    def records(blob: bytes) -> BlobRecords:
        if request.param == "bytes":
            return BlobRecords(blob, expected=SPECS, shard="tp0", narrow_indices=True)
        f = tempfile.TemporaryFile(buffering=0)  # noqa: SIM115 (closed by the fixture)
        files.append(f)
        f.write(blob)
        span = FileSpan(f, 0, len(blob))
        return BlobRecords(span, expected=SPECS, shard="tp0", narrow_indices=True)

    yield records
    for f in files:
        f.close()


def _verify_chain(steps, read):
    return [(v, kind, [read(b).lazily(1) for b in blobs]) for v, kind, blobs in steps]


@pytest.mark.parametrize("stash_chunk", [CHUNK, 700], ids=["bounds-kept", "bounds-read-back"])
def test_a_chain_verified_with_its_pieces_stashed_hashes_to_the_state_it_leaves(
    tmp_path, read, stash_chunk
):
    steps = _chain(1)
    live = _live(2)
    want = state_digest(_folded(live, steps))
    held = chain_state_digest(live, iter_chain(_verify_chain(steps, read), SPECS), chunk=CHUNK)
    kept = []
    # a stash for another chunk than the verify's reads each piece's bounds back
    with Stash(str(tmp_path), chunk=stash_chunk, min_bytes=1) as stash:

        def keep(u):
            kept.append(stash.keep(u))
            return kept[-1]

        chain = iter_chain(_verify_chain(steps, read), SPECS, keep=keep)
        got = chain_state_digest(live, chain, chunk=CHUNK)
    assert got == want == held
    stashed = [p for p in kept if isinstance(p, StashedPiece)]
    # every non-empty sparse piece of every version (the dense ones and empty records stay)
    assert {p.name for p in stashed} == {"emb", "h", "f", "small"}
    assert len(stashed) > 2 * VERSIONS


def test_a_chain_written_version_by_version_leaves_what_the_folded_chain_leaves(read):
    steps = _chain(3)
    live = _live(4)
    out = {n: t.clone() for n, t in live.items()}
    for v, kind, blobs in steps:  # each step's pieces alone, in chain order
        for item in iter_chain([(v, kind, [read(b) for b in blobs])], SPECS, check=False):
            apply_pieces(item, out, ordered=True)
    assert_same_bits(out, _folded(live, steps), "written version by version")


def test_overlapping_writers_are_refused_with_their_pieces_stashed(tmp_path):
    gen = torch.Generator().manual_seed(5)
    a = random_update(SPECS, "emb", gen, 0.3)
    b = random_update(SPECS, "emb", gen, 0.3)  # shares elements with ``a``
    steps = [
        (1, "delta", [_blob(1, 0, [a], "w00000")]),
        (2, "delta", [_blob(2, 1, [a], "w00000"), _blob(2, 1, [b], "w00001")]),
    ]
    chain = [(v, kind, [BlobRecords(x, expected=SPECS) for x in blobs]) for v, kind, blobs in steps]
    with Stash(str(tmp_path), chunk=CHUNK, min_bytes=1) as stash:
        with pytest.raises(BlobMismatchError, match="version 2: two writers sent the same element"):
            list(iter_chain(chain, SPECS, keep=stash.keep))


@pytest.mark.parametrize("why", ["no-dir", "no-room"])
def test_a_stash_that_cannot_write_keeps_its_pieces_in_memory_and_says_so(
    tmp_path, monkeypatch, caplog, why
):
    where = tmp_path / "no-such-dir" if why == "no-dir" else tmp_path
    if why == "no-room":  # the room a stash leaves beside it: more than any disk has free
        monkeypatch.setattr(scratch, "HEADROOM", 1 << 62)
    steps = _chain(6)
    live = _live(7)
    records = [
        (v, kind, [BlobRecords(b, expected=SPECS) for b in blobs]) for v, kind, blobs in steps
    ]
    with caplog.at_level(logging.WARNING, logger="deltasync.format.stash"):
        with Stash(str(where), chunk=CHUNK, min_bytes=1) as stash:
            kept = []

            def keep(u):
                kept.append(stash.keep(u))
                return kept[-1]

            got = chain_state_digest(live, iter_chain(records, SPECS, keep=keep), chunk=CHUNK)
    assert got == state_digest(_folded(live, steps))
    assert kept and not any(isinstance(p, StashedPiece) for p in kept)
    assert str(where) in caplog.text and "Free space in that dir" in caplog.text
    if why == "no-room":
        assert "bytes free" in caplog.text and list(tmp_path.iterdir()) == []


def test_a_held_section_is_let_go_once_its_last_record_is_read():
    # One sparse record in a one-shot section (below READ_ONE_SHOT_MAX decompressed): a
    # chain read in lockstep keeps the stream suspended after it, and the decompressed
    # section must not stay beside the decoded record.
    n = 200_000
    spec = TensorSpec(shape=(8 * n,), dtype=BF16)
    gen = torch.Generator().manual_seed(8)
    idx = torch.randperm(8 * n, generator=gen)[:n].sort().values
    vals = torch.randn(n, generator=gen).to(BF16)
    u = TensorUpdate(name="x", shape=spec.shape, dtype=BF16, indices=idx, values=vals)
    blob = _blob(1, 0, [u], "w00000")
    records = iter(BlobRecords(blob, expected={"x": spec}, narrow_indices=True))
    tracemalloc.start()
    try:
        got = next(records)  # the stream stays suspended after its last record
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    decoded = got.indices.numel() * 4 + got.values.numel() * 2
    section = 3 * n  # at least a gap byte and two value bytes an element
    assert held < decoded + section // 2, (held, decoded, section)
    assert torch.equal(got.indices.to(torch.int64), idx)
    assert list(records) == []


def _stashed(stash: Stash, kind: str = "scattered") -> tuple[TensorUpdate, StashedPiece]:
    gen = torch.Generator().manual_seed(9)
    u = random_update(SPECS, "emb", gen, 0.4)
    idx = u.indices.to(torch.int32)
    if kind == "run":  # every index from 1000 to 9999: a writer's whole rows
        idx = torch.arange(1000, 10000, dtype=torch.int32)
    vals = torch.randn(idx.numel(), generator=gen).to(u.dtype)
    u = TensorUpdate(u.name, u.shape, u.dtype, idx, vals)
    p = stash.keep(u)
    assert isinstance(p, StashedPiece) and p.run == (kind == "run")
    return u, p


@pytest.mark.parametrize("kind", ["scattered", "run"])
def test_a_stashed_piece_reads_back_as_the_piece_it_parked(tmp_path, monkeypatch, kind):
    reads = []
    real_read = StashedPiece._read

    def counted(self, count, dtype, offset):
        reads.append(dtype)
        return real_read(self, count, dtype, offset)

    monkeypatch.setattr(StashedPiece, "_read", counted)
    with Stash(str(tmp_path), chunk=CHUNK, min_bytes=1) as stash:
        u, p = _stashed(stash, kind)
        on_file = os.fstat(p.file.fileno()).st_size
        assert on_file == u.nnz * (2 if kind == "run" else 6)  # a run: its values alone
        for lo, hi in [(0, u.nnz), (0, 1), (17, 900), (u.nnz - 3, u.nnz), (5, 5)]:
            for got, want in zip(p.span(lo, hi), u.span(lo, hi), strict=True):
                assert got.dtype == want.dtype and torch.equal(got.view(-1), want.view(-1))
        assert torch.equal(p.all_indices(), u.indices)
        assert p.index_range() == u.index_range()
        starts = torch.tensor([0, 999, 1000, 1001, 5000, 9999, 10000, 10001, 19200])
        assert p.locate(starts) == u.locate(starts)
        reads.clear()
        assert p.chunk_bounds(CHUNK) == u.chunk_bounds(CHUNK)
        assert reads == []  # found as the piece was written: nothing read back
        assert p.chunk_bounds(700) == u.chunk_bounds(700)
        assert (reads == []) == (kind == "run")  # another chunk: read back, or counted out


def test_a_stash_that_cannot_be_read_back_names_the_tensor_and_its_dir(tmp_path):
    with Stash(str(tmp_path), chunk=CHUNK, min_bytes=1) as stash:
        _, p = _stashed(stash)
        with open(os.devnull, "wb") as write_only:  # a real EBADF on read
            broken = dataclasses.replace(p, file=write_only)
            with pytest.raises(LocalStateError, match=r"tensor 'emb'.*Nothing was written") as e:
                broken.span(0, 10)
    assert str(tmp_path) in str(e.value) and isinstance(e.value.__cause__, OSError)
