"""A parted record above the one-shot size is written without its raw section ever existing:
the encoder holds the compressed frame (the format puts its length first) and the value bytes
after the first plane, not the record's bytes. Measured on the process's resettable RSS
high-water mark (Linux), in a fresh process, on a record whose raw section would stand far
above the bound."""

from __future__ import annotations

import torch
from kit import in_fresh_process, settled_rss, status_kib

from deltasync.format import BlobWriter, section
from deltasync.format.updates import PartedUpdate

N = 12 << 20  # changed elements: a raw section of 48 MiB (2-byte gaps, 2-byte values)
STRIDE = 300  # gaps of 294..301: two bytes each
SLICE = 1 << 16
HEAD = dict(version=2, base_version=1, shard="tp0", writer="w00000")


def _update(n: int) -> PartedUpdate:
    """``n`` changed elements, produced a slice at a time (nothing of the update is held)."""

    def indices():
        for a in range(0, n, SLICE):
            i = torch.arange(a, min(n, a + SLICE), dtype=torch.int64)
            yield i * STRIDE + i % 7

    def parts():
        for idx in indices():
            yield idx, torch.sin(idx.float() * 0.37).to(torch.bfloat16)

    return PartedUpdate(
        name="w",
        shape=(n * STRIDE + 7,),
        dtype=torch.bfloat16,
        nnz=n,
        first=0,
        max_gap=STRIDE + 1,
        parts=parts,
        indices=indices,
    )


def _measure() -> tuple[int, int, int]:
    """The RSS peak of encoding the update above the settled baseline, its section's
    compressed and raw bytes."""
    written = [0]

    def sink(chunk: bytes) -> None:  # the store's side: counted, not kept
        written[0] += len(chunk)

    BlobWriter(sink, **HEAD).segment([_update(SLICE * 3)])  # warm: zstd, numpy, torch
    base = settled_rss()
    writer = BlobWriter(sink, **HEAD)
    writer.segment([_update(N)])
    peak = status_kib("VmHWM") * 1024 - base
    return peak, writer.body_len, writer.raw_len


def test_a_large_parted_record_never_holds_its_raw_section() -> None:
    peak, frame, raw = in_fresh_process(_measure)
    assert raw > section.ONE_SHOT_MAX and raw >= 4 * N - 2  # streamed: above the one-shot size
    # What it may hold: the frame, the values' second byte plane (one byte per element) and a
    # fixed ~9 MiB (zstd's streaming context and window, a slice): measured 20.7 MiB here, so
    # the bound leaves ~8 MiB of slack. Writing into the raw section first held its 48 MiB and
    # the frame at once.
    assert peak < frame + N + 16 * 2**20, (peak, frame, raw)
