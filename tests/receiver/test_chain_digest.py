"""Verify before write over a streamed chain: the digest ``chain_state_digest`` predicts from
the live tensors and the chain's pieces is the state digest the tensors have after
``apply_pieces``, for chains of deltas from several writers and for an anchor with sparse
records, at chunk sizes that put tensors in one chunk and across many."""

from __future__ import annotations

import pytest
import torch
from kit import random_tensors, random_update

from deltasync.format import (
    BlobRecords,
    TensorSpec,
    TensorUpdate,
    apply_pieces,
    encode_blob,
    iter_chain,
)
from deltasync.layout.digest import state_digest
from deltasync.layout.verify import chain_state_digest

SPECS = {
    "a": TensorSpec(shape=(64, 48), dtype=torch.bfloat16),
    "b": TensorSpec(shape=(3000,), dtype=torch.bfloat16),
    "untouched": TensorSpec(shape=(100,), dtype=torch.bfloat16),
}


def _sparse(name, gen, density, keep=None):
    return random_update(SPECS, name, gen, density, keep)


def _records(version, base, updates, writer="w00000"):
    blob = encode_blob(updates, version=version, base_version=base, shard="tp0", writer=writer)
    return BlobRecords(blob, expected=SPECS, shard="tp0", narrow_indices=True)


def _live(gen):
    return random_tensors(SPECS, gen)


def _check(live, steps, chunk):
    predicted = chain_state_digest(live, iter_chain(steps, SPECS), chunk=chunk)
    before = state_digest(live)
    for item in iter_chain(steps, SPECS, check=False):
        apply_pieces(item, live)
    assert predicted == state_digest(live)
    return before


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])
def test_a_chain_of_deltas_from_two_writers_predicts_the_digest_after_the_writes(chunk):
    gen = torch.Generator().manual_seed(8)
    live = _live(gen)
    steps = []
    for v in (3, 4, 5):
        half = torch.zeros(3000, dtype=torch.bool)
        half[:1500] = True
        w0 = [_sparse("a", gen, 0.1), _sparse("b", gen, 0.05, keep=half)]
        w1 = [_sparse("b", gen, 0.05, keep=~half)]
        steps.append((v, "delta", [_records(v, v - 1, w0), _records(v, v - 1, w1, "w00001")]))
    before = _check(live, steps, chunk)
    assert before != state_digest(live)  # the chain changed the state


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])
def test_an_anchor_with_sparse_and_dense_records_then_a_delta_predicts_the_digest(chunk):
    gen = torch.Generator().manual_seed(9)
    live = _live(gen)
    dense_b = TensorUpdate(
        name="b",
        shape=(3000,),
        dtype=torch.bfloat16,
        indices=None,
        values=torch.randn(3000, generator=gen).to(torch.bfloat16),
    )
    anchor = [_sparse("a", gen, 0.5), dense_b, _sparse("untouched", gen, 0.0)]
    steps = [
        (0, "anchor", [_records(0, -1, anchor)]),
        (1, "delta", [_records(1, 0, [_sparse("a", gen, 0.1), _sparse("b", gen, 0.1)])]),
    ]
    _check(live, steps, chunk)
    assert not bool(live["untouched"].view(torch.int16).any())  # anchor: unlisted are zero


@pytest.mark.parametrize("chunk", [1 << 20, 1000, 7])
def test_a_one_version_delta_is_hashed_in_one_c_call_and_predicts_the_digest(chunk, monkeypatch):
    # Tensors one sparse piece patches, and untouched ones, go to patched_digests16 in batches;
    # with the kernels off every tensor takes the Python pass. Both predict the same digest.
    import deltasync.layout.verify as verify
    from deltasync.native import loader as native

    one_call = verify.patched_digests16
    hashed = []

    def counted(items, scratch, chunk):
        got = one_call(items, scratch, chunk)
        hashed.extend(d is not None for d in got or [None] * len(items))
        return got

    monkeypatch.setattr(verify, "patched_digests16", counted)
    gen = torch.Generator().manual_seed(11)
    live = _live(gen)
    steps = [(6, "delta", [_records(6, 5, [_sparse("a", gen, 0.2), _sparse("b", gen, 0.01)])])]
    native.disable()
    try:
        python_pass = chain_state_digest(live, iter_chain(steps, SPECS), chunk=chunk)
    finally:
        native.enable()
    hashed.clear()
    _check(live, steps, chunk)
    assert hashed == [True] * len(SPECS)  # a, b and the untouched tensor, all in C
    assert python_pass == state_digest(live)
