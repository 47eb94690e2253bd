"""Several FSDP writers publish to the store WITHOUT the full state: each writer states its
part digest of every receiver shard in its marker, the committer joins them into each shard's
parts digest (``w{W}:`` + xxh3-128 of the W part digests), and receivers check it (verify before
write, verify_on_open, scrub, after a write) from their own tensors. No rank gathers the model."""

from __future__ import annotations

import json

import pytest
from kit import unlinked_fds_under

from deltasync import names
from deltasync.commit import Catalog
from deltasync.errors import (
    CommitConflictError,
    ConfigError,
    IntegrityError,
    ReceiverLayoutRequiredError,
    VersionError,
)
from deltasync.format import stash as stash_module
from deltasync.layout import fsdp_dim0_rows
from deltasync.layout.digest import is_parts_digest, parts_digest, state_digest
from deltasync.layout.part_digests import receiver_part_digests
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver, store_receiver
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    KEY,
    RankTracker,
    TinyTrainer,
    assert_same_bits,
    every_rank,
    expected_shards,
    layouts,
    rconfig,
    same_bits,
    scratch_store,
    zero_tensors,
)

SHARDS = ("tp0", "tp1")


def _ranks(stores, world, *, full_state_for=(), session="s1", **config):
    """One TrainerSync per rank (the same deterministic training, each on its dim-0 rows);
    ranks in ``full_state_for`` are given their trainer's full params, the others none."""
    spec, _tl, rl = layouts()
    syncs, trainers = [], []
    for rank in range(world):
        trainer = TinyTrainer(spec, seed=7)
        local = {
            n: p.detach()[slice(*fsdp_dim0_rows(p.shape[0], rank, world))]
            for n, p in trainer.params.items()
        }
        cfg = PublisherConfig(
            writer_rank=rank,
            num_writers=world,
            session=session,
            poll_interval_s=0.02,
            **{"marker_timeout_s": 20, **config},
        )
        pub = Publisher(stores[rank], receiver_layout=rl, config=cfg)
        tracker = RankTracker(
            SnapshotTracker(trainer.named_parameters()), trainer.params, rank, world
        )
        full = trainer.params if rank in full_state_for else None
        syncs.append(TrainerSync(tracker, pub, local, full_state=full))
        trainers.append(trainer)
    return syncs, trainers


def _published(syncs, version):
    out = every_rank(lambda r: syncs[r].step_published(version), len(syncs))
    assert all(not isinstance(x, Exception) for x in out), out
    return out


def _receivers(store, rl, tmp_path, tag="r", **config):
    return {
        s: Receiver.for_layout(
            store,
            rl,
            s,
            zero_tensors(rl, s),
            str(tmp_path / f"{tag}-{s}"),
            rconfig(f"{tag}{s}", **config),
        )
        for s in SHARDS
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_writers_without_the_full_state_commit_versions_every_receiver_holds_bit_exactly(
    tmp_path, world
):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * world, world, anchor_every=3)
    recs = _receivers(store, rl, tmp_path, verify_after_write=True)
    # blobs left compressed and read a tensor at a time (twice), not decoded and held
    lazy = _receivers(store, rl, tmp_path, "z", max_staged_bytes=0)
    catalog = Catalog(store)
    for v in range(5):  # anchor, delta, delta, anchor, delta
        if v:
            for t in trainers:
                t.step()
        _published(syncs, v)
        m = catalog.manifest(v)
        assert m.kind == ("anchor" if v % 3 == 0 else "delta")
        want = expected_shards(trainers[0].params, tl, rl)
        for s in SHARDS:
            listed = m.shard_digests[s]
            assert listed.startswith(f"w{world}:") and is_parts_digest(listed), listed
            assert recs[s].pull().version == v
            assert_same_bits(recs[s].tensors, want[s], f"v{v} {s}")
            assert lazy[s].pull().version == v
            assert_same_bits(lazy[s].tensors, want[s], f"v{v} {s} read lazily")
            # the parts digest is what a receiver computes from an exact state
            parts = receiver_part_digests(want[s], layout=rl, shard=s, count=world)
            assert parts_digest([parts[k] for k in range(world)]) == listed
            assert recs[s].state_digest == listed
            assert recs[s].scrub()
    # a fresh receiver takes the chain from the newest anchor
    fresh = _receivers(store, rl, tmp_path, "f")
    assert fresh["tp1"].pull().chain == (3, 4)
    assert_same_bits(fresh["tp1"].tensors, expected_shards(trainers[0].params, tl, rl)["tp1"])


@pytest.mark.timeout(120)
def test_a_spilled_first_pull_from_several_writers_parks_their_pieces_and_is_exact(
    tmp_path, monkeypatch
):
    # Each writer's sparse piece of a tensor is parked in the state dir as it is read (a
    # stash), and the parts digest reads it back a row chunk's share at a time: an anchor
    # alone, and a catch-up (anchor and delta) in one pull.
    monkeypatch.setattr(stash_module, "STASH_MIN", 64)  # the tiny model's pieces too
    parked: list = []

    class Spy(stash_module.Stash):
        def keep(self, record):
            got = super().keep(record)
            if isinstance(got, stash_module.StashedPiece):
                parked.append(got.name)
            return got

    monkeypatch.setattr(store_receiver, "Stash", Spy)
    held: list[int] = []  # pieces of each item the write pass writes
    real_apply = store_receiver.apply_pieces

    def apply(item, *args, **kwargs):
        held.append(len(item.pieces))
        return real_apply(item, *args, **kwargs)

    monkeypatch.setattr(store_receiver, "apply_pieces", apply)
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2, anchor_every=3)
    for v in range(5):  # anchor, delta, delta, anchor, delta
        if v:
            for t in trainers:
                t.step()
        _published(syncs, v)
        if v not in (0, 4):
            continue  # an anchor alone, then the newest anchor and a delta
        want = expected_shards(trainers[0].params, tl, rl)
        for s in SHARDS:
            tensors = zero_tensors(rl, s)
            seen: dict = {}

            def written(name, tensors=tensors, seen=seen):
                assert name not in seen, f"{name} reported twice"
                seen[name] = tensors[name].clone()

            rx = Receiver.for_layout(
                store,
                rl,
                s,
                tensors,
                str(tmp_path / f"a{v}-{s}"),
                rconfig(f"a{v}{s}", max_staged_bytes=0),
                on_tensor_written=written,
            )
            parked.clear()
            held.clear()
            assert rx.pull().chain == ((0,) if v == 0 else (3, 4))
            # written a writer's piece at a time, never every writer's of a tensor together
            assert held and set(held) == {1}, held
            assert_same_bits(tensors, want[s], f"v{v} {s}")
            assert len(set(parked)) > 3, parked  # several tensors' pieces were parked
            # each tensor reported once, when every writer's piece of it was written
            assert_same_bits(seen, want[s], f"v{v} {s} as each tensor was reported")
            assert unlinked_fds_under(tmp_path / f"a{v}-{s}") == []
            assert rx.scrub()
            rx.close()


@pytest.mark.timeout(90)
def test_a_live_tensor_changed_behind_the_receivers_back_is_caught_by_scrub_and_on_open(tmp_path):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2)
    _published(syncs, 0)
    recs = _receivers(store, rl, tmp_path)
    for rec in recs.values():
        assert rec.pull().version == 0
    for rec in recs.values():
        rec.tensors["model.layers.0.mlp.down_proj.weight"].view(-1)[3] += 1  # a stray write
    assert not recs["tp0"].scrub()
    assert recs["tp0"].version is None or recs["tp0"].dirty
    # tp1 restarted on its state dir: verify_on_open sees that its tensors are not version 0
    tensors = recs["tp1"].tensors
    recs["tp1"].close()
    again = Receiver.for_layout(store, rl, "tp1", tensors, str(tmp_path / "r-tp1"), rconfig("rtp1"))
    assert again.dirty and again.state_digest is None
    # the next pull restores the newest anchor: exact again
    assert again.pull().version == 0
    assert_same_bits(again.tensors, expected_shards(trainers[0].params, tl, rl)["tp1"])


class _TamperedMarker:
    """Writer 1's store: its marker of ``version`` goes in with the part digest of ``shard``
    replaced (an unsigned store: anyone who can write it can do this)."""

    def __init__(self, inner, version: int, writer: str, shard: str) -> None:
        self.inner, self.shard = inner, shard
        self.key = names.writer_marker_key(version, writer)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data):
        if key == self.key:
            obj = json.loads(data)
            obj["part_digests"][self.shard] = "0" * 32
            data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
        return self.inner.put_if_absent(key, data)


@pytest.mark.timeout(90)
def test_a_marker_with_a_wrong_part_digest_is_refused_by_receivers_before_any_write(tmp_path):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    tampered = _TamperedMarker(store, 1, "w00001-s1", "tp0")
    syncs, trainers = _ranks([store, tampered], 2)
    _published(syncs, 0)
    recs = _receivers(store, rl, tmp_path)
    for rec in recs.values():
        rec.pull()
    held = {s: {n: t.clone() for n, t in recs[s].tensors.items()} for s in SHARDS}
    for t in trainers:
        t.step()
    _published(syncs, 1)  # committed: the committer cannot tell a wrong part digest
    with pytest.raises(IntegrityError, match="Refused before any write"):
        recs["tp0"].pull()
    assert recs["tp0"].version == 0 and not recs["tp0"].dirty
    assert same_bits(recs["tp0"].tensors, held["tp0"])
    assert recs["tp1"].pull().version == 1  # its parts were stated right
    assert_same_bits(recs["tp1"].tensors, expected_shards(trainers[0].params, tl, rl)["tp1"])


@pytest.mark.timeout(60)
def test_a_receiver_built_without_its_layout_refuses_a_parts_digest_by_name(tmp_path):
    _, _tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, 2)
    _published(syncs, 0)
    tensors = zero_tensors(rl, "tp0")
    rec = Receiver(
        store, shard="tp0", tensors=tensors, state_dir=str(tmp_path / "r"), config=rconfig("r")
    )
    with pytest.raises(ReceiverLayoutRequiredError, match=r"version 0 .*Receiver.for_layout"):
        rec.pull()
    assert rec.version is None
    assert all(not t.any() for t in tensors.values())  # nothing written


@pytest.mark.timeout(60)
def test_a_committer_without_the_full_state_names_a_writer_that_stated_no_part_digests(tmp_path):
    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, 2, full_state_for=(1,), marker_timeout_s=2)
    out = every_rank(lambda r: syncs[r].step_published(0), 2)
    assert isinstance(out[0], VersionError), out
    assert "w00001-s1's marker states no part digests" in str(out[0])
    assert Catalog(store).versions() == []


@pytest.mark.timeout(90)
def test_a_committer_given_the_full_state_still_lists_whole_state_digests(tmp_path):
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2, full_state_for=(0,))
    _published(syncs, 0)
    m = Catalog(store).manifest(0)
    want = expected_shards(trainers[0].params, tl, rl)
    assert dict(m.shard_digests) == {s: state_digest(want[s]) for s in SHARDS}


@pytest.mark.timeout(90)
def test_writers_resumed_with_the_full_state_recognise_a_parts_digest_version(tmp_path):
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2)
    _published(syncs, 0)
    for t in trainers:
        t.step()
    _published(syncs, 1)
    # a restarted job whose checkpoint holds version 1's state, resumed with the full state
    again, replay = _ranks([store] * 2, 2, full_state_for=(0, 1), session="s2")
    for t in replay:
        t.step()
    assert every_rank(lambda r: again[r].resume(1), 2) == [True, True]
    assert every_rank(lambda r: again[r].resume(0), 2) == [False, False]  # another state


@pytest.mark.timeout(90)
def test_a_scatter_stopped_midway_is_replayed_from_its_journal_against_the_parts_digest(
    tmp_path, monkeypatch
):
    from deltasync.receiver import store_receiver

    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2)
    _published(syncs, 0)
    recs = _receivers(store, rl, tmp_path)
    recs["tp0"].pull()
    for t in trainers:
        t.step()
    _published(syncs, 1)
    real, count = store_receiver.apply_pieces, [0]

    def stopping(*args, **kwargs):
        if count[0] == 2:
            raise RuntimeError("injected: the scatter stopped")
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "apply_pieces", stopping)
    with pytest.raises(RuntimeError, match="injected"):
        recs["tp0"].pull()
    monkeypatch.undo()
    assert recs["tp0"].dirty and recs["tp0"].version is None  # torn: neither 0 nor 1
    tensors = recs["tp0"].tensors
    recs["tp0"].close()
    # restarted on its state dir: the journal is replayed (verified against the parts digest)
    again = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "r-tp0"), rconfig("rtp0"))
    assert again.last_repair is not None and again.last_repair.repaired
    assert again.version == 1
    assert_same_bits(again.tensors, expected_shards(trainers[0].params, tl, rl)["tp0"])


@pytest.mark.timeout(90)
def test_writers_without_the_full_state_replaying_a_committed_version_keep_their_changes(
    tmp_path,
):
    # docs/sync.md "Already committed?": without the full state no writer (the committer
    # included, with several writers) can tell whether its changes are in that version
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2)
    _published(syncs, 0)
    for t in trainers:
        t.step()
    _published(syncs, 1)
    again, replay = _ranks([store] * 2, 2, session="s2")
    for t in replay:
        t.step()
    out = every_rank(lambda r: again[r].step_published(1), 2)
    assert all(isinstance(x, CommitConflictError) and "keeps them" in str(x) for x in out), out
    for t in replay:
        t.step()
    version = max(s.next_version() for s in again)
    reports = _published(again, version)
    assert [x[0].kind for x in reports] == ["anchor", "anchor"]
    rec = _receivers(store, rl, tmp_path)["tp0"]
    assert rec.pull().version == version
    assert_same_bits(rec.tensors, expected_shards(replay[0].params, tl, rl)["tp0"])


@pytest.mark.timeout(60)
def test_a_trainer_layout_other_than_the_transformers_one_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
    # part digests are defined over the transformers parameters (receivers derive each
    # writer's rows from them); a trainer layout with other parameters would state parts no
    # receiver can check
    from deltasync.publish import publisher

    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, 2)
    real = publisher.parts_param_shapes
    monkeypatch.setattr(
        publisher,
        "parts_param_shapes",
        lambda layout: {("model." + n if "embed" in n else n): s for n, s in real(layout).items()},
    )
    with pytest.raises(ConfigError, match="Give the committer full_state"):
        syncs[0].step_published(0)  # the committer: it needs every writer's parts
    assert store.list("") == []  # no claim, blob or marker


def test_a_writer_whose_layout_has_no_parts_still_publishes_to_a_committer_given_full_state(
    tmp_path, monkeypatch
):
    # a writer cannot know whether its committer was given full_state: without part digests
    # defined over its layout it states none, and a committer with full_state needs none
    from deltasync.publish import publisher

    store = scratch_store(tmp_path / "store")
    syncs, _ = _ranks([store] * 2, 2, full_state_for=(0,))
    real = publisher.parts_param_shapes
    monkeypatch.setattr(
        publisher,
        "parts_param_shapes",
        lambda layout: {("model." + n if "embed" in n else n): s for n, s in real(layout).items()},
    )
    out = every_rank(lambda r: syncs[r].step_published(0), 2)
    assert all(isinstance(x, list) and x[0].version == 0 for x in out), out
    manifest = Catalog(store).manifest(0)
    assert not any(is_parts_digest(d) for d in manifest.shard_digests.values())


@pytest.mark.timeout(90)
def test_with_a_signing_key_a_rewritten_part_digest_is_never_committed(tmp_path):
    # the part digests are under the marker's MAC: the rewritten marker does not verify, the
    # committer waits for a genuine one, and nothing commits
    from deltasync.publish import MissingWritersError

    _, _tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    tampered = _TamperedMarker(store, 1, "w00001-s1", "tp0")
    syncs, trainers = _ranks([store, tampered], 2, signing_key=KEY, marker_timeout_s=2)
    _published(syncs, 0)
    for t in trainers:
        t.step()
    out = every_rank(lambda r: syncs[r].step_published(1), 2)
    assert isinstance(out[0], MissingWritersError) and "w00001-s1" in str(out[0]), out
    assert Catalog(store).versions() == [0]
    rec = Receiver.for_layout(
        store,
        rl,
        "tp0",
        zero_tensors(rl, "tp0"),
        str(tmp_path / "k"),
        rconfig("k", signing_key=KEY),
    )
    assert rec.pull().version == 0
