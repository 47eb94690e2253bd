"""full_updates / sparse_update read live tensors correctly; the encoder refuses invalid input."""

from __future__ import annotations

import pytest
import torch
from kit import bits_equal

from deltasync.errors import ConfigError
from deltasync.format import (
    InvalidUpdateError,
    TensorSpec,
    TensorUpdate,
    apply_updates,
    decode_blob,
    encode_blob,
    full_updates,
    sparse_update,
)

HEAD = dict(version=3, base_version=2, shard="tp0", writer="w00000")


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_sparse_update_takes_the_current_values_at_the_indices():
    src = rand(8, 8, dtype=torch.bfloat16)
    idx = torch.tensor([0, 9, 63])
    u = sparse_update("w", src, idx)
    assert u.shape == (8, 8) and u.dtype == torch.bfloat16
    assert torch.equal(u.indices, idx)
    assert bits_equal(u.values, src.view(-1)[idx])


def test_sparse_update_from_fp32_rounds_to_nearest_even_like_torch():
    src = rand(1000, seed=1)
    idx = torch.arange(0, 1000, 50)
    u = sparse_update("w", src, idx, dtype=torch.bfloat16)
    assert bits_equal(u.values, src[idx].to(torch.bfloat16))
    # A tie: 1 + 2^-8 lies exactly between two bf16 values; even rounds down to 1.0.
    tie = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8])
    got = sparse_update("t", tie, torch.tensor([0]), dtype=torch.bfloat16).values
    assert got.view(torch.int16).item() == 0x3F80


def test_sparse_update_accepts_int32_indices_and_widens_them():
    u = sparse_update("w", rand(50), torch.tensor([1, 2], dtype=torch.int32), dtype=torch.float32)
    assert u.indices.dtype == torch.int64


def test_sparse_update_of_a_transposed_source_reads_row_major_positions_of_the_view():
    owner = rand(6, 4, dtype=torch.bfloat16)
    view = owner.t()
    idx = torch.tensor([1, 5, 23])
    u = sparse_update("w", view, idx)
    assert bits_equal(u.values, view.contiguous().view(-1)[idx])


def test_sparse_update_goes_dense_when_indices_would_outweigh_the_saved_values():
    src = rand(100, dtype=torch.bfloat16)
    # 70 of 100 bf16 with u8 gaps: 70*3 = 210 bytes > 200 dense bytes.
    dense = sparse_update("w", src, torch.arange(70))
    assert dense.indices is None and bits_equal(dense.values, src)
    # 60 of 100: 60*2 + 59 = 179 bytes < 200.
    assert sparse_update("w", src, torch.arange(60)).indices is not None


def test_sparse_update_rejects_bad_indices_and_lossy_conversions():
    src = rand(10, dtype=torch.bfloat16)
    with pytest.raises(InvalidUpdateError, match="outside"):
        sparse_update("w", src, torch.tensor([3, 10]))
    with pytest.raises(InvalidUpdateError, match="strictly increasing"):
        sparse_update("w", src, torch.tensor([3, 3]))
    with pytest.raises(InvalidUpdateError, match="integers"):
        sparse_update("w", src, torch.tensor([1.0]))
    with pytest.raises(InvalidUpdateError, match="would change values"):
        sparse_update("w", src, torch.tensor([1]), dtype=torch.float16)


def test_full_updates_round_trip_a_state_dict_bit_for_bit():
    state = {
        "a": rand(16, 8, dtype=torch.bfloat16),
        "b": rand(5, dtype=torch.float16).t(),
        "c": rand(3, 4, seed=7).t(),  # non-contiguous fp32
    }
    state["a"].view(torch.int16)[0, 0] = -32768  # -0.0
    ups = full_updates(state)
    assert [u.name for u in ups] == ["a", "b", "c"] and all(u.indices is None for u in ups)
    live = {k: torch.zeros_like(v).contiguous() for k, v in state.items()}
    blob = encode_blob(ups, version=0, base_version=-1, shard="tp0", writer="w00000")
    spec = {k: TensorSpec(shape=tuple(v.shape), dtype=v.dtype) for k, v in live.items()}
    apply_updates(decode_blob(blob, expected=spec).updates, live)
    assert all(bits_equal(live[k], state[k].contiguous()) for k in state)


def test_full_updates_rejects_unsupported_dtypes():
    with pytest.raises(InvalidUpdateError, match="int64"):
        full_updates({"step": torch.tensor([3])})


# --- constructor and encoder validation -------------------------------------------------------


def test_tensor_update_construction_checks_cheap_invariants():
    v = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(InvalidUpdateError, match="int64"):
        TensorUpdate(
            name="w",
            shape=(4,),
            dtype=torch.bfloat16,
            indices=torch.tensor([0, 1], dtype=torch.int16),
            values=v,
        )
    # int32 indices are the decoder's compact form, only where every index fits
    TensorUpdate(
        name="w",
        shape=(4,),
        dtype=torch.bfloat16,
        indices=torch.tensor([0, 1], dtype=torch.int32),
        values=v,
    )
    with pytest.raises(InvalidUpdateError, match="2 indices but 3 values"):
        TensorUpdate(
            name="w",
            shape=(4,),
            dtype=torch.bfloat16,
            indices=torch.tensor([0, 1]),
            values=torch.zeros(3, dtype=torch.bfloat16),
        )
    with pytest.raises(InvalidUpdateError, match="float32"):
        TensorUpdate(
            name="w",
            shape=(4,),
            dtype=torch.bfloat16,
            indices=torch.tensor([0, 1]),
            values=torch.zeros(2),
        )
    with pytest.raises(InvalidUpdateError, match="dense update needs 4"):
        TensorUpdate(name="w", shape=(4,), dtype=torch.bfloat16, indices=None, values=v)
    with pytest.raises(InvalidUpdateError, match="non-negative"):
        TensorUpdate(name="w", shape=(-1,), dtype=torch.bfloat16, indices=None, values=v)
    with pytest.raises(ConfigError, match="dtype"):
        TensorSpec(shape=(4,), dtype=torch.int8)


def test_tensor_update_reports_numel_and_nnz():
    u = TensorUpdate(
        name="w",
        shape=(1 << 20, 1 << 14),
        dtype=torch.bfloat16,
        indices=torch.tensor([5]),
        values=torch.zeros(1, dtype=torch.bfloat16),
    )
    assert (u.numel, u.nnz, u.is_dense) == (1 << 34, 1, False)


@pytest.mark.parametrize(
    "indices, match",
    [
        ([4, 2], "not strictly increasing at position 1"),
        ([1, 1], "not strictly increasing"),
        ([-1, 2], "span"),
        ([0, 16], "span"),
    ],
)
def test_the_encoder_refuses_indices_that_would_make_an_invalid_record(indices, match):
    u = TensorUpdate(
        name="w",
        shape=(16,),
        dtype=torch.bfloat16,
        indices=torch.tensor(indices),
        values=torch.zeros(2, dtype=torch.bfloat16),
    )
    with pytest.raises(InvalidUpdateError, match=match):
        encode_blob([u], **HEAD)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(version=-1, base_version=-1), "version -1"),
        (dict(version=3, base_version=3), "base_version 3"),
        (dict(version=3, base_version=-2), "base_version -2"),
        (dict(shard="../etc"), "shard"),
        (dict(writer=""), "writer"),
        (dict(level=23), "level 23"),
        (dict(level=True), "level"),
    ],
)
def test_the_encoder_refuses_bad_header_arguments(kwargs, match):
    args = {**HEAD, **kwargs}
    with pytest.raises(InvalidUpdateError, match=match):
        encode_blob([], **args)


def test_the_encoder_refuses_two_updates_for_one_tensor():
    u = sparse_update("w", rand(16, dtype=torch.bfloat16), torch.tensor([1]))
    with pytest.raises(InvalidUpdateError, match="twice"):
        encode_blob([u, u], **HEAD)
