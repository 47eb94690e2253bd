"""An in-cluster receiver's extra memory is bounded by one tensor's changes, not by the version's.

The real sender builds the payloads (one process, no group); the receiver stages, verifies and
applies them under ``tracemalloc``, which sees every numpy array the decoder allocates and every
``bytes`` object zstd returns (torch's CPU allocator is invisible to it; the receiver's torch
temporaries are per-chunk scratch). A receiver that decodes a whole version before verifying it
holds 10 bytes per changed element at once; these tests fail on such a receiver. The payload
bytes themselves arrived before the apply and are not counted: they are read in place.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from kit import bits, tiny_layouts

from deltasync import ClusterConfig, ClusterReceiver
from deltasync.cluster import RolePlan
from deltasync.format import section

from cluster_testkit import one_process_roles

SPEC, TRAINER, RECEIVERS = tiny_layouts(
    tp=2, hidden_size=256, intermediate_size=512, num_hidden_layers=16, vocab_size=509
)
DECODED_PER_ELEMENT = 10  # int64 index + BF16 value of one decoded element
SLACK = 1 << 20  # interpreter noise, record headers, a segment's small objects
DENSITY = 0.2


class Rig:
    """Writers (FSDP dim-0 parts of one fp32 model, exact snapshot trackers) and the two TP
    receivers, exchanging payloads by hand; the receivers hold the anchor (version 0)."""

    def __init__(self, *, writers: int, digest: bool, full_state: bool, **rx: object) -> None:
        g = torch.Generator().manual_seed(0)
        self.full = {
            n: torch.randn(s, generator=g) * 0.05 for n, s in TRAINER.param_shapes().items()
        }
        self.gen = torch.Generator().manual_seed(1)
        self.plan = RolePlan.contiguous(num_writers=writers, shards=["tp0", "tp1"])
        config = ClusterConfig(digest_every=1 if digest else 0)
        self.senders, self.receivers = one_process_roles(
            self.full,
            self.plan,
            config,
            trainer_layout=TRAINER,
            receiver_layout=RECEIVERS,
            full_state=full_state,
            **rx,
        )
        self.version = -1
        self.sync(anchor=True)

    def payloads(self, *, anchor: bool = False) -> dict[int, dict[int, bytes]]:
        inbox: dict[int, dict[int, bytes]] = {r: {} for r in self.receivers}
        for s in self.senders:
            out = s.payloads_for_version(self.version + 1, anchor=anchor)
            s.mark_sent(out)
            for dst, payload in out.payloads.items():
                inbox[dst][s.rank] = payload
        return inbox

    def commit(self) -> None:
        """What a positive joint commit does on every rank."""
        self.version += 1
        for s in self.senders:
            s.tracker.clear()
            s.version = self.version
            s._pending, s._pending_anchor = {}, False
        for rec in self.receivers.values():
            rec.journal.commit(self.version)

    def sync(self, *, anchor: bool = False) -> None:
        inbox = self.payloads(anchor=anchor)
        for rank, rec in self.receivers.items():
            rec.apply_payload(inbox[rank])
        self.commit()

    def step(self) -> int:
        """Move a ``DENSITY`` fraction of every param by a BF16-visible amount."""
        for p in self.full.values():
            mask = torch.rand(p.shape, generator=self.gen) < DENSITY
            p.add_(mask * 0.01)
        return sum(p.numel() for p in self.full.values())

    def traced_apply(self, rank: int, payload: dict[int, bytes]):
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            report = self.receivers[rank].apply_payload(payload)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return report, peak - base

    def mismatches(self) -> list[tuple[int, str]]:
        bf16 = {n: p.to(torch.bfloat16) for n, p in self.full.items()}
        truth = RECEIVERS.split(TRAINER.to_canonical(bf16))
        return [
            (rank, n)
            for rank, rec in self.receivers.items()
            for n, t in rec.tensors.items()
            if not torch.equal(bits(t), bits(truth[rec.shard][n]))
        ]


def _largest_changes(rec: ClusterReceiver, density: float) -> float:
    """Decoded bytes of the largest local tensor's changes (fused tensors gather several
    params' changes; 10% over the density for the random draw)."""
    return max(t.numel() for t in rec.tensors.values()) * density * 1.1 * DECODED_PER_ELEMENT


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("writers", "digest", "full_state"),
    [(1, True, False), (1, False, False), (2, True, False), (2, True, True)],
    ids=["state-digest", "no-digest", "part-digests", "two-writers-state-digest"],
)
def test_a_large_delta_is_verified_and_applied_holding_one_tensors_changes_at_a_time(
    monkeypatch: pytest.MonkeyPatch, writers: int, digest: bool, full_state: bool
) -> None:
    # every section streamed: each writer's blob then holds a few chunk buffers, not a one-shot
    # section (up to READ_ONE_SHOT_MAX), so the bound is the tensors' pieces
    monkeypatch.setattr(section, "READ_ONE_SHOT_MAX", 0)
    rig = Rig(writers=writers, digest=digest, full_state=full_state, max_staged_bytes=0)
    rig.step()
    inbox = rig.payloads()
    rank = rig.plan.receivers[0].rank
    rec = rig.receivers[rank]
    report, extra = rig.traced_apply(rank, inbox[rank])
    assert report.version == 1 and report.elements > 0
    assert (report.state_digest is not None) == (digest and (writers == 1 or full_state))
    whole = report.elements * DECODED_PER_ELEMENT
    bound = writers * 2 * _largest_changes(rec, DENSITY) + SLACK
    assert whole > 2 * bound, "the tensor set is too small for this test to tell"
    assert extra < bound, f"apply held {extra} traced bytes; bound {bound:.0f}, whole {whole}"
    for other, r in rig.receivers.items():
        if other != rank:
            r.apply_payload(inbox[other])
    assert rig.mismatches() == []


@pytest.mark.timeout(300)
def test_a_streamed_anchor_restores_every_element_within_one_tensors_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(section, "READ_ONE_SHOT_MAX", 0)
    rig = Rig(writers=2, digest=True, full_state=False, max_staged_bytes=0)
    rig.step()
    inbox = rig.payloads(anchor=True)
    rank = rig.plan.receivers[0].rank
    rec = rig.receivers[rank]
    for t in rec.tensors.values():  # a receiver that drifted: the anchor overwrites it all
        t.view(torch.int16).add_(1)
    report, extra = rig.traced_apply(rank, inbox[rank])
    shard_elements = sum(t.numel() for t in rec.tensors.values())
    assert report.base == -1 and report.elements == shard_elements
    bound = 2 * _largest_changes(rec, 1.0) + SLACK  # an anchor lists every element
    assert shard_elements * DECODED_PER_ELEMENT > 2 * bound
    assert extra < bound, f"anchor held {extra} traced bytes; bound {bound:.0f}"
    rig.receivers[rig.plan.receivers[1].rank].apply_payload(inbox[rig.plan.receivers[1].rank])
    assert rig.mismatches() == []


@pytest.mark.timeout(300)
def test_a_delta_within_the_staging_budget_is_decoded_once_and_held() -> None:
    rig = Rig(writers=1, digest=True, full_state=False, max_staged_bytes=1 << 30)
    rig.step()
    inbox = rig.payloads()
    rank = rig.plan.receivers[0].rank
    report, extra = rig.traced_apply(rank, inbox[rank])
    assert report.version == 1
    assert extra > report.elements * 6 // 2  # held: int32 indices + values, all at once
    rig.receivers[rig.plan.receivers[1].rank].apply_payload(inbox[rig.plan.receivers[1].rank])
    assert rig.mismatches() == []
