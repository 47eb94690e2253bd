"""Merge of several writers' updates and fold of a chain (format/merge.py): pure, on tiny specs."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import BlobMismatchError
from deltasync.format import TensorSpec, TensorUpdate, fold_chain, merge_writers

BF = torch.bfloat16


def _dense(updates):
    return {u.name: u for u in updates}


def _sparse(name, idx, vals, shape=(4,)):
    return TensorUpdate(
        name=name,
        shape=shape,
        dtype=BF,
        indices=torch.tensor(idx, dtype=torch.int64),
        values=torch.tensor(vals, dtype=BF),
    )


def _dense_up(name, vals):
    return TensorUpdate(
        name=name, shape=(len(vals),), dtype=BF, indices=None, values=torch.tensor(vals, dtype=BF)
    )


SPECS = {"a": TensorSpec(shape=(4,), dtype=BF), "b": TensorSpec(shape=(4,), dtype=BF)}


@pytest.mark.parametrize(
    "steps, expected",
    [
        # later deltas win element by element; untouched tensors stay out of the result
        (
            [("delta", [_sparse("a", [0, 2], [1, 2])]), ("delta", [_sparse("a", [2, 3], [5, 6])])],
            {"a": ([0, 2, 3], [1, 5, 6])},
        ),
        # an anchor is the full state: what it does not list is zero, deltas patch it
        (
            [("anchor", [_sparse("a", [1], [7])]), ("delta", [_sparse("a", [0], [3])])],
            {"a": (None, [3, 7, 0, 0]), "b": (None, [0, 0, 0, 0])},
        ),
        # deltas before an anchor do not matter
        (
            [
                ("delta", [_sparse("b", [0], [9])]),
                ("anchor", [_dense_up("a", [1, 2, 3, 4]), _dense_up("b", [5, 6, 7, 8])]),
            ],
            {"a": (None, [1, 2, 3, 4]), "b": (None, [5, 6, 7, 8])},
        ),
        # a dense delta replaces a tensor; later sparse steps patch it
        (
            [
                ("delta", [_sparse("a", [0], [1])]),
                ("delta", [_dense_up("a", [2, 2, 2, 2])]),
                ("delta", [_sparse("a", [3], [4])]),
            ],
            {"a": (None, [2, 2, 2, 4])},
        ),
    ],
)
def test_folding_a_chain_gives_the_newest_value_of_every_element(steps, expected):
    out = _dense(fold_chain(steps, SPECS))
    assert out.keys() == expected.keys()
    for name, (idx, vals) in expected.items():
        u = out[name]
        assert (u.indices is None) == (idx is None)
        if idx is not None:
            assert u.indices.tolist() == idx
        assert u.values.float().tolist() == [float(v) for v in vals]


def test_two_writers_sending_the_same_element_are_refused():
    with pytest.raises(BlobMismatchError, match="same element"):
        merge_writers(3, [[_sparse("a", [1, 2], [1, 1])], [_sparse("a", [2], [1])]])
    with pytest.raises(BlobMismatchError, match="dense"):
        merge_writers(3, [[_dense_up("a", [1, 2, 3, 4])], [_sparse("a", [2], [1])]])
