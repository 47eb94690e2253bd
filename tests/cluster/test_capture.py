"""The in-cluster capture in one process: an overlapped version is captured as positions only
(about one byte per changed element, no BF16 values), joined exactly with the carry of failed
attempts, and its routing with values read later gives the same bits as routing the values the
detection read; built batch by batch, its blobs decode to the same updates."""

from __future__ import annotations

import threading

import pytest
import torch
from kit import (
    SyntheticTrainer,
    bits,
    one_torch_thread,  # noqa: F401 - an autouse fixture: pytest finds it by name here
    tiny_layouts,
)
from overlap_testkit import CountingTracker

from deltasync.cluster.capture import (
    capture_positions,
    capture_with_values,
    carry_bytes,
    carry_of,
    iter_handed,
    route_positions,
    streamed_blobs,
)
from deltasync.errors import CaptureAbandonedError, ConfigError
from deltasync.format import decode_blob, encode_blob
from deltasync.layout.routing import shard_updates
from deltasync.trainer import AdamWTracker, SnapshotTracker
from deltasync.trainer.handoff import Handoff
from deltasync.trainer.positions import Positions

SPEC, TRAINER, RECEIVERS = tiny_layouts(engine="vllm", tp=2)
RL_LR = 3e-6
BLOB = {  # streamed_blobs' arguments besides the positions and the params
    "shards": [s.id for s in RECEIVERS.shards()],
    "trainer_layout": TRAINER,
    "receiver_layout": RECEIVERS,
    "version": 4,
    "base_version": 3,
    "writer": "w00000",
}


def trained(steps: int = 3) -> tuple[SyntheticTrainer, AdamWTracker]:
    """A trainer of the tiny Qwen3 at an RL learning rate, its tracker cleared after
    ``steps`` warm-up steps and one more step taken."""
    trainer = SyntheticTrainer.gaussian(TRAINER.param_shapes(), seed=3, lr=RL_LR)
    tracker = AdamWTracker(trainer.opt, trainer.named)
    for v in range(steps):
        trainer.step(v)
    tracker.clear()
    trainer.step(steps)
    return trainer, tracker


def same_updates(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for shard in a:
        ua, ub = a[shard], b[shard]
        if [u.name for u in ua] != [u.name for u in ub]:
            return False
        for x, y in zip(ua, ub, strict=True):
            if not torch.equal(x.indices, y.indices) or not torch.equal(
                bits(x.values), bits(y.values)
            ):
                return False
    return True


def test_an_overlapped_capture_asks_for_positions_only_and_holds_about_a_byte_per_element() -> None:
    trainer, inner = trained()
    tracker = CountingTracker(inner)
    caps = capture_positions(tracker, {}, trainer.params())
    # no values read, nor a whole parameter's int64 positions
    assert tracker.calls == {"iter_changes": 0, "iter_changed": 0, "iter_positions": 1}
    assert caps.values is None and caps.changed is None and caps.positions
    elements = sum(len(p) for p in caps.positions.values())
    total = sum(p.numel() for _, p in trainer.named)
    assert 0.001 * total < elements < 0.5 * total  # an RL step: a few percent changed
    # int32 indices would be 4 bytes per element, int32 + BF16 values 6
    assert carry_bytes(caps.positions) <= 1.2 * elements
    expected = dict(inner.iter_changed())
    for name, pos in caps.positions.items():
        assert torch.equal(pos.indices(), expected.pop(name).to(torch.int64))
    assert expected == {} or all(not t.numel() for t in expected.values())


def test_positions_routed_with_values_read_later_equal_the_values_the_detection_read() -> None:
    trainer, tracker = trained()
    params = trainer.params()
    where = {"trainer_layout": TRAINER, "receiver_layout": RECEIVERS}
    caps = capture_positions(tracker, {}, trainer.params())
    assert caps.positions is not None
    late = route_positions(caps.positions, params, **where)
    triples = list(tracker.iter_changes())
    at_detection = shard_updates(
        {n: i for n, i, _ in triples}, params, **where, values={n: v for n, _, v in triples}
    )
    assert same_updates(late, at_detection)
    assert sum(u.nnz for us in late.values() for u in us) > 0


def test_the_carry_joins_the_next_capture_as_the_sorted_union_in_both_forms() -> None:
    trainer, tracker = trained()
    first = capture_positions(tracker, {}, trainer.params()).positions
    assert first is not None
    tracker.clear()  # as the overlapped sender does at the capture
    trainer.step(10)
    carry = carry_of(first)
    later = capture_positions(tracker, carry, trainer.params()).positions
    blocking = capture_with_values(tracker, carry)
    assert later is not None and blocking.changed is not None and blocking.values is not None
    now = dict(tracker.iter_changed())
    names = set(first) | {n for n, i in now.items() if i.numel()}
    assert set(later) == names == set(blocking.changed)
    for name in names:
        parts = [first[name].indices()] if name in first else []
        if name in now:
            parts.append(now[name].to(torch.int64))
        union = torch.unique(torch.cat(parts))
        assert torch.equal(later[name].indices(), union), name
        assert torch.equal(blocking.changed[name], union), name
    # a carried param's values are gathered at routing (at the union), never the tracker's
    assert not set(blocking.values) & set(carry)
    params = trainer.params()
    where = {"trainer_layout": TRAINER, "receiver_layout": RECEIVERS}
    assert same_updates(
        route_positions(later, params, **where),
        shard_updates(blocking.changed, params, **where, values=blocking.values),
    )
    assert first is not None and all(isinstance(p, Positions) for p in carry.values())


def test_a_tracker_without_a_positions_stream_is_captured_from_its_triples() -> None:
    p = torch.zeros(64)
    tracker = SnapshotTracker([("w", p)])
    p[[3, 9, 300 % 64]] = 1.0
    caps = capture_positions(tracker, {}, {"w": p})
    assert caps.positions is not None
    assert caps.positions["w"].indices().tolist() == [3, 9, 44]


def test_a_positions_stream_with_float_indices_is_refused_naming_the_param() -> None:
    class Bad:
        def iter_changed(self):
            yield "w", torch.tensor([1.0, 2.0])

        def iter_changes(self):
            return iter(())

        def clear(self) -> None:
            pass

    with pytest.raises(ConfigError, match="'w'"):
        capture_positions(Bad(), {}, {"w": torch.zeros(3)})


@pytest.mark.parametrize("batch_elements", [1, 500, 1 << 20])
def test_blobs_streamed_batch_by_batch_decode_to_the_one_segment_updates(
    batch_elements: int,
) -> None:
    trainer, tracker = trained()
    params = trainer.params()
    where = {"trainer_layout": TRAINER, "receiver_layout": RECEIVERS}
    caps = capture_positions(tracker, {}, trainer.params())
    assert caps.positions is not None
    shards = [s.id for s in RECEIVERS.shards()]
    blobs, elements = streamed_blobs(
        caps.positions,
        params,
        shards=shards,
        **where,
        version=4,
        base_version=3,
        writer="w00000",
        batch_elements=batch_elements,
    )
    whole = route_positions(caps.positions, params, **where)
    for shard in shards:
        blob = bytes(blobs[shard])
        got = decode_blob(blob, version=4, base_version=3, shard=shard)
        by_name = {u.name: u for u in got.updates}
        assert same_updates({shard: [by_name[u.name] for u in whole[shard]]}, {shard: whole[shard]})
        assert len(by_name) == len(whole[shard])
        assert elements[shard] == sum(u.nnz for u in whole[shard]) > 0
        one = encode_blob(
            whole[shard],
            version=4,
            base_version=3,
            shard=shard,
            writer="w00000",
            open_segments=True,  # as every streamed blob is written
        )
        assert (blob == one) == (batch_elements >= 1 << 20)  # one segment: same bytes


def _streamed_whole():
    """A tracker after one step, the params, its captured positions, streamed_blobs' keyword
    arguments (batches of 500) and the blobs and element counts of that whole capture."""
    trainer, tracker = trained()
    params = trainer.params()
    caps = capture_positions(tracker, {}, params)
    assert caps.positions is not None
    kw = {**BLOB, "batch_elements": 500}
    return tracker, params, caps.positions, kw, streamed_blobs(caps.positions, params, **kw)


def test_blobs_built_from_a_detection_still_running_equal_those_of_the_whole_capture() -> None:
    # the overlapped sender's background takes each parameter as the caller captures it
    _, params, positions, kw, (whole, whole_elements) = _streamed_whole()
    handoff: Handoff[Positions] = Handoff()
    taken = threading.Event()
    built: dict = {}

    def taking():
        for item in handoff:
            taken.set()
            yield item

    def build() -> None:
        built["out"] = streamed_blobs(taking(), params, **kw)

    worker = threading.Thread(target=build)
    worker.start()
    names = [n for n in params if n in positions]
    for k, name in enumerate(names):
        handoff.put(name, positions[name])
        if k == 0:
            assert taken.wait(10)  # taken before the next parameter is even put
    handoff.close()
    worker.join(30)
    blobs, elements = built["out"]
    assert elements == whole_elements
    assert blobs == whole


def test_values_detection_handed_over_build_the_blobs_of_values_read_from_the_params() -> None:
    tracker, params, positions, kw, (whole, whole_elements) = _streamed_whole()
    handed = list(iter_handed(tracker, {}, params, values_max=1 << 30))
    assert [(n, p.indices().tolist()) for n, p, _ in handed] == [
        (n, p.indices().tolist()) for n, p in positions.items()
    ]
    assert all(vals is not None for *_, vals in handed)  # every one, within values_max
    values = {}

    def feeding():  # as the sender's background does: the values first, then the name
        for name, pos, vals in handed:
            values[name] = vals
            yield name, pos

    unread = {n: torch.full_like(p, float("nan")) for n, p in params.items()}
    blobs, elements = streamed_blobs(feeding(), unread, **kw, values=values)
    assert values == {}  # each taken as its parameter came
    assert elements == whole_elements and blobs == whole
    carried = list(iter_handed(tracker, positions, params, values_max=1 << 30))
    assert all(vals is None for *_, vals in carried)  # joined with a carry: read again
    assert all(vals is None for *_, vals in iter_handed(tracker, {}, params, values_max=0))


def test_a_detection_that_fails_midway_stops_the_build_with_its_error() -> None:
    trainer, tracker = trained()
    params = trainer.params()
    caps = capture_positions(tracker, {}, params)
    assert caps.positions is not None
    handoff: Handoff[Positions] = Handoff()
    first = next(n for n in params if n in caps.positions)
    handoff.put(first, caps.positions[first])
    handoff.fail(RuntimeError("detection failed on purpose"))
    with pytest.raises(CaptureAbandonedError, match="detection failed on purpose"):
        streamed_blobs(
            handoff,
            params,
            **BLOB,
        )


def test_positions_out_of_params_order_are_refused_naming_the_param() -> None:
    trainer, tracker = trained()
    params = trainer.params()
    caps = capture_positions(tracker, {}, params)
    assert caps.positions is not None
    a, b = [n for n in params if n in caps.positions][:2]
    with pytest.raises(ConfigError, match=repr(a)):
        streamed_blobs(
            [(b, caps.positions[b]), (a, caps.positions[a])],
            params,
            **BLOB,
        )


def test_the_handed_capture_hashes_the_receivers_tensors_as_it_detects() -> None:
    # the overlapped sender's capture with a DigestFeed: the same items, and every receiver
    # tensor's digest entry from the detection pass, equal to the digest pass's
    from deltasync.layout.digest import state_tensor_digests
    from deltasync.layout.digest_feed import DigestFeed

    trainer, tracker = trained(steps=0)  # one plain AdamW step: the kernel detects it
    params = trainer.params()
    plain = list(iter_handed(tracker, {}, params, values_max=1 << 30))
    feed = DigestFeed(TRAINER, RECEIVERS)
    fed = list(iter_handed(tracker, {}, params, values_max=1 << 30, sink=feed))
    assert [(n, p.indices().tolist(), bits(v).tolist()) for n, p, v in fed] == [
        (n, p.indices().tolist(), bits(v).tolist()) for n, p, v in plain
    ]
    want = state_tensor_digests(params, trainer_layout=TRAINER, receiver_layout=RECEIVERS)
    assert feed.entries() == want
