"""The role plan: who writes, who receives, who sends to whom (pure tables)."""

from __future__ import annotations

import pytest

from deltasync.cluster import ClusterConfig, ReceiverRole, RolePlan, WriterRole
from deltasync.cluster.roles import GroupHealth
from deltasync.errors import ConfigError, ExchangeError, FormatError, PeerFailedError
from deltasync.exchange import ExchangeConfig
from deltasync.publish import PublisherConfig
from deltasync.validate import MAX_SECONDS

SHARDS = ["tp0", "tp1"]


def test_contiguous_placement_puts_writers_first_then_one_block_of_shards_per_replica() -> None:
    plan = RolePlan.contiguous(num_writers=2, shards=SHARDS, replicas=2)
    assert plan.world_size == 6
    assert [plan.role(r) for r in range(6)] == [
        WriterRole(0, 0, 2),
        WriterRole(1, 1, 2),
        ReceiverRole(2, "tp0", 0),
        ReceiverRole(3, "tp1", 0),
        ReceiverRole(4, "tp0", 1),
        ReceiverRole(5, "tp1", 1),
    ]
    assert plan.writer_ids() == ("w00000", "w00001")


# (dp_mode, replicas) -> (exchanges, first hop {rank: shard}, forwards {rank: targets},
#                         sources {receiver rank: source ranks})
CASES = {
    ("direct", 1): (1, {1: "tp0", 2: "tp1"}, {1: (), 2: ()}, {1: (0,), 2: (0,)}),
    ("forward", 1): (1, {1: "tp0", 2: "tp1"}, {1: (), 2: ()}, {1: (0,), 2: (0,)}),
    ("direct", 2): (
        1,
        {1: "tp0", 2: "tp1", 3: "tp0", 4: "tp1"},
        {1: (), 2: (), 3: (), 4: ()},
        {1: (0,), 2: (0,), 3: (0,), 4: (0,)},
    ),
    ("forward", 2): (
        2,
        {1: "tp0", 2: "tp1"},
        {1: (3,), 2: (4,), 3: (), 4: ()},
        {1: (0,), 2: (0,), 3: (1,), 4: (2,)},
    ),
    ("forward", 3): (
        2,
        {1: "tp0", 2: "tp1"},
        {1: (3, 5), 2: (4, 6), 3: (), 4: (), 5: (), 6: ()},
        {1: (0,), 2: (0,), 3: (1,), 4: (2,), 5: (1,), 6: (2,)},
    ),
}


@pytest.mark.parametrize(("mode", "replicas"), list(CASES))
def test_who_sends_to_whom_follows_the_dp_mode(mode: str, replicas: int) -> None:
    exchanges, first, forwards, sources = CASES[(mode, replicas)]
    plan = RolePlan.contiguous(num_writers=1, shards=SHARDS, replicas=replicas, dp_mode=mode)
    assert plan.exchanges == exchanges
    assert plan.first_hop() == first
    assert {r: plan.forward_targets(r) for r in forwards} == forwards
    assert {r: plan.sources(r) for r in sources} == sources


def test_traffic_model_moves_writer_bytes_to_replica_zero_when_forwarding() -> None:
    blob = {(0, "tp0"): 100, (0, "tp1"): 50, (1, "tp0"): 10, (1, "tp1"): 5}
    direct = RolePlan.contiguous(num_writers=2, shards=SHARDS, replicas=2).traffic(blob)
    assert len(direct) == 1
    assert direct[0][0] == [0, 0, 100, 50, 100, 50]
    assert direct[0][1] == [0, 0, 10, 5, 10, 5]
    fwd = RolePlan.contiguous(num_writers=2, shards=SHARDS, replicas=2, dp_mode="forward")
    hops = fwd.traffic(blob)
    assert hops[0][0] == [0, 0, 100, 50, 0, 0]
    assert hops[1][2] == [0, 0, 0, 0, 110, 0]  # tp0 replica 0 forwards both writers' blobs
    assert hops[1][3] == [0, 0, 0, 0, 0, 55]
    # Either way every receiver ends up with the same bytes.
    for dst in range(2, 6):
        assert sum(row[dst] for row in direct[0]) == sum(h[s][dst] for h in hops for s in range(6))


W1 = [WriterRole(0, 0, 1)]


def recv(*triples: tuple[int, str, int]) -> list[ReceiverRole]:
    return [ReceiverRole(*t) for t in triples]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(writers=W1, receivers=recv((2, "tp0", 0))), "no role"),
        (dict(writers=W1, receivers=recv((0, "tp0", 0), (1, "tp0", 1))), "two roles"),
        (
            dict(writers=[WriterRole(0, 1, 2)], receivers=recv((1, "tp0", 0), (2, "tp0", 1))),
            "dim-0 shards 0..count-1",
        ),
        (dict(writers=W1, receivers=recv((1, "tp0", 1), (2, "tp1", 0))), "numbered 0..n-1"),
        (dict(writers=W1, receivers=recv((1, "../x", 0), (2, "tp1", 0))), "not a safe name"),
        (dict(writers=W1, receivers=recv((1, "tp0", 0)), dp_mode="relay", world_size=2), "dp_mode"),
        (dict(writers=W1, receivers=recv((5, "tp0", 0)), world_size=2), r"not in \[0, 2\)"),
    ],
)
def test_an_inconsistent_plan_is_refused_naming_the_problem(kwargs: dict, match: str) -> None:
    kwargs.setdefault("world_size", 3)
    with pytest.raises(ConfigError, match=match):
        RolePlan(**kwargs)


def test_a_plan_must_hold_exactly_the_layouts_shards() -> None:
    plan = RolePlan.contiguous(num_writers=1, shards=SHARDS)
    plan.check_shards(["tp1", "tp0"])
    with pytest.raises(ConfigError, match="every layout shard needs a receiver"):
        plan.check_shards(["tp0", "tp1", "tp2"])


def test_asking_a_writer_for_its_receiver_role_is_a_config_error() -> None:
    plan = RolePlan.contiguous(num_writers=1, shards=SHARDS)
    with pytest.raises(ConfigError, match="not a receiver"):
        plan.receiver(0)
    with pytest.raises(ConfigError, match="not a writer"):
        plan.writer(1)


@pytest.mark.parametrize(
    ("raised", "broken"),
    [
        (KeyboardInterrupt(), True),  # an interrupt leaves an operation posted
        (MemoryError(), True),  # so may any error deltasync did not raise
        (RuntimeError("[gloo] Connection closed by peer"), True),
        (FormatError("a payload that does not decode"), False),  # typed: note()'s to judge
        (PeerFailedError("rank 2 reported a failure"), False),
    ],
)
def test_collectives_a_raise_deltasync_did_not_make_breaks_the_group(raised, broken) -> None:
    # A MemoryError inside a receiver's receive left its group in use: the caller's retry
    # waited out wait_for_version_s on a group whose operations were still posted.
    health = GroupHealth("receiver rank 1")
    with pytest.raises(type(raised)):
        with health.collectives("version 3"):
            raise raised
    assert (health.broken is not None) is broken
    if broken:
        with pytest.raises(ExchangeError, match=r"version 3: .*use_group"):
            health.check()
    else:
        health.check()


@pytest.mark.parametrize(
    "make",
    [
        lambda t: ExchangeConfig(timeout_s=t),
        lambda t: ClusterConfig(wait_for_version_s=t),
        lambda t: ClusterConfig(commit_timeout_s=t),
        lambda t: PublisherConfig(marker_timeout_s=t),
    ],
    ids=["exchange", "wait_for_version", "commit", "publisher"],
)
def test_a_finite_timeout_too_long_to_wait_on_is_refused_at_construction(make) -> None:
    # 1e300 s was taken, and the first sync() failed on every rank holding it with an untyped
    # "Overflow when unpacking long long" (int64 milliseconds), breaking the group
    with pytest.raises(ConfigError, match=r"at most 1000000000 seconds"):
        make(1e300)
    make(MAX_SECONDS)
