"""An object with fields this release refuses is named by those fields (docs/storage.md: every
violation raises ManifestError naming the field), never as "a JSON list"."""

from __future__ import annotations

import json

import pytest

from deltasync.commit.records import AckRecord, ReceiverRecord, decode_latest
from deltasync.errors import ManifestError


def test_latest_with_an_unknown_field_names_that_field():
    with pytest.raises(ManifestError, match="'bogus_field'"):
        decode_latest(b'{"bogus_field":1,"version":5}')


def test_an_ack_with_too_many_later_fields_names_them():
    obj = {"version": 1, "receiver": "r", "shard": "tp0", "state_digest": "0" * 32}
    obj |= {"created_at": 1.0} | {f"f{i:02d}": i for i in range(17)}
    with pytest.raises(ManifestError) as info:
        AckRecord.from_json(json.dumps(obj))
    assert "'f00'" in str(info.value) and "and 9 more" in str(info.value)


def test_a_registration_with_a_later_field_that_canonical_json_cannot_write_names_it():
    obj = {"receiver": "r", "shard": "tp0", "version": None, "updated_at": 1.0}
    data = json.dumps(obj)[:-1] + ', "huge_number": 1e999}'
    with pytest.raises(ManifestError, match="'huge_number'"):
        ReceiverRecord.from_json(data)


def test_a_hostile_number_of_unknown_fields_is_named_in_a_bounded_message():
    obj = {f"x{i:05d}": i for i in range(200)} | {"version": 1}
    with pytest.raises(ManifestError) as info:
        decode_latest(json.dumps(obj).encode())
    assert "'x00000'" in str(info.value) and "and 192 more" in str(info.value)
