"""A version that meets a full store gives back the room it took: the blobs it stored before
the write that failed are named by nothing (no marker lists them yet), so they are deleted
with the failed attempt instead of keeping the disk full (the temp file of the failed write
was already removed; a finished blob was left, and gc never deletes an attempt above the
newest committed version). The error names the key and the remedy; the retry, once space is
freed, commits a version the receivers hold bit for bit. On a real tmpfs where this machine
lets the test mount one, and through a fake store that fails the second blob's upload."""

from __future__ import annotations

import os

import pytest
from kit import fill_up, mounted_tmpfs

from deltasync.errors import StoreError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.store import LocalStore, MemoryStore
from deltasync.trainer import AdamWTracker

from sync_kit import TinyTrainer, assert_same_bits, expected_shards, layouts, rconfig, zero_tensors


class SecondBlobFails:
    """A store whose second blob upload is refused for room (the first one lands)."""

    def __init__(self, inner) -> None:
        self.inner, self.blobs = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_stream(self, key, chunks):
        if key.endswith(".blob"):
            self.blobs += 1
            if self.blobs == 2:
                raise StoreError(f"writing {key!r} failed: OSError: [Errno 28] No space left")
        return self.inner.put_stream(key, chunks)


def _sync(store):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=4)
    pub = Publisher(
        store, receiver_layout=rl, config=PublisherConfig(anchor_every=100, upload_threads=1)
    )
    tracker = AdamWTracker(trainer.opt, trainer.named_parameters())
    return tl, rl, trainer, TrainerSync(tracker, pub, trainer.params)


def _pulls_exactly(store, tl, rl, trainer, tmp_path, version) -> None:
    for shard in ("tp0", "tp1"):
        rec = Receiver.for_layout(
            store, rl, shard, zero_tensors(rl, shard), str(tmp_path / shard), rconfig(shard)
        )
        assert rec.pull().version == version
        assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)[shard], shard)


@pytest.mark.timeout(60)
def test_an_anchor_whose_second_blob_is_refused_deletes_the_first(tmp_path):
    inner = MemoryStore()
    tl, rl, trainer, sync = _sync(SecondBlobFails(inner))
    with pytest.raises(StoreError, match="No space left"):
        sync.step_published(0)
    assert inner.list("") == []  # the first shard's blob went with the failed attempt
    sync.step_published(0)  # the third upload lands: the retry commits
    _pulls_exactly(inner, tl, rl, trainer, tmp_path, 0)


@pytest.mark.timeout(60)
def test_an_anchor_that_fills_the_disk_gives_its_room_back_and_commits_once_freed(tmp_path):
    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        store = LocalStore(mnt / "store", durable=False)
        tl, rl, trainer, sync = _sync(store)
        fill_up(mnt, leave=90112)  # one shard's anchor blob fits, not both
        room = os.statvfs(mnt).f_bavail
        with pytest.raises(StoreError, match=r"\.blob' in .*No space left.*deltasync gc"):
            sync.step_published(0)
        assert store.list("") == [] and os.statvfs(mnt).f_bavail == room
        assert not [n for _, _, names in os.walk(mnt / "store") for n in names]  # no temp
        os.unlink(mnt / "FILLER")
        trainer.step()
        sync.step_published(sync.next_version())
        _pulls_exactly(store, tl, rl, trainer, tmp_path, 0)
