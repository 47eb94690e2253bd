"""S3Store: objects in an S3-compatible bucket under ``prefix/``, through boto3.

- ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *``: the server refuses (HTTP 412)
  a second create of the same key, which fences a second publisher racing for one version.
  A 409 ``ConditionalRequestConflict`` (another conditional write in flight) is retried; if it
  persists it is reported as a commit conflict.
- Transient failures (connection refused or reset while a server restarts, timeouts, 5xx,
  throttling) are retried with backoff (:mod:`deltasync.store.retry`); every other failure
  becomes a StoreError that names the endpoint, bucket and key.
- A retried ``put_if_absent`` whose first attempt may have landed (the connection dropped
  after the request was sent) reads the key back when it gets 412: if it holds exactly our
  bytes, the earlier attempt won and the call succeeds. (So two writers that race with
  byte-identical payloads can both succeed; both then agree on the stored bytes.)
- ``put_stream`` uses multipart upload above one part size, aborting the upload on failure.

boto3 is imported when an S3Store is created, so the package imports without it. Credentials
come from :class:`S3Config`; when left unset, boto3's own default chain is used. Nothing here
knows what the bytes mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from deltasync.errors import CommitConflictError, ConfigError, KeyNotFoundError, StoreError
from deltasync.store.base import (
    Bytes,
    as_bytes,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)
from deltasync.store.retry import RetriesExhausted, call_with_retries
from deltasync.store.s3_config import (
    CONFLICT,
    IN_FLIGHTCONFLICT,
    NOT_FOUND,
    S3Config,
    error_code,
    is_transient,
    make_client,
    redact_url,
)

T = TypeVar("T")


class S3Store:
    """Keys live at ``s3://{bucket}/{prefix}/{key}``."""

    def __init__(self, bucket: str, prefix: str = "", *, config: S3Config | None = None) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket:
            raise ConfigError(f"S3Store bucket must be a bucket name without '/', got {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.config = config or S3Config()
        self._client = make_client(self.config)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}'{self._at()})"

    def _at(self) -> str:
        endpoint = self.config.endpoint_url
        return f" at {redact_url(endpoint)}" if endpoint else ""

    def with_prefix(self, prefix: str) -> S3Store:
        """A store for ``{self.prefix}/{prefix}`` sharing this one's client and connections
        (creating a boto3 client costs ~0.1-0.3 s)."""
        prefix = prefix.strip("/")
        check_key(prefix)
        child = object.__new__(S3Store)
        child.bucket = self.bucket
        child.prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        child.config = self.config
        child._client = self._client
        return child

    def close(self) -> None:
        """Close the client's connections (shared with stores made by ``with_prefix``)."""
        self._client.close()

    # --- helpers ------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}{self._at()}"

    def _call(self, what: str, key: str, op: Callable[[int], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call_with_retries(op, policy=self.config.retry, is_transient=is_transient)
        except RetriesExhausted as exc:
            last = exc.last
            if isinstance(last, ClientError) and error_code(last)[0] in IN_FLIGHTCONFLICT:
                raise CommitConflictError(
                    f"S3 {what} of {self._url(key)}: another conditional write kept conflicting "
                    f"for {exc.attempts} attempts; treat the key as taken"
                ) from last
            raise StoreError(
                f"S3 {what} of {self._url(key)} failed after {exc.attempts} attempts over "
                f"{exc.elapsed_s:.1f} s: {type(last).__name__}: {last}. Is the server reachable? "
                "Raise S3Config.retry to wait longer"
            ) from last
        except ClientError as exc:
            raise self._map_client_error(what, key, exc) from exc
        except BotoCoreError as exc:
            raise StoreError(f"S3 {what} of {self._url(key)} failed: {exc}") from exc

    def _map_client_error(self, what: str, key: str, exc: BaseException) -> StoreError:
        code, status = error_code(exc)
        if code in NOT_FOUND or (status == 404 and code != "NoSuchBucket"):
            return KeyNotFoundError(f"key {key!r} not found: {self._url(key)}")
        if code in CONFLICT or status == 412:
            return CommitConflictError(
                f"key {key!r} already exists at {self._url(key)}; another writer committed it first"
            )
        if code == "NoSuchBucket":
            return StoreError(
                f"S3 bucket {self.bucket!r} does not exist ({what} of {self._url(key)})"
            )
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return StoreError(
                f"S3 {what} of {self._url(key)} was refused ({code}); check S3Config credentials"
            )
        return StoreError(f"S3 {what} of {self._url(key)} failed: {code or status}: {exc}")

    # --- reads --------------------------------------------------------------------------

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        full = self._full(check_key(key))
        check_max_bytes(key, max_bytes)

        def op(_: int) -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
            body = response["Body"]
            try:
                # The object's size comes with the response headers: refuse before the body.
                size = response.get("ContentLength")
                if max_bytes is not None and isinstance(size, int) and size > max_bytes:
                    raise too_large(key, self, size, max_bytes)
                if max_bytes is None:
                    return body.read()  # inside op: a connection drop mid-body is retried
                # A server that under-reports the length still cannot make us read more.
                data = body.read(max_bytes + 1)
                if len(data) > max_bytes:
                    raise too_large(key, self, f"more than {max_bytes}", max_bytes)
                return data
            finally:
                body.close()

        return self._call("get", key, op)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        if length == 0:
            size = self.size(key)
            if start > size:
                raise StoreError(
                    f"get_range({key!r}, {start}, 0) starts past the end ({size} bytes)"
                )
            return b""
        full = self._full(check_key(key))

        def op(_: int) -> bytes:
            from botocore.exceptions import ClientError

            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as exc:
                if error_code(exc)[0] == "InvalidRange":
                    return b""  # starts past the end: reported below like a short range
                raise
            return response["Body"].read()

        data = self._call("get_range", key, op)
        if len(data) != length:
            raise StoreError(
                f"get_range({key!r}, {start}, {length}) reads past the end of {self._url(key)} "
                f"(got {len(data)} bytes)"
            )
        return data

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except KeyNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        full = self._full(check_key(key))

        def op(_: int) -> int:
            return int(self._client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])

        return self._call("size", key, op)

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full_prefix = self._full(prefix) if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def op(_: int) -> list[str]:
            keys = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Contents", ()):
                    keys.append(obj["Key"][strip:])
            return keys

        keys = self._call("list", prefix or "(all)", op)
        valid = []
        for key in keys:
            try:
                valid.append(check_key(key))
            except StoreError:
                continue  # objects this API could never address (written by someone else)
        valid.sort()
        return valid

    # --- writes -------------------------------------------------------------------------

    def put(self, key: str, data: Bytes) -> None:
        full = self._full(check_key(key))
        body = bytes(as_bytes(data))
        self._call(
            "put", key, lambda _: self._client.put_object(Bucket=self.bucket, Key=full, Body=body)
        )

    def put_if_absent(self, key: str, data: Bytes) -> None:
        from botocore.exceptions import ClientError

        full = self._full(check_key(key))
        body = bytes(as_bytes(data))
        maybe_landed = False

        def op(attempt: int) -> None:
            nonlocal maybe_landed
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
            except ClientError as exc:
                code, status = error_code(exc)
                if (
                    maybe_landed
                    and (code in CONFLICT or status == 412)
                    and self._read_quietly(full, len(body)) == body
                ):
                    return  # our earlier attempt committed before its reply was lost
                if is_transient(exc):
                    maybe_landed = True
                raise
            except Exception as exc:
                if is_transient(exc):
                    maybe_landed = True
                raise

        self._call("put_if_absent", key, op)

    def _read_quietly(self, full: str, expected: int) -> bytes | None:
        """The object if it is at most one byte longer than ``expected`` (enough to tell it
        from our bytes; a huge object planted there is never read whole), else None."""
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return body.read(expected + 1)
            finally:
                body.close()
        except Exception:
            return None

    def put_stream(self, key: str, chunks: Iterable[Bytes]) -> int:
        full = self._full(check_key(key))
        part_bytes = self.config.multipart_part_bytes
        buf = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        total = 0

        def upload(data: bytes) -> None:
            number = len(parts) + 1
            response = self._call(
                "upload_part",
                key,
                lambda _: self._client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=data
                ),
            )
            parts.append({"PartNumber": number, "ETag": response["ETag"]})

        try:
            for chunk in chunks:
                view = as_bytes(chunk)
                total += len(view)
                buf += view
                while len(buf) >= part_bytes:
                    if upload_id is None:
                        upload_id = self._call(
                            "create_multipart_upload",
                            key,
                            lambda _: self._client.create_multipart_upload(
                                Bucket=self.bucket, Key=full
                            )["UploadId"],
                        )
                    upload(bytes(buf[:part_bytes]))
                    del buf[:part_bytes]
            if upload_id is None:
                self.put(key, bytes(buf))
                return total
            if buf or not parts:
                upload(bytes(buf))
            self._call(
                "complete_multipart_upload",
                key,
                lambda _: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except BaseException:
            if upload_id is not None:
                try:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=full, UploadId=upload_id
                    )
                except Exception:
                    pass  # the bucket's lifecycle rules reap uploads we cannot abort now
            raise
        return total

    def delete(self, key: str) -> None:
        full = self._full(check_key(key))
        self._call(
            "delete", key, lambda _: self._client.delete_object(Bucket=self.bucket, Key=full)
        )

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests, demos and fresh deployments)."""
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.config.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.config.region}

        def op(_: int) -> None:
            try:
                self._client.create_bucket(**kwargs)
            except ClientError as exc:
                if error_code(exc)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._call("create_bucket", "(bucket)", op)
