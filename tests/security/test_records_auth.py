"""With a signing key nothing unsigned is trusted: writer markers, acks and receiver records are
authenticated, the committer signs its own marker from memory, and future-dated records are
refused; every parse error is typed and every token rule is a full match."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from kit import TinyTrainer, expected_shards, rconfig, same_bits, tiny_layouts, zero_tensors

from deltasync import (
    MemoryStore,
    Publisher,
    PublisherConfig,
    Receiver,
    SnapshotTracker,
    TrainerSync,
    names,
)
from deltasync.commit import (
    AckRecord,
    BlobEntry,
    Catalog,
    Manifest,
    ReceiverRecord,
    WriterMarker,
    blob_digest,
)
from deltasync.commit.committer import wait_for_markers
from deltasync.commit.records import MAX_CLOCK_SKEW_S, decode_latest
from deltasync.errors import ManifestError, MissingWritersError, SignatureError

KEY = b"records-signing-key-0123456789ab"
OTHER = b"another-key-of-another-tenant-xx"
D = "ab" * 16
B = blob_digest(b"the genuine blob")
FORGED = blob_digest(b"the attacker's blob")


def _blob(version: int, shard: str, writer: str, digest: str = B) -> BlobEntry:
    return BlobEntry(
        shard=shard,
        writer=writer,
        key=names.blob_key(version, shard, writer),
        size=10,
        digest=digest,
    )


def _marker(version=3, writer="w00001-s", digest=B) -> WriterMarker:
    return WriterMarker(
        version=version,
        writer=writer,
        created_at=time.time(),
        blobs=(_blob(version, "tp0", writer, digest),),
    )


def test_a_signed_marker_round_trips_and_an_unsigned_forged_or_foreign_key_one_is_refused():
    marker = _marker()
    data = marker.to_json(KEY)
    assert WriterMarker.from_json(data, signing_key=KEY) == marker
    assert WriterMarker.from_json(data) == marker  # without a key the MAC is not required
    with pytest.raises(SignatureError, match="unsigned"):
        WriterMarker.from_json(marker.to_json(), signing_key=KEY)
    obj = json.loads(data)
    obj["blobs"][0]["digest"] = FORGED
    with pytest.raises(SignatureError, match="does not verify"):
        WriterMarker.from_json(json.dumps(obj), signing_key=KEY)
    with pytest.raises(SignatureError, match="does not verify"):
        WriterMarker.from_json(marker.to_json(OTHER), signing_key=KEY)


def test_a_mac_of_one_record_kind_never_verifies_as_another():
    ack = AckRecord(version=3, receiver="r", shard="tp0", state_digest=D, created_at=1.0)
    rec = ReceiverRecord(receiver="r", shard="tp0", version=3, updated_at=1.0)
    mac = json.loads(ack.to_json(KEY))["mac"]
    obj = json.loads(rec.to_json())
    obj["mac"] = mac
    with pytest.raises(SignatureError):
        ReceiverRecord.from_json(json.dumps(obj), signing_key=KEY)


def test_the_committer_ignores_a_forged_marker_and_names_it_when_the_wait_times_out():
    store = MemoryStore()
    writers = ["w00000-s", "w00001-s"]
    own = _marker(writer="w00000-s")
    forged = _marker(writer="w00001-s", digest=FORGED)
    store.put(forged.key, forged.to_json())  # pre-planted by someone without the key
    with pytest.raises(MissingWritersError, match=r"w00001-s.*refused.*unsigned"):
        wait_for_markers(store, 3, writers, timeout_s=0.1, poll_s=0.01, own=own, signing_key=KEY)
    genuine = _marker(writer="w00001-s")
    store.put(genuine.key, genuine.to_json(KEY))  # the real writer's marker replaces it
    got = wait_for_markers(store, 3, writers, timeout_s=1, poll_s=0.01, own=own, signing_key=KEY)
    assert got == [own, genuine]


def test_the_committer_uses_its_own_marker_from_memory_not_what_the_store_now_holds():
    store = MemoryStore()
    own = _marker(writer="w00000-s")
    tampered = _marker(writer="w00000-s", digest=FORGED)
    store.put(tampered.key, tampered.to_json(KEY))  # even a validly signed replay is not read
    (got,) = wait_for_markers(
        store, 3, ["w00000-s"], timeout_s=0.1, poll_s=0.01, own=own, signing_key=KEY
    )
    assert got.blobs == own.blobs


class RewritingStore(MemoryStore):
    """Rewrites every writer marker right after it is stored, pointing its blobs at another
    digest: what an outsider racing the committer's read-back could do."""

    def put(self, key, data):
        super().put(key, data)
        if "/writers/" in key:
            obj = json.loads(bytes(data))
            for b in obj["blobs"]:
                b["digest"] = FORGED
            super().put(key, json.dumps(obj).encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", [None, KEY])
def test_a_marker_rewritten_after_its_put_never_reaches_the_signed_manifest(tmp_path, key):
    spec, tl, rl = tiny_layouts()
    store = RewritingStore()
    trainer = TinyTrainer(spec, density=0.2)
    pub = Publisher(
        store, receiver_layout=rl, config=PublisherConfig(signing_key=key, anchor_every=100)
    )
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    for v in range(2):
        if v:
            trainer.step()
        (report,) = sync.step_published(v)
        manifest = Catalog(store, signing_key=key).manifest(v)
        assert {b.digest for b in manifest.blobs} == {b.digest for b in report.blobs}
    zeros = zero_tensors(rl, "tp1")
    rec = Receiver.for_layout(
        store,
        rl,
        "tp1",
        zeros,
        str(tmp_path / "r"),
        rconfig("r", signing_key=key),
    )
    assert rec.pull().version == 1
    assert same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp1"])
    pub.close()


def test_with_a_key_unsigned_and_forged_acks_and_registrations_do_not_count():
    store = MemoryStore()
    good = ReceiverRecord(receiver="good", shard="tp0", version=2, updated_at=time.time())
    bad = ReceiverRecord(receiver="bad", shard="tp0", version=0, updated_at=time.time())
    store.put(good.key, good.to_json(KEY))
    store.put(bad.key, bad.to_json())  # unsigned: would pin retention at version 0
    forged = dataclasses.replace(bad, receiver="forged")
    store.put(forged.key, forged.to_json(OTHER))
    ack = AckRecord(version=2, receiver="good", shard="tp0", state_digest=D, created_at=time.time())
    fake = AckRecord(version=2, receiver="bad", shard="tp0", state_digest=D, created_at=time.time())
    store.put(ack.key, ack.to_json(KEY))
    store.put(fake.key, fake.to_json())
    keyed = Catalog(store, signing_key=KEY)
    assert set(keyed.receivers()) == {"good"}
    assert set(keyed.live_receivers(60)) == {"good"}
    assert set(keyed.acks(2)) == {"good"}
    # without a key, records are advisory: all of them count
    assert set(Catalog(store).receivers()) == {"good", "bad", "forged"}


def test_a_heartbeat_dated_in_the_far_future_is_refused_and_never_live():
    now = time.time()
    future = ReceiverRecord(receiver="r", shard="tp0", version=0, updated_at=now + 10 * 365 * 86400)
    assert not future.is_live(now, ttl_s=120)
    assert ReceiverRecord(receiver="r", shard="tp0", version=0, updated_at=now + 5).is_live(
        now, ttl_s=120
    )  # a little clock skew is fresh
    with pytest.raises(ManifestError, match="in the future"):
        ReceiverRecord.from_json(future.to_json(), now=now)
    store = MemoryStore()
    store.put(future.key, future.to_json())
    assert Catalog(store).live_receivers(120) == {}
    late = AckRecord(
        version=1, receiver="r", shard="tp0", state_digest=D, created_at=now + 2 * MAX_CLOCK_SKEW_S
    )
    with pytest.raises(ManifestError, match="in the future"):
        AckRecord.from_json(late.to_json(), now=now)


HUGE = "9" * 309  # float() of it overflows


def _manifest_text(**raw: str) -> str:
    """A valid manifest's JSON with the given fields replaced by raw JSON text."""
    m = Manifest(
        version=1,
        base_version=0,
        kind="delta",
        format_version=1,
        created_at=1.0,
        writers=("w",),
        blobs=(),
        shard_digests={"tp0": D},
        run_id="run0",
        base_digests={"tp0": D},
    )
    obj = json.loads(m.to_json())
    for k in raw:
        obj[k] = f"@{k}@"
    text = json.dumps(obj)
    for k, v in raw.items():
        text = text.replace(f'"@{k}@"', v)
    return text


@pytest.mark.parametrize(
    "parse, text",
    [
        (decode_latest, '{"version":' + HUGE + "}"),
        (
            AckRecord.from_json,
            '{"version":1,"receiver":"r","shard":"tp0","state_digest":"'
            + D
            + '","created_at":'
            + HUGE
            + "}",
        ),
        (
            AckRecord.from_json,
            '{"version":1,"receiver":"r","shard":"tp0","state_digest":"'
            + D
            + '","created_at":1,"pause_s":-'
            + HUGE
            + "}",
        ),
        (
            ReceiverRecord.from_json,
            '{"receiver":"r","shard":"tp0","version":1,"updated_at":' + HUGE + "}",
        ),
        (
            ReceiverRecord.from_json,
            '{"receiver":"r","shard":"tp0","version":' + HUGE + ',"updated_at":1}',
        ),
        (WriterMarker.from_json, '{"version":1,"writer":"w","blobs":[],"created_at":1e400}'),
        (Manifest.from_json, _manifest_text(created_at=HUGE)),
        (Manifest.from_json, _manifest_text(version=HUGE)),
        (Manifest.from_json, _manifest_text(format_version="-" + HUGE)),
        (
            ReceiverRecord.from_json,
            '{"receiver":"r","shard":"tp0","version":1,"updated_at":' + "9" * 5000 + "}",
        ),
        (ReceiverRecord.from_json, '{"receiver":["r"],"shard":{},"version":1,"updated_at":1}'),
        (ReceiverRecord.from_json, "[" * 100000 + "]" * 100000),
        (AckRecord.from_json, b"\xff\xfe{}"),
    ],
)
def test_huge_integers_and_malformed_records_raise_manifest_error_not_untyped_errors(parse, text):
    with pytest.raises(ManifestError):
        parse(text)


@pytest.mark.parametrize("value", ["w00000\n", "tp0\n", "r\n"])
def test_ids_with_a_trailing_newline_fail_the_token_rule(value):
    with pytest.raises(ManifestError):
        names.check_token("writer", value)
    with pytest.raises(ManifestError):
        ReceiverRecord(receiver=value, shard="tp0", version=None, updated_at=1.0)


def test_digests_and_macs_with_a_trailing_newline_are_refused():
    with pytest.raises(ManifestError):
        AckRecord(version=1, receiver="r", shard="tp0", state_digest=D + "\n", created_at=1.0)
    rec = ReceiverRecord(receiver="r", shard="tp0", version=1, updated_at=1.0)
    obj = json.loads(rec.to_json(KEY))
    obj["mac"] += "\n"
    with pytest.raises(ManifestError):
        ReceiverRecord.from_json(json.dumps(obj), signing_key=KEY)
