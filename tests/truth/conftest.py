"""tests/truth runs torch single-threaded: its tensors are tiny, and forked children must not
inherit a busy OpenMP pool (on this shared machine that made small steps ~10x slower)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
