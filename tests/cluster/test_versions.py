"""Consecutive versions over one gloo group with a real (tiny) Qwen3 trainer: every receiver is
bit-identical to a dense split of the trainer's BF16 state at every version (20 by default,
100 in the ``slow`` variants)."""

from __future__ import annotations

import pytest

from deltasync.exchange import spawn

from cluster_testkit import Setup, run_inline, run_versions

VERSIONS = 20
MANY = 100


@pytest.fixture(scope="module")
def tp2_run() -> list[dict]:
    """1 trainer (AdamW tracker) + 2 receivers (vLLM TP=2): an anchor, then 20 deltas, with
    state digests on every version (the default)."""
    setup = Setup(versions=VERSIONS, digest_every=1)
    return spawn(run_versions, setup.world_size(), setup, timeout_s=110)


def check_run(results: list[dict], versions: int) -> None:
    trainer, *receivers = results
    assert trainer["versions"] == list(range(versions + 1))
    assert min(trainer["elements"]) > 0
    for r in receivers:
        assert r["versions"] == list(range(versions + 1))
        assert r["bad"] == []
    assert len(set(receivers[0]["digests"])) == versions + 1


def check_replicas(receivers: list[dict], setup: Setup, versions: int) -> None:
    """Every receiver exact at every version, and both replicas of a shard identical."""
    for r in receivers:
        assert r["versions"] == list(range(versions + 1))
        assert r["bad"] == []
    by_rank = {r["rank"]: r for r in receivers}
    plan = setup.plan()
    for shard in plan.shards():
        first, second = (by_rank[role.rank]["digests"] for role in plan.replicas(shard))
        assert first == second


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_100_versions_keep_both_tp_receivers_bit_identical_to_a_dense_split() -> None:
    setup = Setup(versions=MANY, digest_every=10)
    check_run(spawn(run_versions, setup.world_size(), setup, timeout_s=180), MANY)


@pytest.mark.timeout(150)
def test_20_versions_keep_both_tp_receivers_bit_identical_to_a_dense_split(tp2_run) -> None:
    trainer, *receivers = tp2_run
    assert trainer["versions"] == list(range(VERSIONS + 1))
    # Real AdamW steps at lr 1e-3 change most elements; every version moved something.
    assert min(trainer["elements"]) > 0
    for r in receivers:
        assert r["versions"] == list(range(VERSIONS + 1))
        assert r["bad"] == []  # torch.equal on int16 views after every version
        assert len(r["digests"]) == VERSIONS + 1
    # Versions really differ from each other (the check above could not pass by standing still).
    assert len(set(receivers[0]["digests"])) == VERSIONS + 1


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dp_replicas_get_every_version_directly_then_forwarded_with_identical_results() -> None:
    # 1 trainer + 2 TP shards x 2 DP replicas; versions 11.. switch to receiver-side forwarding.
    setup = Setup(versions=VERSIONS, replicas=2, forward_from=11, digest_every=5)
    trainer, *receivers = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    assert trainer["exchanges"] == [1] * 11 + [2] * 10
    check_replicas(receivers, setup, VERSIONS)


@pytest.mark.timeout(150)
def test_two_fsdp_writers_give_exactly_the_receiver_states_of_one_writer(tp2_run) -> None:
    # Same model, data and steps as tp2_run; each writer sends only its dim-0 half of every
    # param (exact snapshot trackers over the halves), writer 0 also the state digests.
    setup = Setup(num_writers=2, tracker="snapshot", versions=15, digest_every=5)
    results = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    writers, receivers = results[:2], results[2:]
    assert [w["versions"] for w in writers] == [list(range(16))] * 2
    assert all(min(w["elements"]) > 0 for w in writers)  # both halves carry changes
    one_writer = {r["rank"] - 1: r["digests"] for r in tp2_run[1:]}  # tp0, tp1 in rank order
    for i, r in enumerate(receivers):
        assert r["bad"] == []
        assert r["digests"] == one_writer[i][:16]


@pytest.mark.timeout(150)
def test_two_overlapped_fsdp_writers_give_exactly_the_receiver_states_of_one_writer(
    tp2_run,
) -> None:
    # As above, with every writer sending in the background (the tracker cleared at capture,
    # its positions carried until the joint commit, the collectives on the sender's thread).
    setup = Setup(num_writers=2, tracker="snapshot", versions=8, digest_every=1, overlap=True)
    results = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    writers, receivers = results[:2], results[2:]
    assert [w["versions"] for w in writers] == [list(range(9))] * 2
    assert all(r.overlapped for w in writers for r in w["reports"])
    one_writer = {r["rank"] - 1: r["digests"] for r in tp2_run[1:]}
    for i, r in enumerate(receivers):
        assert r["bad"] == []
        assert r["digests"] == one_writer[i][:9]


@pytest.mark.timeout(150)
def test_two_overlapped_writers_streaming_in_parts_give_exactly_the_states_of_one_writer(
    tp2_run,
) -> None:
    # As above with every delta streamed in 2 KiB parts: the writers' halves differ in size,
    # so one writer ends its parts before the other and sends nothing in the rest.
    setup = Setup(
        num_writers=2, tracker="snapshot", versions=6, digest_every=1, overlap=True, part_bytes=2048
    )
    results = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    writers, receivers = results[:2], results[2:]
    assert [w["versions"] for w in writers] == [list(range(7))] * 2
    for w in writers:
        assert w["reports"][0].exchanges == 1  # the anchor
        assert min(r.exchanges for r in w["reports"][1:]) > 5
    one_writer = {r["rank"] - 1: r["digests"] for r in tp2_run[1:]}
    for i, r in enumerate(receivers):
        assert r["bad"] == []
        assert r["digests"] == one_writer[i][:7]


@pytest.mark.timeout(150)
def test_forwarding_replicas_pass_on_a_delta_that_came_in_parts_exactly() -> None:
    # 1 overlapped trainer streaming 2 KiB parts to replica 0 of each TP shard, which forwards
    # the joined envelope to replica 1 in the second exchange.
    setup = Setup(
        versions=4, replicas=2, dp_mode="forward", digest_every=1, overlap=True, part_bytes=2048
    )
    trainer, *receivers = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    assert trainer["versions"] == list(range(5))
    assert min(r.exchanges for r in trainer["reports"][1:]) > 5
    check_replicas(receivers, setup, 4)


@pytest.mark.timeout(150)
def test_an_overlapped_writer_detecting_after_sync_returns_gives_the_blocking_states(
    tp2_run,
) -> None:
    # The real AdamWTracker holds the optimizer's steps for the sender: each delta's detection
    # goes on after sync returns (and streams in parts); same model, data and steps as tp2_run.
    setup = Setup(versions=6, digest_every=1, overlap=True)
    trainer, *receivers = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    assert trainer["versions"] == list(range(7))
    assert all(r.overlapped for r in trainer["reports"])
    for i, r in enumerate(receivers):
        assert r["bad"] == []
        assert r["digests"] == tp2_run[1 + i]["digests"][:7]


def _two_writers_meet(tp2_run: list[dict], versions: int, **fields) -> list[dict]:
    """Two overlapped writers (snapshot trackers, deltas streamed in 2 KiB parts) and TP=2
    receivers, ``fields`` the rest of the Setup: every version commits on both writers, and
    each receiver ends where tp2_run's single writer left it, version for version. Returns
    the writers' results."""
    setup = Setup(
        num_writers=2,
        tracker="snapshot",
        versions=versions,
        digest_every=1,
        overlap=True,
        part_bytes=2048,
        **fields,
    )
    results = spawn(run_versions, setup.world_size(), setup, timeout_s=110)
    writers, receivers = results[:2], results[2:]
    assert [w["versions"] for w in writers] == [list(range(versions + 1))] * 2
    one_writer = {r["rank"] - 1: r["digests"] for r in tp2_run[1:]}
    for i, r in enumerate(receivers):
        assert r["bad"] == []
        assert r["digests"] == one_writer[i][: versions + 1]
    return writers


@pytest.mark.timeout(150)
def test_writers_sending_small_deltas_inline_or_in_the_background_still_meet_exactly(
    tp2_run,
) -> None:
    # Writer 0 runs every version after a small delta on its own thread (inline_below above
    # the tiny model's deltas) in one exchange, writer 1 in the background in 2 KiB parts:
    # the inline writer must take part, sending nothing, in the rest of writer 1's parts.
    writers = _two_writers_meet(tp2_run, 6, inline_below=(1 << 30, 0))
    # the anchor and the first delta (no small delta seen yet) in the background
    assert [r.inline for r in writers[0]["reports"]] == [False, False] + [True] * 5
    assert not any(r.inline for r in writers[1]["reports"])
    for w in writers:
        assert min(r.exchanges for r in w["reports"][1:]) > 5
    inline = writers[0]["reports"][2:]
    assert all(r.overlapped and r.stall_s == r.total_s for r in inline)


@pytest.mark.timeout(150)
def test_a_writer_told_to_expect_a_small_delta_sends_its_first_one_inline_and_meets_exactly(
    tp2_run,
) -> None:
    # A new sender took its first delta to the background whatever the caller knew of its
    # size (the benchmark's first in-cluster version after the store path's small ones took
    # 1.6-2x the next one's time), and an anchor reset what it knew. Writer 0 is told;
    # writer 1, not told, still meets it.
    writers = _two_writers_meet(
        tp2_run, 3, inline_below=(1 << 30, 1 << 30), expect_small=(True, False)
    )
    # an anchor is never inline; writer 0's first delta after it is, writer 1's only later
    assert [r.inline for r in writers[0]["reports"]] == [False, True, True, True]
    assert [r.inline for r in writers[1]["reports"]] == [False, False, True, True]
    assert all(r.stall_s == r.total_s for r in writers[0]["reports"][1:])


@pytest.mark.timeout(150)
def test_an_inline_version_that_fails_is_raised_at_the_next_call_and_its_carry_repairs() -> None:
    setup = Setup(digest_every=1, overlap=True, inline_below=(1 << 30,))
    writer, *receivers = spawn(run_inline, setup.world_size(), setup, timeout_s=110)
    steps = writer["steps"]
    assert [s.get("inline") for s in steps] == [False, False, True, None, True]
    assert [s["done_on_return"] for s in steps[2:]] == [True, True, True]
    error, message = steps[4]["raised"]
    assert error == "SendFailedError" and "version 3 did not commit" in message
    assert [s["version_after"] for s in steps] == [0, 1, 2, 2, 4]
    applied, refused = receivers  # rank 2's copy of version 3 was corrupted
    # rank 1 applied 3, which never committed: it reports no version until 4 repairs it
    assert [s["version_after"] for s in applied["steps"]] == [0, 1, 2, None, 4]
    assert [s["version_after"] for s in refused["steps"]] == [0, 1, 2, 2, 4]
    assert refused["steps"][3]["unchanged"]
    for r in receivers:
        ok = [r["steps"][v] for v in (0, 1, 2, 4)]
        assert all(s["error"] is None and s["exact"] for s in ok), ok
        assert r["steps"][3]["error"] is not None
