"""BlobRecords over a file (``section.FileSpan``: a receiver's private spill of a large blob)
reads the same records as over the blob's bytes, and refuses a malformed blob with the same
error and message: the header, trailer and structure checks (decode.py's checks 2-4) run on
the file as on bytes; only the digest is not recomputed (its spiller hashed it as it wrote it).

Differential: every blob is decoded both ways, including blobs with a byte changed at many
positions and the digest resealed (so only the structural checks can refuse them), closed and
open segments, raw and zstd sections, one-shot and streamed ones.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from deltasync.format import BlobRecords, TensorSpec, TensorUpdate, encode_blob
from deltasync.format.section import READ_ONE_SHOT_MAX, FileSpan

from format_testkit import reseal

HEAD = dict(version=5, base_version=-1, shard="tp0", writer="w00000")
BF16 = torch.bfloat16
BIG = (READ_ONE_SHOT_MAX // 2) + 4096  # a dense BF16 record whose section streams


def _updates(big: bool) -> list[TensorUpdate]:
    g = torch.Generator().manual_seed(7)
    ups = [
        TensorUpdate(
            name="a",
            shape=(4, 4),
            dtype=BF16,
            indices=torch.tensor([0, 5, 15]),
            values=torch.tensor([1.0, -2.0, 3.0]).to(BF16),
        ),
        TensorUpdate(
            name="d",
            shape=(64, 8),
            dtype=torch.float32,
            indices=None,
            values=torch.randn(512, generator=g),
        ),
    ]
    if big:
        ups.append(
            TensorUpdate(
                name="e",
                shape=(BIG,),
                dtype=BF16,
                indices=None,
                values=(torch.randn(BIG, generator=g) * 0.02).to(BF16),
            )
        )
    return ups


def _specs(ups: list[TensorUpdate]) -> dict[str, TensorSpec]:
    return {u.name: TensorSpec(shape=u.shape, dtype=u.dtype) for u in ups}


def _outcome(source, specs) -> tuple:
    """("ok", the records' bits) or (error type, message) of reading every record."""
    try:
        records = BlobRecords(source, expected=specs, narrow_indices=True)
        got = []
        for u in records:
            bits = u.values.view(torch.int16 if u.dtype == BF16 else torch.int32)
            idx = None if u.indices is None else u.indices.tolist()
            got.append((u.name, u.shape, idx, bits.clone()))
        names = records.names()
    except Exception as exc:  # every outcome is compared, errors included
        return (type(exc), str(exc))
    return ("ok", got, names)


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != "ok" or b[0] != "ok":
        return a == b
    return a[2] == b[2] and all(
        x[:3] == y[:3] and torch.equal(x[3], y[3]) for x, y in zip(a[1], b[1], strict=True)
    )


def _both(blob: bytes, specs) -> tuple[tuple, tuple]:
    with tempfile.TemporaryFile(buffering=0) as f:
        f.write(blob)
        return _outcome(blob, specs), _outcome(FileSpan(f, 0, len(blob)), specs)


# open segments are zstd frames only: no uncompressed (level 0) blob has them
FORMS = [(0, False), (1, False), (1, True)]


@pytest.mark.parametrize(("level", "open_segments"), FORMS)
@pytest.mark.parametrize("big", [False, True])
def test_a_blob_in_a_file_reads_as_its_bytes(level, open_segments, big) -> None:
    ups = _updates(big)
    blob = encode_blob(ups, **HEAD, level=level, open_segments=open_segments)
    mem, file = _both(blob, _specs(ups))
    assert mem[0] == "ok", mem
    assert _same(mem, file)


@pytest.mark.parametrize(("level", "open_segments"), FORMS)
def test_a_resealed_damaged_blob_is_refused_from_a_file_as_from_its_bytes(
    level, open_segments
) -> None:
    ups = _updates(False)
    blob = encode_blob(ups, **HEAD, level=level, open_segments=open_segments)
    specs = _specs(ups)
    refused = 0
    for at in range(len(blob) - 16):
        for flip in (0x01, 0x80):
            bad = bytearray(blob)
            bad[at] ^= flip
            mem, file = _both(reseal(bytes(bad)), specs)
            assert _same(mem, file), (at, flip, mem[:2], file[:2])
            refused += mem[0] != "ok"
    assert refused > 300  # the heads, ids, frame and trailer (most bytes are float values)


def test_a_streamed_section_damaged_in_its_frame_is_refused_the_same_way() -> None:
    ups = _updates(True)
    blob = encode_blob(ups, **HEAD, level=1)
    specs = _specs(ups)
    for at in range(len(blob) // 3, len(blob) - 16, max(1, len(blob) // 97)):
        bad = bytearray(blob)
        bad[at] ^= 0x40
        mem, file = _both(reseal(bytes(bad)), specs)
        assert _same(mem, file), (at, mem[:2], file[:2])


def test_a_span_read_after_its_file_was_closed_raises() -> None:
    ups = _updates(False)
    blob = encode_blob(ups, **HEAD, level=1)
    with tempfile.TemporaryFile(buffering=0) as f:
        f.write(blob)
        records = BlobRecords(FileSpan(f, 0, len(blob)), expected=_specs(ups))
    with pytest.raises(ValueError):
        list(records)
