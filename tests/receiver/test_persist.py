"""A receiver with ``persist`` (a sidecar writing the copy its engine reads): no record of a
version (ack, registration, state file) before persist has taken it, and a failed persist is
retried by the next pull, or replayed by a receiver restarted meanwhile."""

from __future__ import annotations

import pytest
from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors
from safetensors.torch import load_file

from deltasync import MemoryStore, Receiver, names
from deltasync.commit import Catalog, ReceiverRecord
from deltasync.errors import ApplyError

SHARD = "tp0"


class Copy:
    """The persisted copy: fails while ``full`` is set, as a full disk would."""

    def __init__(self) -> None:
        self.full = False
        self.version = None
        self.tensors = None

    def __call__(self, tensors, state) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        self.tensors = {n: t.clone() for n, t in tensors.items()}
        self.version = state.version


@pytest.fixture
def published():
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=5)
    return store, pub, params, tl, rl


def _receiver(store, rl, tmp_path, copy):
    tensors = zero_tensors(rl, SHARD)
    state_dir = str(tmp_path / "rec")
    return Receiver.for_layout(store, rl, SHARD, tensors, state_dir, rconfig("rec"), persist=copy)


def test_a_failed_persist_records_nothing_and_the_next_pull_persists_then_acks(tmp_path, published):
    store, pub, params, tl, rl = published
    copy = Copy()
    rec = _receiver(store, rl, tmp_path, copy)
    assert rec.pull().version == 0 and copy.version == 0
    publish_edit(pub, params, 1, 9)
    catalog = Catalog(store)
    copy.full = True
    with pytest.raises(ApplyError, match=r"persisting version 1 failed .*reports version 0"):
        rec.pull()
    # the live tensors hold version 1; nothing says so until the copy does
    assert_same_bits(rec.tensors, rl.split(tl.to_canonical(params))[SHARD])
    assert rec.version == 0 and copy.version == 0
    assert catalog.acks(1) == {} and catalog.receivers()["rec"].version == 0
    with pytest.raises(ApplyError):  # retried first, still failing
        rec.pull()
    assert catalog.acks(1) == {}
    copy.full = False
    publish_edit(pub, params, 2, 9)
    report = rec.pull()  # persists version 1, records it, then pulls on to 2
    assert report.version == 2 and copy.version == 2 and rec.version == 2
    assert set(catalog.acks(1)) == {"rec"} and set(catalog.acks(2)) == {"rec"}
    assert catalog.receivers()["rec"].version == 2
    assert_same_bits(copy.tensors, rl.split(tl.to_canonical(params))[SHARD])


def test_a_receiver_restarted_before_persisting_replays_the_version_and_persists_it(
    tmp_path, published
):
    store, pub, params, tl, rl = published
    copy = Copy()
    rec = _receiver(store, rl, tmp_path, copy)
    rec.pull()
    publish_edit(pub, params, 1, 9)
    copy.full = True
    with pytest.raises(ApplyError):
        rec.pull()
    # restarted from the persisted copy (version 0), on the same state dir
    copy.full = False
    restarted = {n: t.clone() for n, t in copy.tensors.items()}
    again = Receiver.for_layout(
        store, rl, SHARD, restarted, str(tmp_path / "rec"), rconfig("rec"), persist=copy
    )
    assert again.last_repair is not None and again.last_repair.version == 1
    assert copy.version == 1 and set(Catalog(store).acks(1)) == {"rec"}
    assert_same_bits(copy.tensors, rl.split(tl.to_canonical(params))[SHARD])


def test_a_sidecar_file_removed_while_its_next_version_waits_to_be_persisted_is_not_relabelled(
    tmp_path,
):
    # Persisting version 1 failed (a full --dir), the operator removed the file to free
    # space, and the sidecar rewrote it from the tensors in memory, which held version 1,
    # labelled version 0: a file and a registration naming a version it did not hold.
    from safetensors import safe_open

    from deltasync.commands.pull import META_VERSION, _ShardFile

    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, SHARD)
    file = _ShardFile(tmp_path / "out" / "tp0.safetensors")
    full = [False]

    def persist(live, held):
        if full[0]:
            raise ApplyError("could not write: No space left on device")
        file.write(live, held.version, held.state_digest, SHARD, held.run_id)

    rec = Receiver.for_layout(
        store, rl, SHARD, tensors, str(tmp_path / "rec"), rconfig("rec"), persist=persist
    )
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    v1 = rl.split(tl.to_canonical(params))[SHARD]
    full[0] = True
    with pytest.raises(ApplyError, match="No space left"):
        rec.pull()
    assert rec.version == 0 and rec.unpersisted_version == 1
    file.path.unlink()  # the operator frees space
    full[0] = False
    assert file.keep(rec, SHARD) is False  # nothing rewritten under version 0's name
    assert not file.path.exists()
    assert rec.version is None and rec.unpersisted_version is None
    assert ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version is None
    report = rec.pull()  # the journal replayed, version 1 persisted under its own name
    assert report.version == 1 and report.repaired
    with safe_open(str(file.path), framework="pt") as f:
        assert f.metadata()[META_VERSION] == "1"
    assert_same_bits(load_file(str(file.path)), v1, "the file")
    assert ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version == 1
