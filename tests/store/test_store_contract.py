"""The Store contract, checked identically on LocalStore, MemoryStore and S3Store (moto)."""

from __future__ import annotations

import threading
import time

import pytest

from deltasync import names
from deltasync.errors import CommitConflictError, KeyNotFoundError, ObjectTooLargeError, StoreError
from deltasync.store import InvalidKeyError, Store

ALL_BYTES = bytes(range(256)) * 17


def test_get_returns_exactly_the_bytes_put_stored(any_store: Store) -> None:
    any_store.put("a/b/c.bin", ALL_BYTES)
    assert any_store.get("a/b/c.bin") == ALL_BYTES
    assert any_store.size("a/b/c.bin") == len(ALL_BYTES)
    assert any_store.exists("a/b/c.bin")


def test_modified_says_when_a_key_was_last_written(any_store: Store) -> None:
    before = time.time()
    any_store.put("a/k", b"x")
    first = any_store.modified("a/k")
    # S3 keeps LastModified to the second; a local clock and the server's agree within that
    assert before - 1.5 <= first <= time.time() + 1.5
    with pytest.raises(KeyNotFoundError, match="nope"):
        any_store.modified("a/nope")
    any_store.delete("a/k")
    with pytest.raises(KeyNotFoundError):
        any_store.modified("a/k")


def test_an_empty_object_round_trips(any_store: Store) -> None:
    any_store.put("empty", b"")
    assert any_store.get("empty") == b""
    assert any_store.size("empty") == 0


def test_reading_a_missing_key_raises_key_not_found(any_store: Store) -> None:
    with pytest.raises(KeyNotFoundError, match="nope"):
        any_store.get("nope")
    with pytest.raises(KeyNotFoundError):
        any_store.size("dir/nope")
    with pytest.raises(KeyNotFoundError):
        any_store.get_range("nope", 0, 1)
    assert not any_store.exists("nope")


def test_put_replaces_the_whole_object(any_store: Store) -> None:
    any_store.put("k", b"x" * 1000)
    any_store.put("k", b"short")
    assert any_store.get("k") == b"short"


def test_put_copies_mutable_buffers_so_later_mutation_changes_nothing(any_store: Store) -> None:
    buf = bytearray(b"abcdef")
    any_store.put("k1", buf)
    any_store.put("k2", memoryview(buf)[1:4])
    buf[:] = b"zzzzzz"
    assert any_store.get("k1") == b"abcdef"
    assert any_store.get("k2") == b"bcd"


def test_get_range_returns_the_slice_and_refuses_to_read_past_the_end(any_store: Store) -> None:
    any_store.put("r", ALL_BYTES)
    assert any_store.get_range("r", 0, 10) == ALL_BYTES[:10]
    assert any_store.get_range("r", 300, 1000) == ALL_BYTES[300:1300]
    assert any_store.get_range("r", len(ALL_BYTES) - 1, 1) == ALL_BYTES[-1:]
    assert any_store.get_range("r", 5, 0) == b""
    with pytest.raises(StoreError, match="past the end"):
        any_store.get_range("r", len(ALL_BYTES) - 1, 2)
    with pytest.raises(StoreError, match="past the end"):
        any_store.get_range("r", len(ALL_BYTES) + 10, 1)
    with pytest.raises(StoreError, match="non-negative"):
        any_store.get_range("r", -1, 1)


def test_put_if_absent_creates_once_then_conflicts_and_keeps_the_first_bytes(
    any_store: Store,
) -> None:
    key = names.manifest_key(3)
    any_store.put_if_absent(key, b"first")
    with pytest.raises(CommitConflictError, match="already exists"):
        any_store.put_if_absent(key, b"second")
    assert any_store.get(key) == b"first"


def _race_put_if_absent(store: Store, key: str, writers: int) -> list[str]:
    barrier = threading.Barrier(writers)
    outcomes = [""] * writers

    def writer(i: int) -> None:
        barrier.wait()
        try:
            store.put_if_absent(key, f"writer {i}".encode() * 1000)
            outcomes[i] = "won"
        except CommitConflictError:
            outcomes[i] = "lost"
        except Exception as exc:  # surfaced by the caller's assertion
            outcomes[i] = repr(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return outcomes


def test_eight_racing_put_if_absent_writers_have_exactly_one_winner(any_store: Store) -> None:
    for round_ in range(4):
        key = names.manifest_key(100 + round_)
        outcomes = _race_put_if_absent(any_store, key, 8)
        assert sorted(outcomes) == ["lost"] * 7 + ["won"], outcomes
        winner = outcomes.index("won")
        assert any_store.get(key) == f"writer {winner}".encode() * 1000


def test_list_returns_sorted_keys_under_a_plain_string_prefix(any_store: Store) -> None:
    keys = [
        names.blob_key(1, "tp1", "w00000"),
        names.blob_key(1, "tp0", "w00001"),
        names.blob_key(1, "tp0", "w00000"),
        names.manifest_key(1),
        names.manifest_key(12),
        names.ack_key(1, "rcv-a"),
        names.LATEST,
    ]
    for k in keys:
        any_store.put(k, b"x")
    assert any_store.list() == sorted(keys)
    assert any_store.list("v00000001/") == sorted(k for k in keys if k.startswith("v00000001/"))
    assert any_store.list("v0000001") == [names.manifest_key(12)]
    assert any_store.list("v00000001/tp0/") == [
        names.blob_key(1, "tp0", "w00000"),
        names.blob_key(1, "tp0", "w00001"),
    ]
    assert any_store.list("nothing/here/") == []


def test_delete_removes_a_key_and_deleting_a_missing_key_is_not_an_error(any_store: Store) -> None:
    any_store.put("v00000001/tp0/w00000.blob", b"1")
    any_store.put("v00000001/MANIFEST.json", b"2")
    any_store.delete("v00000001/tp0/w00000.blob")
    assert not any_store.exists("v00000001/tp0/w00000.blob")
    assert any_store.list() == ["v00000001/MANIFEST.json"]
    any_store.delete("v00000001/tp0/w00000.blob")
    any_store.delete("never/existed")
    # The key can be created again after deletion (its directory may have been pruned).
    any_store.put("v00000001/tp0/w00000.blob", b"3")
    assert any_store.get("v00000001/tp0/w00000.blob") == b"3"


def test_put_stream_stores_the_concatenated_chunks(any_store: Store) -> None:
    chunks = [b"head", bytearray(b"-middle-"), memoryview(ALL_BYTES), b""]
    n = any_store.put_stream("streamed", iter(chunks))
    expected = b"head-middle-" + ALL_BYTES
    assert n == len(expected)
    assert any_store.get("streamed") == expected


HOSTILE_KEYS = [
    "",
    "../x",
    "a/../../x",
    "/abs",
    "/etc/passwd",
    "a\\b",
    "a//b",
    "a/./b",
    "a/",
    ".hidden",
    "a/.tmp-x",
    "..",
    "x\x00y",
    "x\ny",
    "k" * 2000,
]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_hostile_keys_are_rejected_before_any_io(any_store: Store, key: str) -> None:
    for call in (
        lambda: any_store.put(key, b"x"),
        lambda: any_store.put_if_absent(key, b"x"),
        lambda: any_store.put_stream(key, [b"x"]),
        lambda: any_store.get(key),
        lambda: any_store.get_range(key, 0, 1),
        lambda: any_store.exists(key),
        lambda: any_store.size(key),
        lambda: any_store.delete(key),
    ):
        with pytest.raises(InvalidKeyError):
            call()
    assert any_store.list() == []


@pytest.mark.parametrize("prefix", ["../", "/abs", "a/../b", "a\\b", ".hid", "a/.tmp"])
def test_hostile_list_prefixes_are_rejected(any_store: Store, prefix: str) -> None:
    with pytest.raises(InvalidKeyError):
        any_store.list(prefix)


def test_a_reader_never_sees_a_partial_object_while_a_writer_replaces_it(any_store: Store) -> None:
    payloads = [bytes([i]) * (512 * 1024) for i in (1, 2, 3)]
    any_store.put("hot", payloads[0])
    seen: set[int] = set()
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            data = any_store.get("hot")
            if data not in payloads:
                bad.append(f"{len(data)} bytes starting {data[:4]!r}")
                return
            seen.add(data[0])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(24):
            any_store.put("hot", payloads[i % 3])
    finally:
        stop.set()
        t.join(timeout=30)
    assert not bad, bad
    assert seen  # the reader really read while the writer wrote


def test_get_with_max_bytes_returns_objects_within_the_bound_and_refuses_larger_ones(
    any_store: Store,
) -> None:
    any_store.put("bounded", ALL_BYTES)
    assert any_store.get("bounded", max_bytes=len(ALL_BYTES)) == ALL_BYTES
    assert any_store.get("bounded", max_bytes=None) == ALL_BYTES
    with pytest.raises(ObjectTooLargeError, match=f"more than the {len(ALL_BYTES) - 1}"):
        any_store.get("bounded", max_bytes=len(ALL_BYTES) - 1)
    any_store.put("nothing", b"")
    assert any_store.get("nothing", max_bytes=0) == b""
    with pytest.raises(KeyNotFoundError):
        any_store.get("absent", max_bytes=10)
    with pytest.raises(StoreError, match="max_bytes"):
        any_store.get("bounded", max_bytes=-1)
