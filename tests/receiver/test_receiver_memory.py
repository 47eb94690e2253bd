"""A pull's extra memory is bounded by one tensor's changes, not by the version's.

``tracemalloc`` sees every numpy array the decoder allocates and every ``bytes`` object the
store returns (torch's own CPU allocator is invisible to it, and the receiver's torch
temporaries are per-chunk scratch anyway). The old pull decoded a whole chain before verifying
it, so its peak grew with the changed count; these tests fail on such a pull.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from kit import assert_same_bits, rconfig, tiny_layouts, zero_tensors

from deltasync import MemoryStore, Publisher, PublisherConfig, Receiver
from deltasync.format import section

# int64 index + BF16 value of one decoded element
DECODED_PER_ELEMENT = 10
SLACK = 1 << 20  # interpreter noise, record headers, one segment's small objects


def _shapes():
    spec, tl, rl = tiny_layouts(
        tp=1, hidden_size=256, intermediate_size=512, num_hidden_layers=24, vocab_size=509
    )
    return spec, tl, rl


def _changes(params, gen, density):
    out = []
    for name, p in params.items():
        flat = p.view(-1)
        n = flat.numel()
        idx = torch.nonzero(torch.rand(n, generator=gen) < density).view(-1)
        new = (flat[idx].float() + 2.0**-5).to(torch.bfloat16)
        flat[idx] = new
        out.append((name, idx, new.clone()))
    return out


class Rig:
    def __init__(self, tmp_path, *, versions: int, density: float, **rx):
        self.spec, self.tl, self.rl = _shapes()
        self.store = MemoryStore()
        gen = torch.Generator().manual_seed(0)
        self.params = {
            n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
            for n, s in self.tl.param_shapes().items()
        }
        self.pub = Publisher(
            self.store, receiver_layout=self.rl, config=PublisherConfig(anchor_every=1000)
        )
        self.pub.publish(0, [], self.params, anchor=True)
        self.rx = Receiver.for_layout(
            self.store,
            self.rl,
            "tp0",
            zero_tensors(self.rl, "tp0"),
            str(tmp_path / "rx"),
            rconfig("rx", **rx),
        )
        assert self.rx.pull().version == 0
        self.changed: dict[str, int] = {}
        for v in range(1, versions + 1):
            changes = _changes(self.params, gen, density)
            for name, idx, _ in changes:
                self.changed[name] = self.changed.get(name, 0) + idx.numel()
            self.pub.publish(v, changes, self.params)
        self.versions = versions

    def traced_pull(self):
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            report = self.rx.pull()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return report, peak - base

    def expected(self):
        return self.rl.split(self.tl.to_canonical(self.params))["tp0"]


@pytest.mark.timeout(120)
def test_a_large_delta_is_verified_and_scattered_holding_one_tensors_changes_at_a_time(tmp_path):
    rig = Rig(tmp_path, versions=1, density=0.2, max_staged_bytes=0)
    report, extra = rig.traced_pull()
    assert report.version == 1 and report.chain == (1,)
    assert_same_bits(rig.rx.tensors, rig.expected(), "after the streamed pull")
    whole = sum(rig.changed.values()) * DECODED_PER_ELEMENT
    # the largest receiver tensor's changes (fused tensors gather several params' changes)
    largest = max(t.numel() for t in rig.rx.tensors.values()) * 0.2 * 1.1 * DECODED_PER_ELEMENT
    bound = report.bytes_fetched + 2 * largest + SLACK
    assert whole > 2 * bound, "the tensor set is too small for this test to tell"
    assert extra < bound, f"pull held {extra} traced bytes; bound {bound:.0f}, whole {whole}"


@pytest.mark.timeout(120)
def test_a_chain_of_deltas_streams_per_tensor_and_ends_exact(tmp_path, monkeypatch):
    # every section streamed: each of the three blobs then holds a few chunk buffers, not a
    # one-shot section (up to READ_ONE_SHOT_MAX each), and the bound is the tensors' pieces
    monkeypatch.setattr(section, "READ_ONE_SHOT_MAX", 0)
    rig = Rig(tmp_path, versions=3, density=0.1, max_staged_bytes=0)
    report, extra = rig.traced_pull()
    assert report.chain == (1, 2, 3) and report.version == 3 and not report.from_anchor
    assert_same_bits(rig.rx.tensors, rig.expected(), "after the streamed chain")
    whole = sum(rig.changed.values()) * DECODED_PER_ELEMENT
    largest = max(t.numel() for t in rig.rx.tensors.values()) * 0.1 * 1.1 * DECODED_PER_ELEMENT
    bound = report.bytes_fetched + 2 * 3 * largest + SLACK
    assert whole > 2 * bound, "the tensor set is too small for this test to tell"
    assert extra < bound, f"pull held {extra} traced bytes; bound {bound:.0f}, whole {whole}"


@pytest.mark.timeout(120)
def test_a_small_chain_is_decoded_once_and_held_within_its_budget(tmp_path):
    # the same delta with a budget that holds it: one decode, and the same bits
    rig = Rig(tmp_path, versions=1, density=0.2, max_staged_bytes=1 << 30)
    report, extra = rig.traced_pull()
    assert report.version == 1
    assert_same_bits(rig.rx.tensors, rig.expected(), "after the held pull")
    whole = sum(rig.changed.values()) * DECODED_PER_ELEMENT
    assert extra > whole // 2  # held: the decoded version was in memory at once
