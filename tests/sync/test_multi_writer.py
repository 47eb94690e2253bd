"""Several trainer ranks, each holding an FSDP dim-0 shard of every parameter, publish as
separate processes; rank 0 commits through their markers. Anchors from several writers are
sparse (each sends its own elements; what nobody sends, vocabulary padding, is zero). A missing
writer is named in the committer's error and nothing is committed."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

import pytest
import torch

from deltasync import names
from deltasync.commit import Catalog, WriterAbandoned, collect_garbage
from deltasync.commit import committer as commit_mod
from deltasync.errors import (
    CommitConflictError,
    CommitTimeoutError,
    ConfigError,
    DeltaSyncError,
    OutcomeUnknownError,
    StoreError,
    VersionError,
)
from deltasync.layout import ReceiverLayout, fsdp_dim0_rows
from deltasync.publish import MissingWritersError, Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from crash_kit import replay_version
from sync_kit import (
    RankTracker,
    TinyTrainer,
    assert_same_bits,
    every_rank,
    expected_shards,
    fork_child,
    layouts,
    rconfig,
    same_bits,
    scratch_store,
    zero_tensors,
)

WORLD = 2
VERSIONS = 5


def _rows(p: torch.Tensor, rank: int, world: int = WORLD) -> tuple[int, int, int]:
    start, stop = fsdp_dim0_rows(p.shape[0], rank, world)
    return start, stop, (p[0].numel() if p.dim() > 1 else 1)


def writer(path, rank: int, session: str) -> None:
    """One trainer rank: the same deterministic training, publishing its shard of each step."""
    spec, _tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=7)
    local = {}
    for name, p in trainer.params.items():
        start, stop, _ = _rows(p, rank)
        local[name] = p.detach()[start:stop]  # a view: follows the optimizer's updates
    config = PublisherConfig(
        writer_rank=rank, num_writers=WORLD, session=session, anchor_every=3, marker_timeout_s=30
    )
    pub = Publisher(scratch_store(path), receiver_layout=rl, config=config)
    tracker = RankTracker(SnapshotTracker(trainer.named_parameters()), trainer.params, rank, WORLD)
    sync = TrainerSync(tracker, pub, local, full_state=trainer.params if rank == 0 else None)
    for v in range(VERSIONS):
        if v:
            trainer.step()
        sync.step_published(v)


@pytest.mark.timeout(90)
def test_writers_in_separate_processes_commit_one_bit_exact_version_per_step(tmp_path):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=7)  # the oracle; built first so children fork warm
    states = []
    for v in range(VERSIONS):
        if v:
            trainer.step()
        states.append(expected_shards(trainer.params, tl, rl))
    path = tmp_path / "store"
    children = [fork_child(writer, path, rank, "run1") for rank in range(WORLD)]
    for c in children:
        c.join(60)
        assert c.exitcode == 0, "a writer failed"
    store = scratch_store(path)
    catalog = Catalog(store)
    assert catalog.versions() == list(range(VERSIONS))
    for v, want in enumerate(states):
        m = catalog.manifest(v)
        assert m.writers == ("w00000-run1", "w00001-run1")
        assert m.kind == ("anchor" if v % 3 == 0 else "delta")
        for shard in ("tp0", "tp1"):
            assert same_bits(replay_version(store, shard, v), want[shard]), f"v{v} {shard}"
    rec = Receiver.for_layout(
        store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    assert rec.pull().chain == (3, 4)
    assert_same_bits(rec.tensors, want["tp0"])


@pytest.mark.timeout(30)
def test_the_committer_names_the_writers_whose_markers_never_came(tmp_path):
    spec, _tl, rl = layouts()
    trainer = TinyTrainer(spec)
    config = PublisherConfig(writer_rank=0, num_writers=3, session="lonely", marker_timeout_s=0.3)
    pub = Publisher(scratch_store(tmp_path / "store"), receiver_layout=rl, config=config)
    local = {
        n: p.detach()[slice(*fsdp_dim0_rows(p.shape[0], 0, 3))] for n, p in trainer.params.items()
    }
    with pytest.raises(MissingWritersError, match=r"\['w00001-lonely', 'w00002-lonely'\]"):
        pub.publish(0, {}, local, full_state=trainer.params)
    assert pub.committed() is None


class FailingUploads:
    """A store whose blob uploads of ``version`` fail once, when armed."""

    def __init__(self, inner, version: int) -> None:
        self.inner, self.prefix, self.armed = inner, f"v{version:08d}/", False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_stream(self, key, chunks):
        if self.armed and key.startswith(self.prefix):
            self.armed = False
            raise StoreError(f"injected: upload of {key!r} failed")
        return self.inner.put_stream(key, chunks)


@pytest.mark.timeout(90)
def test_a_failed_version_number_is_never_reused_and_the_next_one_converges(tmp_path):
    # The committer's upload of v1 fails; writer 1 stored its blobs and marker and times out.
    # Both train on. Retrying v1 let the committer read writer 1's marker of the failed
    # attempt while writer 1 overwrote the blobs it names (a committed manifest whose blobs
    # do not match it), or commit writer 1's stale blobs and have writer 1 drop its changes.
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    failing = FailingUploads(store, 1)
    syncs, trainers = _ranks([failing, store], marker_timeout_s=2)
    everyone = every_rank

    everyone(lambda r: syncs[r].step_published(0))
    for trainer in trainers:
        trainer.step()
    failing.armed = True
    failed = everyone(lambda r: syncs[r].step_published(1))
    assert all(isinstance(e, DeltaSyncError) for e in failed), failed
    for trainer in trainers:
        trainer.step()
    refused = everyone(lambda r: syncs[r].step_published(1))
    assert all(isinstance(e, VersionError) and "not reused" in str(e) for e in refused), refused
    assert [s.next_version() for s in syncs] == [2, 2]
    everyone(lambda r: syncs[r].step_published(syncs[r].next_version()))
    assert Catalog(store).versions() == [0, 2]
    rec = Receiver.for_layout(
        store, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
    )
    assert rec.pull().chain == (0, 2)
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


def _ranks(
    stores,
    *,
    world=WORLD,
    num_writers=None,
    full_state=None,
    lay=None,
    keys=None,
    session="s1",
    full_everywhere=False,
    gather=None,
    receiver_layouts=None,
    left_out=(),
    **config,
):
    """One TrainerSync per rank (threads of this process, each on its dim-0 rows of the same
    deterministic training), rank ``r`` publishing to ``stores[r]``; ``num_writers`` per
    rank (default: the world size); ``full_state(trainer)``: the committer's full state;
    ``lay``: the layouts (default: the tiny Qwen3's, vLLM TP=2); ``keys``: each rank's
    signing key (default: none); ``session``: the job's; ``full_everywhere``: every rank
    gets its trainer's full state (resume() needs it on every writer); ``gather(trainer)``:
    every rank's ``full_state`` (a callable, e.g. a fake collective); ``receiver_layouts``:
    each rank's receiver layout (default: ``lay``'s); ``left_out``: parameter names no
    rank's params hold."""
    spec, _tl, rl = lay or layouts()
    syncs, trainers = [], []
    for rank in range(world):
        trainer = TinyTrainer(spec, seed=7)
        local = {}
        for name, p in trainer.params.items():
            if name in left_out:
                continue
            start, stop, _ = _rows(p, rank, world)
            local[name] = p.detach()[start:stop]
        writers = world if num_writers is None else num_writers[rank]
        cfg = PublisherConfig(
            writer_rank=rank,
            num_writers=writers,
            session=session,
            poll_interval_s=0.02,
            signing_key=None if keys is None else keys[rank],
            **config,
        )
        own = rl if receiver_layouts is None else receiver_layouts[rank]
        pub = Publisher(stores[rank], receiver_layout=own, config=cfg)
        tracker = RankTracker(
            SnapshotTracker(trainer.named_parameters()), trainer.params, rank, world
        )
        full = trainer.params if full_everywhere else None
        if rank == 0:
            full = trainer.params if full_state is None else full_state(trainer)
        if gather is not None:
            full = gather(trainer)
        syncs.append(TrainerSync(tracker, pub, local, full_state=full))
        trainers.append(trainer)
    return syncs, trainers


def _delta_on_the_one_before(syncs, store, version: int) -> None:
    """Every rank publishes ``version``, its own next version, and it commits on the one
    before."""
    assert [s.next_version() for s in syncs] == [version] * len(syncs)
    reports = every_rank(lambda r: syncs[r].step_published(version))
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert Catalog(store).manifest(version).base_version == version - 1


def _stepped_past_version_0(tmp_path, stores=lambda store: [store, store], **config):
    """Two ranks that committed version 0 and took the next optimizer step; rank r publishes
    to ``stores(store)[r]``. Returns the store, the layouts, the syncs and the trainers."""
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks(stores(store), **config)
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    return store, tl, rl, syncs, trainers


def _fresh_pull(store, rl, tmp_path, shard="tp0", key=None):
    rec = Receiver.for_layout(
        store,
        rl,
        shard,
        zero_tensors(rl, shard),
        str(tmp_path / f"fresh-{shard}"),
        rconfig("f", signing_key=key),
    )
    return rec, rec.pull()


@pytest.mark.timeout(90)
def test_a_writer_that_timed_out_while_the_committer_joined_its_blobs_adopts_the_version(
    tmp_path,
):
    # The committer's manifest write of version 1 is slow: writer 1 gives up waiting for it
    # (and withdraws its marker, too late), yet the committer commits its blobs. Writer 1's
    # changes since version 0 are kept, so they cover version 1's too: its next part is a
    # delta on 1, as the committer's is, never an anchor beside it (a version no receiver
    # could apply).
    store, tl, rl, syncs, trainers = _stepped_past_version_0(
        tmp_path, lambda store: [ManifestWrite(store, 1, _slow), store], marker_timeout_s=1.0
    )
    first = every_rank(lambda r: syncs[r].step_published(1))
    assert isinstance(first[1], CommitTimeoutError), first[1]
    assert not isinstance(first[0], Exception), first[0]
    assert Catalog(store).versions() == [0, 1]
    # its notice landed after the committer had read its marker: the version still commits
    assert store.exists(names.writer_abandoned_key(1, "w00001-s1"))
    for v in (2, 3):
        for t in trainers:
            t.step()
        _delta_on_the_one_before(syncs, store, v)
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path, shard)
        assert report.version == 3
        assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[shard])


@pytest.mark.timeout(90)
def test_an_adopted_version_whose_changes_went_back_since_is_still_exact(tmp_path):
    # Writer 1 adopts version 1 (committed with its blobs while it waited). Its tracker diffs
    # against version 0: elements version 1 changed that go back to their version-0 bits by
    # version 2 are not among its changes, yet the receivers hold version 1's bits there. The
    # params its adopted attempt sent go out whole with version 2.
    store = scratch_store(tmp_path / "store")
    _, tl, rl = layouts()
    syncs, trainers = _ranks([ManifestWrite(store, 1, _slow), store], marker_timeout_s=1.0)
    every_rank(lambda r: syncs[r].step_published(0))
    at_0 = [{n: p.detach().clone() for n, p in t.params.items()} for t in trainers]
    for t in trainers:
        t.step()
    first = every_rank(lambda r: syncs[r].step_published(1))
    assert isinstance(first[1], CommitTimeoutError), first[1]
    assert Catalog(store).versions() == [0, 1]
    for t, old in zip(trainers, at_0, strict=True):
        for n, p in t.params.items():  # back to version 0's bits, then one more step
            p.detach().copy_(old[n])
        t.step()
    reports = every_rank(lambda r: syncs[r].step_published(2))
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert Catalog(store).manifest(2).base_version == 1
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path, shard)
        assert report.version == 2
        assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[shard])


@pytest.mark.timeout(90)
def test_params_resent_whole_after_an_adoption_go_out_in_params_order_among_the_changed_ones(
    tmp_path,
):
    # Version 1 changes every other param, and writer 1 adopts it. By version 2 those params
    # are back at their version-0 bits, so writer 1's tracker (diffing against version 0)
    # reports none of them, only the params in between: the params its adopted attempt sent
    # go out whole, each at its own place between the changed ones, as the router requires.
    store = scratch_store(tmp_path / "store")
    _, tl, rl = layouts()
    syncs, trainers = _ranks([ManifestWrite(store, 1, _slow), store], marker_timeout_s=1.0)
    receivers = {
        shard: Receiver.for_layout(
            store, rl, shard, zero_tensors(rl, shard), str(tmp_path / shard), rconfig(shard)
        )
        for shard in ("tp0", "tp1")
    }

    def every_receiver_holds(version: int) -> None:
        want = expected_shards(trainers[0].params, tl, rl)
        for shard, rec in receivers.items():
            assert rec.pull().version == version
            assert_same_bits(rec.tensors, want[shard], f"v{version} {shard}")

    every_rank(lambda r: syncs[r].step_published(0))
    every_receiver_holds(0)
    at_0 = [{n: p.detach().clone() for n, p in t.params.items()} for t in trainers]
    alternate = list(trainers[0].params)[::2]
    for t, old in zip(trainers, at_0, strict=True):
        t.step()
        for n in alternate:  # unchanged in version 1
            t.params[n].detach().copy_(old[n])
    first = every_rank(lambda r: syncs[r].step_published(1))
    assert isinstance(first[1], CommitTimeoutError), first[1]
    assert Catalog(store).versions() == [0, 1]
    every_receiver_holds(1)
    for t, old in zip(trainers, at_0, strict=True):
        t.step()
        for n in set(old) - set(alternate):  # version 1's params: back to version 0's bits
            t.params[n].detach().copy_(old[n])
    for v in (2, 3):
        if v == 3:
            for t in trainers:
                t.step()
        _delta_on_the_one_before(syncs, store, v)
        every_receiver_holds(v)


@pytest.mark.timeout(60)
def test_a_writer_whose_attempt_fails_after_an_adoption_goes_on_with_deltas(tmp_path):
    # Writer 1 adopts version 1, then its attempt at version 2 fails (a marker write refused).
    # Its TrainerSync still gives its changes relative to version 0, the publisher's base is
    # version 1: those changes cover version 1, so version 3 is a delta like writer 0's (it
    # built an anchor beside writer 0's delta, refused as another version, for good).
    store = scratch_store(tmp_path / "store")
    _, tl, rl = layouts()
    refusing = FailingMarker(store)
    syncs, trainers = _ranks([ManifestWrite(store, 1, _slow), refusing], marker_timeout_s=1.0)
    receivers = {
        shard: Receiver.for_layout(
            store, rl, shard, zero_tensors(rl, shard), str(tmp_path / shard), rconfig(shard)
        )
        for shard in ("tp0", "tp1")
    }
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    first = every_rank(lambda r: syncs[r].step_published(1))
    assert isinstance(first[1], CommitTimeoutError), first[1]
    refusing.armed = True
    for t in trainers:
        t.step()
    failed = every_rank(lambda r: syncs[r].step_published(2))
    assert all(isinstance(x, Exception) for x in failed), failed
    for v in (3, 4):
        for t in trainers:
            t.step()
        reports = every_rank(lambda r, v=v: syncs[r].step_published(v))
        assert all(not isinstance(x, Exception) for x in reports), reports
        assert Catalog(store).manifest(v).kind == "delta"
        want = expected_shards(trainers[0].params, tl, rl)
        for shard, rec in receivers.items():
            assert rec.pull().version == v
            assert_same_bits(rec.tensors, want[shard], f"v{v} {shard}")


@pytest.mark.timeout(60)
def test_a_writer_that_adopted_a_version_may_name_only_its_own_changes_as_touched(tmp_path):
    # Publisher calls with touched: writer 1 adopts version 1, whose only change (element 0
    # of the first param on each rank) is undone by version 2. Writer 1's touched names its
    # own changes since version 0 (the last param only); the first param goes out whole
    # beside them, and touched does not refuse it.
    store = scratch_store(tmp_path / "store")
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=7)
    local = [  # each rank's rows, views that follow the edits below
        {n: p.detach()[slice(*_rows(p, r)[:2])] for n, p in trainer.params.items()}
        for r in range(WORLD)
    ]
    pubs = [
        Publisher(
            s,
            receiver_layout=rl,
            config=PublisherConfig(
                writer_rank=r,
                num_writers=WORLD,
                session="s1",
                poll_interval_s=0.02,
                marker_timeout_s=1.0,
            ),
        )
        for r, s in enumerate([ManifestWrite(store, 1, _slow), store])
    ]
    first, last = next(iter(trainer.params)), list(trainer.params)[-1]

    def bump(name: str) -> None:  # element 0 of each rank's rows
        with torch.no_grad():
            for part in local:
                part[name].view(-1)[0] += 1.0

    def publish(v: int, changed: dict[int, list[str]]) -> list:
        def call(r):
            changes = [
                (n, torch.tensor([0]), local[r][n].reshape(-1)[:1].to(torch.bfloat16))
                for n in changed[r]
            ]
            return pubs[r].publish(
                v, changes, local[r], full_state=trainer.params, touched=set(changed[r])
            )

        return every_rank(call)

    publish_anchor = every_rank(
        lambda r: pubs[r].publish(0, [], local[r], anchor=True, full_state=trainer.params)
    )
    assert all(not isinstance(x, Exception) for x in publish_anchor), publish_anchor
    at_0 = trainer.params[first].detach().clone()
    bump(first)
    adopted = publish(1, {0: [first], 1: [first]})
    assert isinstance(adopted[1], CommitTimeoutError), adopted[1]
    trainer.params[first].detach().copy_(at_0)
    bump(last)
    reports = publish(2, {0: [first, last], 1: [last]})
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert Catalog(store).manifest(2).base_version == 1
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path, shard)
        assert report.version == 2
        assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)[shard])


@pytest.mark.timeout(60)
def test_an_anchor_the_publisher_chooses_streams_every_param_whatever_touched_names(tmp_path):
    # anchor_every makes version 2 an anchor of a caller that captured a delta (an overlapped
    # TrainerSync passes touched: the params it captured, and those whose counters moved;
    # under FSDP2 a foreach AdamW step moves no counter). The anchor streams every param of
    # every writer, whatever touched names.
    store = scratch_store(tmp_path / "store")
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=7)
    local = [
        {n: p.detach()[slice(*_rows(p, r)[:2])] for n, p in trainer.params.items()}
        for r in range(WORLD)
    ]
    pubs = [
        Publisher(
            store,
            receiver_layout=rl,
            config=PublisherConfig(
                writer_rank=r, num_writers=WORLD, session="s1", anchor_every=2, poll_interval_s=0.02
            ),
        )
        for r in range(WORLD)
    ]
    last = list(trainer.params)[-1]

    def publish(v: int) -> list:
        with torch.no_grad():
            for part in local:
                part[last].view(-1)[0] += 1.0

        def call(r):
            change = (last, torch.tensor([0]), local[r][last].reshape(-1)[:1].to(torch.bfloat16))
            return pubs[r].publish(v, [change], local[r], full_state=trainer.params, touched={last})

        return every_rank(call)

    for v in range(3):
        reports = publish(v)
        assert all(not isinstance(x, Exception) for x in reports), (v, reports)
        assert reports[0].kind == ("anchor" if v % 2 == 0 else "delta"), reports[0]
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path, shard)
        assert report.version == 2 and report.chain == (2,)
        assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)[shard])


class FailingMarker:
    """A store that refuses the next writer-marker write once ``armed``."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if self.armed and "/writers/" in key:
            self.armed = False
            raise StoreError("marker write refused")
        return self.inner.put_if_absent(key, data)


class ManifestWrite:
    """A store whose manifest write of ``version`` is ``write(inner, key, data)`` instead."""

    def __init__(self, inner, version: int, write) -> None:
        self.inner, self.key, self.write = inner, names.manifest_key(version), write

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key == self.key:
            return self.write(self.inner, key, data)
        return self.inner.put_if_absent(key, data)


def _slow(inner, key, data):
    """A write 2 s late (an overloaded server)."""
    time.sleep(2.0)
    return inner.put_if_absent(key, data)


def _late(inner, key, data):
    """A write without a verdict (an S3 PUT timed out past its retries), applied by the
    server 0.3 s later."""
    threading.Timer(0.3, inner.put_if_absent, args=(key, data)).start()
    raise OutcomeUnknownError(f"the PUT of {key!r} timed out")


def _once(ready):
    """A write once ``ready(inner)`` (at most 30 s)."""

    def write(inner, key, data):
        deadline = time.monotonic() + 30
        while not ready(inner) and time.monotonic() < deadline:
            time.sleep(0.01)
        return inner.put_if_absent(key, data)

    return write


@pytest.mark.timeout(90)
def test_writers_that_published_different_numbers_converge_on_the_largest_next_version(
    tmp_path,
):
    # Each writer's next_version() skips the numbers that failed on it, so writers given
    # different numbers disagree after: the largest of them (an all-reduce MAX) is a number
    # none of them tried, and the abandoned attempts' markers were withdrawn, so the version
    # joins no stale part.
    store, tl, rl, syncs, trainers = _stepped_past_version_0(tmp_path, marker_timeout_s=1.0)
    split = every_rank(lambda r: syncs[r].step_published(1 + r))
    assert all(isinstance(x, DeltaSyncError) for x in split), split
    assert [s.next_version() for s in syncs] == [2, 3]
    left = [k for v in (1, 2) for k in store.list(names.writers_prefix(v))]
    assert left == [
        names.writer_abandoned_key(1, "w00000-s1"),
        names.writer_claim_key(1, "w00000-s1"),
        names.writer_abandoned_key(2, "w00001-s1"),
        names.writer_claim_key(2, "w00001-s1"),
    ]
    # the markers were withdrawn; the claims and the notices of the failed attempts stay until
    # gc (these numbers are never reused)
    for v in (3, 4):
        for t in trainers:
            t.step()
        reports = every_rank(lambda r, v=v: syncs[r].step_published(v))
        assert all(not isinstance(x, Exception) for x in reports), reports
    assert Catalog(store).versions() == [0, 3, 4]
    rec, report = _fresh_pull(store, rl, tmp_path)
    assert report.chain == (0, 3, 4)
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


def _the_next_version_commits_exactly(store, tl, rl, syncs, trainers, tmp_path):
    """After one more step, every writer publishes the documented all-reduce MAX of
    next_version(): it commits, and a fresh receiver holds it bit-exactly. Returns the
    version and every writer's reports."""
    for t in trainers:
        t.step()
    version = max(s.next_version() for s in syncs)
    reports = every_rank(lambda r: syncs[r].step_published(version))
    assert all(not isinstance(x, Exception) for x in reports), reports
    rec, report = _fresh_pull(store, rl, tmp_path)
    assert report.version == version
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])
    return version, reports


def _restarted_at_version_2(tmp_path, **config):
    """Versions 0-2 committed by session s1; then session s2's ranks (``config`` to
    :func:`_ranks`), whose deterministic training replayed two steps: version 2's state."""
    store, tl, rl, syncs, trainers = _stepped_past_version_0(tmp_path, marker_timeout_s=1.0)
    _delta_on_the_one_before(syncs, store, 1)
    for t in trainers:
        t.step()
    _delta_on_the_one_before(syncs, store, 2)
    syncs, trainers = _ranks([store] * 2, session="s2", marker_timeout_s=1.0, **config)
    for _ in range(2):
        for t in trainers:
            t.step()
    return store, tl, rl, syncs, trainers


@pytest.mark.timeout(90)
def test_a_writer_handed_a_committed_number_keeps_its_changes_and_the_next_version_is_exact(
    tmp_path,
):
    # Writer 1, handed version 1 again (committed, with its blobs) while the committer
    # published 2, took it as its own and cleared a step's changes: version 3 committed, and
    # every receiver refused it (its state digest is the full state's, its blobs lack them).
    store, tl, rl, syncs, trainers = _stepped_past_version_0(tmp_path, marker_timeout_s=1.0)
    _delta_on_the_one_before(syncs, store, 1)
    for t in trainers:
        t.step()
    out = every_rank(lambda r: syncs[r].step_published(2 if r == 0 else 1))
    assert isinstance(out[0], MissingWritersError), out[0]
    assert isinstance(out[1], CommitConflictError), out[1]
    assert "version 1 is already committed" in str(out[1]) and "keeps them" in str(out[1])
    _the_next_version_commits_exactly(store, tl, rl, syncs, trainers, tmp_path)


@pytest.mark.timeout(90)
def test_writers_replaying_a_committed_version_under_a_new_session_converge_on_an_anchor(
    tmp_path,
):
    # A restarted job replays version 2. The committer takes it by its digests, writer 1
    # (no full state) cannot: the committer then sent deltas beside writer 1's anchors, and
    # nothing committed until a multiple of anchor_every.
    store, tl, rl, syncs, trainers = _restarted_at_version_2(tmp_path)
    replayed = every_rank(lambda r: syncs[r].step_published(2))
    assert replayed[0][0].already_committed, replayed
    assert isinstance(replayed[1], CommitConflictError), replayed
    version, reports = _the_next_version_commits_exactly(store, tl, rl, syncs, trainers, tmp_path)
    assert [x[0].kind for x in reports] == ["anchor", "anchor"]
    assert "was taken from other writers (another session" in reports[0][0].anchor_reason
    for t in trainers:
        t.step()
    _delta_on_the_one_before(syncs, store, version + 1)


@pytest.mark.timeout(90)
def test_writers_resumed_from_another_sessions_version_agree_whatever_numbers_they_are_given(
    tmp_path,
):
    # After resume(2) under a new session, writer 1 handed the replayed 2 took it by its
    # digests and anchored next; the committer, whose baseline came from resume(), sent
    # deltas: nothing committed until a multiple of anchor_every.
    store, tl, rl, syncs, trainers = _restarted_at_version_2(tmp_path, full_everywhere=True)
    assert every_rank(lambda r: syncs[r].resume(2)) == [True, True]
    first = every_rank(lambda r: syncs[r].step_published(3 if r == 0 else 2))
    assert isinstance(first[0], MissingWritersError) and first[1][0].already_committed, first
    version, reports = _the_next_version_commits_exactly(store, tl, rl, syncs, trainers, tmp_path)
    assert [x[0].kind for x in reports] == ["anchor", "anchor"]
    for t in trainers:
        t.step()
    _delta_on_the_one_before(syncs, store, version + 1)


@pytest.mark.timeout(60)
def test_a_committer_without_the_writers_signing_key_commits_nothing(tmp_path):
    # It committed writer 1's signed part unsigned: receivers holding the key refused that
    # version and every one after it, and no error named the keys.
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, keys=[None, b"k" * 32], marker_timeout_s=0.5)
    out = every_rank(lambda r: syncs[r].step_published(0))
    assert isinstance(out[0], MissingWritersError), out[0]
    assert "w00001-s1 was refused: it is signed, and this committer has no signing key" in str(
        out[0]
    )
    assert Catalog(store).versions() == []


@pytest.mark.timeout(60)
def test_a_second_process_running_as_the_same_writer_is_refused_before_it_writes_a_blob(
    tmp_path,
):
    # Its marker overwrote the first one's, and the committer joined whichever it read: the
    # first process was told that "another publisher attempt won the commit". Refused at the
    # marker, its blobs (another state here) still overwrote the first one's, and every
    # receiver refused the version they committed.
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, marker_timeout_s=5.0)
    twins, twin_trainers = _ranks([store] * 2)
    twin_trainers[1].step()
    first = threading.Thread(target=syncs[1].step_published, args=(0,))
    first.start()
    deadline = time.monotonic() + 30
    while not store.exists(names.writer_marker_key(0, "w00001-s1")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stored = {k: store.get(k) for k in store.list(names.version_prefix(0))}
    claimed = rf"writer 'w00001-s1' was claimed by another process \(host '.+', pid {os.getpid()}\)"
    with pytest.raises(ConfigError, match=claimed):
        twins[1].step_published(0)
    assert {k: store.get(k) for k in store.list(names.version_prefix(0))} == stored
    syncs[0].step_published(0)
    first.join(30)
    assert Catalog(store).versions() == [0]
    _spec, tl, rl = layouts()
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path / shard, shard=shard)
        assert report.version == 0
        assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[shard])


class _UnreadableStore:
    """A store whose reads fail (a timeout), its writes going through."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, *args, **kwargs):
        raise StoreError(f"reading {key!r} timed out")


def test_a_claim_or_marker_that_cannot_be_read_back_is_a_store_error_not_another_process(
    tmp_path,
):
    # The reply of our own write was lost and the read that tells whose it is failed once:
    # "another process runs as this writer", naming this very process, a fatal ConfigError.
    from deltasync.commit import WriterMarker

    store = scratch_store(tmp_path / "store")
    claim = commit_mod.claim_record()
    commit_mod.claim_version(store, 5, "w00001-s", claim)
    with pytest.raises(StoreError, match=r"claim is stored, and reading it back .* failed"):
        commit_mod.claim_version(_UnreadableStore(store), 5, "w00001-s", claim)
    commit_mod.claim_version(store, 5, "w00001-s", claim)  # read once the store answers
    marker = WriterMarker(version=5, writer="w00001-s", blobs=(), created_at=1.0, base_version=4)
    data = marker.to_json()
    commit_mod.store_marker(store, marker, data)
    with pytest.raises(StoreError, match=r"marker is stored, and reading it back .* failed"):
        commit_mod.store_marker(_UnreadableStore(store), marker, data)


@pytest.mark.timeout(60)
def test_a_writer_configured_for_another_world_size_is_refused_and_nothing_commits(tmp_path):
    # Three ranks hold world-3 shards; rank 1 was told num_writers=2. Its smaller shard fits
    # inside a world-2 shard's range, so only its shapes can tell.
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 3, world=3, num_writers=[3, 2, 3], marker_timeout_s=0.5)
    out = every_rank(lambda r: syncs[r].step_published(0), world=3)
    assert isinstance(out[1], ConfigError), out[1]
    assert "rank 1's dim-0 shard among num_writers=2" in str(out[1])
    assert isinstance(out[0], MissingWritersError), out[0]
    assert Catalog(store).versions() == []


@pytest.mark.timeout(60)
def test_the_committer_never_joins_parts_built_for_another_base(tmp_path):
    # Writer 1 publishes an anchor of version 1 while the committer publishes a delta on 0:
    # refused by the committer, nothing committed, then a version both build alike commits.
    store, tl, rl, syncs, trainers = _stepped_past_version_0(tmp_path, marker_timeout_s=1.0)
    out = every_rank(lambda r: syncs[r].step_published(1, anchor=r == 1))
    assert isinstance(out[0], VersionError), out[0]
    message = str(out[0])
    assert "w00000-s1: base 0, num_writers=2; w00001-s1: anchor, num_writers=2" in message
    assert Catalog(store).versions() == [0]
    for t in trainers:
        t.step()
    reports = every_rank(lambda r: syncs[r].step_published(syncs[r].next_version()))
    assert all(not isinstance(x, Exception) for x in reports), reports
    rec, report = _fresh_pull(store, rl, tmp_path)
    assert report.version == 2
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


@pytest.mark.timeout(60)
def test_writers_routing_for_different_receiver_layouts_commit_nothing(tmp_path):
    # Writer 1 built for vLLM TP=1, the committer for TP=2: the committer joined writer 1's
    # tp0 blob (the shard names alone were compared) and committed a version every receiver
    # refused, which every later delta then built on.
    spec, _, rl = layouts()
    other = ReceiverLayout.build(spec, engine="vllm", tp=1)
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store, store], receiver_layouts=[rl, other], marker_timeout_s=0.5)
    out = every_rank(lambda r: syncs[r].step_published(0))
    assert isinstance(out[0], VersionError), out[0]
    assert re.search(
        r"w00000-s1: anchor, num_writers=2, layout [0-9a-f]{12}; w00001-s1", str(out[0])
    )
    assert "receiver layout" in str(out[0])
    assert isinstance(out[1], DeltaSyncError), out[1]  # it waited for a manifest in vain
    assert Catalog(store).versions() == []


@pytest.mark.timeout(60)
def test_writers_whose_params_leave_out_a_parameter_are_refused_before_any_blob(tmp_path):
    # Each rank's params lacked lm_head.weight (a model whose embeddings are tied, with a
    # layout that unties them): an anchor without it was committed, which no receiver could
    # restore, and every delta after it would never have sent that parameter's changes.
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store, store], left_out={"lm_head.weight"}, marker_timeout_s=0.5)
    out = every_rank(lambda r: syncs[r].step_published(0))
    for rank, error in enumerate(out):
        assert isinstance(error, ConfigError), (rank, error)
        assert "params have no ['lm_head.weight']" in str(error)
        assert "dim-0 shard of every parameter" in str(error)
    assert Catalog(store).versions() == []
    assert store.list(names.version_prefix(0)) == []  # not a blob, claim or marker


@pytest.mark.timeout(60)
def test_a_committer_whose_full_state_leaves_out_a_parameter_is_refused_by_name(tmp_path):
    # It failed with a bare KeyError while hashing; the others waited out every version.
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks(
        [store, store],
        full_state=lambda t: {n: p for n, p in t.params.items() if n != "lm_head.weight"},
        marker_timeout_s=0.5,
    )
    out = every_rank(lambda r: syncs[r].step_published(0))
    assert isinstance(out[0], ConfigError), out[0]
    assert "full_state has no ['lm_head.weight']" in str(out[0])
    assert isinstance(out[1], DeltaSyncError), out[1]
    assert Catalog(store).versions() == []


@pytest.mark.timeout(60)
def test_next_version_is_the_same_on_a_writer_that_asks_while_another_publishes_it(tmp_path):
    # Rank 0 started publishing its next_version() before rank 1 asked for its own: an
    # attempt in flight is not an abandoned one, and both must publish the same number.
    store, _, _, syncs, _ = _stepped_past_version_0(tmp_path, marker_timeout_s=5.0)
    first = syncs[0].next_version()
    out: list = []
    t = threading.Thread(target=lambda: out.append(_publish(syncs[0], first)))
    t.start()
    deadline = time.monotonic() + 10
    while not store.list(f"v{first:08d}/") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.list(f"v{first:08d}/"), "rank 0 never started uploading"
    second = syncs[1].next_version()
    assert second == first
    syncs[1].step_published(second)
    t.join(30)
    assert not isinstance(out[0], Exception), out
    assert Catalog(store).versions() == [0, first]


def _publish(sync, version):
    try:
        return sync.step_published(version)
    except DeltaSyncError as exc:
        return exc


@pytest.mark.timeout(60)
def test_a_shard_holding_only_vocabulary_padding_takes_the_writers_sparse_anchor(tmp_path):
    # vLLM pads 65 tokens to 128 rows: at TP=4, tp3's 32 rows are all padding. The writers'
    # anchor is routed from their elements, none of which lands there: tp3 still gets a
    # record for the tensor (empty: zeros), or it would refuse every anchor as incomplete.
    lay = layouts(tp=4, vocab_size=65)
    _spec, tl, rl = lay
    assert "model.embed_tokens.weight" in rl.table.uncovered("tp3")
    assert rl.table.uncovered("tp0") == []
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store, store], lay=lay)
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    every_rank(lambda r: syncs[r].step_published(1))
    want = expected_shards(trainers[0].params, tl, rl)
    for s in rl.shards():
        live = zero_tensors(rl, s.id)
        for t in live.values():
            t.fill_(1.0)  # stale bits: the anchor defines every element, padding included
        rec = Receiver.for_layout(store, rl, s.id, live, str(tmp_path / s.id), rconfig(s.id))
        assert rec.pull().chain == (0, 1)
        assert_same_bits(rec.tensors, want[s.id], s.id)


def _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path, steps=2) -> None:
    """``steps`` more versions, each the all-reduce MAX of next_version(), commit as deltas
    on the one before on every writer; fresh receivers hold the last one bit-exactly."""
    for _ in range(steps):
        for t in trainers:
            t.step()
        version = max(s.next_version() for s in syncs)
        reports = every_rank(lambda r, v=version: syncs[r].step_published(v))
        assert all(not isinstance(x, Exception) for x in reports), reports
        assert [x[0].kind for x in reports] == ["delta", "delta"], reports
    for shard in ("tp0", "tp1"):
        rec, report = _fresh_pull(store, rl, tmp_path, shard)
        assert report.version == version
        assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[shard])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "late, failing, error",
    [(_slow, 1, CommitTimeoutError), (_late, 0, OutcomeUnknownError)],
    ids=["writer-gave-up", "no-verdict"],
)
def test_a_first_version_that_failed_on_one_writer_yet_committed_is_adopted(
    tmp_path, late, failing, error
):
    # A job's first version (an anchor) commits while one writer's attempt failed: writer 1
    # gave up on a slow manifest write, or the committer's own write ended without a verdict
    # and landed. That writer has no baseline, so it never adopted the anchor: it anchored
    # beside the others' deltas, and nothing committed until a multiple of anchor_every.
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([ManifestWrite(store, 0, late), store], marker_timeout_s=1.0)
    first = every_rank(lambda r: syncs[r].step_published(0))
    assert isinstance(first[failing], error), first
    assert not isinstance(first[1 - failing], Exception), first
    time.sleep(0.5)  # the late write has landed
    assert Catalog(store).versions() == [0]
    # a writer that gave up leaves a notice; a committer whose manifest may still land never
    assert store.exists(names.writer_abandoned_key(0, f"w0000{failing}-s1")) == (failing == 1)
    _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path)


@pytest.mark.timeout(90)
def test_an_anchor_of_a_new_lineage_that_a_writer_gave_up_on_is_adopted(tmp_path):
    # The job committed version 0, another session version 1; the job's version 2 is then an
    # anchor of a new lineage, and writer 1 gives up on its slow manifest write: the same
    # disagreement as at a first version (its baseline is of another lineage).
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([ManifestWrite(store, 2, _slow), store], marker_timeout_s=1.0)
    every_rank(lambda r: syncs[r].step_published(0))
    others, other_trainers = _ranks([store, store], session="s9", marker_timeout_s=1.0)
    for t in other_trainers:
        t.step()
    assert all(
        not isinstance(x, Exception) for x in every_rank(lambda r: others[r].step_published(1))
    )
    for t in trainers:
        t.step()
    anchored = every_rank(lambda r: syncs[r].step_published(2))
    assert isinstance(anchored[1], CommitTimeoutError), anchored
    assert anchored[0][0].kind == "anchor", anchored
    assert Catalog(store).versions() == [0, 1, 2]
    _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path)


@pytest.mark.timeout(90)
def test_a_committer_that_lost_the_race_to_an_equal_state_anchors_next_with_its_writers(
    tmp_path,
):
    # A restarted job (s2) publishes version 0 beside its old incarnation (s1), with equal
    # states. s1 commits first; s2's committer meets it at its exclusive manifest write, finds
    # the same digests and takes it; its other writer, its blobs not listed, cannot. The
    # committer then sent a delta beside that writer's anchor: nothing committed until a
    # multiple of anchor_every.
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    full = {"full_everywhere": True, "marker_timeout_s": 2.0}
    claimed = _once(lambda inner: inner.exists(names.writer_claim_key(0, "w00000-s2")))
    old, _ = _ranks([ManifestWrite(store, 0, claimed), store], session="s1", **full)
    stored = _once(lambda inner: inner.exists(names.manifest_key(0)))
    new, trainers = _ranks([ManifestWrite(store, 0, stored), store], session="s2", **full)
    both = old + new
    out = every_rank(lambda r: both[r].step_published(0), world=4)
    assert all(not isinstance(x, Exception) for x in out[:3]), out
    assert Catalog(store).manifest(0).writers == ("w00000-s1", "w00001-s1")
    assert out[2][0].already_committed, out[2]
    assert isinstance(out[3], CommitConflictError), out[3]
    for t in trainers:
        t.step()
    version = max(s.next_version() for s in new)
    reports = every_rank(lambda r: new[r].step_published(version))
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert [x[0].kind for x in reports] == ["anchor", "anchor"]
    _deltas_commit_exactly(store, tl, rl, new, trainers, tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", [0, 1], ids=["committer", "writer"])
def test_a_writer_whose_attempt_failed_tells_the_others_who_stop_waiting(tmp_path, failing):
    # One rank's failed upload left every other rank waiting out marker_timeout_s (120 s by
    # default) for a marker or manifest that could no longer come.
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    uploads = FailingUploads(store, 1)
    stores = [store, store]
    stores[failing] = uploads
    syncs, trainers = _ranks(stores, marker_timeout_s=60)
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    uploads.armed = True
    t0 = time.monotonic()
    failed = every_rank(lambda r: syncs[r].step_published(1))
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    other = failed[1 - failing]
    assert isinstance(failed[failing], StoreError), failed
    if failing == 1:
        assert isinstance(other, MissingWritersError), other
        assert "['w00001-s1'] abandoned their attempt (w00001-s1: StoreError: injected" in str(
            other
        )
    else:
        assert isinstance(other, CommitTimeoutError), other
        assert "the committing writer w00000-s1 abandoned its attempt" in str(other)
    assert store.exists(names.writer_abandoned_key(1, f"w0000{failing}-s1"))
    _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path)
    collect_garbage(store, Catalog(store), keep_versions=5, receiver_ttl_s=60, orphan_grace_s=0)
    assert store.list(names.version_dir(1)) == []  # the failed attempt, its notice included


class FullFromMarker:
    """A store that fills up at writer ``writer``'s marker of ``version`` (written once the
    committer's marker is there, so the committer is waiting for it): from then on every
    write is refused for room, as on a full disk, until a delete gives room back."""

    def __init__(self, inner, version: int, writer: str, committer: str) -> None:
        self.inner, self.armed, self.full = inner, False, False
        self.marker = names.writer_marker_key(version, writer)
        self.committers = names.writer_marker_key(version, committer)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _write(self, op, key, *args):
        if self.armed and key == self.marker:
            deadline = time.monotonic() + 20
            while not self.inner.exists(self.committers) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.armed, self.full = False, True
        if self.full:
            raise StoreError(f"writing {key!r} failed: OSError: [Errno 28] No space left on device")
        return getattr(self.inner, op)(key, *args)

    def put(self, key, data):
        return self._write("put", key, data)

    def put_if_absent(self, key, data):
        return self._write("put_if_absent", key, data)

    def put_stream(self, key, chunks):
        return self._write("put_stream", key, chunks)

    def delete(self, key):
        self.inner.delete(key)
        self.full = False  # room again


@pytest.mark.timeout(60)
def test_a_writer_whose_marker_meets_a_full_disk_frees_its_blobs_so_its_notice_lands(tmp_path):
    # Its blobs kept the room, so its notice was refused too, and the committer waited out
    # marker_timeout_s (120 s by default) and blamed ranks that "crashed or are stuck".
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    full = FullFromMarker(store, 1, "w00001-s1", "w00000-s1")
    syncs, trainers = _ranks([store, full], marker_timeout_s=30)
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    full.armed = True
    t0 = time.monotonic()
    failed = every_rank(lambda r: syncs[r].step_published(1))
    assert time.monotonic() - t0 < 20  # not the 30 s timeout
    assert isinstance(failed[1], StoreError) and "No space left" in str(failed[1]), failed
    assert isinstance(failed[0], MissingWritersError), failed
    assert "['w00001-s1'] abandoned their attempt (w00001-s1: StoreError: " in str(failed[0])
    assert not [k for k in store.list(names.version_dir(1)) if "w00001-s1.blob" in k]
    _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path)


@pytest.mark.timeout(60)
def test_an_abandoned_notice_without_the_signing_key_is_ignored_a_signed_one_taken(tmp_path):
    # A notice is a write to the store: with a signing key, one nobody holding the key wrote
    # (forged, or a writer configured without it) cannot make a version fail.
    # A signed one, a failed writer's own, still ends the wait at once.
    store = scratch_store(tmp_path / "store")
    key = b"k" * 32
    uploads = FailingUploads(store, 2)
    syncs, trainers = _ranks([store, uploads], keys=[key, key], marker_timeout_s=60)
    every_rank(lambda r: syncs[r].step_published(0))
    forged = WriterAbandoned(version=1, writer="w00001-s1", reason="forged", created_at=time.time())
    store.put(forged.key, forged.to_json())  # unsigned
    for t in trainers:
        t.step()
    reports = every_rank(lambda r: syncs[r].step_published(1))
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert Catalog(store).versions() == [0, 1]
    for t in trainers:
        t.step()
    uploads.armed = True
    t0 = time.monotonic()
    failed = every_rank(lambda r: syncs[r].step_published(2))
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    assert isinstance(failed[0], MissingWritersError) and "abandoned" in str(failed[0]), failed
    notice = WriterAbandoned.from_json(
        store.get(names.writer_abandoned_key(2, "w00001-s1")), signing_key=key
    )
    assert notice.reason.startswith("StoreError: injected")


@pytest.mark.timeout(60)
def test_a_notice_that_does_not_verify_is_logged_once_per_wait(tmp_path, caplog):
    # ignored, but logged at every poll of a wait: a planted file flooded every rank's log for
    # the whole marker_timeout_s
    store = scratch_store(tmp_path / "store")
    forged = WriterAbandoned(version=3, writer="w00000-s1", reason="forged", created_at=time.time())
    store.put(forged.key, forged.to_json())  # unsigned
    with caplog.at_level("WARNING", logger="deltasync.commit.committer"):
        with pytest.raises(CommitTimeoutError, match=r"waited 1\.5 s"):
            commit_mod.wait_for_manifest(
                Catalog(store),
                3,
                timeout_s=1.5,
                poll_s=0.01,
                committer="w00000-s1",
                signing_key=b"k" * 32,
            )
    assert sum("ignoring the abandoned notice" in r.message for r in caplog.records) == 1


def test_a_store_without_every_store_method_is_refused(tmp_path):
    # the check's own list left delete and size out: a failed multi-writer attempt's
    # withdrawal then raised AttributeError over the error that ended it
    class NoDelete:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            if name == "delete":
                raise AttributeError(name)
            return getattr(self.inner, name)

    _, _, rl = layouts()
    with pytest.raises(ConfigError, match="without delete"):
        Publisher(NoDelete(scratch_store(tmp_path / "store")), receiver_layout=rl)


class _Refused:
    """A store that refuses the exclusive write of ``key`` before it lands."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.key = inner, key

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key == self.key:
            raise StoreError(f"{key!r} was refused")
        return self.inner.put_if_absent(key, data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["claim", "marker", "full-state"])
def test_a_failure_anywhere_after_the_claim_leaves_a_notice(tmp_path, where):
    # The notice was stored only by the failures of the uploads and of the commit: a claim or
    # marker write refused, or the committer's full_state gather failing, around those, left
    # the other rank waiting out marker_timeout_s.
    gathers = []

    def full_state(trainer):
        def gather():
            gathers.append(1)
            if len(gathers) == 2:  # version 1's
                raise StoreError("the gather of the full parameters failed")
            return trainer.params

        return gather

    refused = {
        "claim": names.writer_claim_key(1, "w00001-s1"),
        "marker": names.writer_marker_key(1, "w00001-s1"),
    }.get(where)
    stores = (lambda s: [s, _Refused(s, refused)]) if refused else (lambda s: [s, s])
    extra = {"full_state": full_state} if where == "full-state" else {}
    store, _tl, _rl, syncs, _ = _stepped_past_version_0(
        tmp_path, stores, marker_timeout_s=60, **extra
    )
    failing = 0 if where == "full-state" else 1
    t0 = time.monotonic()
    failed = every_rank(lambda r: syncs[r].step_published(1))
    assert time.monotonic() - t0 < 20  # not the 60 s timeout
    assert all(isinstance(x, DeltaSyncError) for x in failed), failed
    assert "abandoned" in str(failed[1 - failing]), failed
    assert store.exists(names.writer_abandoned_key(1, f"w0000{failing}-s1"))


@pytest.mark.timeout(60)
def test_a_full_state_callable_that_gathers_across_the_writers_is_called_on_every_writer(
    tmp_path,
):
    # A gathering full_state (FSDP's p.full_tensor(), as docs/integration.md has it) is a
    # collective every writer must join: called by the committer alone, inside its publish, it
    # would wait for the other writer, which waits for the manifest.
    met = threading.Barrier(WORLD, timeout=10)  # the collective: every rank, or none
    calls = [0] * WORLD

    def gather(trainer):
        def full():
            calls[trainers.index(trainer)] += 1
            met.wait()
            return trainer.params

        return full

    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store, store], gather=gather, marker_timeout_s=20)
    for version in range(3):
        if version:
            for t in trainers:
                t.step()
        reports = every_rank(lambda r, v=version: syncs[r].step_published(v))
        assert all(not isinstance(x, Exception) for x in reports), reports
    assert calls == [3, 3]
    _, tl, rl = layouts()
    for shard in ("tp0", "tp1"):
        rec, _ = _fresh_pull(store, rl, tmp_path, shard)
        assert rec.version == 2
        assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[shard])


@pytest.mark.timeout(90)
def test_a_late_manifest_behind_a_gap_is_found_by_its_committer(tmp_path):
    # Version 1 failed (a gap), the committer's manifest write of 2 got no verdict and landed
    # while writer 1 waited (its base: 2). LATEST stayed at 0, and the committer's probe from
    # it stopped at the gap: it built deltas on 0 beside writer 1's on 2, and nothing
    # committed again (nothing in the job moves LATEST).
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    uploads = FailingUploads(store, 1)
    syncs, trainers = _ranks([ManifestWrite(store, 2, _late), uploads], marker_timeout_s=4.0)
    every_rank(lambda r: syncs[r].step_published(0))
    for t in trainers:
        t.step()
    uploads.armed = True
    assert all(
        isinstance(x, DeltaSyncError) for x in every_rank(lambda r: syncs[r].step_published(1))
    )
    for t in trainers:
        t.step()
    late = every_rank(lambda r: syncs[r].step_published(2))
    assert isinstance(late[0], OutcomeUnknownError) and late[1][0].version == 2, late
    assert Catalog(store).versions() == [0, 2] and Catalog(store).read_latest() == 0
    _deltas_commit_exactly(store, tl, rl, syncs, trainers, tmp_path)
    assert Catalog(store).manifest(3).base_version == 2


@pytest.mark.timeout(60)
def test_with_a_key_a_claim_or_marker_planted_at_a_future_version_cannot_make_it_fail(tmp_path):
    # Someone who can write the store but holds no key knows the next version's claim and
    # marker keys (the session is in every key). Taken for another process's, each would fail
    # the version on every writer: a fatal ConfigError blaming writer_rank/session, and the
    # committer waiting out marker_timeout_s.
    key = b"k" * 32
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store, store], keys=[key, key], marker_timeout_s=30)
    every_rank(lambda r: syncs[r].step_published(0))
    store.put(names.writer_claim_key(1, "w00001-s1"), b'{"host":"evil","pid":1,"token":"x"}')
    store.put(names.writer_marker_key(2, "w00001-s1"), b"{}")
    for v in (1, 2):
        for t in trainers:
            t.step()
        t0 = time.monotonic()
        reports = every_rank(lambda r, v=v: syncs[r].step_published(v))
        assert all(not isinstance(x, Exception) for x in reports), reports
        assert time.monotonic() - t0 < 20
    assert Catalog(store, signing_key=key).versions() == [0, 1, 2]
    rec, report = _fresh_pull(store, rl, tmp_path, key=key)
    assert report.version == 2
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


def test_with_a_key_a_claim_another_key_holder_stored_is_still_another_process():
    from deltasync.store import MemoryStore

    key = b"k" * 32
    store = MemoryStore()
    commit_mod.claim_version(store, 3, "w00001-s", commit_mod.claim_record(), signing_key=key)
    with pytest.raises(ConfigError, match="claimed by another process"):
        commit_mod.claim_version(store, 3, "w00001-s", commit_mod.claim_record(), signing_key=key)


class _SlowSecondReader:
    """A store where two processes (threads ``A`` and ``B``) both read ``key``'s planted bytes
    first, and ``B`` goes on only once ``A`` has deleted them and written its own claim."""

    def __init__(self, store, key):
        self.store, self.key = store, key
        self.first_reads = threading.Barrier(2, timeout=10)
        self.a_wrote = threading.Event()
        self.seen: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, key, **kw):
        out = self.store.get(key, **kw)
        me = threading.current_thread().name
        if key == self.key and me not in self.seen:
            self.seen.add(me)
            self.first_reads.wait()
            if me == "B":
                self.a_wrote.wait(10)
        return out

    def put_if_absent(self, key, data):
        self.store.put_if_absent(key, data)
        if key == self.key and threading.current_thread().name == "A":
            self.a_wrote.set()


@pytest.mark.timeout(60)
def test_two_key_holders_replacing_one_planted_claim_never_both_hold_the_writer():
    # The same writer id run twice (what claims catch) meets a claim planted without the key:
    # both read the planted bytes; the one that replaces it first keeps its claim, and the
    # other, slower one, finds that claim (it verifies) instead of deleting it.
    from deltasync.store import MemoryStore

    key = b"k" * 32
    claim = names.writer_claim_key(1, "w00001-s1")
    inner = MemoryStore()
    inner.put(claim, b'{"host":"evil","pid":1,"token":"x"}')
    store = _SlowSecondReader(inner, claim)
    out: dict[str, object] = {}

    def run(who):
        try:
            record = commit_mod.claim_record()
            commit_mod.claim_version(store, 1, "w00001-s1", record, signing_key=key)
            out[who] = record
        except ConfigError as exc:
            out[who] = exc

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(out["B"], ConfigError), out
    assert "claimed by another process" in str(out["B"])
    token = json.loads(out["A"])["token"]
    assert json.loads(inner.get(claim))["token"] == token  # A's claim, kept


@pytest.mark.timeout(90)
@pytest.mark.parametrize("record", ["claim", "marker"])
def test_with_a_key_a_genuine_claim_or_marker_copied_to_a_future_version_cannot_make_it_fail(
    tmp_path, record
):
    # Without the key, a store writer can still copy a record that verifies: another writer's
    # claim of version 0, or this writer's own marker of version 0, to writer 1's key of
    # version 1. A MAC that covered neither that version nor that writer would let it pass for
    # another process's, failing version 1 on every writer.
    key = b"k" * 32
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store, store], keys=[key, key], marker_timeout_s=30)
    every_rank(lambda r: syncs[r].step_published(0))
    if record == "claim":
        copied = store.get(names.writer_claim_key(0, "w00000-s1"))
        store.put(names.writer_claim_key(1, "w00001-s1"), copied)
    else:
        copied = store.get(names.writer_marker_key(0, "w00001-s1"))
        store.put(names.writer_marker_key(1, "w00001-s1"), copied)
    for t in trainers:
        t.step()
    t0 = time.monotonic()
    reports = every_rank(lambda r: syncs[r].step_published(1))
    assert all(not isinstance(x, Exception) for x in reports), reports
    assert time.monotonic() - t0 < 20
    assert Catalog(store, signing_key=key).versions() == [0, 1]
    rec, report = _fresh_pull(store, rl, tmp_path, key=key)
    assert report.version == 1
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


@pytest.mark.timeout(60)
def test_a_full_state_that_fails_on_a_writer_that_does_not_commit_is_said_there(tmp_path, caplog):
    # only the committer reads the state, so nothing raises a non-committer's failure later
    def gather(trainer):
        def full():
            if trainers.index(trainer) == 1:
                raise RuntimeError("gather lost rank 1's peer")
            return trainer.params

        return full

    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store, store], gather=gather, marker_timeout_s=20)
    with caplog.at_level(logging.WARNING, logger="deltasync.publish.trainer_sync"):
        reports = every_rank(lambda r: syncs[r].step_published(0))
    assert all(not isinstance(x, Exception) for x in reports), reports
    said = [r.getMessage() for r in caplog.records if "full_state raised" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: gather lost rank 1's peer" in said[0], said
    assert syncs[1].publishers[0].writer in said[0]


def _gather_bf16(keep_on):
    """``_ranks``' ``gather``: the docs' FSDP recipe, ``gather_bf16(..., keep=rank in keep_on)``
    (plain tensors here: each rank's full state, as the gather would have it)."""
    from deltasync.trainer import gather_bf16

    ranks = iter(range(WORLD))
    return lambda trainer: gather_bf16(trainer.params.items(), keep=next(ranks) in keep_on)


@pytest.mark.timeout(90)
def test_the_recipes_gather_kept_by_the_committer_alone_resumes_only_where_kept_everywhere(
    tmp_path,
):
    # A writer given gather_bf16(keep=False) gets {}: resume() (which compares the state on
    # every writer) blamed that full_state for "missing" every parameter, naming no remedy,
    # and a committed version handed to it was a ConfigError, not the CommitConflictError
    # that keeps its changes, as without full_state.
    store, _, _, syncs, trainers = _stepped_past_version_0(
        tmp_path, gather=_gather_bf16({0}), marker_timeout_s=1.0
    )
    _delta_on_the_one_before(syncs, store, 1)
    for t in trainers:
        t.step()
    out = every_rank(lambda r: syncs[r].step_published(2 if r == 0 else 1))
    assert isinstance(out[1], CommitConflictError), out[1]
    assert "version 1 is already committed" in str(out[1]) and "keeps them" in str(out[1])
    for kept, want in (({0}, ConfigError), ({0, 1}, True)):
        again, _ = _ranks([store] * 2, session=f"s{len(kept)}", gather=_gather_bf16(kept))
        resumed = every_rank(lambda r, s=again: s[r].resume(0))
        assert resumed[0] is True, resumed
        if want is True:
            assert resumed[1] is True, resumed
        else:
            assert isinstance(resumed[1], ConfigError), resumed
            assert "full_state returned no parameters" in str(resumed[1]), resumed
            assert "gather_bf16(..., keep=True)" in str(resumed[1]), resumed
