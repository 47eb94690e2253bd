"""A publisher writes every large segment open (wire FLAG_OPEN_SEGMENTS) and a receiver pulls
such blobs end to end: the store's blobs carry open segments and the receiver ends bitwise
equal to the dense split."""

from __future__ import annotations

import pytest
import torch
from kit import assert_same_bits, rconfig, tiny_layouts, zero_tensors

from deltasync import MemoryStore, Publisher, PublisherConfig, Receiver, names
from deltasync.format import section
from deltasync.format.wire import FLAG_OPEN_SEGMENTS, HEADER, OPEN_LEN, SEGMENT


def _open_segments(blob: bytes) -> bool:
    """Whether the blob's header flags open segments and its first segment is open."""
    flags, shard_len, writer_len = (HEADER.unpack_from(blob)[i] for i in (2, 5, 6))
    first = HEADER.size + shard_len + writer_len
    return bool(flags & FLAG_OPEN_SEGMENTS) and SEGMENT.unpack_from(blob, first)[0] == OPEN_LEN


@pytest.mark.timeout(120)
def test_a_receiver_pulls_open_segments_to_the_exact_state(tmp_path, monkeypatch):
    monkeypatch.setattr(section, "ONE_SHOT_MAX", 0)  # every compressed section streams: open
    _, tl, rl = tiny_layouts(tp=2, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(4)
    params = {
        n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
        for n, s in tl.param_shapes().items()
    }
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    pub.publish(0, [], params, anchor=True)
    rx = Receiver.for_layout(
        store, rl, "tp1", zero_tensors(rl, "tp1"), str(tmp_path / "rx"), rconfig("rx")
    )
    assert rx.pull().version == 0
    for v in (1, 2):
        changes = []
        for name, p in params.items():
            flat = p.view(-1)
            idx = torch.nonzero(torch.rand(flat.numel(), generator=gen) < 0.3).view(-1)
            flat[idx] = (flat[idx].float() + 2.0**-4).to(torch.bfloat16)
            changes.append((name, idx, flat[idx].clone()))
        pub.publish(v, changes, params)
    for v in (0, 1, 2):  # the anchor's sections stream too
        for shard in ("tp0", "tp1"):
            assert _open_segments(store.get(names.blob_key(v, shard, pub.writer))), (v, shard)
    assert rx.pull().version == 2
    assert_same_bits(rx.tensors, rl.split(tl.to_canonical(params))["tp1"], "after open segments")
