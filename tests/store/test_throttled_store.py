"""ThrottledStore emulates a link: bytes moved per second stay at its configured rate."""

from __future__ import annotations

import time

import pytest

from deltasync.errors import ConfigError
from deltasync.store import MemoryStore, ThrottledStore

MiB = 2**20


def _rate(fn, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0)


@pytest.mark.timeout(60)
def test_puts_and_gets_move_bytes_at_the_configured_rate() -> None:
    """Never faster than the rate (+20%: the burst), and not far slower: a throttle that
    charged a byte twice would read 0.5x. A loaded machine only makes a run slower, so the
    lower bound leaves it room (0.6x) where the upper one holds exactly."""
    gbps = 0.4  # 50 MB/s: 20 MiB take ~0.42 s each way
    store = ThrottledStore(MemoryStore(), gbps, burst_bytes=64 * 1024)
    target = gbps * 1e9 / 8
    payload = b"\x5a" * MiB
    n = 20

    put_rate = _rate(lambda: [store.put(f"k{i}", payload) for i in range(n)], n * MiB)
    get_rate = _rate(lambda: [store.get(f"k{i}") for i in range(n)], n * MiB)
    stream_rate = _rate(lambda: store.put_stream("s", (payload for _ in range(n))), n * MiB)
    for name, rate in (("put", put_rate), ("get", get_rate), ("put_stream", stream_rate)):
        assert 0.6 * target <= rate <= 1.2 * target, (
            f"{name}: {rate / 1e6:.1f} MB/s vs {target / 1e6:.1f}"
        )


def test_metadata_calls_are_not_throttled() -> None:
    store = ThrottledStore(MemoryStore(), 0.001, burst_bytes=0)  # 125 kB/s
    store.inner.put("k", b"x" * MiB)
    t0 = time.perf_counter()
    assert store.exists("k") and store.size("k") == MiB and store.list() == ["k"]
    store.delete("k")
    assert time.perf_counter() - t0 < 0.5


def test_a_range_read_pays_only_for_its_length() -> None:
    store = ThrottledStore(MemoryStore(), 0.08, burst_bytes=0)  # 10 MB/s
    store.inner.put("big", b"y" * (50 * MiB))
    t0 = time.perf_counter()
    assert store.get_range("big", 10, 100_000) == b"y" * 100_000  # ~10 ms, not 5 s
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("gbps", [0, -1.0, "fast"])
def test_a_non_positive_rate_is_a_config_error(gbps) -> None:
    with pytest.raises(ConfigError, match="gbps"):
        ThrottledStore(MemoryStore(), gbps)
