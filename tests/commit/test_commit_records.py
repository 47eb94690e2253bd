"""Commit-protocol records (LATEST, writer marker, ack, receiver registration) and digests."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
import torch
import xxhash

from deltasync import names
from deltasync.commit import (
    AckRecord,
    ReceiverRecord,
    WriterMarker,
    blob_digest,
    decode_latest,
    encode_latest,
)
from deltasync.errors import ManifestError
from deltasync.layout.digest import combine_digests, state_digest, tensor_digest

from store_manifest_samples import D1, D2, blob


def test_latest_round_trips_and_rejects_garbage() -> None:
    assert decode_latest(encode_latest(12)) == 12
    assert encode_latest(12) == b'{"version":12}'
    for bad in (b"12", b'{"version":"12"}', b'{"version":-1}', b'{"version":1,"x":2}', b"\x00"):
        with pytest.raises(ManifestError):
            decode_latest(bad)


def test_a_writer_marker_round_trips_including_an_empty_one() -> None:
    marker = WriterMarker(
        version=7,
        writer="w00000",
        created_at=5.0,
        blobs=(blob(7, "tp1", "w00000"), blob(7, "tp0", "w00000")),
    )
    again = WriterMarker.from_json(marker.to_json())
    assert again == marker
    assert [b.shard for b in again.blobs] == ["tp0", "tp1"]
    assert marker.key == names.writer_marker_key(7, "w00000")
    empty = WriterMarker(version=7, writer="w00003", created_at=5.0, blobs=())
    assert WriterMarker.from_json(empty.to_json()) == empty


def test_a_writer_marker_states_its_base_and_world_size_under_its_mac() -> None:
    key = b"k" * 16
    marker = WriterMarker(
        version=7, writer="w00000", created_at=5.0, blobs=(), base_version=6, num_writers=4
    )
    signed = marker.to_json(key)
    again = WriterMarker.from_json(signed, signing_key=key)
    assert (again.base_version, again.num_writers) == (6, 4)
    anchor = WriterMarker(version=7, writer="w00000", created_at=5.0, blobs=(), base_version=-1)
    assert WriterMarker.from_json(anchor.to_json()).base_version == -1
    d = json.loads(signed)
    d["base_version"] = -1  # a co-writer without the key turns the delta into an anchor
    with pytest.raises(ManifestError):
        WriterMarker.from_json(json.dumps(d), signing_key=key)
    for bad in (dict(base_version=7), dict(base_version=-2), dict(num_writers=0)):
        with pytest.raises(ManifestError):
            WriterMarker(version=7, writer="w00000", created_at=5.0, blobs=(), **bad)


def test_a_writer_marker_cannot_vouch_for_another_writers_or_versions_blobs() -> None:
    with pytest.raises(ManifestError, match="of writer"):
        WriterMarker(version=7, writer="w00000", created_at=0.0, blobs=(blob(7, "tp0", "w00001"),))
    d = json.loads(
        WriterMarker(
            version=7, writer="w00000", created_at=0.0, blobs=(blob(7, "tp0", "w00000"),)
        ).to_json()
    )
    d["version"] = 8
    with pytest.raises(ManifestError, match="is not the key"):
        WriterMarker.from_json(json.dumps(d))
    d["version"] = 7
    d["blobs"][0]["key"] = "../v00000007/tp0/w00000.blob"
    with pytest.raises(ManifestError, match="is not the key"):
        WriterMarker.from_json(json.dumps(d))


def test_an_ack_round_trips_and_rejects_bad_digests_and_names() -> None:
    ack = AckRecord(
        version=7,
        receiver="rcv-0",
        shard="tp0",
        state_digest=D1,
        created_at=3.5,
        pause_s=0.01,
        total_s=0.2,
    )
    assert AckRecord.from_json(ack.to_json()) == ack
    assert ack.key == names.ack_key(7, "rcv-0")
    bare = AckRecord(version=7, receiver="rcv-0", shard="tp0", state_digest=D2, created_at=3.5)
    assert AckRecord.from_json(bare.to_json()) == bare
    d = json.loads(ack.to_json())
    for field, value in (
        ("state_digest", "abc"),
        ("receiver", "../x"),
        ("pause_s", -1),
        ("total_s", float("nan")),
        ("Surprise", 1),  # a later release's field is named as ours are
        ("mac2 ", 1),
    ):
        bad = dict(d, **{field: value})
        with pytest.raises(ManifestError):
            AckRecord.from_json(json.dumps(bad))


def test_a_receiver_record_round_trips_and_knows_whether_it_is_live() -> None:
    fresh = ReceiverRecord(receiver="rcv-1", shard="tp1", version=None, updated_at=100.0)
    assert ReceiverRecord.from_json(fresh.to_json()) == fresh
    rec = ReceiverRecord(receiver="rcv-1", shard="tp1", version=9, updated_at=100.0)
    assert ReceiverRecord.from_json(rec.to_json()) == rec
    assert rec.key == names.receiver_key("rcv-1")
    assert rec.is_live(now=130.0, ttl_s=30.0)
    assert not rec.is_live(now=130.5, ttl_s=30.0)
    with pytest.raises(ManifestError):
        ReceiverRecord.from_json(b'{"receiver":"r","shard":"tp0","version":true,"updated_at":1}')


def test_acks_and_registrations_carry_their_lineage_under_the_mac() -> None:
    key = b"k" * 32
    ack = AckRecord(
        version=4, receiver="r", shard="tp0", state_digest=D1, created_at=1.0, run_id="run-a"
    )
    rec = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0, run_id="run-a")
    for record, cls in ((ack, AckRecord), (rec, ReceiverRecord)):
        signed = record.to_json(key)
        assert cls.from_json(signed, signing_key=key).run_id == "run-a"
        forged = signed.replace(b"run-a", b"run-b")  # the lineage is signed with the rest
        with pytest.raises(ManifestError):
            cls.from_json(forged, signing_key=key)
        d = json.loads(record.to_json())
        with pytest.raises(ManifestError):
            cls.from_json(json.dumps(dict(d, run_id=7)))
        with pytest.raises(ManifestError):
            cls.from_json(json.dumps(dict(d, run_id="../x")))
    # records written before lineages were recorded in them still parse, without one
    assert (
        b"run_id"
        not in ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0).to_json()
    )


def test_a_registration_carries_the_engine_request_it_was_written_for_under_the_mac() -> None:
    key = b"k" * 32
    rec = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0, request="req-a")
    signed = rec.to_json(key)
    assert ReceiverRecord.from_json(signed, signing_key=key) == rec
    with pytest.raises(ManifestError):  # a registration of another request is not made
        ReceiverRecord.from_json(signed.replace(b"req-a", b"req-b"), signing_key=key)
    d = json.loads(rec.to_json())
    for bad in (7, "../x", ""):
        with pytest.raises(ManifestError, match="request"):
            ReceiverRecord.from_json(json.dumps(dict(d, request=bad)))
    # registrations of receivers no engine request reached name none, as before requests
    legacy = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0)
    assert b"request" not in legacy.to_json()
    assert ReceiverRecord.from_json(legacy.to_json()).request is None


@pytest.mark.parametrize("cls", [AckRecord, ReceiverRecord])
def test_fields_of_a_later_release_are_kept_under_the_mac_and_ignored(cls) -> None:
    # A registration that a later release's receiver wrote with a new field was refused, so
    # every reader of this release counted that receiver as absent (and retention stopped
    # keeping what it holds).
    key = b"k" * 32
    if cls is AckRecord:
        record = AckRecord(version=4, receiver="r", shard="tp0", state_digest=D1, created_at=1.0)
    else:
        record = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0)
    later = {"engine_epoch": 3, "notes": {"a": [1, 2]}}
    newer = replace(record, later=later)
    signed = newer.to_json(key)
    read = cls.from_json(signed, signing_key=key)
    assert read == record and read.version == 4 and read.later == later
    assert read.to_json(key) == signed  # written again as read, MAC and all
    with pytest.raises(ManifestError):  # the later fields are signed with the rest
        cls.from_json(signed.replace(b'"engine_epoch":3', b'"engine_epoch":4'), signing_key=key)
    with pytest.raises(ManifestError):  # a record's own field is never a later one
        replace(record, later={"version": 5})
    with pytest.raises(ManifestError, match="at most 16"):
        cls.from_json(
            json.dumps(dict(json.loads(record.to_json()), **{f"f{i}": i for i in range(17)}))
        )


@pytest.mark.parametrize("cls", [AckRecord, ReceiverRecord])
@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_a_later_field_canonical_json_cannot_write_is_a_malformed_record(cls, key) -> None:
    # The later fields are written again for the MAC: 1e999 parses as inf, and nesting just
    # under the parser's depth limit parses, but canonical JSON writes neither. That raised
    # ValueError / RecursionError out of from_json, past the readers that skip malformed
    # records (Catalog.receiver, Catalog.acks), instead of a ManifestError.
    if cls is AckRecord:
        record = AckRecord(version=4, receiver="r", shard="tp0", state_digest=D1, created_at=1.0)
    else:
        record = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0)
    good = record.to_json(key).decode()
    bad = ["1e999", "-1e999"] + ["[" * d + "]" * d for d in range(900, 1001)]
    for value in bad:
        try:
            cls.from_json(good[:-1] + ',"zz":' + value + "}", signing_key=key)
        except ManifestError:
            pass
    with pytest.raises(ManifestError, match="canonical JSON"):
        replace(record, later={"zz": float("inf")})


def test_a_registration_names_the_anchor_it_restores_under_the_mac() -> None:
    key = b"k" * 32
    rec = ReceiverRecord(
        receiver="r",
        shard="tp0",
        version=None,
        updated_at=1.0,
        restoring=8,
        restoring_run_id="run-a",
    )
    signed = rec.to_json(key)
    read = ReceiverRecord.from_json(signed, signing_key=key)
    assert read == rec and (read.restoring, read.restoring_run_id) == (8, "run-a")
    assert read.later == {} and read.to_json(key) == signed
    assert read.restoring_in("run-a") == 8
    assert read.restoring_in("run-b") is None  # another lineage's anchor is nothing of this one
    # the anchor is signed with the rest: a forged one would pin versions in its place
    for old, new in ((b'"restoring":8', b'"restoring":4'), (b"run-a", b"run-b")):
        with pytest.raises(ManifestError):
            ReceiverRecord.from_json(signed.replace(old, new), signing_key=key)
    d = json.loads(rec.to_json())
    for bad in (
        dict(d, restoring=-1),
        dict(d, restoring=True),
        dict(d, restoring_run_id=7),
        dict(d, restoring_run_id="../x"),
        {k: v for k, v in d.items() if k != "restoring_run_id"},  # both or neither
        {k: v for k, v in d.items() if k != "restoring"},
    ):
        with pytest.raises(ManifestError, match="restoring"):
            ReceiverRecord.from_json(json.dumps(bad))
    # a registration restoring nothing writes neither field, as before them
    plain = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0)
    assert b"restoring" not in plain.to_json() and plain.restoring_in("run-a") is None
    # beside a version held (of another lineage, which no delta builds on)
    both = replace(plain, run_id="run-a", restoring=8, restoring_run_id="run-b")
    assert ReceiverRecord.from_json(both.to_json(key), signing_key=key) == both


def test_a_reader_that_does_not_know_the_restoring_fields_keeps_them_under_the_mac() -> None:
    # What this release's reader was before the fields: they are two of a later release's,
    # kept in ``later``, verified with the rest and ignored (retention of that release keeps
    # only the newest anchor's chain for the receiver, as it always did).
    class Before(ReceiverRecord):
        FIELDS = ReceiverRecord.FIELDS - {"restoring", "restoring_run_id"}

    key = b"k" * 32
    rec = ReceiverRecord(
        receiver="r", shard="tp0", version=None, updated_at=1.0, restoring=8, restoring_run_id="a"
    )
    signed = rec.to_json(key)
    read = Before.from_json(signed, signing_key=key)
    assert read.restoring is None and read.later == {"restoring": 8, "restoring_run_id": "a"}
    assert read.version is None and read.to_json(key) == signed


def test_a_registration_holds_a_version_only_of_its_own_lineage() -> None:
    rec = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0, run_id="run-a")
    assert rec.version_in("run-a") == 4
    assert rec.version_in("run-b") is None  # the old lineage's v4 is nothing of the new one
    legacy = ReceiverRecord(receiver="r", shard="tp0", version=4, updated_at=1.0)
    assert legacy.version_in("run-b") == 4  # no lineage recorded: taken at its word


# --- digests --------------------------------------------------------------------------------


def test_blob_digest_is_the_hex_blake2b_256_of_the_bytes() -> None:
    assert blob_digest(b"hello") == hashlib.blake2b(b"hello", digest_size=32).hexdigest()
    assert len(blob_digest(b"")) == 64


def test_state_digest_pins_its_definition_on_a_tiny_state() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    inner = xxhash.xxh3_128(t.numpy().tobytes()).digest()
    h = xxhash.xxh3_128()
    h.update((1).to_bytes(4, "little") + b"t")
    h.update((5).to_bytes(4, "little") + b"int16")
    h.update((2).to_bytes(4, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little"))
    h.update(inner)
    assert state_digest({"t": t}) == h.hexdigest()
    assert tensor_digest(t) == inner


def test_state_digest_is_independent_of_mapping_order_and_memory_layout() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    b = torch.randn(17, generator=g).to(torch.bfloat16)
    d = state_digest({"a": a, "b": b})
    assert state_digest({"b": b, "a": a}) == d
    strided = a.t().contiguous().t()  # same values, column-major storage
    assert not strided.is_contiguous()
    assert state_digest({"a": strided, "b": b}) == d
    parts = [
        ("a", "bfloat16", (64, 48), tensor_digest(a)),
        ("b", "bfloat16", (17,), tensor_digest(b)),
    ]
    assert combine_digests(reversed(parts)) == d


def test_state_digest_sees_one_flipped_bit_including_the_sign_of_zero() -> None:
    a = torch.zeros(1000, dtype=torch.bfloat16)
    d = state_digest({"a": a})
    neg = a.clone()
    neg[123] = -0.0  # equal as floats, different bits
    assert torch.equal(neg, a) and state_digest({"a": neg}) != d
    flipped = a.clone()
    flipped.view(torch.int16)[999] ^= 1
    assert state_digest({"a": flipped}) != d


def test_state_digest_covers_names_dtypes_and_shapes_not_just_bytes() -> None:
    x = torch.arange(12, dtype=torch.int16)
    d = state_digest({"x": x})
    assert state_digest({"y": x}) != d
    assert state_digest({"x": x.view(3, 4)}) != d
    assert state_digest({"x": x.view(torch.bfloat16)}) != d
    assert state_digest({"x": x, "e": torch.empty(0)}) != d
    with pytest.raises(ManifestError, match="twice"):
        combine_digests([("x", "int16", (12,), tensor_digest(x))] * 2)
