"""LayoutTable itself: a table that loses or doubles an element is refused at construction."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import LayoutError
from deltasync.layout import Block, LayoutTable, Placement

from layout_cases import bitwise_equal


def rows(src_row: int, dst_row: int, n: int, cols: int = 4) -> Block:
    return Block(src_cols=cols, dst_cols=cols, src_row=src_row, dst_row=dst_row, rows=n)


def table(placements, dst=None, src=None) -> LayoutTable:
    return LayoutTable(
        src_shapes=src or {"w": (6, 4)},
        dst_shapes=dst or {"a": {"x": (3, 4)}, "b": {"x": (4, 4)}},
        placements={"w": placements},
    )


def test_a_table_that_leaves_a_source_element_uncovered_is_refused():
    with pytest.raises(LayoutError, match="does not cover"):
        table([Placement("a", "x", rows(0, 0, 3)), Placement("b", "x", rows(3, 0, 2))])


def test_a_table_whose_source_blocks_partly_overlap_is_refused():
    with pytest.raises(LayoutError, match="overlap"):
        table([Placement("a", "x", rows(0, 0, 3)), Placement("b", "x", rows(2, 0, 4))])


def test_two_source_blocks_writing_the_same_destination_elements_are_refused():
    with pytest.raises(LayoutError, match="same elements"):
        table(
            [Placement("b", "x", rows(0, 0, 3)), Placement("b", "x", rows(3, 1, 3))],
        )


def test_a_block_outside_its_tensors_is_refused():
    with pytest.raises(LayoutError, match="does not fit"):
        table([Placement("a", "x", rows(0, 0, 6))])
    with pytest.raises(LayoutError, match="unknown tensor"):
        table([Placement("a", "y", rows(0, 0, 6))])


def stacked(dst_rows: int) -> LayoutTable:
    """ "w" (3x4) at rows 2..4 of "fused" (dst_rows x 4), "v" (2,) as is."""
    return LayoutTable(
        src_shapes={"w": (3, 4), "v": (2,)},
        dst_shapes={"s": {"fused": (dst_rows, 4), "v": (2,)}},
        placements={
            "w": [Placement("s", "fused", rows(0, dst_rows - 3, 3))],
            "v": [Placement("s", "v", rows(0, 0, 2, cols=1))],
        },
    )


def test_split_zero_fills_what_no_block_covers_and_merge_ignores_it():
    fwd = stacked(6)
    full = {"w": torch.randn(3, 4).to(torch.bfloat16), "v": torch.randn(2).to(torch.bfloat16)}
    shards = fwd.split(full)
    assert not shards["s"]["fused"][:3].view(torch.int16).any()
    shards["s"]["fused"][0] = 1.0
    back = fwd.merge(shards)
    assert all(bitwise_equal(back[n], full[n]) for n in full)


def test_the_inverse_table_undoes_the_forward_table_and_needs_full_coverage():
    fwd = stacked(3)
    full = {"w": torch.randn(3, 4).to(torch.bfloat16), "v": torch.randn(2).to(torch.bfloat16)}
    back = fwd.inverse(shard="canon").split(fwd.split(full)["s"])["canon"]
    assert all(bitwise_equal(back[n], full[n]) for n in full)
    with pytest.raises(LayoutError, match="does not cover"):
        stacked(6).inverse(shard="canon")  # padding rows would have no canonical home


def test_merge_refuses_shards_of_mixed_dtypes_instead_of_casting():
    fwd = stacked(3)
    shards = fwd.split(
        {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "v": torch.zeros(2, dtype=torch.bfloat16)}
    )
    shards["s"]["v"] = shards["s"]["v"].float()
    with pytest.raises(LayoutError, match="float32"):
        fwd.merge(shards)
