"""Calls on a receiver while its pull scatters: the tensors are torn then (the pull withdrew
the registration before its first write), so the receiver reports no version meanwhile and
nothing may register the version before it or touch the records the pull is about to write,
from another thread or from the pull's own callbacks."""

from __future__ import annotations

import threading

import pytest
from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors

from deltasync import MemoryStore, Receiver, names
from deltasync.commit import ReceiverRecord
from deltasync.errors import ConfigError

SHARD = "tp0"


def _registered(store) -> int | None:
    return ReceiverRecord.from_json(store.get(names.receiver_key("rec"))).version


def _from_another_thread(call):
    """``call()`` on a thread of its own: what it returned or raised."""
    out = {}

    def run():
        try:
            out["returned"] = call()
        except Exception as exc:  # judged by the test
            out["raised"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    return out


@pytest.mark.timeout(60)
def test_a_heartbeat_and_a_deregister_mid_scatter_leave_the_registration_withdrawn(tmp_path):
    # The heartbeat re-registered version 0 over the torn tensors (a kill then left a torn
    # receiver counted as holding it for the whole TTL).
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, SHARD)
    seen = []

    def mid_scatter(_name):
        if seen:
            return
        seen.append(_registered(store))
        seen.append(_from_another_thread(lambda: rec.heartbeat()))
        seen.append(_from_another_thread(lambda: rec.deregister()))
        seen.append((rec.version, rec.dirty, rec.heartbeat()))  # this thread: the callback's
        seen.append(_registered(store))

    rec = Receiver.for_layout(
        store,
        rl,
        SHARD,
        tensors,
        str(tmp_path / "rec"),
        rconfig("rec"),
        on_tensor_written=mid_scatter,
    )
    assert rec.pull().version == 0
    seen.clear()
    assert _registered(store) == 0
    publish_edit(pub, params, 1, 7)
    assert rec.pull().version == 1
    before, beat, dereg, here, after = seen
    assert before is None and after is None, seen
    assert here == (None, True, True), here  # torn: no version, and registered as none
    assert beat == {"returned": False}, beat
    assert isinstance(dereg.get("raised"), ConfigError), dereg
    assert "while another thread's pull" in str(dereg["raised"])
    assert _registered(store) == 1
    assert rec.heartbeat() is True  # no call beside it: written
    assert_same_bits(tensors, rl.split(tl.to_canonical(params))[SHARD])
