"""Device tier: decoded (CPU) updates scatter into CUDA targets in place, all or nothing.

Deselected by default (``-m 'not gpu'`` in pyproject); run with ``pytest -m gpu tests/format``
on a machine with a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from kit import bits_equal

from deltasync.errors import ApplyError
from deltasync.format import TensorUpdate, apply_updates, decode_blob, encode_blob, sparse_update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the gpu tier needs a CUDA device"),
]


def test_decoded_updates_scatter_into_cuda_targets_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    new = (torch.randn(1000, 64, generator=g) * 0.02).to(torch.bfloat16)
    idx = torch.randperm(new.numel(), generator=g)[:600].sort().values
    owner = torch.zeros(64, 1000, dtype=torch.bfloat16, device="cuda")
    live = {"w": owner.t(), "d": torch.zeros(8, 8, dtype=torch.float32, device="cuda")}
    dense = torch.randn(64, generator=g)
    ups = [
        sparse_update("w", new, idx),
        TensorUpdate(name="d", shape=(8, 8), dtype=torch.float32, indices=None, values=dense),
    ]
    blob = encode_blob(ups, version=1, base_version=0, shard="tp0", writer="w00000")
    assert apply_updates(decode_blob(blob).updates, live) == 600 + 64
    assert bits_equal(live["w"].reshape(-1)[idx.cuda()], new.reshape(-1)[idx].cuda())
    assert bits_equal(live["d"].reshape(-1), dense.cuda())


def test_a_bad_update_leaves_cuda_targets_unchanged():
    live = {"a": torch.randn(16, device="cuda"), "b": torch.randn(16, device="cuda")}
    before = {k: v.clone() for k, v in live.items()}
    ok = TensorUpdate(
        name="a", shape=(16,), dtype=torch.float32, indices=torch.tensor([1]), values=torch.ones(1)
    )
    bad = TensorUpdate(
        name="b", shape=(16,), dtype=torch.float32, indices=torch.tensor([16]), values=torch.ones(1)
    )
    with pytest.raises(ApplyError):
        apply_updates([ok, bad], live)
    assert all(bits_equal(live[k], before[k]) for k in live)
