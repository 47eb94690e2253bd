"""apply_updates writes in place through every kind of target view, or writes nothing at all."""

from __future__ import annotations

import pytest
import torch
from kit import bits_equal, same_bits

from deltasync.errors import ApplyError
from deltasync.format import TensorUpdate, apply_updates, decode_blob, encode_blob

from format_testkit import clone_all

BF16 = torch.bfloat16


def rand(*shape, dtype=BF16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def update(name, shape, indices, dtype=BF16, seed=1):
    idx = torch.tensor(indices, dtype=torch.int64)
    return TensorUpdate(
        name=name,
        shape=tuple(shape),
        dtype=dtype,
        indices=idx,
        values=rand(len(indices), dtype=dtype, seed=seed),
    )


def expected_after(target: torch.Tensor, u: TensorUpdate) -> torch.Tensor:
    """Reference result computed on a private contiguous copy, element by element semantics."""
    out = target.clone().contiguous()
    flat = out.view(-1)
    if u.indices is None:
        flat.copy_(u.values)
    else:
        flat[u.indices] = u.values
    return out


def test_sparse_values_land_at_their_flat_indices_of_a_contiguous_target():
    target = rand(6, 5)
    u = update("w", (6, 5), [0, 7, 8, 29])
    want = expected_after(target, u)
    storage = target.data_ptr()
    assert apply_updates([u], {"w": target}) == 4
    assert bits_equal(target, want)
    assert target.data_ptr() == storage  # in place


def test_a_dense_update_overwrites_every_element():
    target = rand(3, 4, dtype=torch.float32)
    u = TensorUpdate(
        name="w",
        shape=(3, 4),
        dtype=torch.float32,
        indices=None,
        values=rand(12, dtype=torch.float32, seed=9),
    )
    assert apply_updates([u], {"w": target}) == 12
    assert bits_equal(target.reshape(-1), u.values)


def test_a_transposed_view_is_written_through_its_strides_into_the_owning_tensor():
    owner = rand(5, 7)
    view = owner.t()  # (7, 5), non-contiguous; row-major flat indices refer to the view
    assert not view.is_contiguous()
    u = update("w", (7, 5), [0, 1, 6, 17, 34])
    want_view = expected_after(view, u)
    apply_updates([u], {"w": view})
    assert bits_equal(view, want_view)
    assert bits_equal(owner, want_view.t())  # the writes reached the owner's storage


def test_a_dense_update_into_a_transposed_view_reaches_the_owner():
    owner = rand(4, 3)
    u = TensorUpdate(name="w", shape=(3, 4), dtype=BF16, indices=None, values=rand(12, seed=5))
    apply_updates([u], {"w": owner.t()})
    assert bits_equal(owner.t().contiguous().view(-1), u.values)


def test_a_strided_slice_is_written_without_touching_the_skipped_columns():
    owner = rand(4, 10)
    before = owner.clone()
    view = owner[:, ::2]  # (4, 5), every other column
    u = update("w", (4, 5), [0, 4, 12, 19])
    want_view = expected_after(view, u)
    apply_updates([u], {"w": view})
    assert bits_equal(view, want_view)
    assert bits_equal(owner[:, 1::2], before[:, 1::2])


def test_a_slice_with_a_storage_offset_is_written_in_place_and_its_neighbours_are_not():
    big = rand(100)
    before = big.clone()
    target = big[30:50].view(4, 5)  # contiguous, storage offset 30
    assert target.storage_offset() == 30 and target.is_contiguous()
    u = update("w", (4, 5), [0, 3, 19])
    want = expected_after(target, u)
    apply_updates([u], {"w": target})
    assert bits_equal(big[30:50].view(4, 5), want)
    assert bits_equal(big[:30], before[:30]) and bits_equal(big[50:], before[50:])


def test_a_parameter_that_requires_grad_is_written_in_place():
    p = torch.nn.Parameter(rand(4, 4, dtype=torch.float32))
    u = update("p", (4, 4), [3, 9], dtype=torch.float32)
    apply_updates([u], {"p": p})
    assert bits_equal(p.detach().view(-1)[u.indices], u.values)


def test_updates_decoded_from_a_blob_apply_to_reproduce_the_source_bit_for_bit():
    source = {"a": rand(64, 32, seed=2), "b": rand(100, dtype=torch.float16, seed=3)}
    live = {k: torch.zeros_like(v) for k, v in source.items()}
    idx_a = torch.arange(0, 2048, 7)
    ups = [
        TensorUpdate(
            name="a", shape=(64, 32), dtype=BF16, indices=idx_a, values=source["a"].view(-1)[idx_a]
        ),
        TensorUpdate(name="b", shape=(100,), dtype=torch.float16, indices=None, values=source["b"]),
    ]
    blob = encode_blob(ups, version=1, base_version=0, shard="tp0", writer="w00000")
    apply_updates(decode_blob(blob).updates, live)
    assert bits_equal(live["a"].view(-1)[idx_a], source["a"].view(-1)[idx_a])
    assert bits_equal(live["b"], source["b"])


# --- nothing is written when anything is wrong ---------------------------------------------------


def bad_cases():
    ok = update("a", (4, 4), [1, 2])
    return {
        "unknown name": [ok, update("zz", (4, 4), [0])],
        "wrong shape": [ok, update("b", (17,), [0])],
        "wrong dtype": [ok, update("b", (16,), [0], dtype=torch.float16)],
        "index past the end": [ok, update("b", (16,), [3, 16])],
        "negative index": [ok, update("b", (16,), [-1, 3])],
        "unsorted indices": [ok, update("b", (16,), [5, 3])],
        "duplicate indices": [ok, update("b", (16,), [3, 3])],
        "two updates for one tensor": [ok, update("a", (4, 4), [7])],
        "not an update": [ok, "b"],
    }


@pytest.mark.parametrize("case", sorted(bad_cases()))
def test_a_bad_update_raises_and_leaves_every_target_bit_identical(case):
    live = {"a": rand(4, 4, seed=4), "b": rand(16, seed=5)}
    before = clone_all(live)
    with pytest.raises(ApplyError) as info:
        apply_updates(bad_cases()[case], live)
    assert "Nothing was written" in str(info.value) or "nothing was written" in str(info.value)
    assert same_bits(live, before)


def test_an_expanded_target_whose_elements_share_memory_is_refused():
    base = rand(1, 5)
    live = {"a": rand(4, 4), "e": base.expand(3, 5)}
    before_a, before_base = live["a"].clone(), base.clone()
    with pytest.raises(ApplyError, match="share memory"):
        apply_updates([update("a", (4, 4), [0]), update("e", (3, 5), [2])], live)
    assert bits_equal(live["a"], before_a) and bits_equal(base, before_base)


def test_an_update_with_nothing_to_write_is_accepted_on_any_target():
    target = rand(3, 3)
    before = target.clone()
    assert apply_updates([update("w", (3, 3), [])], {"w": target.t()}) == 0
    assert bits_equal(target, before)
