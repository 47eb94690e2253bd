"""TrainerSync(overlap=True): the trainer waits for detection only.

``step_published`` returns once the changes are captured; the commit runs in the background;
the next optimizer step waits for it; the baseline advances only when a version commits; a
version that fails is carried into the next one (never lost) and its error is raised at the
next call, naming it. A store whose manifest write is held at a gate makes "not yet committed"
a state the test controls, not a race it hopes to win."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch
from kit import spy_digest_pass

from deltasync import names
from deltasync.errors import (
    CommitConflictError,
    ConfigError,
    IntegrityError,
    ParamsEditedError,
    PublishFailedError,
    SendInterruptedError,
    StoreError,
)
from deltasync.layout import ReceiverLayout
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.publish.trainer_sync import PendingVersion, with_values
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import AdamWTracker
from deltasync.trainer import positions as positions_mod
from deltasync.trainer.carry import merge_positions
from deltasync.trainer.positions import Positions

from sync_kit import (
    GateStore,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    zero_tensors,
)

pytestmark = pytest.mark.timeout(120)


class ManifestGate:
    """Holds the manifest write of ``version`` until ``release()``; ``fail`` makes it raise."""

    def __init__(self, version: int, *, fail: bool = False) -> None:
        self.key = names.manifest_key(version)
        self.fail = fail
        self.reached = threading.Event()
        self._open = threading.Event()

    def __call__(self, op: str, key: str) -> None:
        if key != self.key:
            return
        self.reached.set()
        if self.fail:
            self.fail = False  # once: the retry gets through
            raise StoreError(f"injected: the manifest write of {key!r} failed")
        assert self._open.wait(60), "the test never released the gate"

    def release(self) -> None:
        self._open.set()


def _receivers(store, rl, tmp_path, *, prefix: str = "rx-") -> dict[str, Receiver]:
    """A receiver of every shard of ``rl``, from zeros, its state under ``tmp_path``."""
    return {
        s.id: Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(prefix + s.id)
        )
        for s in rl.shards()
    }


def _setup(tmp_path, gate, *, density=0.05, seed=0, inline_below=0, **config):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=density, seed=seed)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = GateStore(MemoryStore(), gate)
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(**config))
    # inline_below=0: every version goes to the background, however small (this file tests
    # the background path; the inline one has tests of its own)
    sync = TrainerSync(
        tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=inline_below
    )
    receivers = _receivers(store, rl, tmp_path)
    return trainer, tracker, sync, pub, receivers, (tl, rl)


def _anchor_then_step(sync, trainer) -> None:
    """Commit version 0 as an anchor, then take the optimizer step version 1 publishes."""
    sync.step_published(0, anchor=True)
    sync.wait()
    trainer.step()


def _nothing_left_then_retried_exactly(sync, pub, trainer, receivers, lay) -> None:
    """Version 1 failed in detection: nothing committed, no blob, no carry; the tracker kept
    step 1's changes, so version 1 again after one more step (steps 1 and 2) is exact."""
    assert pub.committed() == 0 and sync._carry == {}
    assert not [k for k in pub.store.list("v00000001/") if k.endswith(".blob")]
    trainer.step()
    sync.step_published(1)
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def _two_versions_exact(sync, trainer, receivers, lay) -> None:
    """Anchor 0, one step, delta 1: both committed and every receiver exact at 1."""
    sync.step_published(0, anchor=True)
    sync.wait()
    trainer.step()
    sync.step_published(1)
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 1)


def _version_2_refused_by_every_receiver(sync, receivers) -> None:
    """Publish 2: the manifest's digest is the real state's, so every receiver refuses it and
    stays at 1."""
    sync.step_published(2)
    sync.wait()
    for rx in receivers.values():
        with pytest.raises(IntegrityError):
            rx.pull()
        assert rx.version == 1
    sync.close()


def _refused_then_retried_exactly(sync, trainer, receivers, lay) -> None:
    """Version 1 was refused after its reads: version 1 again after one more step is a delta
    on version 0 (steps 1, 2 and whatever the refusal sent in full) and exact."""
    trainer.step()
    (report,) = sync.step_published(1).result()
    sync.wait()
    assert report.base_version == 0
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def _assert_receivers_exact(receivers, trainer, layouts_, version):
    tl, rl = layouts_
    expected = expected_shards(trainer.params, tl, rl)
    for shard, rx in receivers.items():
        rx.pull()
        assert rx.version == version
        assert_same_bits(rx.tensors, expected[shard], f"v{version} {shard}")


def test_step_published_returns_before_the_commit_and_the_baseline_waits_for_it(tmp_path):
    gate = ManifestGate(1)
    trainer, _, sync, pub, receivers, lay = _setup(tmp_path, gate)
    _anchor_then_step(sync, trainer)
    pending = sync.step_published(1)
    assert isinstance(pending, PendingVersion) and pending.version == 1
    assert gate.reached.wait(30)  # the background got to the commit ...
    assert not pending.done()  # ... and is held there, while the caller already runs on
    assert sync.baseline == 0 and pub.committed() == 0  # joint commit: nothing advanced yet
    gate.release()
    (report,) = sync.wait()
    assert report.version == 1 and report.kind == "delta"
    assert sync.baseline == 1 and pub.committed() == 1
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_next_version_is_above_the_version_in_flight(tmp_path):
    # step_published(sync.next_version()) evaluates it before that call waits for the version
    # in flight: it named that version again, which then committed, and the new call's own
    # publish of the same number was a CommitConflictError.
    gate = ManifestGate(1)
    trainer, _, sync, pub, receivers, lay = _setup(tmp_path, gate)
    _anchor_then_step(sync, trainer)
    sync.step_published(sync.next_version())
    assert gate.reached.wait(30) and pub.committed() == 0
    assert sync.next_version() == 2  # 1 is in flight
    gate.release()
    trainer.step()
    sync.step_published(sync.next_version())
    sync.wait()
    assert pub.committed() == 2
    _assert_receivers_exact(receivers, trainer, lay, 2)
    sync.close()


def _step_held_back(trainer, before) -> tuple[threading.Thread, threading.Event]:
    """Start the next optimizer step on a thread and check that it is held back (its
    pre-step hook waits for the sync) with the params still bitwise ``before``."""
    stepped = threading.Event()

    def next_step():
        trainer.step()
        stepped.set()

    t = threading.Thread(target=next_step)
    t.start()
    assert not stepped.wait(0.5), "the optimizer stepped while the sync still read the state"
    assert all(
        torch.equal(before[n].view(torch.int32), p.detach().view(torch.int32))
        for n, p in trainer.params.items()
    )
    return t, stepped


def test_the_next_optimizer_step_waits_for_the_version_in_flight(tmp_path):
    gate = ManifestGate(1)
    trainer, _, sync, pub, _, _ = _setup(tmp_path, gate)
    _anchor_then_step(sync, trainer)
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    pending = sync.step_published(1)
    assert gate.reached.wait(30)
    t, stepped = _step_held_back(trainer, before)  # the background hashes the params
    gate.release()
    t.join(30)
    assert stepped.is_set() and pending.done() and pub.committed() == 1
    sync.close()


def test_a_failed_version_is_carried_into_the_next_and_its_error_names_it(tmp_path):
    gate = ManifestGate(2, fail=True)
    trainer, _tracker, sync, pub, receivers, lay = _setup(tmp_path, gate, density=0.02)
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    trainer.step()  # waits for version 1 (committed)
    pending = sync.step_published(2)  # its manifest write fails in the background
    assert pending.wait_detected(30)  # detection may go on after the return
    carried = {n: p.indices() for n, p in sync._carry.items()}
    trainer.step()  # a different random mask: elements changed only at step 2 exist
    with pytest.raises(PublishFailedError, match="version 2 did not commit") as err:
        sync.step_published(3)
    assert err.value.version == 2 and isinstance(err.value.__cause__, StoreError)
    assert pub.committed() == 1 and sync.baseline == 1  # the baseline did not move
    # the carry is the failed version's positions, O(changed), about a byte each
    assert sync._carry.keys() == carried.keys()
    for n, positions in sync._carry.items():
        assert torch.equal(positions.indices(), carried[n])
        assert positions.nbytes <= 2 * len(positions)
    assert sum(len(p) for p in sync._carry.values()) < 0.2 * sum(
        p.numel() for p in trainer.params.values()
    )
    (report,) = sync.step_published(3).result()  # the retry: version 3 = steps 2 and 3
    sync.wait()
    assert report.kind == "delta" and report.base_version == 1
    _assert_receivers_exact(receivers, trainer, lay, 3)  # nothing of step 2 was lost
    assert sync._carry == {}
    sync.close()


class StagedTracker:
    """An AdamWTracker whose positions stream raises ``fail`` once, after ``after``
    parameters."""

    def __init__(self, inner: AdamWTracker, after: int) -> None:
        self.inner, self.after = inner, after
        self.fail: Exception | None = None

    def arrived(self) -> None:
        """Called when the stream reaches parameter ``after``."""

    def iter_changed(self):
        for k, item in enumerate(self.inner.iter_changed()):
            if k == self.after:
                self.arrived()
                if self.fail is not None:
                    exc, self.fail = self.fail, None
                    raise exc
            yield item

    def iter_changes(self):
        return self.inner.iter_changes()

    def clear(self) -> None:
        self.inner.clear()

    def mark_changed(self, *names: str) -> None:
        self.inner.mark_changed(*names)

    def seal_state(self):
        return self.inner.seal_state()

    def marks(self) -> int:
        return self.inner.marks()

    def marked_since(self, marks: int) -> set[str]:
        return self.inner.marked_since(marks)


def _staged(tmp_path, gate):
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, gate)
    staged = StagedTracker(tracker, after=3)
    sync = TrainerSync(
        staged, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    sync.step_published(0, anchor=True)
    sync.wait()
    return trainer, staged, sync, pub, receivers, lay


def test_a_detection_error_midway_stores_nothing_and_keeps_the_trackers_changes(tmp_path):
    trainer, staged, sync, pub, receivers, lay = _staged(tmp_path, lambda op, key: None)
    trainer.step()
    staged.fail = RuntimeError("injected: detection failed")
    with pytest.raises(RuntimeError, match="injected"):
        sync.step_published(1)
    assert sync.in_flight is None
    _nothing_left_then_retried_exactly(sync, pub, trainer, receivers, lay)


class HeldTracker:
    """An AdamWTracker whose positions stream stops after ``after`` parameters until the
    publisher has taken the first of them (or ``wait_s`` passes), and records which."""

    def __init__(self, inner: AdamWTracker, after: int, taken: threading.Event) -> None:
        self.inner, self.after, self.taken = inner, after, taken
        self.overlapped: bool | None = None

    def iter_changed(self):
        for k, item in enumerate(self.inner.iter_changed()):
            if k == self.after:
                self.overlapped = self.taken.wait(10)
            yield item

    def iter_changes(self):
        return self.inner.iter_changes()

    def clear(self) -> None:
        self.inner.clear()


def test_the_background_publishes_early_parameters_while_later_ones_are_detected(
    tmp_path, monkeypatch
):
    from deltasync.publish import segments

    taken = threading.Event()
    route = segments.GroupRouter.stream

    def observed(self, streams, source, params, **kw):
        def items():
            for item in source:
                taken.set()
                yield item

        return route(self, streams, items(), params, **kw)

    monkeypatch.setattr(segments.GroupRouter, "stream", observed)
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    held = HeldTracker(tracker, after=3, taken=taken)
    sync = TrainerSync(
        held, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    sync.step_published(0, anchor=True)
    sync.wait()
    for version in (1, 2):
        trainer.step()
        taken.clear()
        sync.step_published(version)
        assert held.overlapped, "the publisher took nothing until detection had finished"
        sync.wait()
        _assert_receivers_exact(receivers, trainer, lay, version)
    sync.close()


def test_two_publishers_each_commit_every_change_of_an_overlapped_version(tmp_path):
    # the first publisher takes the parameters as they are captured, the second the whole
    # capture after it: both must hold every change
    spec, tl, rl = layouts()
    hf = ReceiverLayout.build(spec, engine="hf")
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=4)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    stores = [MemoryStore(), MemoryStore()]
    pubs = [
        Publisher(store, receiver_layout=layout, trainer_layout=tl, config=PublisherConfig())
        for store, layout in zip(stores, (rl, hf), strict=True)
    ]
    sync = TrainerSync(
        tracker, pubs, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    receivers = [
        (
            layout,
            Receiver.for_layout(
                store,
                layout,
                s.id,
                zero_tensors(layout, s.id),
                str(tmp_path / f"{i}-{s.id}"),
                rconfig(f"rx-{i}-{s.id}"),
            ),
        )
        for i, (store, layout) in enumerate(zip(stores, (rl, hf), strict=True))
        for s in layout.shards()
    ]
    sync.step_published(0, anchor=True)
    for version in (1, 2, 3):
        trainer.step()
        sync.step_published(version)
        reports = sync.wait()
        assert [r.kind for r in reports] == ["delta", "delta"]
        for layout, rx in receivers:
            rx.pull()
            assert rx.version == version
            want = expected_shards(trainer.params, tl, layout)[rx.shard]
            assert_same_bits(rx.tensors, want, f"v{version} {rx.shard}")
    sync.close()


def test_an_interrupt_during_the_capture_stops_the_background_and_commits_nothing(tmp_path):
    # the background already routes the first parameters (inline_below=0) when it comes
    trainer, staged, sync, pub, receivers, lay = _staged(tmp_path, lambda op, key: None)
    trainer.step()
    staged.fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        sync.step_published(1)
    assert sync.in_flight is None and pub.committed() == 0 and sync._carry == {}
    assert not [k for k in pub.store.list("v00000001/") if k.endswith(".blob")]
    sync.step_published(1)  # the tracker kept the step's changes
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_close_raises_the_error_of_the_version_in_flight(tmp_path):
    gate = ManifestGate(1, fail=True)
    trainer, _, sync, _, _, _ = _setup(tmp_path, gate)
    sync.step_published(0, anchor=True)
    trainer.step()  # the barrier settles nothing: version 0 committed
    sync.step_published(1)
    with pytest.raises(PublishFailedError, match="version 1"):
        sync.close()


def test_merged_carry_joins_positions_and_the_background_reads_current_values():
    params = {"a": torch.randn(10), "b": torch.randn(4), "c": torch.randn(3)}
    fresh = [("a", torch.tensor([1, 5])), ("c", torch.tensor([0]))]
    carry = {"a": Positions.of(torch.tensor([0, 5, 9])), "b": Positions.of(torch.tensor([2]))}
    out = list(merge_positions(fresh, carry, params))
    assert [n for n, _ in out] == ["a", "b", "c"]
    assert [p.indices().tolist() for _, p in out] == [[0, 1, 5, 9], [2], [0]]
    for name, positions in out:
        got, idx, vals = with_values((name, positions), params)
        assert got == name and idx.dtype == torch.int64
        assert torch.equal(
            vals.view(torch.int16), params[name][idx].to(torch.bfloat16).view(torch.int16)
        )
    with pytest.raises(ConfigError, match="not in params"):
        list(merge_positions([("zz", torch.tensor([0]))], {}, params))


@pytest.mark.parametrize(
    "numel, density", [(1, 1.0), (50, 1.0), (100_000, 0.03), (100_000, 0.004), (10_000, 0.0005)]
)
def test_positions_round_trip_bit_exactly_in_about_a_byte_each_where_gaps_are_small(numel, density):
    g = torch.Generator().manual_seed(numel)
    idx = torch.nonzero(torch.rand(numel, generator=g) < density).reshape(-1)
    pos = Positions.of(idx)
    assert torch.equal(pos.indices(), idx) and len(pos) == idx.numel()
    assert pos.nbytes <= 4 * idx.numel()  # never more than int32 positions
    if idx.numel() > 1 and density >= 0.03:  # gaps above 255 are rare: a byte each
        assert pos.gaps is not None and pos.nbytes <= 1.01 * idx.numel() + 64


def test_positions_encoded_slice_by_slice_equal_one_slice(monkeypatch):
    g = torch.Generator().manual_seed(3)
    idx = torch.nonzero(torch.rand(200_000, generator=g) < 0.03).reshape(-1)
    idx = torch.cat([idx, torch.tensor([10**6, 10**6 + 1])])  # an escape in the last slice
    whole = Positions.of(idx)
    monkeypatch.setattr(positions_mod, "CHUNK", 97)
    sliced = Positions.of(idx)
    assert torch.equal(sliced.gaps, whole.gaps) and torch.equal(sliced.escapes, whole.escapes)
    assert torch.equal(sliced.indices(), idx)


def test_positions_with_gaps_too_wide_for_a_byte_stay_exact():
    idx = torch.tensor([0, 3, 3 + 255, 3 + 255 + 256, 3 + 511 + 70_000, 2**31 - 2])
    pos = Positions.of(idx)
    assert torch.equal(pos.indices(), idx)
    many = torch.arange(0, 255 * 1000, 255)  # every gap exactly 255: no escape
    assert Positions.of(many).escapes.numel() == 0
    assert torch.equal(Positions.of(many).indices(), many)
    mixed = torch.cat([torch.arange(100), torch.tensor([100 + 256, 100 + 256 + 10**6])])
    assert Positions.of(mixed).escapes.tolist() == [257, 10**6]
    assert torch.equal(Positions.of(mixed).indices(), mixed)
    sparse = torch.arange(0, 10**7, 5000)  # every gap escaped: int32 is smaller
    assert Positions.of(sparse).wide.dtype == torch.int32
    assert torch.equal(Positions.of(sparse).indices(), sparse)
    big = torch.tensor([5, 2**33])  # beyond int32: int64 kept
    assert Positions.of(big).count == 2 and torch.equal(Positions.of(big).indices(), big)
    assert Positions.of(many).union(torch.tensor([1, 2**20])).indices().tolist() == (
        sorted({*many.tolist(), 1, 2**20})
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_a_version_argument_that_is_no_version_number_is_refused_at_the_call_losing_nothing(
    tmp_path, overlap
):
    # With overlap one was accepted: detection ran, the tracker was cleared, and the error came
    # at the next call as "version None did not commit"; next_version() meanwhile raised a
    # TypeError or named a version past the largest. Without overlap it was a ManifestError.
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl)
    sync = TrainerSync(
        tracker, pub, trainer.params, overlap=overlap, optimizer=trainer.opt, inline_below=0
    )
    receivers = _receivers(store, rl, tmp_path)
    _anchor_then_step(sync, trainer)
    for bad in (None, "1", 1.0, True, -1, names.MAX_VERSION + 1):
        with pytest.raises(
            ConfigError,
            match=r"step_published\.version must be an int in \[0, \d+\], got .*: publish sync\.next_version\(\)$",
        ):
            sync.step_published(bad)
        assert sync.next_version() == 1 and pub.committed() == 0
    sync.step_published(sync.next_version())
    sync.wait()
    _assert_receivers_exact(receivers, trainer, (tl, rl), 1)
    sync.close()


def test_overlap_without_the_optimizer_is_refused_naming_it():
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    pub = Publisher(MemoryStore(), receiver_layout=rl, trainer_layout=tl)
    with pytest.raises(ConfigError, match=r"TrainerSync.optimizer"):
        TrainerSync(tracker, pub, trainer.params, overlap=True)


def test_a_small_version_publishes_before_step_published_returns_with_the_same_contract(
    tmp_path,
):
    gate = ManifestGate(2, fail=True)  # version 2's manifest write fails once
    trainer, _, sync, pub, receivers, lay = _setup(tmp_path, gate)
    sync.inline_below = 1 << 30  # every delta of this tiny model is "small"
    _anchor_then_step(sync, trainer)
    pending = sync.step_published(1)
    assert pending.done() and pub.committed() == 1  # committed on the caller's thread
    _assert_receivers_exact(receivers, trainer, lay, 1)
    trainer.step()
    failed = sync.step_published(2)
    assert failed.done() and pub.committed() == 1
    with pytest.raises(PublishFailedError, match="version 2 did not commit"):
        sync.wait()  # raised at the next call, as in the background, and the carry is kept
    assert sync._carry
    trainer.step()
    sync.step_published(3)
    (report,) = sync.wait()
    assert report.version == 3 and pub.committed() == 3
    _assert_receivers_exact(receivers, trainer, lay, 3)
    sync.close()


def test_a_small_version_is_published_with_the_values_its_detection_read(tmp_path, monkeypatch):
    import deltasync.publish.segments as segments_mod
    import deltasync.publish.trainer_sync as sync_mod

    reads: list[int] = []

    def counting(read):
        def bf16_at(t, idx, **kw):
            reads.append(idx.numel())
            return read(t, idx, **kw)

        return bf16_at

    monkeypatch.setattr(segments_mod, "bf16_at", counting(segments_mod.bf16_at))
    monkeypatch.setattr(sync_mod, "bf16_at", counting(sync_mod.bf16_at))
    gate = ManifestGate(2, fail=True)
    trainer, _, sync, _pub, receivers, lay = _setup(tmp_path, gate)
    sync.inline_below = 1 << 30
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    sync.wait()
    assert reads == []  # no parameter was read a second time
    _assert_receivers_exact(receivers, trainer, lay, 1)
    trainer.step()
    sync.step_published(2)  # its commit fails: its positions are the carry
    with pytest.raises(PublishFailedError):
        sync.wait()
    trainer.step()
    sync.step_published(3)
    sync.wait()
    assert reads  # carried positions have no detected values: read from the params
    _assert_receivers_exact(receivers, trainer, lay, 3)
    sync.close()


def test_a_large_version_routes_the_values_detection_handed_over(tmp_path, monkeypatch):
    # a vocabulary large enough that the embedding is detected in chunks (above 2^20)
    import deltasync.publish.segments as segments_mod
    import deltasync.publish.trainer_sync as sync_mod

    reads: list[int] = []
    read = segments_mod.bf16_at

    def counting(t, idx, **kw):
        reads.append(idx.numel())
        return read(t, idx, **kw)

    monkeypatch.setattr(segments_mod, "bf16_at", counting)
    spec, tl, rl = layouts(vocab_size=16411)
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=4)
    assert trainer.params["model.embed_tokens.weight"].numel() > 1 << 20
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    gate = ManifestGate(2, fail=True)
    pub = Publisher(GateStore(MemoryStore(), gate), receiver_layout=rl, trainer_layout=tl)
    sync = TrainerSync(
        tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    receivers = _receivers(pub.store, rl, tmp_path, prefix="")
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    sync.wait()
    assert reads == []  # every parameter's values came from its detection
    _assert_receivers_exact(receivers, trainer, (tl, rl), 1)
    budget = sync_mod.VALUES_IN_FLIGHT
    monkeypatch.setattr(sync_mod, "VALUES_IN_FLIGHT", 0)  # no room: the background reads
    trainer.step()
    sync.step_published(2)  # its commit fails: its positions are the carry
    with pytest.raises(PublishFailedError):
        sync.wait()
    assert reads
    monkeypatch.setattr(sync_mod, "VALUES_IN_FLIGHT", budget)
    reads.clear()
    trainer.step()
    sync.step_published(3)
    sync.wait()
    assert reads  # carried positions have no detected values: read from the params
    _assert_receivers_exact(receivers, trainer, (tl, rl), 3)
    sync.close()


class GatedTracker(StagedTracker):
    """A StagedTracker that holds the optimizer's steps for the sync (``hold_steps``) and
    whose stream stops at parameter ``after`` until ``gate`` opens."""

    def __init__(self, inner: AdamWTracker, after: int) -> None:
        super().__init__(inner, after)
        self.reached, self.gate = threading.Event(), threading.Event()

    def hold_steps(self, optimizer, wait):
        return self.inner.hold_steps(optimizer, wait)

    def arrived(self) -> None:
        self.reached.set()
        assert self.gate.wait(30), "the test never opened the gate"


def _gated(tmp_path, **config):
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None, **config)
    gated = GatedTracker(tracker, after=3)
    sync = TrainerSync(
        gated, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    gated.gate.set()
    sync.step_published(0, anchor=True)
    sync.wait()
    gated.gate.clear()
    return trainer, gated, sync, pub, receivers, lay


def test_detection_goes_on_after_step_published_returns_and_the_step_waits_for_it(tmp_path):
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    pending = sync.step_published(1)  # returns while parameter 3 is still to be detected
    assert gated.reached.wait(30) and not pending.detected() and not pending.done()
    state = {n: p.detach().clone() for n, p in trainer.params.items()}  # version 1's
    t, stepped = _step_held_back(trainer, state)  # detection still reads θ, m, v
    gated.gate.set()
    t.join(30)
    assert stepped.is_set() and pending.detected() and pub.committed() == 1
    (report,) = sync.wait()
    assert report.kind == "delta" and sync.barrier_wait_s > 0.3
    tl, rl = lay
    expected = expected_shards(state, tl, rl)
    for shard, rx in receivers.items():
        rx.pull()
        assert_same_bits(rx.tensors, expected[shard], f"v1 {shard}")
    sync.step_published(2)  # the step above: version 2, detected whole in the background
    gated.gate.set()
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 2)
    sync.close()


def test_a_detection_error_after_the_return_names_the_version_at_the_next_call(tmp_path):
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    gated.fail = RuntimeError("injected: detection failed after the return")
    sync.step_published(1)
    assert gated.reached.wait(30)
    gated.gate.set()
    with pytest.raises(PublishFailedError, match="version 1 did not commit") as err:
        sync.wait()
    assert isinstance(err.value.__cause__, RuntimeError)
    _nothing_left_then_retried_exactly(sync, pub, trainer, receivers, lay)


def test_an_edit_while_the_version_reads_the_params_refuses_it_and_the_next_sends_it_whole(
    tmp_path,
):
    # Against the contract, a param is written in place after step_published returned while
    # detection has yet to read it: the version read a mix of old and new bits, so it must
    # not commit, and the tracker (cleared after the write) cannot see the write by itself.
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    victim = list(trainer.params)[-1]  # detected after the gate
    sync.step_published(1)
    assert gated.reached.wait(30)
    with torch.no_grad():
        trainer.params[victim].mul_(1.5)
    gated.gate.set()
    with pytest.raises(PublishFailedError, match="version 1 did not commit") as err:
        sync.wait()
    cause = err.value.__cause__
    assert isinstance(cause, ParamsEditedError)
    assert cause.version == 1 and cause.names == (victim,)
    assert victim in str(cause) and "written in place" in str(cause)
    assert pub.committed() == 0 and sync.baseline == 0
    assert gated.inner.out_of_band == (victim,)  # marked: it goes out in full
    _refused_then_retried_exactly(sync, trainer, receivers, lay)  # steps 1, 2 and the edit


def test_a_mark_while_the_version_reads_the_params_refuses_it_and_the_next_sends_it_whole(
    tmp_path,
):
    # A write through .data moves no counter; mark_changed is its documented remedy. Made
    # while detection still runs after the return, the clear() at its end wiped the mark: the
    # version committed without the write and every receiver refused every later version.
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    victim = list(trainer.params)[1]  # detected before the gate: its values went out
    sync.step_published(1)
    assert gated.reached.wait(30)
    trainer.params[victim].data.add_(0.5)
    gated.inner.mark_changed(victim)
    gated.gate.set()
    with pytest.raises(PublishFailedError, match="version 1 did not commit") as err:
        sync.wait()
    cause = err.value.__cause__
    assert isinstance(cause, ParamsEditedError) and cause.names == (victim,)
    assert pub.committed() == 0 and gated.inner.out_of_band == (victim,)
    _refused_then_retried_exactly(sync, trainer, receivers, lay)


def test_optimizer_state_reset_while_the_version_reads_it_refuses_it_and_the_next_is_exact(
    tmp_path,
):
    # Against the contract, the moments are reset after step_published returned while
    # detection has yet to invert the last parameters from them: what it read is not the
    # state the step left, so the version must not commit.
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    sync.step_published(1)
    assert gated.reached.wait(30)
    for state in trainer.opt.state.values():
        state["exp_avg"].zero_()
    gated.gate.set()
    with pytest.raises(PublishFailedError, match="version 1 did not commit") as err:
        sync.wait()
    cause = err.value.__cause__
    assert isinstance(cause, ParamsEditedError) and cause.version == 1
    assert set(cause.names) == set(gated.inner.shards)  # every covered param's state moved
    assert "optimizer state that was replaced or written" in str(cause)
    assert pub.committed() == 0 and sync.baseline == 0
    _refused_then_retried_exactly(sync, trainer, receivers, lay)


def test_a_publish_that_fails_early_holds_the_next_step_until_detection_has_ended(tmp_path):
    # The store fails the background's first read while detection still runs on its own
    # thread: the optimizer's next step must still wait for detection (it reads θ, m, v and
    # clears the tracker), or that step's changes would be lost.
    trainer, gated, sync, pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    pub.store.reads_fail = True
    pending = sync.step_published(1)
    assert gated.reached.wait(30)
    with pytest.raises(StoreError):
        pending.result(30)  # the background failed, detection is held at the gate
    pub.store.reads_fail = False
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    t, stepped = _step_held_back(trainer, before)
    gated.gate.set()
    t.join(30)
    assert stepped.is_set() and pending.detected()
    with pytest.raises(PublishFailedError, match="version 1 did not commit"):
        sync.step_published(1)
    sync.step_published(1)  # steps 1 and 2: the carry and the tracker
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_the_tracker_holds_its_own_pre_step_hook_behind_the_sync() -> None:
    spec, _, _ = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=1)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    trainer.step()
    seen = []
    remove = tracker.hold_steps(trainer.opt, lambda: seen.append(len(tracker._pending)))
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert tracker.hold_steps(other, lambda: None) is None  # not the optimizer it hooks
    trainer.step()
    # the hold ran before the tracker folded the previous step's pending masks
    assert seen and seen[0] > 0
    remove()
    trainer.step()
    assert len(seen) == 1


def test_detect_in_background_false_detects_before_the_return(tmp_path):
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    sync = TrainerSync(
        tracker,
        pub,
        trainer.params,
        overlap=True,
        optimizer=trainer.opt,
        inline_below=0,
        detect_in_background=False,
    )
    sync.step_published(0, anchor=True)
    sync.wait()
    for version in (1, 2):  # the second one after a large delta too
        trainer.step()
        pending = sync.step_published(version)
        assert pending.detected()
        sync.wait()
        _assert_receivers_exact(receivers, trainer, lay, version)
    sync.close()
    with pytest.raises(ConfigError, match="detect_in_background must be a bool"):
        TrainerSync(
            tracker,
            pub,
            trainer.params,
            overlap=True,
            optimizer=trainer.opt,
            detect_in_background=1,
        )


@pytest.mark.parametrize("mode", ["background", "inline", "no overlap"])
def test_the_digests_come_from_the_detection_pass_not_a_second_read(tmp_path, monkeypatch, mode):
    # The embedding (> 2^20 elements) is detected in chunks, the rest one item each: every
    # receiver tensor is hashed from the kernel's casts as detection passes, and the digest
    # pass takes all of them as given: it reads no parameter. The manifests stay exact. Overlapped
    # (the background path, the inline one) and not (iter_changes(sink=) on the stream the
    # publisher routes as it is detected).
    import deltasync.publish.publisher as publisher_mod
    from deltasync.layout.digest import state_digests

    given = spy_digest_pass(monkeypatch, publisher_mod)
    spec, tl, rl = layouts(vocab_size=16411)
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=6)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    pub = Publisher(MemoryStore(), receiver_layout=rl, trainer_layout=tl)
    overlap = mode != "no overlap"
    sync = TrainerSync(
        tracker,
        pub,
        trainer.params,
        overlap=overlap,
        optimizer=trainer.opt,
        inline_below=1 << 30 if mode == "inline" else 0,
    )
    receivers = _receivers(pub.store, rl, tmp_path, prefix="")
    tensors = sum(len(rl.local_specs(s.id)) for s in rl.shards())
    _anchor_then_step(sync, trainer)
    for version in (1, 2):
        given.clear()
        pending = sync.step_published(version)
        sync.wait()
        if overlap:
            assert pending.feed is not None and pending.feed.covered() > 0
        assert given == [tensors]  # every tensor given: nothing for the pass to read
        truth = state_digests(trainer.params, trainer_layout=tl, receiver_layout=rl)
        assert dict(pub.catalog.manifest(version).shard_digests) == truth
        _assert_receivers_exact(receivers, trainer, (tl, rl), version)
        trainer.step()
    sync.close()


@pytest.mark.parametrize(
    "option",
    ["full_state", "digests_in_detection=False"],
)
def test_no_feed_is_built_where_detection_cannot_or_should_not_hash(tmp_path, option):
    # full_state: the publisher hashes the full state, which detection does not see (nothing
    # its casts could vouch for); digests_in_detection=False: the separate pass, by request.
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    kw = (
        {"full_state": lambda: trainer.params}
        if option == "full_state"
        else {"digests_in_detection": False}
    )
    sync = TrainerSync(
        tracker,
        pub,
        trainer.params,
        overlap=True,
        optimizer=trainer.opt,
        inline_below=0,
        **kw,
    )
    _anchor_then_step(sync, trainer)
    pending = sync.step_published(1)
    sync.wait()
    assert pending.feed is None
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_digests_in_detection_must_be_a_bool(tmp_path):
    trainer, tracker, _, pub, _, _ = _setup(tmp_path, lambda op, key: None)
    with pytest.raises(ConfigError, match="digests_in_detection"):
        TrainerSync(tracker, pub, trainer.params, digests_in_detection=1)


@pytest.mark.timeout(60)
def test_a_publish_that_stops_early_leaves_no_digest_pass_waiting_for_its_feed(
    tmp_path, monkeypatch
):
    # Without overlap the digest pass waits for the end of the detection stream the publisher
    # consumes; a publish that stops after the first parameter must not leave it waiting (the
    # next version's pass would queue behind it forever): the retry commits, exact.
    from deltasync.publish import segments

    route = segments.GroupRouter.stream
    stopped = []

    def stops_early(self, streams, source, *args, **kwargs):
        if not stopped:
            next(iter(source))
            stopped.append(True)
            raise RuntimeError("injected: the routing stopped after one parameter")
        return route(self, streams, source, *args, **kwargs)

    monkeypatch.setattr(segments.GroupRouter, "stream", stops_early)
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    sync = TrainerSync(tracker, pub, trainer.params)
    sync.step_published(0, anchor=True)
    trainer.step()
    with pytest.raises(RuntimeError, match="injected"):
        sync.step_published(1)
    assert stopped and pub.committed() == 0
    sync.step_published(1)  # the tracker kept its changes
    _assert_receivers_exact(receivers, trainer, lay, 1)
    trainer.step()
    sync.step_published(2)
    _assert_receivers_exact(receivers, trainer, lay, 2)
    sync.close()


@pytest.mark.parametrize("inline_below", [0, 1 << 30])  # a large delta, a small one
def test_the_carry_of_a_large_delta_is_compact_and_a_small_ones_is_held_as_detected(
    tmp_path, inline_below
):
    # A small delta publishes on the caller's thread: its positions are held as detection gave
    # them (encoding each parameter's would cost more than it saves in the few milliseconds
    # they live); a large delta's stay until its commit beside the background: about a byte each.
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    sync = TrainerSync(
        tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=inline_below
    )
    _anchor_then_step(sync, trainer)
    pending = sync.step_published(1)
    assert pending.wait_detected(30)
    carry = dict(sync._carry)  # the capture: the carry until settled
    wide64 = [n for n, p in carry.items() if p.wide is not None and p.wide.dtype == torch.int64]
    if inline_below:
        assert wide64  # held as detected
    else:
        assert carry and not wide64
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 1)
    sync.close()


def test_without_overlap_a_small_deltas_successor_keeps_the_pass_beside_detection(
    tmp_path, monkeypatch
):
    # A version after a delta of fewer than inline_below changed elements: the digest pass
    # reads the params beside detection (a small model: that core is idle) instead of the
    # detection pass hashing them; before any such delta, and for a large one, the detection
    # pass hashes them. The manifests stay exact either way.
    import deltasync.publish.publisher as publisher_mod
    from deltasync.layout.digest import state_digests

    given = spy_digest_pass(monkeypatch, publisher_mod)
    trainer, tracker, _, pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    tl, rl = lay
    sync = TrainerSync(tracker, pub, trainer.params, inline_below=1 << 30)
    sync.step_published(0, anchor=True)
    tensors = sum(len(rl.local_specs(s.id)) for s in rl.shards())
    for version, fed in ((1, tensors), (2, 0), (3, 0)):
        trainer.step()
        given.clear()
        sync.step_published(version)
        assert given == [fed], version
        truth = state_digests(trainer.params, trainer_layout=tl, receiver_layout=rl)
        assert dict(pub.catalog.manifest(version).shard_digests) == truth
        _assert_receivers_exact(receivers, trainer, lay, version)
    sync.close()


def test_after_close_a_failed_versions_capture_goes_out_with_the_next_blocking_call(tmp_path):
    # close() removes the barrier: a later call must not publish in the background beside the
    # next optimizer step, and the capture of a version that failed in flight must not be lost.
    gate = ManifestGate(1, fail=True)
    trainer, _tracker, sync, pub, receivers, lay = _setup(tmp_path, gate)
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    with pytest.raises(PublishFailedError, match="version 1 did not commit"):
        sync.close()
    assert sync._carry  # step 1's positions, the tracker already cleared
    gate.release()
    trainer.step()
    reports = sync.step_published(1)  # steps 1 and 2: blocks until committed
    assert isinstance(reports, list) and reports[0].base_version == 0
    assert pub.committed() == 1 and sync._inflight is None and sync._worker is None
    _assert_receivers_exact(receivers, trainer, lay, 1)
    trainer.step()
    reports = sync.step_published(2)  # nothing carried: the plain blocking path
    assert isinstance(reports, list) and pub.committed() == 2
    _assert_receivers_exact(receivers, trainer, lay, 2)


class DroppingTracker:
    """An AdamWTracker that loses every change of ``lost`` (a stand-in for a detection bug):
    what the receivers' verify must still catch."""

    def __init__(self, inner: AdamWTracker, lost: str) -> None:
        self.inner, self.lost = inner, lost

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def iter_capture(self, *args, **kwargs):
        return (item for item in self.inner.iter_capture(*args, **kwargs) if item[0] != self.lost)

    def iter_changed(self):
        return ((n, i) for n, i in self.inner.iter_changed() if n != self.lost)


@pytest.mark.parametrize("inline_below", [0, 2**18])
def test_a_param_that_detection_missed_entirely_never_keeps_its_old_digest(tmp_path, inline_below):
    # The digests of receiver tensors only untouched params feed are reused from the last
    # commit. A parameter written since that commit is touched whatever detection says: if it
    # kept its old digest, a whole parameter lost by detection would pass every verify.
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=3)
    lost = "model.norm.weight"
    trainer.params[lost].requires_grad_(False)  # a constant: never fed by detection
    trainer.opt = torch.optim.AdamW(
        [p for n, p in trainer.params.items() if n != lost], lr=1e-3, foreach=False
    )
    tracker = DroppingTracker(AdamWTracker(trainer.opt, trainer.named_parameters()), lost)
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    sync = TrainerSync(
        tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=inline_below
    )
    receivers = _receivers(store, rl, tmp_path)
    _two_versions_exact(sync, trainer, receivers, (tl, rl))  # nothing lost yet
    trainer.step()
    with torch.no_grad():
        trainer.params[lost].add_(0.5)  # seen by the tracker, lost by the wrapper
    _version_2_refused_by_every_receiver(sync, receivers)


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_a_stepped_param_that_detection_missed_never_keeps_its_old_digest(tmp_path, impl):
    # A fused update moves no version counter: a stepped parameter lost by detection kept the
    # digest of the last commit, and every receiver verified and reported a version whose
    # bits it did not hold. The tracker's count of the updates it saw moves for both. The bug
    # stood in for: the tracker loses the parameter's step (its pending inversion).
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.5, seed=5)
    trainer.opt = torch.optim.AdamW(trainer.params.values(), lr=1e-3, **impl)
    lost = "model.layers.0.mlp.down_proj.weight"
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    sync = TrainerSync(tracker, pub, trainer.params, overlap=True, optimizer=trainer.opt)
    receivers = _receivers(store, rl, tmp_path)
    _two_versions_exact(sync, trainer, receivers, (tl, rl))  # nothing lost yet
    before = trainer.params[lost].detach().to(torch.bfloat16)
    trainer.step()
    assert not torch.equal(trainer.params[lost].detach().to(torch.bfloat16), before)
    tracker._pending = [step for step in tracker._pending if step[0] != lost]
    _version_2_refused_by_every_receiver(sync, receivers)


def test_a_committed_version_published_again_after_a_step_keeps_the_steps_changes(tmp_path):
    # v1 committed; the trainer steps and publishes v1 again (it believed v1 failed). The
    # publisher refuses it (another state under a committed number), and that step's changes,
    # captured and cleared from the tracker, must go out with the next version.
    trainer, _tracker, sync, _pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    sync.wait()
    trainer.step()
    sync.step_published(1)
    with pytest.raises(PublishFailedError, match="version 1 did not commit") as err:
        sync.wait()
    assert isinstance(err.value.__cause__, CommitConflictError)
    assert sync._carry  # kept
    trainer.step()
    (report,) = sync.step_published(sync.next_version()).result()
    sync.wait()
    assert report.version == 2 and report.base_version == 1
    _assert_receivers_exact(receivers, trainer, lay, 2)
    sync.close()


class InterruptAt:
    """Raises ``KeyboardInterrupt`` (a Ctrl-C arriving there) once, at the write of ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, op: str, key: str) -> None:
        if key == self.key:
            self.key = ""
            raise KeyboardInterrupt


def _steps_within(trainer, seconds: float) -> bool:
    """Whether the next optimizer step (its pre-step hook included) ends within ``seconds``."""
    t = threading.Thread(target=trainer.step, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_an_interrupt_during_an_inline_publish_is_a_failed_version_at_the_next_call(tmp_path):
    # a small version publishes on the caller's thread: the interrupt reaches the caller, and
    # the version must be settled as failed, not left pending (the next step, wait() and
    # close() would wait for it forever)
    gate = InterruptAt(names.manifest_key(2))
    trainer, _, sync, pub, receivers, lay = _setup(tmp_path, gate, inline_below=1 << 30)
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    trainer.step()
    with pytest.raises(KeyboardInterrupt):
        sync.step_published(2)
    pending = sync.in_flight
    assert pending is not None and pending.version == 2 and pending.done()
    assert _steps_within(trainer, 30), "the optimizer step waits for a version that never ends"
    with pytest.raises(PublishFailedError, match="version 2 did not commit") as err:
        sync.step_published(3)
    assert err.value.version == 2 and pub.committed() == 1
    assert isinstance(err.value.__cause__, SendInterruptedError)
    assert isinstance(err.value.__cause__.__cause__, KeyboardInterrupt)
    sync.step_published(3)  # steps 2 and 3, on version 1
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 3)
    sync.close()


def _interrupt_soon() -> Callable[[], None]:
    """A real SIGINT to this process in 0.3 s (as a Ctrl-C), raised as KeyboardInterrupt on
    the main thread whatever handler the test runner installed; returns the undo."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    return lambda: signal.signal(signal.SIGINT, previous)


def test_an_interrupt_while_waiting_leaves_the_version_in_flight_for_the_step_to_wait_for(
    tmp_path,
):
    trainer, gated, sync, _pub, receivers, lay = _gated(tmp_path)
    trainer.step()
    pending = sync.step_published(1)  # detection held at parameter 3
    assert gated.reached.wait(30)
    restore = _interrupt_soon()
    try:
        with pytest.raises(KeyboardInterrupt):
            sync.wait()
    finally:
        restore()
    assert sync.in_flight is pending and not pending.detected()
    state = {n: p.detach().clone() for n, p in trainer.params.items()}  # version 1's
    t, stepped = _step_held_back(trainer, state)  # the barrier still holds the step
    gated.gate.set()
    t.join(30)
    assert stepped.is_set()
    (report,) = sync.wait()  # settled now
    assert report.version == 1 and sync.in_flight is None
    tl, rl = lay
    expected = expected_shards(state, tl, rl)
    for shard, rx in receivers.items():
        rx.pull()
        assert_same_bits(rx.tensors, expected[shard], f"v1 {shard}")
    sync.step_published(2)  # the held step's changes: none was cleared by version 1
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 2)
    sync.close()


def _version_2_held_in_detection(sync, trainer, gated) -> PendingVersion:
    """Version 1 published whole, then version 2's detection held at the gate."""
    gated.gate.set()
    trainer.step()
    sync.step_published(1)
    sync.wait()
    gated.gate.clear()
    trainer.step()
    pending = sync.step_published(2)
    assert gated.reached.wait(30)
    return pending


def test_wait_returns_after_detection_even_when_the_publish_read_none_of_it(tmp_path):
    # the publisher makes version 2 an anchor (anchor_every): it sends the params whole and
    # commits without the change stream, while detection still runs; detection clears the
    # tracker when it ends, so the step after wait() must come after that
    trainer, gated, sync, _pub, receivers, lay = _gated(tmp_path, anchor_every=2)
    pending = _version_2_held_in_detection(sync, trainer, gated)
    (report,) = pending.result()  # committed while detection is held
    assert report.kind == "anchor" and not pending.detected()
    waited = threading.Thread(target=sync.wait)
    waited.start()
    waited.join(0.5)
    assert waited.is_alive(), "wait() returned while detection still ran"
    gated.gate.set()
    waited.join(30)
    assert pending.detected()
    trainer.step()
    sync.step_published(3)
    sync.wait()
    _assert_receivers_exact(receivers, trainer, lay, 3)
    sync.close()


def test_a_later_publisher_routes_the_whole_capture_when_the_first_sends_an_anchor(tmp_path):
    # publisher 0 anchors version 2 (anchor_every) and never drains the handoff: publisher 1's
    # delta must still wait for the whole capture, not route what detection has found so far
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=4)
    gated = GatedTracker(AdamWTracker(trainer.opt, trainer.named_parameters()), after=3)
    stores = [MemoryStore(), MemoryStore()]
    pubs = [
        Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(**cfg))
        for store, cfg in zip(stores, ({"anchor_every": 2}, {}), strict=True)
    ]
    sync = TrainerSync(
        gated, pubs, trainer.params, overlap=True, optimizer=trainer.opt, inline_below=0
    )
    receivers = [
        Receiver.for_layout(
            stores[1], rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(s.id)
        )
        for s in rl.shards()
    ]
    gated.gate.set()
    sync.step_published(0, anchor=True)
    pending = _version_2_held_in_detection(sync, trainer, gated)
    deadline = time.monotonic() + 30
    while pubs[0].committed() != 2:  # publisher 0's anchor, with detection held
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # room for publisher 1 to route too early, were it to
    gated.gate.set()
    assert [r.kind for r in pending.result()] == ["anchor", "delta"]
    sync.wait()
    want = expected_shards(trainer.params, tl, rl)
    for rx in receivers:
        rx.pull()
        assert rx.version == 2
        assert_same_bits(rx.tensors, want[rx.shard], f"v2 {rx.shard}")
    sync.close()


@pytest.mark.parametrize("both", [True, False])
def test_every_optimizer_passed_waits_for_the_version_in_flight(tmp_path, both):
    # Two optimizers (SGD on the matrices, as Muon would be, AdamW on the rest), the untracked
    # one stepped first: passed too, its step waits and every version commits first time;
    # left out, its step lands while the version reads, and that version is refused.
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.05, seed=4)
    matrices = [p for p in trainer.params.values() if p.dim() == 2]
    rest = [p for p in trainer.params.values() if p.dim() != 2]
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    sgd = torch.optim.SGD(matrices, lr=1e-2)
    tracker = AdamWTracker(adamw, trainer.named_parameters())
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    with pytest.raises(ConfigError, match=r"TrainerSync.optimizer holds a str"):
        TrainerSync(tracker, pub, trainer.params, overlap=True, optimizer=[adamw, "sgd"])
    sync = TrainerSync(
        tracker,
        pub,
        trainer.params,
        overlap=True,
        optimizer=[adamw, sgd] if both else adamw,
        inline_below=0,
    )
    receivers = _receivers(store, rl, tmp_path)
    sync.step_published(0, anchor=True)
    sync.wait()
    refused = 0
    for version in range(1, 5):
        for p in trainer.params.values():
            g = torch.Generator().manual_seed(version)
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        sgd.step()
        adamw.step()
        pending = sync.step_published(version)
        for p in trainer.params.values():  # the next forward/backward, as the version reads
            p.grad = None
        sgd.step(), adamw.step()  # no gradient: moves nothing, but runs the barrier
        try:
            sync.wait()
        except PublishFailedError as exc:
            assert isinstance(exc.__cause__, ParamsEditedError)
            refused += 1
            continue
        assert pending.result()[0].version == version
        _assert_receivers_exact(receivers, trainer, (tl, rl), version)
    sync.close()
    assert (refused == 0) if both else (refused > 0)


def test_closing_the_tracker_waits_for_a_detection_still_reading_it(tmp_path):
    # close() removed the hook that holds the steps while an overlapped version's detection
    # still ran on its thread: the next step then moved θ, m and v under it.
    trainer, tracker, sync, _pub, receivers, lay = _setup(tmp_path, lambda op, key: None)
    _anchor_then_step(sync, trainer)
    sync.step_published(1)
    sync.wait()
    trainer.step()
    real = tracker.iter_capture

    def slow(*args, **kwargs):
        time.sleep(0.5)
        yield from real(*args, **kwargs)

    tracker.iter_capture = slow
    pending = sync.step_published(2)
    assert not pending.detected()  # detection goes on after the return
    tracker.close()
    assert pending.detected()
    sync.wait()
    sync.close()
    _assert_receivers_exact(receivers, trainer, lay, 2)
