"""S3Store against a real S3 HTTP server on loopback (moto): outages, fencing, multipart."""

from __future__ import annotations

import contextlib
import datetime
import io
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError
from botocore.response import StreamingBody

from deltasync.errors import (
    CommitConflictError,
    ConfigError,
    KeyNotFoundError,
    OutcomeUnknownError,
    StoreError,
)
from deltasync.store import RetryPolicy, S3Config, S3Store
from deltasync.store import s3 as s3_module
from deltasync.store.s3 import multipart_etag

PATIENT = RetryPolicy(max_attempts=40, base_delay_s=0.05, max_delay_s=0.3, deadline_s=15.0)


@pytest.fixture
def own_server(s3_server):
    """A second loopback server (same in-process moto state) that a test may stop and restart
    without disturbing the session's server."""
    server = type(s3_server)()
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
def test_an_s3_server_restart_mid_sequence_is_retried_and_no_data_is_lost(own_server) -> None:
    store = S3Store(own_server.new_bucket(), "run", config=own_server.config(retry=PATIENT))
    store.put("v00000001/MANIFEST.json", b"m1")
    own_server.stop()
    restarter = threading.Timer(0.6, own_server.start)
    restarter.start()
    t0 = time.monotonic()
    try:
        store.put_if_absent("v00000002/MANIFEST.json", b"m2")  # issued while the server is down
    finally:
        restarter.join()
    waited = time.monotonic() - t0
    assert waited >= 0.5, "the write did not wait for the restart, so no outage was exercised"
    assert store.get("v00000001/MANIFEST.json") == b"m1"
    assert store.get("v00000002/MANIFEST.json") == b"m2"
    with pytest.raises(CommitConflictError):
        store.put_if_absent("v00000002/MANIFEST.json", b"other")


@pytest.mark.timeout(60)
def test_a_lasting_outage_ends_in_a_store_error_naming_endpoint_bucket_and_key(own_server) -> None:
    bucket = own_server.new_bucket()
    endpoint = own_server.endpoint
    store = S3Store(
        bucket,
        "run",
        config=own_server.config(
            retry=RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0)
        ),
    )
    own_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.get("v00000003/MANIFEST.json")
    assert time.monotonic() - t0 < 5.0
    message = str(info.value)
    assert f"s3://{bucket}/run/v00000003/MANIFEST.json" in message
    assert endpoint in message
    assert "after 4 attempts" in message
    assert not isinstance(info.value, KeyNotFoundError)


def test_a_missing_bucket_is_a_store_error_that_names_it(s3_server) -> None:
    store = S3Store("no-such-bucket-here", config=s3_server.config())
    with pytest.raises(StoreError, match=r"no-such-bucket-here.*does not exist"):
        store.put("k", b"x")
    store.close()


def test_stores_under_different_prefixes_do_not_see_each_other(s3_session_store) -> None:
    a = s3_session_store.with_prefix("iso-a/run")
    b = s3_session_store.with_prefix("iso-a/run2")
    a.put("LATEST", b"a")
    b.put("LATEST", b"b")
    assert a.list() == ["LATEST"] and b.list() == ["LATEST"]
    assert a.get("LATEST") == b"a" and b.get("LATEST") == b"b"


def test_put_stream_above_the_part_size_uses_multipart_and_round_trips(s3_store) -> None:
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    chunks = [bytes([i]) * (2**20 + 7) for i in range(11)]  # ~11 MiB: three parts
    n = store.put_stream("v00000001/tp0/w00000.blob", iter(chunks))
    data = store.get("v00000001/tp0/w00000.blob")
    assert n == len(data) == sum(map(len, chunks))
    assert data == b"".join(chunks)
    # Multipart uploads leave an ETag of the form "<md5>-<parts>".
    head = store._client.head_object(
        Bucket=store.bucket, Key=f"{store.prefix}/v00000001/tp0/w00000.blob"
    )
    assert head["ETag"].strip('"').endswith("-3")


def test_a_failed_stream_aborts_its_multipart_upload_and_stores_nothing(s3_store) -> None:
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)

    def chunks():
        yield b"x" * (6 * 2**20)
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        store.put_stream("blob", chunks())
    assert not store.exists("blob")
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []


class _AbortSlowDownOnce:
    """abort_multipart_upload's first request is answered 503 SlowDown, unapplied."""

    def __init__(self, client) -> None:
        self._client, self.aborts = client, 0

    def abort_multipart_upload(self, **kwargs):
        self.aborts += 1
        if self.aborts == 1:
            raise ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
                "AbortMultipartUpload",
            )
        return self._client.abort_multipart_upload(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_failed_streams_abort_is_retried_so_no_upload_stays_open(s3_store) -> None:
    # The abort was sent once, outside the retries: one 503 left the upload open, and a
    # CompleteMultipartUpload of the failed write still in flight could land later, over a
    # newer write of the key.
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    store._client = _AbortSlowDownOnce(store._client)

    def chunks():
        yield b"x" * (6 * 2**20)
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        store.put_stream("blob", chunks())
    assert store._client.aborts == 2
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []


class _CreateReplyLost:
    """create_multipart_upload's first request is applied (an upload is opened) and its reply
    lost, as when the connection drops after the server answered."""

    def __init__(self, client) -> None:
        self._client, self.creates = client, 0

    def create_multipart_upload(self, **kwargs):
        self.creates += 1
        reply = self._client.create_multipart_upload(**kwargs)
        if self.creates == 1:
            raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")
        return reply

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_an_upload_opened_by_a_create_whose_reply_was_lost_does_not_stay_open(s3_store) -> None:
    # The retried create opens a second upload and the stream completes it; the first one,
    # whose id the client never learns, must not stay open for good.
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    store._client = _CreateReplyLost(store._client)
    chunks = [bytes([i]) * (2**20 + 7) for i in range(11)]
    assert store.put_stream("v00000001/tp0/w00000.blob", iter(chunks)) == sum(map(len, chunks))
    assert store.get("v00000001/tp0/w00000.blob") == b"".join(chunks)
    assert store._client.creates == 2
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []


class _EveryCreateReplyLost(_CreateReplyLost):
    """Every create_multipart_upload is applied (an upload opened) and its reply lost."""

    def create_multipart_upload(self, **kwargs):
        self.creates += 1
        self._client.create_multipart_upload(**kwargs)
        raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")


def test_uploads_opened_by_creates_whose_replies_were_all_lost_do_not_stay_open(s3_store) -> None:
    # Every attempt opened an upload and none learned its id; the call failed, and the sweep
    # ran only after a create that succeeded: all of them stayed open for good.
    store = s3_store
    store.config = replace(
        store.config,
        multipart_part_bytes=5 * 2**20,
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0),
    )
    store._client = _EveryCreateReplyLost(store._client)
    chunks = [bytes([i]) * (2**20 + 7) for i in range(6)]
    with pytest.raises(StoreError, match=r"create_multipart_upload of s3://.*w00000\.blob"):
        store.put_stream("v00000001/tp0/w00000.blob", iter(chunks))
    assert store._client.creates == 3
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []
    assert not store.exists("v00000001/tp0/w00000.blob")


class _StampedUploads(_CreateReplyLost):
    """Like _CreateReplyLost, and once the retried create has opened its upload another
    client opens one of the same key. moto lists every upload with one constant
    ``Initiated``, so each upload is stamped with when it was created, as AWS lists it."""

    def __init__(self, client, other) -> None:
        super().__init__(client)
        self._other, self.stamps, self.others = other, {}, []

    def _stamped(self, client, **kwargs):
        reply = client.create_multipart_upload(**kwargs)
        self.stamps[reply["UploadId"]] = datetime.datetime.now(datetime.UTC)
        return reply

    def create_multipart_upload(self, **kwargs):
        self.creates += 1
        reply = self._stamped(self._client, **kwargs)
        if self.creates == 1:
            raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")
        time.sleep(0.3)  # ours is open; the other client's comes after it
        self.others.append(self._stamped(self._other, **kwargs)["UploadId"])
        return reply

    def list_multipart_uploads(self, **kwargs):
        listed = self._client.list_multipart_uploads(**kwargs)
        for upload in listed.get("Uploads", ()):
            upload["Initiated"] = self.stamps.get(upload["UploadId"], upload["Initiated"])
        return listed


def test_the_strays_aborted_after_a_lost_create_reply_are_never_uploads_opened_after_ours(
    s3_store, s3_server
) -> None:
    # Only uploads opened before ours within the window are a lost create's: another client's
    # upload opened after ours (streaming the same key) must not be pulled from under it.
    store = s3_store
    other = S3Store(store.bucket, config=s3_server.config())
    full = store._full("v00000001/tp0/w00000.blob")
    store._client = faulty = _StampedUploads(store._client, other._client)
    try:
        store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
        chunks = [bytes([i]) * (2**20 + 7) for i in range(6)]
        assert store.put_stream("v00000001/tp0/w00000.blob", iter(chunks)) == sum(map(len, chunks))
        listed = other._client.list_multipart_uploads(Bucket=store.bucket, Prefix=full)
        open_ids = [u["UploadId"] for u in listed.get("Uploads", []) if u["Key"] == full]
        assert open_ids == faulty.others  # the lost one aborted, the other client's open
    finally:
        for upload_id in faulty.others:
            other._client.abort_multipart_upload(Bucket=store.bucket, Key=full, UploadId=upload_id)
        other.close()


class _InterruptedListing(_CreateReplyLost):
    """Like _CreateReplyLost, and Ctrl-C arrives while the strays are listed."""

    def list_multipart_uploads(self, **kwargs):
        raise KeyboardInterrupt


def test_an_interrupt_while_the_strays_are_listed_leaves_only_the_lost_upload_open(
    s3_store,
) -> None:
    # The retried create's own upload, whose id put_stream had not been handed yet, stayed
    # open: put_stream's abort on an interrupt had no id to abort.
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    real = store._client
    store._client = _InterruptedListing(real)
    chunks = [bytes([i]) * (2**20 + 7) for i in range(6)]
    with pytest.raises(KeyboardInterrupt):
        store.put_stream("v00000001/tp0/w00000.blob", iter(chunks))
    full = store._full("v00000001/tp0/w00000.blob")
    uploads = real.list_multipart_uploads(Bucket=store.bucket, Prefix=full).get("Uploads", [])
    assert len(uploads) == 1  # the lost create's (its id never learned: lifecycle rules)
    real.abort_multipart_upload(Bucket=store.bucket, Key=full, UploadId=uploads[0]["UploadId"])


class _CompleteReplyLost:
    """complete_multipart_upload's first request is applied (``applied``) or not, and its
    reply lost; every retry is answered NoSuchUpload, as MinIO and AWS answer an upload that
    was completed (or aborted) already."""

    def __init__(self, client, *, applied: bool) -> None:
        self._client, self.applied, self.calls = client, applied, 0

    def complete_multipart_upload(self, **kwargs):
        self.calls += 1
        if self.calls == 1:
            if self.applied:
                self._client.complete_multipart_upload(**kwargs)
            raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")
        raise ClientError(
            {"Error": {"Code": "NoSuchUpload"}, "ResponseMetadata": {"HTTPStatusCode": 404}},
            "CompleteMultipartUpload",
        )

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("applied", [True, False])
def test_a_completed_upload_whose_reply_was_lost_is_told_by_its_etag(s3_store, applied) -> None:
    # The retry's NoSuchUpload was mapped to KeyNotFoundError ("key not found") for a blob
    # that was stored intact, and the publish failed.
    store = s3_store
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    store._client = _CompleteReplyLost(store._client, applied=applied)
    chunks = [bytes([i]) * (2**20 + 7) for i in range(11)]
    if applied:
        assert store.put_stream("v00000001/tp0/w00000.blob", iter(chunks)) == sum(map(len, chunks))
        assert store.get("v00000001/tp0/w00000.blob") == b"".join(chunks)
    else:
        with pytest.raises(StoreError, match="no longer knows the upload") as info:
            store.put_stream("v00000001/tp0/w00000.blob", iter(chunks))
        assert not isinstance(info.value, KeyNotFoundError)
        assert not store.exists("v00000001/tp0/w00000.blob")
    assert store._client.calls == 2


def test_part_etags_that_are_not_md5s_make_no_multipart_etag() -> None:
    assert multipart_etag(['"0123456789abcdef0123456789abcdef"']) is not None
    for etags in (['"not-hex"'], ['"abcd"'], [None]):
        assert multipart_etag(etags) is None  # judged not written, never a ValueError


class _FirstBodyCutShort:
    """The first get_object's body (with ``ranged``: only if that one is ranged) is cut
    short to ``keep`` bytes, its connection dropped mid-body."""

    def __init__(self, client, *, keep: int, ranged: bool = False) -> None:
        self._client, self.keep, self.ranged, self.reads = client, keep, ranged, 0

    def get_object(self, **kwargs):
        response = self._client.get_object(**kwargs)
        self.reads += 1
        if self.reads == 1 and (not self.ranged or "Range" in kwargs):
            data = response["Body"].read()
            response["Body"] = StreamingBody(io.BytesIO(data[: self.keep]), len(data))
        return response

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_read_back_cut_short_is_retried_not_taken_for_another_writers_bytes(s3_store) -> None:
    # A prefix of our own bytes read back was judged another writer's: CommitConflictError,
    # and the publisher took its own commit for a lost race.
    _few_retries(s3_store)
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    # the first put_object delivered and its reply lost, the retry 412, the read-back cut short
    s3_store._client = _FirstBodyCutShort(_ReplyLost(s3_store._client, delivered=True), keep=3)
    s3_store.put_if_absent("v00000011/MANIFEST.json", b"ours, a few bytes long")
    assert s3_store._client.reads >= 2
    assert s3_store.get("v00000011/MANIFEST.json") == b"ours, a few bytes long"


def test_a_ranged_read_cut_short_is_retried_not_reported_past_the_end(s3_store) -> None:
    # One attempt, then "reads past the end" for a range inside the object.
    _few_retries(s3_store)
    s3_store.put("v00000001/tp0/w00000.blob", bytes(range(200)))
    s3_store._client = _FirstBodyCutShort(s3_store._client, keep=5, ranged=True)
    assert s3_store.get_range("v00000001/tp0/w00000.blob", 10, 64) == bytes(range(10, 74))
    assert s3_store._client.reads == 2


class _Answers:
    """A client whose named calls answer ``reply`` (a reply missing fields S3 always sends)."""

    def __init__(self, client, **replies) -> None:
        self._client, self.replies = client, replies

    def __getattr__(self, name):
        if name in self.replies:
            return lambda **kwargs: self.replies[name]
        return getattr(self._client, name)


def test_replies_missing_the_fields_s3_always_sends_are_store_errors(s3_store) -> None:
    # A bare KeyError ('ETag', 'UploadId', 'ContentLength', 'LastModified') escaped.
    store = s3_store
    store.put("k", b"v")
    store.config = replace(store.config, multipart_part_bytes=5 * 2**20)
    real = store._client
    big = [b"x" * (6 * 2**20)]
    for replies, call, field in (
        ({"create_multipart_upload": {}}, lambda: store.put_stream("b", iter(big)), "UploadId"),
        ({"upload_part": {}}, lambda: store.put_stream("b", iter(big)), "ETag"),
        ({"head_object": {}}, lambda: store.size("k"), "ContentLength"),
        ({"head_object": {"ContentLength": 1}}, lambda: store.modified("k"), "LastModified"),
    ):
        store._client = _Answers(real, **replies)
        with pytest.raises(StoreError, match=f"the server's reply has no {field}"):
            call()
    store._client = real
    assert not store.exists("b")


class _ReplyLost:
    """A client wrapper whose first put_object loses its connection: after the request
    reached the server (``delivered=True``) or before (``delivered=False``). The caller cannot
    tell which, exactly as with a real connection reset."""

    def __init__(self, client, *, delivered: bool) -> None:
        self._client = client
        self.delivered = delivered
        self.calls = 0

    def put_object(self, **kwargs):
        self.calls += 1
        if self.calls == 1:
            if self.delivered:
                self._client.put_object(**kwargs)
            raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")
        return self._client.put_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_put_if_absent_whose_reply_was_lost_recognises_its_own_commit(s3_store) -> None:
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    s3_store._client = _ReplyLost(s3_store._client, delivered=True)
    s3_store.put_if_absent("v00000004/MANIFEST.json", b"ours")
    assert s3_store._client.calls == 2  # the retry got 412 and found our bytes
    assert s3_store.get("v00000004/MANIFEST.json") == b"ours"


def test_put_if_absent_after_a_lost_reply_still_loses_to_a_different_winner(s3_store) -> None:
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    s3_store._client = _ReplyLost(s3_store._client, delivered=False)
    s3_store.put("v00000005/MANIFEST.json", b"theirs")  # another publisher, meanwhile
    with pytest.raises(CommitConflictError):
        s3_store.put_if_absent("v00000005/MANIFEST.json", b"ours")
    assert s3_store._client.calls == 3  # theirs, our lost attempt, our retry that got 412
    assert s3_store.get("v00000005/MANIFEST.json") == b"theirs"


class _NoReply:
    """A client whose put_object never gets a reply: the first request reaches the server
    (``delivered``) or not, every attempt then loses its connection (``error``)."""

    def __init__(self, client, *, delivered: bool, error) -> None:
        self._client, self.delivered, self.error = client, delivered, error

    def put_object(self, **kwargs):
        if self.delivered:
            self.delivered = False
            self._client.put_object(**kwargs)
        raise self.error(endpoint_url="http://fake-no-reply")

    def __getattr__(self, name):
        return getattr(self._client, name)


def _few_retries(store) -> None:
    store.config = replace(
        store.config,
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0, deadline_s=5.0),
    )


def test_put_if_absent_that_may_have_landed_says_its_outcome_is_unknown(s3_store) -> None:
    _few_retries(s3_store)
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    s3_store._client = _NoReply(s3_store._client, delivered=True, error=ConnectionClosedError)
    with pytest.raises(OutcomeUnknownError, match=r"v00000007/MANIFEST.json.*may hold"):
        s3_store.put_if_absent("v00000007/MANIFEST.json", b"ours")
    assert s3_store.get("v00000007/MANIFEST.json") == b"ours"  # it had landed


def test_put_if_absent_that_never_connected_is_a_plain_failure(s3_store) -> None:
    _few_retries(s3_store)
    s3_store._client = _NoReply(s3_store._client, delivered=False, error=EndpointConnectionError)
    with pytest.raises(StoreError) as info:
        s3_store.put_if_absent("v00000008/MANIFEST.json", b"ours")
    assert not isinstance(info.value, OutcomeUnknownError), "nothing was sent: a verdict"
    assert not s3_store.exists("v00000008/MANIFEST.json")


class _AlwaysInFlightConflict:
    def __init__(self, client) -> None:
        self._client = client

    def put_object(self, **kwargs):
        raise ClientError(
            {
                "Error": {"Code": "ConditionalRequestConflict", "Message": "in flight"},
                "ResponseMetadata": {"HTTPStatusCode": 409},
            },
            "PutObject",
        )

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_persistent_409_conditional_conflict_is_reported_as_a_commit_conflict(s3_store) -> None:
    s3_store.config = replace(
        s3_store.config,
        retry=RetryPolicy(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0, deadline_s=5.0),
    )
    s3_store._client = _AlwaysInFlightConflict(s3_store._client)
    with pytest.raises(CommitConflictError, match="kept conflicting"):
        s3_store.put_if_absent("v00000006/MANIFEST.json", b"x")


class _LostThenInFlight:
    """The first put_object is delivered but its reply lost; every retry then gets 409 (the
    server still processing a conditional write on the key: possibly that very first one)."""

    def __init__(self, client) -> None:
        self._client, self.calls = client, 0

    def put_object(self, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self._client.put_object(**kwargs)
            raise ConnectionClosedError(endpoint_url="http://fake-lost-reply")
        return _AlwaysInFlightConflict(self._client).put_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_409_after_an_attempt_that_may_have_landed_is_an_unknown_outcome(s3_store) -> None:
    # The write in flight behind the conflicts may be our own: "taken" would be a verdict with
    # nothing behind it, and a publisher would reuse the number and overwrite the blobs a late
    # manifest names.
    _few_retries(s3_store)
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    s3_store._client = _LostThenInFlight(s3_store._client)
    with pytest.raises(OutcomeUnknownError, match="may be ours"):
        s3_store.put_if_absent("v00000009/MANIFEST.json", b"ours")


class _ReadBackFails:
    """A lost reply to a delivered put_object, then 412 on the retry, and every read back of
    the key fails (503 SlowDown)."""

    def __init__(self, client) -> None:
        self._inner = _ReplyLost(client, delivered=True)

    def put_object(self, **kwargs):
        return self._inner.put_object(**kwargs)

    def get_object(self, **kwargs):
        raise ClientError(
            {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
            "GetObject",
        )

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_412_whose_read_back_fails_is_an_unknown_outcome_not_a_conflict(s3_store) -> None:
    _few_retries(s3_store)
    s3_store._check_conditional_writes("probe")  # the server's probe, before the faults begin
    real = s3_store._client
    s3_store._client = _ReadBackFails(real)
    with pytest.raises(OutcomeUnknownError, match="may hold"):
        s3_store.put_if_absent("v00000010/MANIFEST.json", b"ours")
    s3_store._client = real
    assert s3_store.get("v00000010/MANIFEST.json") == b"ours"  # it was ours all along


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"endpoint_url": "127.0.0.1:9000"}, "endpoint_url"),
        ({"access_key_id": "a"}, "together"),
        ({"secret_access_key": "b"}, "together"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"multipart_part_bytes": 2**20}, "multipart_part_bytes"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"region": ""}, "region"),
    ],
)
def test_s3_config_rejects_bad_fields_naming_them(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        S3Config(**kwargs)


def test_s3_config_never_prints_its_secret() -> None:
    config = S3Config(access_key_id="AKIDEXAMPLE", secret_access_key="very-secret-value")
    assert "very-secret-value" not in repr(config)


class _TokenExpired:
    """A client whose calls fail as S3 fails them once a session token has expired, while
    ``expired`` is set."""

    def __init__(self, client) -> None:
        self._client = client
        self.expired = True

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not self.expired or not callable(attr):
            return attr

        def refused(**kwargs):
            raise ClientError(
                {
                    "Error": {"Code": "ExpiredToken", "Message": "The provided token has expired."},
                    "ResponseMetadata": {"HTTPStatusCode": 400},
                },
                name,
            )

        return refused


def test_an_expired_session_token_is_a_store_error_naming_the_key_and_the_remedy(s3_store) -> None:
    s3_store.put("v00000001/MANIFEST.json", b"m")
    s3_store._client = _TokenExpired(s3_store._client)
    with pytest.raises(StoreError, match=r"v00000001/MANIFEST.json.*ExpiredToken.*[Rr]enew"):
        s3_store.get("v00000001/MANIFEST.json")
    with pytest.raises(StoreError, match=r"LATEST.*ExpiredToken.*[Rr]enew"):
        s3_store.put("LATEST", b"x")
    s3_store._client.expired = False  # credentials renewed: the same store works again
    assert s3_store.get("v00000001/MANIFEST.json") == b"m"
    assert not s3_store.exists("LATEST")


class _BodyCutShort:
    """A client whose first ``times`` get_object responses lose the connection halfway
    through the body (the headers announce the whole object)."""

    def __init__(self, client, times: int) -> None:
        self._client = client
        self.times = times

    def get_object(self, **kwargs):
        response = self._client.get_object(**kwargs)
        if self.times <= 0:
            return response
        self.times -= 1
        data = response["Body"].read()
        response["Body"] = StreamingBody(io.BytesIO(data[: len(data) // 2]), len(data))
        return response

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("max_bytes", [None, 300_000, 10**9])
def test_a_body_cut_short_is_retried_and_never_returned_as_the_object(s3_store, max_bytes) -> None:
    data = bytes(range(256)) * 1000
    s3_store.put("v00000001/tp0/w.blob", data)
    s3_store._client = _BodyCutShort(s3_store._client, times=2)
    assert s3_store.get("v00000001/tp0/w.blob", max_bytes=max_bytes) == data
    s3_store.config = replace(
        s3_store.config,
        retry=RetryPolicy(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0, deadline_s=5.0),
    )
    s3_store._client.times = 2  # cut short on every attempt: an error, never half the bytes
    with pytest.raises(StoreError, match=r"w\.blob.*2 attempts"):
        s3_store.get("v00000001/tp0/w.blob", max_bytes=max_bytes)


def test_a_missing_bucket_is_an_error_naming_it_not_a_missing_key(s3_server) -> None:
    bucket = f"ds-missing-{uuid.uuid4().hex[:12]}"
    store = S3Store(bucket, "run", config=s3_server.config())
    with pytest.raises(StoreError, match=rf"bucket '{bucket}' does not exist"):
        store.exists("LATEST")
    with pytest.raises(StoreError, match=rf"bucket '{bucket}' does not exist"):
        store.size("v00000001/MANIFEST.json")
    store.ensure_bucket()
    assert not store.exists("LATEST")  # a missing key in a bucket that exists
    store.put("LATEST", b"1")
    assert store.exists("LATEST") and store.size("LATEST") == 1


def test_a_bucket_deleted_under_a_waiting_reader_is_named_once_its_sighting_is_stale(
    s3_server, monkeypatch
) -> None:
    # once seen, a bucket stood forever: after it was deleted, every poll for the next
    # manifest answered "not there yet" and a receiver waited without end
    bucket = f"ds-gone-{uuid.uuid4().hex[:12]}"
    store = S3Store(bucket, "run", config=s3_server.config())
    store.ensure_bucket()
    store.put("LATEST", b"1")
    assert store.exists("LATEST") and not store.exists("v00000002/MANIFEST.json")
    store.delete("LATEST")
    store._client.delete_bucket(Bucket=bucket)
    assert not store.exists("v00000002/MANIFEST.json")  # the sighting still stands
    clock = time.monotonic() + s3_module.BUCKET_RECHECK_S + 1
    monkeypatch.setattr(s3_module.time, "monotonic", lambda: clock)
    with pytest.raises(StoreError, match=rf"bucket '{bucket}' does not exist"):
        store.exists("v00000002/MANIFEST.json")


class _Body:
    """A canned HTTP body for botocore's parser."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_):
        yield self.data


@contextlib.contextmanager
def _no_conditional_writes(store) -> Iterator[list[int]]:
    """While open, ``store``'s server answers as one without conditional writes: a PutObject
    with If-None-Match gets 501 NotImplemented (the other requests reach the server). Yields
    the list each refused request's status is appended to. The client is the session's, shared
    by every S3 test: the handler goes when the block ends."""
    from botocore.awsrequest import AWSResponse

    refused: list[int] = []
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code><Message>A '
        b"header you provided implies functionality that is not implemented</Message></Error>"
    )

    def answer(request, **_):
        if request.headers.get("If-None-Match") in ("*", b"*"):
            refused.append(501)
            return AWSResponse(request.url, 501, {"Content-Type": "application/xml"}, _Body(body))
        return None

    events = store._client.meta.events
    events.register("before-send.s3.PutObject", answer)
    try:
        yield refused
    finally:
        events.unregister("before-send.s3.PutObject", answer)


def test_a_server_without_conditional_writes_is_refused_at_once_naming_the_remedy(
    s3_store,
) -> None:
    # 501 is a refusal no retry changes, not an outage: one attempt, nothing stored, and the
    # error says what the server lacks (not "may hold these bytes", not "is it reachable?")
    s3_store.config = replace(s3_store.config, retry=PATIENT)
    with _no_conditional_writes(s3_store) as refused:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            s3_store.put_if_absent("v00000001/MANIFEST.json", b"m1")
        assert time.monotonic() - t0 < 2.0
        assert refused == [501], refused
        assert not isinstance(info.value, OutcomeUnknownError), info.value
        message = str(info.value)
        assert "v00000001/MANIFEST.json" in message and "If-None-Match" in message, message
        assert "conditional writes" in message, message
        assert not s3_store.exists("v00000001/MANIFEST.json")
        s3_store.put("v00000001/tp0/w00000.blob", b"blob")  # plain writes still work
        assert s3_store.get("v00000001/tp0/w00000.blob") == b"blob"
    s3_store.put_if_absent("v00000001/MANIFEST.json", b"m1")  # the handler is gone


def test_a_served_range_is_checked_against_the_one_asked_whatever_the_units_case() -> None:
    s3_module._check_served("bytes 100-115/16384", 100, 16, "get_range")
    s3_module._check_served("Bytes 100-107/108", 100, 16, "get_range")  # ends at the object's end
    for served in ("bytes 0-15/16384", "bytes 100-116/16384", "bytes 100-99/16384", "items 1-2/3"):
        with pytest.raises(StoreError, match=r"not a part of bytes 100-115"):
            s3_module._check_served(served, 100, 16, "get_range")


class _RecursionInTheHttpClient:
    """Every request ends as a redirect loop does when the caller's stack was already deep:
    the recursion runs out inside the HTTP client, which wraps it."""

    def __init__(self, client) -> None:
        self._client = client
        self.calls = 0

    def _loop(self, **kwargs):
        from botocore.exceptions import HTTPClientError

        self.calls += 1
        raise HTTPClientError(error=RecursionError("maximum recursion depth exceeded"))

    get_object = head_object = put_object = list_objects_v2 = _loop

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_redirect_loop_the_http_client_wrapped_is_named_not_retried(s3_store) -> None:
    # it was retried as a dropped connection, then reported as an unreachable server (an
    # OutcomeUnknownError for a conditional write, which a redirect never applies)
    s3_store._check_conditional_writes("probe")
    s3_store._client = _RecursionInTheHttpClient(s3_store._client)
    for call in (
        lambda: s3_store.get("v00000001/MANIFEST.json"),
        lambda: s3_store.exists("v00000001/MANIFEST.json"),
        lambda: s3_store.put_if_absent("v00000001/MANIFEST.json", b"m"),
    ):
        before = s3_store._client.calls
        with pytest.raises(StoreError, match="kept redirecting the request") as info:
            call()
        assert not isinstance(info.value, OutcomeUnknownError)
        assert s3_store._client.calls == before + 1  # never retried
