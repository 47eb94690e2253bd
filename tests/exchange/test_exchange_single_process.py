"""A group of one is the same code path as many; no group at all is a clear error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from deltasync.errors import ExchangeError, PeerFailedError
from deltasync.exchange import exchange


@pytest.fixture
def group_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("another test left a default process group behind")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_exchange_without_a_process_group_says_how_to_start_one() -> None:
    if dist.is_initialized():
        pytest.fail("another test left a default process group behind")
    with pytest.raises(ExchangeError, match="init_from_env"):
        exchange({0: b"x"})


@pytest.mark.timeout(30)
def test_a_group_of_one_gets_a_copy_of_its_own_payload(group_of_one: None) -> None:
    payload = bytearray(b"\x00\x01\xfe\xff" * 1000)
    got = exchange({0: payload})
    payload[0] = 7  # the result is a copy, not a view of the caller's buffer
    assert sorted(got) == [0]
    assert bytes(got[0].numpy()) == b"\x00\x01\xfe\xff" * 1000
    assert got.stats.bytes_local == 4000
    assert got.stats.messages == 0 and got.stats.bytes_sent == 0


@pytest.mark.timeout(30)
def test_a_group_of_one_reports_its_own_failure_as_a_peer_failure(group_of_one: None) -> None:
    cause = OSError("shard file missing")
    with pytest.raises(
        PeerFailedError, match=r"rank 0 failed .*OSError: shard file missing"
    ) as info:
        exchange({0: b"x"}, status=cause)
    assert info.value.__cause__ is cause
    assert exchange({}) == {}  # the group is still usable
