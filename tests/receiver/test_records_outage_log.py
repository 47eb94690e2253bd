"""A store that refuses the receiver's records (full, down) for many pulls: the first failed
write of each record is a warning, the repeats are not (one warning a pull buried the line an
operator needs), a reminder with the count comes once a minute, and the first write after the
outage says how many failed. The pulls themselves go on, exact."""

from __future__ import annotations

import logging

import pytest
from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors

from deltasync import MemoryStore, Receiver, names
from deltasync.errors import StoreError
from deltasync.receiver import store_receiver

SHARD = "tp0"
LOGGER = "deltasync.receiver.store_receiver"


class RecordsRefused(MemoryStore):
    """A store whose writes of acks (``acks_full``) and registrations (``registrations_full``)
    fail as on a full disk."""

    acks_full = registrations_full = False

    def put(self, key, data):
        refused = self.registrations_full and key.startswith(names.RECEIVERS_PREFIX)
        if refused or (self.acks_full and key.startswith("acks/")):
            raise StoreError(f"cannot write {key!r}: No space left on device")
        super().put(key, data)


def _records_lines(caplog, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == level and "written" in r.getMessage()
    ]


def _receiver_beside_a_full_store(tmp_path):
    store = RecordsRefused()
    tl, rl, params, pub = anchored_bf16(store, seed=5)
    tensors = zero_tensors(rl, SHARD)
    rec = Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "rec"), rconfig("rec"))
    assert rec.pull().version == 0
    assert names.ack_key(1, "rec").startswith("acks/")  # what RecordsRefused refuses
    return store, tl, rl, params, pub, tensors, rec


def test_refused_acks_warn_once_and_the_first_written_after_says_how_many_failed(tmp_path, caplog):
    store, tl, rl, params, pub, tensors, rec = _receiver_beside_a_full_store(tmp_path)
    store.acks_full = True
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for v in range(1, 7):
            publish_edit(pub, params, v, 5 + v)
            assert rec.pull().version == v
            assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])
        warnings = _records_lines(caplog, logging.WARNING)
        # one for the outage, not one per pull (6 here before)
        assert len(warnings) == 1 and "version 1: ack not written" in warnings[0], warnings
        assert len(_records_lines(caplog, logging.DEBUG)) == 5
        caplog.clear()
        store.acks_full = False
        publish_edit(pub, params, 7, 13)
        assert rec.pull().version == 7
    back = _records_lines(caplog, logging.INFO)
    assert any("ack written again after 6 failed writes" in b for b in back), back
    assert not _records_lines(caplog, logging.WARNING)
    assert store.exists(names.ack_key(7, "rec"))


def test_refused_registrations_fail_each_pull_with_the_cause_and_warn_once(tmp_path, caplog):
    store, tl, rl, params, pub, tensors, rec = _receiver_beside_a_full_store(tmp_path)
    v0 = rl.split(tl.to_canonical(params))[SHARD]
    store.registrations_full = store.acks_full = True
    publish_edit(pub, params, 1, 9)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(5):
            # its registration names version 0 and cannot be withdrawn: nothing is written,
            # and the error carries the store's reason (it pointed at a warning before)
            with pytest.raises(StoreError, match=r"No space left on device\); nothing was written"):
                rec.pull()
            assert_same_bits(tensors, v0, "nothing written")
            assert rec.version == 0
        warnings = _records_lines(caplog, logging.WARNING)
        assert len(warnings) == 1 and "registration not written" in warnings[0], warnings
        caplog.clear()
        store.registrations_full = store.acks_full = False
        assert rec.pull().version == 1
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])
    back = _records_lines(caplog, logging.INFO)
    assert any("registration written again after" in b for b in back), back


def test_an_outage_longer_than_the_reminder_warns_again_with_the_count(
    tmp_path, caplog, monkeypatch
):
    store, _, _, params, pub, _, rec = _receiver_beside_a_full_store(tmp_path)
    monkeypatch.setattr(store_receiver._Outage, "REMIND_S", 0.0)
    store.acks_full = True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for v in range(1, 4):
            publish_edit(pub, params, v, 5 + v)
            assert rec.pull().version == v
    warnings = _records_lines(caplog, logging.WARNING)
    assert len(warnings) == 3, warnings
    assert "(3 failed writes so far)" in warnings[2], warnings
