"""Entries no key can name, planted in a local store by someone else (a link, a FIFO, a
socket, a directory where a file belongs): they are invisible to listing, and ``LATEST``, a
hint, never stops a reader or a writer. Every version is still published and pulled exactly."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
from truth_kit import CountingStore, Rig, assert_same_bits, rconfig

from deltasync import LocalStore, names
from deltasync.commit import Catalog, collect_garbage, decode_latest
from deltasync.errors import BlobLimitError, StoreError
from deltasync.format import TensorSpec
from deltasync.receiver import Receiver
from deltasync.receiver.staging import blob_bound, open_version
from deltasync.store.local import TMP_MARK


@pytest.fixture
def rig(tmp_path):
    rig = Rig(LocalStore(tmp_path / "store"), tmp_path)
    for v in range(2):
        rig.publish(v)
    rig.check(rig.rec.pull())
    return rig


def _plant(path, kind: str, tmp_path) -> socket.socket | None:
    if os.path.isdir(path):
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if kind == "link":
        outside = tmp_path / "outside"
        outside.write_text('{"version": 1}')
        os.symlink(outside, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return sock
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link", "fifo", "socket", "dir"])
def test_anything_planted_at_latest_never_stops_the_run(rig, tmp_path, kind, caplog):
    latest = tmp_path / "store" / names.LATEST
    held = _plant(latest, kind, tmp_path)
    assert Catalog(rig.store).latest() == 1  # the manifests are the truth
    assert rig.rec.pull().version == 1
    assert rig.publish(2).version == 2
    rig.check(rig.rec.pull())
    if kind == "dir":  # a directory cannot be replaced by a file: logged with the remedy
        assert "remove whatever is stored at LATEST" in caplog.text
    else:  # the next commit rewrote it, as for a garbage LATEST
        assert not latest.is_symlink() and decode_latest(latest.read_bytes()) == 2
    if kind == "link":  # replaced, never written through
        assert (tmp_path / "outside").read_text() == '{"version": 1}'
    if held is not None:
        held.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("where", ["receivers", "acks/v00000001"])
def test_a_special_file_where_a_directory_belongs_is_invisible_to_listing(
    rig, tmp_path, kind, where
):
    path = tmp_path / "store" / where
    for entry in path.iterdir():  # empty it first: rmdir needs that
        entry.unlink()
    held = _plant(path, kind, tmp_path)
    catalog = Catalog(rig.store)
    prefix = where + "/"
    assert rig.store.list(prefix) == [] and not rig.store.exists(prefix + "rec.json")
    if where == "receivers":
        assert catalog.receivers() == {}
    else:
        assert catalog.acks(1) == {}
    assert rig.trainer.pub.gc() is not None  # retention runs
    assert rig.trainer.pub.wait_for_acks(1, [], timeout=1) == {}
    assert rig.publish(2).version == 2
    rig.check(rig.rec.pull())  # a registration that cannot be written is retried, not raised
    if held is not None:
        held.close()


def test_a_latest_at_the_last_version_number_probes_no_further(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put(names.LATEST, b'{"version":99999999}')
    store.put(names.manifest_key(names.MAX_VERSION), b"{}")  # exists: no manifest after it
    assert Catalog(store).latest() == names.MAX_VERSION


def test_temp_files_are_swept_through_a_linked_root(tmp_path):
    real = tmp_path / "real"
    LocalStore(real, create=True).put("a/b", b"x")
    (real / "a" / f".b{TMP_MARK}dead").write_bytes(b"partial")
    os.symlink(real, tmp_path / "link")
    assert LocalStore(tmp_path / "link").sweep_temp_files() == 1
    assert LocalStore(real).get("a/b") == b"x"


@pytest.mark.timeout(60)
def test_a_planted_latest_and_junk_manifest_above_the_head_never_steer_retention(rig, tmp_path):
    # LATEST names version 1000 and a file sits at its manifest key; neither verifies. Had
    # retention planned from version 1000, the real chain 0..5 would look old enough to
    # delete (its middle went), and a fresh receiver could never reach version 5 again.
    for v in range(2, 6):
        rig.publish(v)
    before = rig.trainer.pub.gc()
    assert before.versions == ()
    rig.store.put(names.LATEST, b'{"version": 1000}')
    rig.store.put(names.manifest_key(1000), b'{"version": 1000, "forged": true}')
    assert rig.trainer.pub.gc().versions == ()
    assert rig.store.exists(names.manifest_key(1000))  # unreadable: never touched either
    rig.store.delete(names.manifest_key(1000))
    tensors = {n: t.clone().zero_() for n, t in rig.tensors.items()}
    report = Receiver.for_layout(
        rig.store,
        rig.rl,
        rig.shard,
        tensors,
        str(tmp_path / "fresh"),
        rconfig("fresh"),
    ).pull()
    assert report.version == 5 and report.chain[0] == 0
    assert_same_bits(tensors, rig.oracle[(report.run_id, 5)][rig.shard])


class _OneFailedRead:
    """The store, except that one read of ``key`` fails (an outage, retries used up)."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.key = inner, key

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, **kwargs):
        if key == self.key:
            self.key = ""
            raise StoreError(f"injected: reading {key!r} failed")
        return self.inner.get(key, **kwargs)


@pytest.mark.timeout(60)
def test_retention_stops_on_a_manifest_it_cannot_read_and_deletes_nothing(rig):
    # Taking an unreadable manifest for a hostile one left it out of the plan: the chain from
    # the anchor to the head broke there and the rest of it was deleted (a fresh receiver
    # could never reach the head again). A read failure stops the plan; a manifest that does
    # not verify keeps every version from the newest anchor on.
    for v in range(2, 7):
        rig.publish(v)
    held = sorted(rig.store.list(""))
    flaky = _OneFailedRead(rig.store, names.manifest_key(3))
    with pytest.raises(StoreError, match=r"v00000003/MANIFEST\.json"):
        collect_garbage(
            flaky, Catalog(flaky), keep_versions=1, receiver_ttl_s=0.0, orphan_grace_s=0.0
        )
    assert sorted(rig.store.list("")) == held
    rig.store.put(names.manifest_key(3), b'{"forged": true}')  # does not verify
    plan = collect_garbage(
        rig.store, Catalog(rig.store), keep_versions=1, receiver_ttl_s=0.0, orphan_grace_s=0.0
    )
    assert plan.versions == ()


@pytest.mark.timeout(60)
def test_a_record_that_cannot_be_read_counts_as_absent_for_every_reader(rig):
    # a registration or ack planted with no read permission (or one read that failed): one
    # such key stopped acks, bounded staleness, retention and inspect for everyone
    rig.store.put(names.receiver_key("junk"), b"{}")
    rig.store.put(names.ack_key(1, "junk"), b"{}")
    for key in (names.receiver_key("junk"), names.ack_key(1, "junk")):
        catalog = Catalog(_OneFailedRead(rig.store, key))
        assert "junk" not in catalog.receivers() and "junk" not in catalog.acks(1)
        assert "rec" in catalog.receivers()


@pytest.mark.timeout(60)
def test_a_blob_listed_larger_than_its_shard_can_need_is_refused_unread(rig):
    # on an unsigned store the manifest's size field is all that bounds a read: a 2 GiB entry
    # for a 100 KiB shard made a receiver allocate 4 GiB before the digest refused it
    manifest = Catalog(rig.store).manifest(1)
    specs = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in rig.tensors.items()}
    bound = blob_bound(specs)
    huge = tuple(
        dataclasses.replace(b, size=bound + 1) if b.shard == rig.shard else b
        for b in manifest.blobs
    )
    counting = CountingStore(rig.store)
    with pytest.raises(BlobLimitError, match=f"more than any blob of shard {rig.shard!r}"):
        open_version(counting, dataclasses.replace(manifest, blobs=huge), rig.shard, specs)
    assert not [k for k in counting.reads if k.endswith(".blob")]
    assert bound < 20 * sum(t.numel() * t.element_size() for t in rig.tensors.values())
