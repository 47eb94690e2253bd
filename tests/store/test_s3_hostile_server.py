"""S3Store against a server that lies (``lying_s3.LyingS3``, a proxy in front of the session's
real moto server): a typed StoreError at once, never a listing that walks forever, a key from
outside the store's prefix taken for one of its own, or a 16-byte ranged read that buffers the
whole object."""

from __future__ import annotations

import pytest
from botocore.response import StreamingBody
from lying_s3 import LyingS3
from urllib3.response import HTTPResponse

from deltasync.errors import KeyNotFoundError, OutcomeUnknownError, StoreError
from deltasync.store import RetryPolicy, S3Store


@pytest.fixture
def lying(s3_server):
    proxy = LyingS3(s3_server.port)
    fast = RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0)
    config = s3_server.config(endpoint_url=proxy.endpoint, retry=fast)
    store = S3Store(s3_server.new_bucket(), "run42", config=config)
    yield proxy, store
    store.close()
    proxy.close()


def test_a_listing_whose_continuation_tokens_loop_is_a_store_error_not_an_endless_walk(lying):
    # tokens A, B, A, ...: botocore only stops a token repeated at once; the list never ended
    # and its keys grew without bound
    proxy, store = lying
    store.put("v00000001/MANIFEST.json", b"m")
    proxy.mode = "loops-tokens"
    with pytest.raises(StoreError, match=r"continuation tokens loop \(token 'A' again"):
        store.list("v")
    assert proxy.pages == 3
    proxy.mode = "honest"
    assert store.list("v") == ["v00000001/MANIFEST.json"]


def test_a_listed_key_outside_the_prefix_is_a_store_error_never_a_key_of_this_store(lying):
    # the prefix was cut off every listed key unchecked: run43's version 9 read as run42's
    proxy, store = lying
    store.put("acks/r1", b"a")
    proxy.mode = "lists-outside-prefix"
    proxy.foreign_key = "run43/v00000009/MANIFEST.json"
    with pytest.raises(StoreError, match=r"listed 'run43/v00000009/MANIFEST.json', which is not"):
        store.list("")
    proxy.mode = "honest"
    assert store.list("") == ["acks/r1"]


def test_a_server_that_ignores_range_is_refused_before_the_body_is_read(lying, monkeypatch):
    # the whole object was read into memory, then reported as "reads past the end"
    proxy, store = lying
    store.put("v00000001/tp0/w00000.blob", b"x" * (4 << 20))
    asked: list = []
    read, read1 = StreamingBody.read, HTTPResponse.read1

    def counted(self, amt=None):
        asked.append(amt)
        return read(self, amt)

    def counted1(self, amt=None):
        asked.append(amt)
        return read1(self, amt)

    monkeypatch.setattr(StreamingBody, "read", counted)
    monkeypatch.setattr(HTTPResponse, "read1", counted1)
    assert store.get_range("v00000001/tp0/w00000.blob", 10, 16) == b"x" * 16
    # the range and one byte more, never the rest of the object
    assert asked and all(amt is not None and amt <= 17 for amt in asked), asked
    asked.clear()
    proxy.mode = "ignores-range"
    with pytest.raises(StoreError, match=r"answered without a Content-Range, i\.e\. ignored the"):
        store.get_range("v00000001/tp0/w00000.blob", 10, 16)
    assert asked == []


def test_a_server_that_serves_another_range_is_refused_not_read_as_the_one_asked(lying):
    # the right length from the wrong place was returned as the range asked for
    proxy, store = lying
    store.put("v00000001/tp0/w00000.blob", bytes(range(256)) * 64)
    assert store.get_range("v00000001/tp0/w00000.blob", 100, 16) == bytes(range(100, 116))
    proxy.mode = "shifts-range"
    with pytest.raises(StoreError, match=r"Content-Range 'bytes 0-15/16384', not a part of bytes"):
        store.get_range("v00000001/tp0/w00000.blob", 100, 16)
    assert store.get_range("v00000001/tp0/w00000.blob", 0, 16) == bytes(range(16))


def test_a_server_that_ignores_if_none_match_is_refused_before_a_conditional_write(lying):
    # a second commit of one version number replaced the first manifest, and both succeeded
    proxy, store = lying
    proxy.mode = "ignores-if-none-match"
    with pytest.raises(StoreError, match=r"ignores If-None-Match.*nothing was written") as info:
        store.put_if_absent("v00000001/MANIFEST.json", b"m1")
    assert not isinstance(info.value, OutcomeUnknownError)
    assert store.list("") == []  # neither the key nor the probe
    proxy.mode = "honest"
    store.put_if_absent("v00000001/MANIFEST.json", b"m1")
    proxy.mode = "ignores-if-none-match"  # the server was checked once per client
    child = store.with_prefix("sub")
    child.put_if_absent("v00000001/MANIFEST.json", b"m1")
    assert store.list("") == ["sub/v00000001/MANIFEST.json", "v00000001/MANIFEST.json"]


def test_a_server_that_redirects_to_itself_is_a_store_error_naming_the_loop(lying):
    # botocore follows a redirect by calling itself: a bare RecursionError after ~80 requests
    proxy, store = lying
    store.put("v00000002/MANIFEST.json", b"m")
    proxy.mode = "redirects"
    for call in (
        lambda: store.exists("v00000002/MANIFEST.json"),
        lambda: store.get("v00000002/MANIFEST.json"),
        lambda: store.put_if_absent("v00000003/MANIFEST.json", b"m"),
        lambda: store.list("v"),
    ):
        with pytest.raises(StoreError, match="kept redirecting the request") as info:
            call()
        assert not isinstance(info.value, OutcomeUnknownError)  # a redirect applies nothing
    assert proxy.redirects > 0
    proxy.mode = "honest"
    assert not store.exists("v00000003/MANIFEST.json")


def test_an_error_reply_cut_short_is_retried_never_a_bare_urllib3_error(lying):
    # GetObject's error reply (404 NoSuchKey) is read while botocore parses it, outside its
    # own wrapping: a body cut short escaped as urllib3's ProtocolError, an untyped error
    # from Catalog.latest() (a LATEST not written yet), and was never retried
    proxy, store = lying
    store.put("v00000001/tp0/w00000.blob", b"x" * 64)
    for call in (
        lambda: store.get("LATEST", max_bytes=64),
        lambda: store.get("LATEST"),
        lambda: store.get_range("missing", 0, 4),
    ):
        proxy.mode = "cuts-error-body-once"
        with pytest.raises(KeyNotFoundError):
            call()
        assert proxy.mode == "honest"  # the cut reply was retried, and the retry answered
    assert proxy.cut == 3
    proxy.mode = "cuts-error-body-once"
    assert store.get("v00000001/tp0/w00000.blob") == b"x" * 64  # a 200 passes untouched


def test_an_error_reply_that_stalls_mid_body_is_retried_never_a_bare_urllib3_error(s3_server):
    # the same read, timed out instead of reset: urllib3's ReadTimeoutError escaped
    proxy = LyingS3(s3_server.port)
    fast = RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0)
    config = s3_server.config(endpoint_url=proxy.endpoint, retry=fast, read_timeout_s=0.3)
    store = S3Store(s3_server.new_bucket(), "run42", config=config)
    try:
        proxy.stall_s = 0.6
        proxy.mode = "stalls-error-body-once"
        with pytest.raises(KeyNotFoundError):
            store.get("LATEST", max_bytes=64)
        assert proxy.cut == 1 and proxy.mode == "honest"
    finally:
        store.close()
        proxy.close()


def test_a_body_damaged_on_the_way_is_read_again_and_damage_that_stays_is_named(lying):
    # botocore's check of the body against the server's checksum was final: one flipped byte
    # in transit failed the read at once ("Expected checksum ... did not match"), unretried
    proxy, store = lying
    store.put("v00000001/tp0/w00000.blob", b"0123456789" * 1000)
    proxy.mode = "flips-body-once"
    assert store.get("v00000001/tp0/w00000.blob") == b"0123456789" * 1000
    assert proxy.flipped == 1
    proxy.mode = "flips-body"
    with pytest.raises(StoreError, match=r"did not match the checksum the server sent") as info:
        store.get("v00000001/tp0/w00000.blob", max_bytes=10_000)
    assert "w00000.blob" in str(info.value) and "on each of 2 attempts" in str(info.value)
    assert proxy.flipped == 3


def test_a_retried_error_whose_text_ends_a_sentence_reads_as_one_sentence(lying):
    # botocore's "... total bytes expected is 2." was followed by ". Is the server reachable?"
    from botocore.exceptions import IncompleteReadError

    _, store = lying

    def cut(_attempt: int) -> None:
        raise IncompleteReadError(actual_bytes=1, expected_bytes=2)

    with pytest.raises(StoreError) as failed:
        store._call("get", "v00000001/tp0/w00000.blob", cut)
    message = str(failed.value)
    assert "expected is 2. Is the server reachable?" in message and ".." not in message, message


def test_uploads_listed_without_their_ids_are_left_never_a_bare_key_error(lying):
    # abort_uploads (gc, for each version it deletes) is best effort, but a listing whose
    # entries had no UploadId raised KeyError out of it, and gc ended in a traceback
    proxy, store = lying
    store._client.create_multipart_upload(Bucket=store.bucket, Key="run42/v00000000/tp0/w.blob")
    proxy.mode = "drops-upload-ids"
    assert store.abort_uploads("v00000000/") == 0
    proxy.mode = "honest"
    assert store.abort_uploads("v00000000/") == 1
