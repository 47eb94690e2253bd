"""Several trainer ranks, each holding an FSDP dim-0 shard of every parameter, publish as
separate processes; rank 0 commits through their markers. Anchors from several writers are
sparse (each sends its own elements; what nobody sends, vocabulary padding, is zero). A missing
writer is named in the committer's error and nothing is committed."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from deltasync.commit import Catalog
from deltasync.errors import DeltaSyncError, StoreError, VersionError
from deltasync.layout import fsdp_dim0_rows
from deltasync.publish import MissingWritersError, Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.trainer import SnapshotTracker

from crash_kit import replay_version
from sync_kit import (
    TinyTrainer,
    assert_same_bits,
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


def _rows(p: torch.Tensor, rank: int) -> tuple[int, int, int]:
    start, stop = fsdp_dim0_rows(p.shape[0], rank, WORLD)
    return start, stop, (p[0].numel() if p.dim() > 1 else 1)


class RankTracker:
    """This rank's view of a whole-model tracker: changed indices local to its rows."""

    def __init__(self, inner, params, rank):
        self.inner, self.params, self.rank = inner, params, rank

    def iter_changes(self):
        for name, idx, vals in self.inner.iter_changes():
            start, stop, row = _rows(self.params[name], self.rank)
            mine = (idx >= start * row) & (idx < stop * row)
            if bool(mine.any()):
                yield name, idx[mine] - start * row, vals[mine]

    def clear(self):
        self.inner.clear()


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
    tracker = RankTracker(SnapshotTracker(trainer.named_parameters()), trainer.params, rank)
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
    spec, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    failing = FailingUploads(store, 1)
    syncs, trainers = [], []
    for rank in range(WORLD):
        trainer = TinyTrainer(spec, seed=7)
        local = {}
        for name, p in trainer.params.items():
            start, stop, _ = _rows(p, rank)
            local[name] = p.detach()[start:stop]
        config = PublisherConfig(
            writer_rank=rank, num_writers=WORLD, session="s1", marker_timeout_s=2
        )
        config = replace(config, poll_interval_s=0.02)
        pub = Publisher(failing if rank == 0 else store, receiver_layout=rl, config=config)
        tracker = RankTracker(SnapshotTracker(trainer.named_parameters()), trainer.params, rank)
        full = trainer.params if rank == 0 else None
        syncs.append(TrainerSync(tracker, pub, local, full_state=full))
        trainers.append(trainer)

    def everyone(call) -> list:
        out: list = [None] * WORLD

        def run(rank):
            try:
                out[rank] = call(rank)
            except DeltaSyncError as exc:
                out[rank] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

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
