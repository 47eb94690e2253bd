"""A parameter written in place while an overlapped in-cluster version still reads it (after
``sync`` returned, before the next optimizer step: against the sender's contract), in real
gloo processes: the version is refused on every rank before anything is applied, naming the
parameter, and the retry sends it in full and is bit-exact (int16 views against a dense
split). Once with detection after the return (the tracker holds the steps: its ``clear()``
comes after the write, so only the sender's mark makes the retry whole), once with detection
before it and the background's read after the write."""

from __future__ import annotations

import pytest
from overlap_testkit import run_edit

from deltasync.exchange import spawn

from cluster_testkit import Setup

HELD = Setup(timeout_s=5.0, digest_every=1, detect_after_return=True)
BEFORE = Setup(timeout_s=5.0, digest_every=1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setup", [HELD, BEFORE], ids=["detected-after", "detected-before"])
def test_a_write_while_the_version_reads_refuses_it_everywhere_and_the_retry_is_exact(setup):
    writer, *receivers = spawn(run_edit, 3, setup, timeout_s=150)
    victim = writer["victim"]
    edited = writer["failed"]
    assert edited["error"] == "SendFailedError" and edited["version"] == 1
    assert "ParamsEditedError" in edited["message"] and repr(victim) in edited["message"]
    assert edited["version_after"] == 0  # nothing committed
    assert writer["marked"] == [victim]  # sent in full with the retry
    assert writer["retry"]["version"] == 1
    for r in receivers:
        assert r["failed"]["error"] == "PeerFailedError", r["failed"]
        assert "written in place" in r["failed"]["message"]
        assert r["failed"]["version_after"] == 0
        assert r["versions"] == {0: [], 1: []}  # bit-exact, nothing mismatched
