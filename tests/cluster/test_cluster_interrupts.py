"""A Ctrl-C on the overlapped in-cluster sender's thread right after the tracker's ``clear()``:
the version's changes must stay in the carry (else the retry misses them) and the background
must not wait forever for a capture that ended (else every rank hangs in the exchange)."""

from __future__ import annotations

import pytest
from overlap_testkit import run_commit_interrupted, run_interrupted, run_preflight_interrupted

from deltasync.exchange import spawn

from cluster_testkit import Setup


@pytest.mark.timeout(180)
def test_a_ctrl_c_right_after_clear_fails_the_version_everywhere_and_the_retry_is_exact():
    writer, *receivers = spawn(run_interrupted, 3, Setup(timeout_s=5.0), False, timeout_s=150)
    assert writer["interrupted"]
    failed = writer["failed"]
    assert failed["error"] == "SendFailedError" and failed["version"] == 1, failed
    assert "KeyboardInterrupt" in failed["message"], failed  # what stopped it, named
    assert failed["version_after"] == 0  # nothing committed
    assert writer["retry"]["version"] == 1 and writer["retry"]["elements"] > 0
    for r in receivers:
        assert r["failed"]["error"] is not None and r["failed"]["version_after"] == 0, r
        assert r["versions"] == {0: [], 1: []}  # bit-exact, nothing mismatched


@pytest.mark.timeout(180)
def test_a_ctrl_c_right_after_an_anchors_clear_makes_the_retry_an_anchor():
    writer, *receivers = spawn(run_interrupted, 3, Setup(timeout_s=5.0), True, timeout_s=150)
    assert writer["interrupted"]
    assert writer["failed"]["error"] is None  # nothing was sent: nothing in flight
    assert writer["failed"]["version_after"] == 0
    assert writer["retry"]["version"] == 1 and writer["retry"]["anchor"], writer["retry"]
    for r in receivers:
        assert r["versions"] == {0: [], 1: []}, r  # bit-exact, nothing mismatched


@pytest.mark.timeout(180)
def test_a_ctrl_c_after_the_joint_commit_retires_the_number_the_receivers_hold():
    # The writer retired a version's number only on an ExchangeError: interrupted once every
    # rank had the verdict, it sent the number 2 again (refused: the receivers hold 2) and its
    # errors' remedies never committed again.
    setup = Setup(timeout_s=5.0, inline_below=(1 << 18,))
    writer, *receivers = spawn(run_commit_interrupted, 3, setup, timeout_s=150)
    assert writer["interrupted"], writer
    assert writer["failed"]["group_broken"] is True, writer["failed"]
    assert writer["attempts"][-1] == ("ok", 3), writer["attempts"]
    assert writer["version"] == 3
    for r in receivers:
        assert r["versions"][:3] == [0, 1, 2] and r["versions"][-1] == 3, r
        assert r["mismatched"] == [], r


@pytest.mark.timeout(180)
def test_a_ctrl_c_inside_the_versions_collectives_breaks_the_writers_group():
    # Interrupted after the preflight, the writer kept its group ("call sync again on every
    # rank"): its next preflight met the receivers' round 1 and gloo aborted a receiver.
    setup = Setup(timeout_s=5.0, inline_below=(1 << 18,))
    writer, *receivers = spawn(run_preflight_interrupted, 3, setup, timeout_s=150)
    assert writer["interrupted"], writer
    assert writer["failed"]["group_broken"] is True, writer["failed"]
    assert "use_group" in writer["failed"]["message"], writer["failed"]
    assert "process group broke" in writer["after"]["message"], writer["after"]
    for r in receivers:
        assert r["stalled"]["exchange_error"] and r["version"] == 1, r
        assert "process group broke" in r["after"]["message"], r
