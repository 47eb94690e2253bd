"""Chunked streaming is an implementation detail: chunk sizes and the one-shot/streaming zstd
choice never change what decodes, and chunking never changes the bytes."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import FormatError
from deltasync.format import TensorUpdate, decode_blob, encode_blob, section

from format_testkit import craft, record, reseal, same_update

HEAD = dict(version=9, base_version=8, shard="tp0", writer="w00001")


def updates() -> list[TensorUpdate]:
    g = torch.Generator().manual_seed(11)
    out = []
    for k, (dtype, numel, nnz) in enumerate(
        [(torch.bfloat16, 5000, 301), (torch.float32, 700, None), (torch.float16, 1 << 20, 9)]
    ):
        idx = None if nnz is None else torch.randperm(numel, generator=g)[:nnz].sort().values
        nnz = numel if nnz is None else nnz
        out.append(
            TensorUpdate(
                name=f"t{k}",
                shape=(numel,),
                dtype=dtype,
                indices=idx,
                values=torch.randn(nnz, generator=g).to(dtype),
            )
        )
    return out


@pytest.mark.parametrize("level", [0, 1])
def test_tiny_chunks_give_the_same_bytes_and_decode_the_same(monkeypatch, level):
    reference = encode_blob(updates(), **HEAD, level=level)
    monkeypatch.setattr(section, "CHUNK", 7)  # many partial chunks per plane, odd boundaries
    assert encode_blob(updates(), **HEAD, level=level) == reference
    decoded = decode_blob(reference)
    assert all(same_update(a, b) for a, b in zip(decoded.updates, updates(), strict=True))


def test_a_streamed_zstd_section_decodes_like_a_one_shot_one(monkeypatch):
    one_shot = encode_blob(updates(), **HEAD)
    monkeypatch.setattr(section, "ONE_SHOT_MAX", 0)  # force the streaming compressor (anchors)
    streamed = encode_blob(updates(), **HEAD)
    assert streamed == encode_blob(updates(), **HEAD)  # deterministic
    for blob in (one_shot, streamed):
        got = decode_blob(blob).updates
        assert all(same_update(a, b) for a, b in zip(got, updates(), strict=True))


@pytest.mark.parametrize("one_shot_max", [section.ONE_SHOT_MAX, 0])
def test_a_corrupt_zstd_block_behind_a_correct_digest_is_a_format_error(monkeypatch, one_shot_max):
    monkeypatch.setattr(section, "ONE_SHOT_MAX", one_shot_max)
    monkeypatch.setattr(section, "READ_ONE_SHOT_MAX", one_shot_max)
    records = b"".join(
        record(f"n{k}", shape=(4096,), nnz=0) for k in range(200)
    )  # compressible, so the frame holds a compressed block
    blob = bytearray(craft(records, 200))
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(FormatError):
        decode_blob(reseal(bytes(blob)))
