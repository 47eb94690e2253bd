"""The trainer's garbage collection deletes only what it wrote; receivers read bounded objects;
a signed manifest's MAC is checked on the raw bytes before parsing; secrets stay out of reprs,
logs and errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from kit import TinyTrainer, expected_shards, rconfig, same_bits, tiny_layouts, zero_tensors

from deltasync import (
    LocalStore,
    MemoryStore,
    Publisher,
    PublisherConfig,
    Receiver,
    S3Config,
    S3Store,
    SnapshotTracker,
    TrainerSync,
    names,
)
from deltasync.commit import Catalog
from deltasync.commit.signing import load_key_file
from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    ManifestError,
    SignatureError,
)

KEY = b"boundary-signing-key-0123456789a"


class Rig:
    def __init__(self, store, *, key=None, keep_versions=2):
        self.spec, self.tl, self.rl = tiny_layouts()
        self.store = store
        self.trainer = TinyTrainer(self.spec, density=0.2)
        self.pub = Publisher(
            store,
            receiver_layout=self.rl,
            config=PublisherConfig(anchor_every=2, keep_versions=keep_versions, signing_key=key),
        )
        self.sync = TrainerSync(
            SnapshotTracker(self.trainer.named_parameters()), self.pub, self.trainer.params
        )

    def publish(self, version):
        if version:
            self.trainer.step()
        self.sync.step_published(version)


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.timeout(60)
def test_gc_never_deletes_through_a_symlinked_acks_directory_nor_foreign_keys(tmp_path):
    root, home = tmp_path / "store", tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / "notes.json").write_bytes(b"mine")
    (home / ".ssh" / "id_ed25519").write_bytes(b"private")
    rig = Rig(LocalStore(root, durable=False), keep_versions=1)
    for v in range(5):
        rig.publish(v)
    (root / "acks").mkdir(exist_ok=True)
    os.symlink(home, root / "acks" / "v00000000")  # the attack: acks/v00000000 -> $HOME
    (root / "v00000001" / "README.txt").write_bytes(b"someone else's file")
    before = _tree(home)
    plan = rig.pub.gc()
    assert 0 in plan.versions and 1 in plan.versions
    assert _tree(home) == before
    assert (root / "v00000001" / "README.txt").read_bytes() == b"someone else's file"
    assert not any(k.startswith("acks/v00000000/") for k in plan.keys)
    assert rig.store.exists(names.manifest_key(4))


def test_a_blob_larger_than_its_manifest_entry_is_refused_without_reading_it_whole(tmp_path):
    rig = Rig(LocalStore(tmp_path / "store", durable=False))
    rig.publish(0)
    rig.publish(1)
    entry = Catalog(rig.store).manifest(1).blobs_for("tp0")[0]
    path = tmp_path / "store" / entry.key
    os.truncate(path, 8 * 2**30)  # sparse: reading it whole would need 8 GiB
    rec = Receiver.for_layout(
        rig.store,
        rig.rl,
        "tp0",
        zero_tensors(rig.rl, "tp0"),
        str(tmp_path / "r"),
        rconfig("r"),
    )
    with pytest.raises(DeltaSyncError, match="larger than the manifest"):
        rec.pull()
    assert rec.version is None
    assert all(not t.view(torch.int16).any() for t in rec.tensors.values())


def test_with_a_key_a_huge_unsigned_manifest_is_refused_before_it_is_parsed(tmp_path):
    store = MemoryStore()
    rig = Rig(store, key=KEY)
    rig.publish(0)
    catalog = Catalog(store, signing_key=KEY)
    store.put(names.manifest_key(1), b"[" * (8 * 2**20))  # would be a deep, slow parse
    with pytest.raises(SignatureError, match="unsigned"):
        catalog.manifest(1)
    genuine = store.get(names.manifest_key(0))
    tampered = genuine.replace(b'"kind":"anchor"', b'"kind":"anchor" ')
    store.put(names.manifest_key(2), tampered)
    with pytest.raises(SignatureError, match="before parsing"):
        catalog.manifest(2)
    without_key = Catalog(store)
    with pytest.raises(ManifestError, match="not valid JSON"):
        without_key.manifest(1)


def test_a_receiver_reads_manifest_latest_and_records_with_small_bounds(tmp_path):
    store = MemoryStore()
    rig = Rig(store)
    rig.publish(0)
    store.put(names.LATEST, b" " * 10_000 + b'{"version":0}')
    reads = []
    real_get = store.get

    def get(key, *, max_bytes=None):
        reads.append((key, max_bytes))
        return real_get(key, max_bytes=max_bytes)

    store.get = get
    assert Catalog(store).read_latest() is None  # an oversized hint is unusable: absent
    assert reads and all(m is not None and m <= 4096 for k, m in reads if k == names.LATEST)
    del store.get
    store.put(names.receiver_key("big"), b'{"receiver":"big"' + b" " * 2**20 + b"}")
    assert "big" not in Catalog(store).receivers()


def test_an_s3_endpoint_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(ConfigError) as info:
        S3Config(endpoint_url="https://AKIAEXAMPLE:hunter2secret@s3.example.com/?token=abc")
    assert "hunter2secret" not in str(info.value) and "abc" not in str(info.value)
    with pytest.raises(ConfigError, match="query string or fragment") as info:
        S3Config(endpoint_url="http://127.0.0.1:9/?X-Token=t0ps3cret")
    assert "t0ps3cret" not in str(info.value)
    config = S3Config(
        endpoint_url="http://127.0.0.1:9/",
        access_key_id="AKIA-ID",
        secret_access_key="s3cr3t-value",
        session_token="sess-t0ken",
    )
    for text in (repr(config), str(config)):
        assert "s3cr3t-value" not in text and "sess-t0ken" not in text and "AKIA-ID" not in text
    store = S3Store("bucket", "run", config=config)
    assert "s3cr3t-value" not in repr(store)
    store.close()


def test_a_key_file_readable_by_others_draws_a_warning_and_a_private_one_does_not(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="deltasync.commit.signing"):
        assert load_key_file(path) == KEY
    assert "readable by its group or others" in caplog.text
    caplog.clear()
    os.chmod(path, 0o600)
    with caplog.at_level(logging.WARNING, logger="deltasync.commit.signing"):
        assert load_key_file(path) == KEY
    assert caplog.text == ""
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_key_file(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_key_file(tmp_path)


@pytest.mark.timeout(60)
def test_a_receiver_with_a_key_still_reaches_every_version_through_the_bounded_reads(tmp_path):
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, key=KEY)
    rec = Receiver.for_layout(
        store,
        rig.rl,
        "tp1",
        zero_tensors(rig.rl, "tp1"),
        str(tmp_path / "r"),
        rconfig("r", signing_key=KEY),
    )
    for v in range(4):
        rig.publish(v)
        assert rec.pull().version == v
        assert same_bits(rec.tensors, expected_shards(rig.trainer.params, rig.tl, rig.rl)["tp1"])
    assert set(Catalog(store, signing_key=KEY).acks(3)) == {"r"}
    assert set(rig.pub.live_receivers()) == {"r"}


def test_the_cli_reads_its_key_file_through_the_checked_loader(tmp_path, caplog):
    import argparse

    from deltasync.commands.inspect_store import read_key

    path = tmp_path / "run.key"
    path.write_bytes(KEY)
    os.chmod(path, 0o640)
    with caplog.at_level(logging.WARNING, logger="deltasync.commit.signing"):
        assert read_key(argparse.Namespace(key_file=str(path))) == KEY
    assert "chmod 600" in caplog.text
    path.write_bytes(b"12345")
    with pytest.raises(ConfigError, match="at least 16"):
        read_key(argparse.Namespace(key_file=str(path)))
    assert read_key(argparse.Namespace(key_file=None)) is None


def test_the_run_identity_is_inside_the_signed_bytes(tmp_path):
    store = MemoryStore()
    rig = Rig(store, key=KEY)
    rig.publish(0)
    data = store.get(names.manifest_key(0))
    run_id = Catalog(store, signing_key=KEY).manifest(0).run_id
    other = data.replace(f'"run_id":"{run_id}"'.encode(), b'"run_id":"another-run-0001"')
    assert other != data
    store.put(names.manifest_key(0), other)
    with pytest.raises(SignatureError, match="does not verify"):
        Catalog(store, signing_key=KEY).manifest(0)


def test_a_manifest_listing_many_writers_blobs_is_refused_before_any_is_read(tmp_path):
    # Each blob passes its own bound (a whole shard's worth), but a pull holds every blob of a
    # version at once: 16 copies of the shard under 16 writer ids would cost 16 shards of memory.
    import json

    from deltasync.commit import blob_digest
    from deltasync.commit.model import Manifest
    from deltasync.format import encode_blob
    from deltasync.format.build import full_updates

    _, tl, rl = tiny_layouts(vocab_size=65536)  # tp0: ~4.2 M elements, 8 MiB of BF16
    store = LocalStore(tmp_path / "store", durable=False)
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in tl.param_shapes().items()}
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=1000))
    pub.publish(0, [], params, anchor=True)
    genuine = json.loads(store.get(names.manifest_key(0)))
    shard = zero_tensors(rl, "tp0")
    blobs = []
    for i in range(16):
        writer = f"x{i:04d}"
        data = encode_blob(
            full_updates(shard), version=1, base_version=-1, shard="tp0", writer=writer, level=0
        )
        key = names.blob_key(1, "tp0", writer)
        store.put(key, data)
        blobs.append(
            {"digest": blob_digest(data), "key": key, "shard": "tp0", "size": len(data)}
            | {"writer": writer}
        )
    planted = dict(genuine, version=1, blobs=blobs, writers=[b["writer"] for b in blobs])
    store.put(names.manifest_key(1), Manifest.from_json(json.dumps(planted)).to_json())
    read: list[str] = []

    class Watched:
        def __getattr__(self, name):
            return getattr(store, name)

        def get(self, key, *, max_bytes=None):
            read.append(key)
            return store.get(key, max_bytes=max_bytes)

    rec = Receiver.for_layout(Watched(), rl, "tp0", shard, str(tmp_path / "r"), rconfig("r"))
    with pytest.raises(DeltaSyncError, match="lists 16 blobs of shard 'tp0'"):
        rec.pull()
    assert not [k for k in read if k.endswith(".blob")]
    assert rec.version is None


@pytest.mark.timeout(120)
def test_with_a_key_a_manifest_and_latest_planted_above_the_head_stop_neither_side(tmp_path):
    # Two unsigned writes: any bytes at the largest version a key can name, and LATEST naming
    # it. Taken as the newest committed version by existence, they would stop the trainer (no
    # version above it can exist) and fail every keyed receiver's pull, for good.
    store = LocalStore(tmp_path / "store", durable=False)
    rig = Rig(store, key=KEY)
    for v in range(3):
        rig.publish(v)
    rec = Receiver.for_layout(
        store,
        rig.rl,
        "tp0",
        zero_tensors(rig.rl, "tp0"),
        str(tmp_path / "r"),
        rconfig("r", signing_key=KEY),
    )
    assert rec.pull().version == 2
    store.put(names.manifest_key(names.MAX_VERSION), b"{}")
    store.put(names.LATEST, b'{"version":%d}' % names.MAX_VERSION)
    with pytest.raises(SignatureError, match=r"v99999999/MANIFEST\.json"):
        rec.pull()  # named, until the trainer publishes past it
    assert rec.version == 2
    assert rig.pub.next_version() == 3
    assert Catalog(store, signing_key=KEY).head(verified=True).version == 2
    rig.publish(3)
    assert rec.pull().version == 3
    assert same_bits(rec.tensors, expected_shards(rig.trainer.params, rig.tl, rig.rl)["tp0"])
    assert b'"version":3' in store.get(names.LATEST)  # moved off the planted one
