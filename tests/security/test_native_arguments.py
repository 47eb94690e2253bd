"""The native entry points refuse what they cannot take with a TensorInputError naming the
argument, before anything is written: a meta tensor on either side of the BF16 cast, a float or
bool where the decode kernels take an int (ctypes would refuse it with an untyped error)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.errors import TensorInputError
from deltasync.native.ops import cast_bf16_into, decode_sparse, join_planes


def test_a_bf16_cast_from_or_into_a_meta_tensor_is_refused_and_writes_nothing():
    out = torch.full((4,), 7.0, dtype=torch.bfloat16)
    with pytest.raises(TensorInputError, match="cast_bf16_into src is on the meta device"):
        cast_bf16_into(torch.empty(4, device="meta"), out)
    assert torch.equal(out, torch.full((4,), 7.0, dtype=torch.bfloat16))
    with pytest.raises(TensorInputError, match="cast_bf16_into out is on the meta device"):
        cast_bf16_into(torch.ones(4), torch.empty(4, dtype=torch.bfloat16, device="meta"))


# one sparse record of 3 elements at 0, 1, 2: gaps 1, 1 in one plane, then the values' two
PAYLOAD = np.array([1, 1, 10, 20, 30, 0, 0, 0], dtype=np.uint8)


def test_decode_sparse_takes_int_arguments_only():
    got = decode_sparse(PAYLOAD, 3, 0, 1, 10, np.int64)
    if got is not None:  # the kernel is built: it decodes the record
        assert got[0].tolist() == [0, 1, 2] and got[1].tolist() == [10, 20, 30]
    good = {"n": 3, "first": 0, "width": 1, "numel": 10}
    for name, bad in [("first", 0.0), ("n", 3.0), ("width", 1.0), ("numel", 10.0), ("n", True)]:
        args = {**good, name: bad}
        with pytest.raises(TensorInputError, match=f"decode_sparse: {name} must be an int"):
            decode_sparse(PAYLOAD, **args, index_dtype=np.int64)


@pytest.mark.parametrize(("name", "bad"), [("start", 0.0), ("width", 1.0), ("start", False)])
def test_join_planes_refuses_a_width_or_start_that_is_not_an_int_and_writes_nothing(name, bad):
    out = np.full(4, 9, dtype=np.int32)
    args = {"width": 1, "lower": None, "last": np.ones(2, dtype=np.uint8), "start": 0}
    with pytest.raises(TensorInputError, match=f"join_planes: {name} must be an int"):
        join_planes(out, **{**args, name: bad})
    assert out.tolist() == [9, 9, 9, 9]
