"""encode_blobs: the same bytes as encode_blob, per shard, in order, whatever the threads."""

from __future__ import annotations

import pytest
import torch

from deltasync.format import (
    InvalidUpdateError,
    TensorUpdate,
    decode_blob,
    encode_blob,
    encode_blobs,
)


def _updates(seed: int, n: int) -> list[TensorUpdate]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(3):
        numel = 1000 + 97 * t
        idx = torch.nonzero(torch.rand(numel, generator=g) < 0.1).reshape(-1)
        vals = torch.randn(idx.numel(), generator=g).to(torch.bfloat16)
        out.append(
            TensorUpdate(
                name=f"w{t}", shape=(numel,), dtype=torch.bfloat16, indices=idx, values=vals
            )
        )
    return out[:n]


@pytest.mark.parametrize("threads", [None, 1, 2, 5])
def test_blobs_equal_encode_blob_and_come_in_shard_order(threads):
    jobs = {f"tp{i}": _updates(i, 1 + i % 3) for i in range(5)}
    jobs["tp5"] = []  # an empty blob is still a blob
    got = list(encode_blobs(jobs, version=7, base_version=6, writer="w00000", threads=threads))
    assert [s for s, _ in got] == list(jobs)
    for shard, blob in got:
        assert blob == encode_blob(
            jobs[shard], version=7, base_version=6, shard=shard, writer="w00000"
        )
        assert decode_blob(blob, shard=shard, version=7).header.shard == shard


def test_an_invalid_update_raises_the_encoders_typed_error():
    bad = TensorUpdate(
        name="w",
        shape=(10,),
        dtype=torch.bfloat16,
        indices=torch.tensor([3, 2]),
        values=torch.zeros(2, dtype=torch.bfloat16),
    )
    jobs = {"tp0": _updates(0, 2), "tp1": [bad], "tp2": _updates(2, 1)}
    it = encode_blobs(jobs, version=1, base_version=0, writer="w00000", threads=2)
    assert next(it)[0] == "tp0"
    with pytest.raises(InvalidUpdateError, match="strictly increasing"):
        next(it)
