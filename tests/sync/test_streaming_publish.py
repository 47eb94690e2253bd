"""The publisher streams: each parameter group is routed and appended as a segment to every
shard's blob, and the blobs' uploads run while the tracker is still detecting later groups.

The proof is an event log: a lazy change stream records when the publisher asks it for each
parameter, a store records when each blob's bytes arrive; bytes of the first groups must land
before the last parameter is even detected. Receivers still end bit-exact, and an error in the
middle of the stream leaves no blob behind and nothing committed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deltasync import names
from deltasync.errors import ConfigError
from deltasync.format import decode_blob
from deltasync.format.wire import HEADER, SEGMENT
from deltasync.layout import ReceiverLayout
from deltasync.layout.groups import param_groups
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.publish import publisher as publisher_mod
from deltasync.receiver import Receiver
from deltasync.store import MemoryStore
from deltasync.trainer import AdamWTracker

from sync_kit import (
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    scratch_store,
    zero_tensors,
)


class LoggingStore(MemoryStore):
    """Logs ("bytes", key) each time a blob's upload receives a chunk."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log, self._lock = log, threading.Lock()

    def put_stream(self, key, chunks):
        def logged():
            for chunk in chunks:
                with self._lock:
                    self.log.append(("bytes", key))
                yield chunk

        return super().put_stream(key, logged())


def logged_stream(source, log: list):
    for item in source:
        log.append(("detected", item[0]))
        yield item


def segments(blob: bytes) -> int:
    at = HEADER.size + blob[24] + blob[25]
    count = 0
    while at < len(blob) - 44:
        at += SEGMENT.size + int.from_bytes(blob[at : at + 8], "little")
        count += 1
    return count


# --- parameter groups ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine, tp, ep, moe",
    [
        ("vllm", 2, 1, False),
        ("vllm", 4, 1, False),
        ("hf", 1, 1, False),
        ("vllm", 2, 2, True),
        ("vllm", 1, 4, True),
    ],
)
def test_groups_partition_the_params_and_never_share_a_local_tensor(engine, tp, ep, moe):
    overrides = dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32) if moe else {}
    spec, tl, _ = layouts(**overrides)
    rl = ReceiverLayout.build(spec, engine, tp, ep)
    params = list(tl.param_shapes())
    groups = param_groups(params, trainer_layout=tl, receiver_layout=rl)
    assert sorted(n for g in groups for n in g.params) == sorted(params)
    owner = {}
    for k, g in enumerate(groups):
        assert g.last == max(params.index(n) for n in g.params)
        for name in g.params:
            for canon in tl.canonical_names(name):
                for holder in rl.holders(canon):
                    assert owner.setdefault(holder, k) == k, f"{holder} fed by two groups"
    assert [g.last for g in groups] == sorted(g.last for g in groups)
    fused = [g.params for g in groups if len(g.params) > 1]
    if engine == "vllm":  # q/k/v -> qkv_proj and gate/up -> gate_up_proj are routed together
        assert any(any(n.endswith("q_proj.weight") for n in g) for g in fused)
    else:
        assert not fused


# --- streaming --------------------------------------------------------------------------------


def test_blobs_upload_while_detection_of_later_groups_is_still_running(tmp_path):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    log: list = []
    store = LoggingStore(log)
    pub = Publisher(
        store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(upload_threads=4)
    )
    pub.publish(0, {}, trainer.params, anchor=True)
    tracker.clear()
    trainer.step()
    log.clear()
    report = pub.publish(1, logged_stream(tracker.iter_changes(), log), trainer.params)
    assert report.kind == "delta"

    detected = [i for i, e in enumerate(log) if e[0] == "detected"]
    last_param = list(trainer.params)[-1]
    assert log[detected[-1]] == ("detected", last_param)
    early = {key for kind, key in log[: detected[-1]] if kind == "bytes"}
    blob_keys = {names.blob_key(1, s.id, pub.writer) for s in rl.shards()}
    # Every shard's blob had its header and first segments in the store's hands before the
    # last parameter was detected: the uploads ran during detection.
    assert early == blob_keys, (early, log[:40])
    for key in blob_keys:
        assert segments(store.get(key)) > 3

    for shard in rl.shards():
        rx = Receiver.for_layout(
            store,
            rl,
            shard.id,
            zero_tensors(rl, shard.id),
            str(tmp_path / shard.id),
            rconfig(f"rx-{shard.id}"),
        )
        rx.pull()
        assert rx.version == 1
        assert_same_bits(rx.tensors, expected_shards(trainer.params, tl, rl)[shard.id], shard.id)


def test_trainer_sync_streams_and_stays_exact_over_versions_on_a_local_store(tmp_path):
    spec, tl, rl = layouts(tp=4)
    trainer = TinyTrainer(spec, lr=3e-3, density=0.1)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = scratch_store(tmp_path / "store")
    pub = Publisher(
        store,
        receiver_layout=rl,
        trainer_layout=tl,
        config=PublisherConfig(anchor_every=5, upload_threads=1),
    )
    sync = TrainerSync(tracker, pub, trainer.params)
    receivers = {
        s.id: Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(f"rx-{s.id}")
        )
        for s in rl.shards()
    }
    sync.step_published(0, anchor=True)
    for version in range(1, 8):
        trainer.step()
        (report,) = sync.step_published(version)
        assert report.kind == ("anchor" if version % 5 == 0 else "delta")
        expected = expected_shards(trainer.params, tl, rl)
        for shard, rx in receivers.items():
            rx.pull()
            assert rx.version == version
            assert_same_bits(rx.tensors, expected[shard], f"v{version} {shard}")


def _no_blobs(store, version: int) -> bool:
    return not [k for k in store.list(names.version_prefix(version)) if k.endswith(".blob")]


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_an_error_mid_stream_leaves_no_blob_and_a_retry_commits_exactly(backend, tmp_path):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = scratch_store(tmp_path / "s") if backend == "local" else MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl)
    pub.publish(0, {}, trainer.params, anchor=True)
    tracker.clear()
    trainer.step()

    def failing(source, after: int):
        for k, item in enumerate(source):
            if k == after:
                raise RuntimeError("detection failed (simulated)")
            yield item

    with pytest.raises(RuntimeError, match="simulated"):
        pub.publish(1, failing(tracker.iter_changes(), 10), trainer.params)
    assert pub.committed() == 0 and _no_blobs(store, 1)
    if backend == "local":  # no temp file left behind either
        assert not [p for p in (tmp_path / "s").rglob("*") if p.is_file() and "v00000001" in str(p)]

    # out of order: refused with the reason, nothing stored
    triples = list(tracker.iter_changes())
    with pytest.raises(ConfigError, match="must follow the order of params"):
        pub.publish(1, iter([triples[1], triples[0]]), trainer.params)
    with pytest.raises(ConfigError, match="not in params"):
        pub.publish(1, iter([("nope.weight", *triples[0][1:])]), trainer.params)
    with pytest.raises(ConfigError, match="triples"):
        pub.publish(1, iter([("nope.weight", triples[0][1])]), trainer.params)
    with pytest.raises(ConfigError, match="not a dict"):
        pub.publish(1, {"nope.weight": triples[0][1]}, trainer.params)
    assert pub.committed() == 0 and _no_blobs(store, 1)

    pub.publish(1, tracker.iter_changes(), trainer.params)  # the tracker kept its bits
    rx = Receiver.for_layout(
        store, rl, "tp1", zero_tensors(rl, "tp1"), str(tmp_path / "rx"), rconfig("rx")
    )
    rx.pull()
    assert_same_bits(rx.tensors, expected_shards(trainer.params, tl, rl)["tp1"])


def test_a_list_of_changes_goes_out_in_fewer_segments_with_the_same_records():
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    trainer.step()
    blobs = []
    for changes in ("list", "stream"):
        store = MemoryStore()
        pub = Publisher(
            store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(session="s")
        )
        pub.publish(0, {}, {n: torch.zeros_like(p) for n, p in trainer.params.items()}, anchor=True)
        changed = list(tracker.iter_changes()) if changes == "list" else tracker.iter_changes()
        pub.publish(1, changed, trainer.params)
        blobs.append({k: store.get(k) for k in store.list("v00000001/") if k.endswith(".blob")})
    listed, streamed = blobs
    assert listed.keys() == streamed.keys() and listed
    for key in listed:
        # detected already: the groups are batched into one segment per blob (they hold far
        # fewer than SEGMENT_ELEMENTS changes); streamed: one segment per group
        assert segments(listed[key]) == 1 < segments(streamed[key])
        a = {u.name: u for u in decode_blob(listed[key]).updates}
        b = {u.name: u for u in decode_blob(streamed[key]).updates}
        assert a.keys() == b.keys()
        for name, x in a.items():
            assert torch.equal(x.indices, b[name].indices), name
            assert torch.equal(x.values.view(torch.int16), b[name].values.view(torch.int16)), name


def test_batched_segments_stop_at_the_element_bound(monkeypatch):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    trainer.step()
    changes = list(tracker.iter_changes())
    monkeypatch.setattr(publisher_mod, "SEGMENT_ELEMENTS", 1)  # every group its own segment
    store = MemoryStore()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    pub.publish(0, {}, trainer.params, anchor=True)
    pub.publish(1, changes, trainer.params, since=0)
    keys = [k for k in store.list("v00000001/") if k.endswith(".blob")]
    assert keys and all(segments(store.get(k)) > 3 for k in keys)


def test_moe_expert_parallel_receivers_get_streamed_blobs_bit_exactly(tmp_path):
    spec, tl, _ = layouts(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32)
    rl = ReceiverLayout.build(spec, "vllm", 2, 2)
    trainer = TinyTrainer(spec, lr=1e-3, density=0.1)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = MemoryStore()
    sync = TrainerSync(
        tracker, Publisher(store, receiver_layout=rl, trainer_layout=tl), trainer.params
    )
    sync.step_published(0, anchor=True)
    for version in (1, 2):
        trainer.step()
        sync.step_published(version)
    expected = expected_shards(trainer.params, tl, rl)
    for s in rl.shards():
        rx = Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(f"rx-{s.id}")
        )
        rx.pull()
        assert_same_bits(rx.tensors, expected[s.id], s.id)


def test_a_failed_upload_stops_the_stream_early_and_commits_nothing():
    from deltasync.errors import StoreError

    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())

    failed = threading.Event()

    class BrokenUploads(MemoryStore):
        def put_stream(self, key, chunks):
            if key.endswith(".blob") and key.startswith("v00000001/"):
                next(iter(chunks))
                failed.set()
                raise StoreError(f"upload of {key} failed (simulated)")
            return super().put_stream(key, chunks)

    def slow_after_first_groups(source):
        for k, item in enumerate(source):
            yield item
            if k == 3:  # let the upload threads see their first segment and fail
                assert failed.wait(10)
                time.sleep(0.2)

    store = BrokenUploads()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl)
    pub.publish(0, {}, trainer.params, anchor=True)
    tracker.clear()
    trainer.step()
    log: list = []
    with pytest.raises(StoreError, match="simulated"):
        pub.publish(
            1, logged_stream(slow_after_first_groups(tracker.iter_changes()), log), trainer.params
        )
    assert pub.committed() == 0 and _no_blobs(store, 1)
    # it stopped consuming detection once the failure was seen (not after the whole model)
    assert len(log) < len(trainer.params)


def test_params_the_layout_does_not_know_are_fine_while_they_carry_no_changes():
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    store = MemoryStore()
    params = {**trainer.params, "extra.buffer": torch.zeros(3)}
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl)
    pub.publish(0, {}, trainer.params, anchor=True)
    tracker.clear()
    trainer.step()
    assert pub.publish(1, tracker.iter_changes(), params).kind == "delta"


def test_every_kind_of_tracker_streams_the_detection_pass_values():
    from deltasync.trainer import SnapshotTracker

    spec, _, _ = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    trackers = [
        AdamWTracker(trainer.opt, trainer.named_parameters()),
        SnapshotTracker(trainer.named_parameters()),
    ]
    trainer.step()
    for tracker in trackers:
        items = list(tracker.iter_changes())
        assert items and all(vals is not None for _, _, vals in items), type(tracker).__name__
        for name, idx, vals in items:
            want = trainer.params[name].detach().reshape(-1)[idx].to(torch.bfloat16)
            assert torch.equal(vals.view(torch.int16), want.view(torch.int16))
        assert [n for n, _, _ in items] == list(tracker.changed())


def test_a_slow_link_holds_back_the_encoder_instead_of_queueing_the_blobs(tmp_path):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, lr=1e-3, density=0.2)
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    link_open = threading.Event()

    class StalledLink(MemoryStore):
        def put_stream(self, key, chunks):
            if key.startswith("v00000001/") and key.endswith(".blob"):
                assert link_open.wait(30), "the test never opened the link"
            return super().put_stream(key, chunks)

    store = StalledLink()
    pub = Publisher(store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig())
    pub.publish(0, {}, trainer.params, anchor=True)
    tracker.clear()
    trainer.step()
    log: list = []
    done = threading.Event()

    def publish() -> None:
        pub.publish(1, logged_stream(tracker.iter_changes(), log), trainer.params)
        done.set()

    t = threading.Thread(target=publish)
    t.start()
    # The encoder runs until every blob's queue is full, then waits: detection stops early.
    deadline, seen = time.monotonic() + 30, -1
    while len(log) != seen and time.monotonic() < deadline:
        seen = len(log)
        time.sleep(1.0)
    total = sum(1 for _ in tracker.iter_changes())
    assert not done.is_set() and len(log) < total, (len(log), total)
    link_open.set()
    t.join(60)
    assert done.is_set() and len(log) == total
    for shard in rl.shards():
        rx = Receiver.for_layout(
            store,
            rl,
            shard.id,
            zero_tensors(rl, shard.id),
            str(tmp_path / shard.id),
            rconfig(f"rx-{shard.id}"),
        )
        rx.pull()
        assert rx.version == 1
        assert_same_bits(rx.tensors, expected_shards(trainer.params, tl, rl)[shard.id], shard.id)
