"""The overlapped in-cluster sender in real gloo processes: ``sync`` returns before the
exchange is done, the optimizer's next step waits for the background's last read of the params,
a failed joint commit or a receiver SIGKILLed during a background version surfaces at the next
call naming that version, and the carry makes the retry bit-exact (int16 views against a dense
split). State digests are on, as by default."""

from __future__ import annotations

import pickle

import pytest
from kit import TINY_QWEN3, HFTrainer, spy_digest_pass
from overlap_testkit import DEATH_AFTER_S, LATE_S, SLOW_READ_S, STREAMED_BELOW, run_overlap

from deltasync import ClusterSender, ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.cluster import RolePlan
from deltasync.errors import ConfigError
from deltasync.exchange import spawn
from deltasync.trainer import AdamWTracker

from cluster_testkit import Setup

SETUP = Setup(timeout_s=3.0, digest_every=1)
# Deltas streamed in parts of 1 KiB (ClusterConfig.part_bytes): dozens of exchanges a version;
# and the tracker holds the optimizer's steps, so detection goes on after sync returns.
IN_PARTS = Setup(timeout_s=3.0, digest_every=1, part_bytes=1024, detect_after_return=True)


@pytest.fixture(scope="module", params=[SETUP, IN_PARTS], ids=["one-part", "in-parts"])
def overlap(request, tmp_path_factory) -> list[dict]:
    notes = tmp_path_factory.mktemp("overlap") / "rank2.pickle"
    results = spawn(run_overlap, 3, request.param, str(notes), timeout_s=120, may_die={2})
    assert results[2] is None  # the receiver really died in version 8
    with open(notes, "rb") as f:
        results[2] = pickle.load(f)
    results[0]["setup"] = request.param
    return results


@pytest.mark.timeout(180)
def test_a_delta_goes_in_one_exchange_or_streamed_in_parts_as_configured(overlap) -> None:
    writer = overlap[0]
    exchanges = [writer["versions"][v]["exchanges"] for v in (1, 2, 3, 4, 5, 7)]
    if writer["setup"].part_bytes == IN_PARTS.part_bytes:
        assert min(exchanges) > 5, exchanges
    else:
        assert exchanges == [1] * 6
    assert writer["versions"][0]["exchanges"] == 1  # an anchor is never streamed


@pytest.mark.timeout(180)
def test_sync_returns_once_the_changes_are_captured_before_the_exchange_is_done(overlap) -> None:
    writer = overlap[0]
    assert writer["returned_before_done"] == [True, True, True]
    # held by the tracker, sync returns before detection has ended (else after it)
    detect_after = writer["setup"].detect_after_return
    assert writer["returned_before_detected"] == [detect_after] * 3
    # the receivers arrived LATE_S after the trainer: sync did not wait for them
    assert max(writer["captured_s"]) < LATE_S
    for v in (1, 2, 3):
        rep = writer["versions"][v]
        assert rep["overlapped"] and rep["stall_s"] < rep["total_s"]
        assert rep["elements"] > 0 and rep["version_after"] == v


@pytest.mark.timeout(180)
def test_every_committed_version_is_bit_exact_on_both_receivers(overlap) -> None:
    for r in overlap[1:]:
        assert r["bad"] == []
        assert r["versions"] == {v: True for v in (0, 1, 2, 3, 4, 5, 7)}


@pytest.mark.timeout(180)
def test_the_optimizer_step_waits_until_the_background_no_longer_reads_the_params(
    overlap,
) -> None:
    barrier = overlap[0]["barrier"]
    assert barrier["step_saw_released"] == [True]
    # the group could not be swapped under the version in flight
    refused = overlap[0]["use_group_in_flight"]
    assert refused["error"] == "ConfigError"
    assert "version 4 is in flight on the current group" in refused["message"]
    # it waited (the forward/backward before the step is far shorter than the slowed read)
    assert barrier["barrier_wait_s"] > SLOW_READ_S / 10


@pytest.mark.timeout(180)
def test_a_detection_failure_midway_fails_the_version_on_every_rank_and_the_resend_is_exact(
    overlap,
) -> None:
    writer = overlap[0]
    failed = writer["detection_failed"]
    assert failed["error"] == "SendFailedError" and failed["version"] == 5
    assert "detection failed on purpose midway" in failed["message"]
    assert failed["version_after"] == 4  # nothing committed
    for rank in (1, 2):
        got = overlap[rank]["detection_failed"]
        assert got["error"] == "PeerFailedError", got
        assert "detection failed on purpose midway" in got["message"]
        assert got["version_after"] == 4
        assert overlap[rank]["versions"][5] is True  # the resend
    assert writer["versions"][5]["version_after"] == 5


@pytest.mark.timeout(180)
def test_a_failed_joint_commit_surfaces_at_the_next_sync_naming_the_version(overlap) -> None:
    writer = overlap[0]
    failure = writer["after_failure"]
    assert failure["error"] == "SendFailedError" and failure["version"] == 6
    assert "version 6 did not commit" in failure["message"]
    assert "DigestMismatchError" in failure["message"]  # rank 2's own error, as gathered
    assert failure["cause"] == "SyncAbortedError"
    assert not failure["group_broken"] and not failure["anchor_required"]
    assert failure["version_after"] == 5  # the baseline did not move
    assert writer["pending_after_6"] > 0  # the carry: 6's positions
    assert overlap[2]["corrupted"] == {"error": "DigestMismatchError", "version_after": 5}
    assert overlap[1]["corrupted"] == {"error": "SyncAbortedError", "version_after": None}


@pytest.mark.timeout(180)
def test_the_retry_carries_the_failed_version_and_is_exact_where_it_was_never_applied(
    overlap,
) -> None:
    assert overlap[0]["versions"][7]["version_after"] == 7
    # rank 2 refused 6 and the tracker was cleared at 6's capture: only the carry repairs it
    assert overlap[2]["versions"][7] is True
    assert overlap[1]["versions"][7] is True  # it held 6's attempt


@pytest.mark.timeout(180)
def test_the_capture_holds_positions_only_about_one_byte_per_changed_element(overlap) -> None:
    writer = overlap[0]
    # versions 1-9 were captured; the tracker was never asked for its values
    assert writer["tracker_calls"]["iter_changes"] == writer["tracker_calls"]["iter_changed"] == 0
    assert writer["tracker_calls"]["iter_positions"] >= 6
    for elements, nbytes in writer["carry"]:  # int32 indices would be 4, with BF16 values 6
        assert elements > 0 and nbytes <= 1.2 * elements
    assert 0 < writer["carry_bytes_after_6"] <= 1.2 * writer["pending_after_6"]


@pytest.mark.timeout(180)
def test_a_receiver_killed_during_a_background_version_surfaces_at_the_next_call(overlap) -> None:
    writer = overlap[0]
    assert writer["kill_returned_before_done"]
    failure = writer["after_kill"]
    assert failure["error"] == "SendFailedError" and failure["version"] == 8, failure
    assert failure["group_broken"]
    assert "re-create the group" in failure["message"]
    for role in (writer, overlap[1]):  # without use_group: refused before any collective
        again = role["same_group"]
        assert again["error"] == "ExchangeError" and "use_group()" in again["message"], again
        assert again["elapsed_s"] < 1.0
    assert failure["elapsed_s"] < DEATH_AFTER_S + SETUP.timeout_s + 3.0
    assert failure["version_after"] == 7
    if writer["setup"].part_bytes < STREAMED_BELOW:  # a delta, killed amid its parts
        assert not failure["anchor_required"]
        assert writer["pending_after_kill"] > 0  # its positions go out with the retry
    else:  # an anchor attempt makes the retry an anchor
        assert failure["anchor_required"]
    survivor = overlap[1]["killed"]
    assert survivor["exchange_error"], survivor


def _one_writer(trainer: HFTrainer, **kw) -> ClusterSender:
    """A single-process overlapped ClusterSender over ``trainer`` (construction only)."""
    spec = ModelSpec.from_hf_config(TINY_QWEN3)
    return ClusterSender(
        AdamWTracker(trainer.opt, trainer.model.named_parameters()),
        trainer.params,
        plan=RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"]),
        trainer_layout=TrainerLayout(spec),
        receiver_layout=ReceiverLayout.build(spec, "vllm", tp=2),
        version=None,
        rank=0,
        overlap=True,
        **kw,
    )


def test_overlap_needs_the_optimizer_whose_step_is_the_barrier() -> None:
    with pytest.raises(ConfigError, match="optimizer is required with overlap=True"):
        _one_writer(HFTrainer())


def test_detection_stays_on_the_callers_thread_unless_the_tracker_holds_the_steps() -> None:
    trainer = HFTrainer()
    held = _one_writer(trainer, optimizer=trainer.opt)
    kept = _one_writer(trainer, optimizer=trainer.opt, detect_in_background=False)
    assert held._background.held and not kept._background.held
    held.close()
    kept.close()
    with pytest.raises(ConfigError, match="detect_in_background must be a bool"):
        _one_writer(trainer, optimizer=trainer.opt, detect_in_background="yes")


def test_expect_small_must_be_a_bool_and_means_nothing_when_every_version_is_backgrounded() -> None:
    trainer = HFTrainer()
    told = _one_writer(trainer, optimizer=trainer.opt, expect_small=True)
    assert told._expect_small
    told.close()
    always = _one_writer(trainer, optimizer=trainer.opt, expect_small=True, inline_below=0)
    assert not always._expect_small  # inline_below=0: every version in the background
    always.close()
    with pytest.raises(ConfigError, match="expect_small must be a bool"):
        _one_writer(trainer, optimizer=trainer.opt, expect_small=1)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_inline_below_must_be_a_non_negative_int(bad) -> None:
    trainer = HFTrainer()
    with pytest.raises(ConfigError, match="inline_below must be a non-negative int"):
        _one_writer(trainer, optimizer=trainer.opt, inline_below=bad)


def test_digests_in_detection_is_the_configs_switch_for_the_feed() -> None:
    from deltasync import ClusterConfig

    trainer = HFTrainer()
    fed = _one_writer(trainer, optimizer=trainer.opt)
    params = trainer.params() if callable(trainer.params) else trainer.params
    assert fed._digest_feed(1, params) is not None  # one writer, digests due, a capable tracker
    fed.close()
    off = _one_writer(
        trainer, optimizer=trainer.opt, config=ClusterConfig(digests_in_detection=False)
    )
    assert off._digest_feed(1, params) is None
    off.close()
    none_due = _one_writer(trainer, optimizer=trainer.opt, config=ClusterConfig(digest_every=0))
    assert none_due._digest_feed(1, params) is None
    none_due.close()
    with pytest.raises(ConfigError, match="digests_in_detection must be a bool"):
        ClusterConfig(digests_in_detection="yes")


def test_the_inline_and_unoverlapped_payloads_hash_their_digests_in_detection(monkeypatch) -> None:
    # payloads_for_version (the sender without overlap, the inline path after a small delta):
    # the detection stream feeds every receiver tensor, and the digest pass after it is given
    # all of them (reads no parameter); the digests are the pass's own.
    import deltasync.cluster.cluster_sender as sender_mod
    from deltasync.layout.digest import state_digests

    given = spy_digest_pass(monkeypatch, sender_mod)
    digested: list[dict] = []
    digests_ = ClusterSender._digests

    def recording(self, params, fed=None):
        got = digests_(self, params, fed)
        digested.append(got[0])
        return got

    monkeypatch.setattr(ClusterSender, "_digests", recording)
    trainer = HFTrainer()
    spec = ModelSpec.from_hf_config(TINY_QWEN3)
    tl, rl = TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", tp=2)
    sender = ClusterSender(
        AdamWTracker(trainer.opt, trainer.model.named_parameters()),
        trainer.params,
        plan=RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"]),
        trainer_layout=tl,
        receiver_layout=rl,
        version=0,
        rank=0,
    )
    trainer.step()
    out = sender.payloads_for_version(1)
    tensors = sum(len(rl.local_specs(s.id)) for s in rl.shards())
    assert given == [tensors]  # every tensor given: nothing for the pass to read
    truth = state_digests(
        {n: p.detach() for n, p in trainer.params.items()}, trainer_layout=tl, receiver_layout=rl
    )
    assert digested == [truth]
    assert sum(out.shard_elements.values()) > 0
    # after a small delta (what sync records at a commit) the pass runs beside detection
    sender._expect_small = True
    given.clear()
    sender.payloads_for_version(1)
    assert given == [0] and digested[-1] == truth
    sender.close()


@pytest.mark.timeout(180)
def test_the_groups_store_holds_only_the_marks_of_the_version_every_rank_runs(overlap) -> None:
    # Each of the 3 ranks leaves an arrival mark per exchange and one at the joint commit.
    # Versions 5 (detection failed: streamed, inside its exchanges) and 6 (commit aborted) in
    # between: once 7 committed, only 7's marks are left, as only 3's were after 3.
    writer = overlap[0]
    marks = {v: 3 * (writer["versions"][v]["exchanges"] + 1) for v in (3, 7)}
    assert writer["keys_after_7"] - marks[7] == writer["keys_after_3"] - marks[3]
