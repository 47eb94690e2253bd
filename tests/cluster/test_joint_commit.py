"""The joint-commit rows and the verdict every rank derives from them (pure tables)."""

from __future__ import annotations

import pytest
import torch

from deltasync.cluster import RolePlan
from deltasync.cluster.joint_commit import (
    ARRIVED,
    PATIENCE,
    UNKNOWN,
    decode_commit_rows,
    encode_commit_row,
    judge,
    shards_digest,
)
from deltasync.errors import ExchangeError

PLAN = RolePlan.contiguous(num_writers=2, shards=["tp0", "tp1"], replicas=2)  # ranks 0-1 write
D1 = "11" * 16
D2 = "22" * 16


def rows(*entries: dict) -> list:
    return decode_commit_rows(torch.stack([encode_commit_row(**e) for e in entries]))


def ok(v: int = 5, b: int = 4, digest: str | None = None) -> dict:
    return dict(version=v, base=b, state_digest=digest)


def test_rows_round_trip_every_field() -> None:
    (a, f) = rows(
        dict(version=7, base=-1, state_digest=D1),
        dict(version=None, base=None, failure="IntegrityError: ü" * 80, anchor_required=True),
    )
    assert (a.ok, a.version, a.base, a.state_digest, a.anchor_required) == (True, 7, -1, D1, False)
    assert (f.ok, f.version, f.base, f.state_digest, f.anchor_required) == (
        False,
        UNKNOWN,
        UNKNOWN,
        None,
        True,
    )
    assert f.message.startswith("IntegrityError: ü") and len(f.message.encode()) <= 1024
    assert f.message.endswith(" [cut]")  # 40 x 18 bytes fit; the cut is marked, not silent


def test_every_rank_ok_on_the_same_version_commits() -> None:
    verdict = judge(rows(ok(), ok(), ok(digest=D1), ok(), ok(digest=D1), ok()), PLAN)
    assert verdict.ok and verdict.failures == {}


# name -> (rows, ranks that must be named, text in the message, anchor_required)
ABORTS = {
    "a receiver failed": (
        [
            ok(),
            ok(),
            ok(),
            dict(version=None, base=None, failure="DigestMismatchError: bad"),
            ok(),
            ok(),
        ],
        {3},
        "rank 3 (receiver tp1 replica 0): DigestMismatchError: bad",
        False,
    ),
    "a receiver needs an anchor": (
        [
            ok(),
            ok(),
            ok(),
            ok(),
            ok(),
            dict(version=None, base=None, failure="AnchorRequiredError: x", anchor_required=True),
        ],
        {5},
        "AnchorRequiredError",
        True,
    ),
    "a receiver applied another version": (
        [ok(), ok(), ok(), ok(6, 5), ok(), ok()],
        {3},
        "applied version 6 on base 5",
        False,
    ),
    "writers disagree": (
        [ok(), ok(5, 3), ok(), ok(), ok(), ok()],
        {1},
        "sent version 5 on base 3",
        False,
    ),
    "replicas hash differently": (
        [ok(), ok(), ok(digest=D1), ok(), ok(digest=D2), ok()],
        {4},
        "differs from replica",
        False,
    ),
}


@pytest.mark.parametrize("name", list(ABORTS))
def test_any_failure_or_disagreement_aborts_naming_the_rank(name: str) -> None:
    entries, ranks, text, anchor = ABORTS[name]
    verdict = judge(rows(*entries), PLAN)
    assert not verdict.ok
    assert set(verdict.failures) == ranks
    assert text in verdict.message
    assert verdict.message.startswith("joint commit of version 5 aborted, nothing committed")
    assert verdict.anchor_required is anchor
    assert not verdict.unsettled  # every rank got this verdict: the number may be sent again


def test_a_row_from_another_protocol_step_is_an_exchange_error() -> None:
    bad = torch.stack([encode_commit_row(**ok()), torch.zeros_like(encode_commit_row(**ok()))])
    with pytest.raises(ExchangeError, match="rank 1 sent a row that is not a commit row"):
        decode_commit_rows(bad)


def test_a_writers_shard_digests_must_be_exactly_what_the_receivers_hashed() -> None:
    # Receivers verify against the digests their own payloads carry: a payload that is not
    # this attempt's (a stale one from an aborted attempt) verifies against its own digest.
    # Writer 0's commit row carries the digests it sent, combined: another channel.
    sent = shards_digest({"tp0": D1, "tp1": D2})
    good = [ok(digest=sent), ok(), ok(digest=D1), ok(digest=D2), ok(digest=D1), ok(digest=D2)]
    assert judge(rows(*good), PLAN).ok
    stale = "33" * 16
    for bad in (
        [ok(digest=sent), ok(), ok(digest=D1), ok(digest=stale), ok(digest=D1), ok(digest=stale)],
        [ok(digest=sent), ok(), ok(), ok(digest=D2), ok(), ok(digest=D2)],  # tp0 unhashed
    ):
        verdict = judge(rows(*bad), PLAN)
        assert not verdict.ok and set(verdict.failures) == {0}
        assert "a payload other than this attempt's" in verdict.message
    assert shards_digest({"tp1": D2, "tp0": D1}) == sent  # order-free, 16 bytes
    assert len(bytes.fromhex(sent)) == 16


def test_a_receiver_that_came_after_a_writer_stopped_waiting_does_not_commit_alone() -> None:
    # The writer's commit wait (2 s) ended before receiver rank 5 finished its verify and
    # arrived: it raised and commits nothing. The gather still completes on the late ranks with
    # the writer's row; their verdict is an abort, so nobody commits what the writer did not.
    stamped = torch.stack(
        [encode_commit_row(**ok(digest=D1 if r in (2, 4) else None)) for r in range(6)]
    )
    stamped[:, ARRIVED] = torch.tensor([1000, 1100, 1200, 1300, 1400, 4500])
    stamped[:, PATIENCE] = 2000
    verdict = judge(decode_commit_rows(stamped), PLAN)
    assert not verdict.ok and not verdict.anchor_required  # the retry covers the applied attempt
    # The writer that gave up retires version 5's number: so must every writer with this verdict.
    assert verdict.unsettled
    assert list(verdict.failures) == [0]
    assert "rank 5 arrived (3.5 s after it)" in verdict.message
    stamped[5, ARRIVED] = 1000 + 2000 + 900  # within the clocks' allowance: a commit
    assert judge(decode_commit_rows(stamped), PLAN).ok
