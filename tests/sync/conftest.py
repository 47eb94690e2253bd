"""tests/sync runs torch single-threaded: its tensors are tiny, and on this shared 2-core
machine OpenMP threads made an AdamW step on them ~10x slower (spinning against other load)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
