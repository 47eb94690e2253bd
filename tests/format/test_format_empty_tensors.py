"""Several writers' records of a 0-element tensor (an EP rank's experts when EP exceeds the
expert count): each writer of an anchor sends one (empty: no element reaches it), and the
encoder writes it dense, since it names all of the tensor's 0 elements. Such records cover
nothing, so they are disjoint; records of a non-empty tensor are checked as before."""

from __future__ import annotations

import pytest
import torch
from kit import assert_same_bits

from deltasync.errors import BlobMismatchError
from deltasync.format import (
    BlobRecords,
    TensorSpec,
    TensorUpdate,
    apply_pieces,
    apply_updates,
    decode_blob,
    encode_blob,
    fold_chain,
    iter_chain,
    merge_writers,
)

BF = torch.bfloat16
SPECS = {
    "experts": TensorSpec(shape=(0, 8, 4), dtype=BF),  # this EP rank holds no expert
    "norm": TensorSpec(shape=(8,), dtype=BF),
}


def _empty(name: str) -> TensorUpdate:
    """A writer's padding record: no element of ``name`` (as ``padding_updates`` builds it)."""
    spec = SPECS[name]
    return TensorUpdate(
        name=name,
        shape=spec.shape,
        dtype=spec.dtype,
        indices=torch.empty(0, dtype=torch.int64),
        values=torch.empty(0, dtype=spec.dtype),
    )


def _norm_half(writer: int) -> TensorUpdate:
    """Writer ``writer``'s half of ``norm``: elements 4w..4w+3, values 1+4w.. ."""
    idx = torch.arange(4 * writer, 4 * writer + 4, dtype=torch.int64)
    return TensorUpdate(name="norm", shape=(8,), dtype=BF, indices=idx, values=(idx + 1).to(BF))


def _anchor_blobs() -> list[bytes]:
    return [
        encode_blob(
            [_empty("experts"), _norm_half(w)],
            version=0,
            base_version=-1,
            shard="tp0-ep3",
            writer=f"w0000{w}",
        )
        for w in range(2)
    ]


def test_the_encoder_writes_an_empty_record_of_a_0_element_tensor_as_dense():
    # the case the merge must take: a writer's padding record reaches the receiver dense
    (blob,) = _anchor_blobs()[:1]
    experts = {u.name: u for u in decode_blob(blob).updates}["experts"]
    assert experts.is_dense and experts.nnz == 0


def test_two_writers_records_of_a_0_element_tensor_merge_into_one():
    merged = {
        u.name: u for u in merge_writers(0, [decode_blob(b).updates for b in _anchor_blobs()])
    }
    assert merged["experts"].shape == (0, 8, 4) and merged["experts"].nnz == 0
    assert merged["norm"].indices.tolist() == list(range(8))
    live = {"experts": torch.empty(0, 8, 4, dtype=BF), "norm": torch.zeros(8, dtype=BF)}
    apply_updates(fold_chain([("anchor", list(merged.values()))], SPECS), live)
    assert_same_bits(
        live, {"experts": torch.empty(0, 8, 4, dtype=BF), "norm": torch.arange(1, 9).to(BF)}
    )


def test_a_streamed_anchor_from_two_writers_passes_the_checks_and_restores_the_shard():
    records = [BlobRecords(b, expected=SPECS, shard="tp0-ep3") for b in _anchor_blobs()]
    chain = [(0, "anchor", records)]
    items = list(iter_chain(chain, SPECS))  # disjoint writers, complete anchor: no refusal
    assert [i.name for i in items] == ["experts", "norm"]
    live = {"experts": torch.empty(0, 8, 4, dtype=BF), "norm": torch.full((8,), 7.0, dtype=BF)}
    for item in iter_chain(chain, SPECS, check=False):
        apply_pieces(item, live)
    assert_same_bits(
        live, {"experts": torch.empty(0, 8, 4, dtype=BF), "norm": torch.arange(1, 9).to(BF)}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_writers_that_overlap_on_a_non_empty_tensor_are_still_refused(stream):
    dense = TensorUpdate(
        name="norm", shape=(8,), dtype=BF, indices=None, values=torch.ones(8, dtype=BF)
    )
    cases = [
        ([dense], [_norm_half(1)], "dense"),
        ([dense], [_empty("norm")], "dense"),  # only a 0-element tensor's records cover nothing
        ([_norm_half(1)], [_norm_half(1)], "same element"),
    ]
    for first, second, match in cases:
        per_writer = [[_empty("experts"), *first], [_empty("experts"), *second]]
        with pytest.raises(BlobMismatchError, match=match):
            if stream:
                blobs = [
                    encode_blob(u, version=0, base_version=-1, shard="s", writer=f"w{k}")
                    for k, u in enumerate(per_writer)
                ]
                list(
                    iter_chain(
                        [(0, "anchor", [BlobRecords(b, expected=SPECS, shard="s") for b in blobs])],
                        SPECS,
                    )
                )
            else:
                merge_writers(0, per_writer)


def test_a_0_element_record_beside_a_non_empty_one_of_the_same_name_is_checked_as_before():
    # a writer that disagrees on the shape is no 0-element tensor's record: the usual check runs
    wide = TensorUpdate(
        name="experts", shape=(1, 8, 4), dtype=BF, indices=None, values=torch.ones(32, dtype=BF)
    )
    with pytest.raises(BlobMismatchError, match="dense"):
        merge_writers(0, [[_empty("experts")], [wide]])
