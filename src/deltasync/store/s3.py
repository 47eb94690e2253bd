"""S3Store: objects in an S3-compatible bucket under ``prefix/``, through boto3.

- ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *``: the server refuses (HTTP 412)
  a second create of the same key, which fences a second publisher racing for one version.
  A 409 ``ConditionalRequestConflict`` (another conditional write in flight) is retried; if it
  persists it is reported as a commit conflict.
- Transient failures (connection refused or reset while a server restarts, timeouts, 5xx,
  throttling, a body that does not match the server's checksum) are retried with backoff (:mod:`deltasync.store.base`); every other failure
  becomes a StoreError that names the endpoint, bucket and key.
- A retried ``put_if_absent`` whose first attempt may have landed (the connection dropped
  after the request was sent) reads the key back when it gets 412: if it holds exactly our
  bytes, the earlier attempt won and the call succeeds. (So two writers that race with
  byte-identical payloads can both succeed; both then agree on the stored bytes.) When it
  fails after such an attempt, it raises OutcomeUnknownError: the server may still apply
  the request later, so the key may hold our bytes now or later.
- ``put_stream`` uses multipart upload above one part size, aborting the upload on failure
  (the abort retried), and the upload a create whose reply was lost left open;
  ``abort_uploads`` aborts what is still open under a prefix (retention calls it for each
  version it deletes: a create the server applied after its call had ended).
- An ``https://`` endpoint is verified against ``S3Config.ca_bundle`` (botocore's bundle when
  unset); a TLS connection no retry can make (a certificate not verified, a server that does
  not speak TLS there, a CA bundle that cannot be read) is a StoreError at once, saying what
  to give or change.

boto3 is imported when an S3Store is created, so the package imports without it, and an
:class:`S3Config` can be built, validated and printed without boto3 installed (botocore is
imported only inside the classifiers, which run only after a boto3 call failed). Credentials
come from :class:`S3Config`; when left unset, boto3's own default chain is used; an endpoint URL
with user info, a query string or a fragment is refused, reprs never show secrets, and every
error built from a botocore exception (or botocore's refusal of the settings, a ConfigError
naming the field) shows the endpoint redacted. Nothing here knows what the bytes mean.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from deltasync.errors import (
    CommitConflictError,
    ConfigError,
    KeyNotFoundError,
    OutcomeUnknownError,
    StoreError,
)
from deltasync.names import probe_key
from deltasync.store.base import (
    Bytes,
    RetriesExhausted,
    RetryPolicy,
    as_bytes,
    call_with_retries,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)
from deltasync.validate import check_instance, check_int, check_number

_OWNER = "S3Config"
log = logging.getLogger(__name__)

MIN_PART = 5 * 2**20  # S3's minimum size of every part but the last
MAX_PART = 5 * 2**30
NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
CONFLICT = {"PreconditionFailed", "412"}
IN_FLIGHTCONFLICT = {"ConditionalRequestConflict", "409"}
EXPIRED = {"ExpiredToken", "InvalidToken", "TokenRefreshRequired"}  # a session token's end
# What the server does not implement (a server without conditional writes answers a PutObject
# with If-None-Match so): refused, nothing stored, and refused again on every retry.
UNSUPPORTED = {"NotImplemented", "501"}
UNSUPPORTED_STATUS = {501, 505}
TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "500",
    "502",
    "503",
    "504",
}


# botocore's own check of a region name (``botocore.utils.validate_region_name``): a DNS label
# of letters, digits and inner hyphens, not all digits. Checked here so a bad region is a
# ConfigError naming the field, before any client is built.
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)", re.IGNORECASE)  # RFC 9110
BUCKET_RECHECK_S = 30.0  # how long a bucket seen stands for a HEAD that answers 404
_REGION = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")


def redact_url(url: str) -> str:
    """``url`` without user info, query or fragment: what may appear in reprs, logs and errors."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<unparseable endpoint URL>"
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """How to reach an S3-compatible server. ``endpoint_url=None`` means AWS itself.

    Credentials go in ``access_key_id`` / ``secret_access_key`` (never printed); an endpoint URL
    that embeds user info is refused, so it cannot leak through reprs, logs or errors."""

    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: str = "auto"  # "path" for most self-hosted servers
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 32
    multipart_part_bytes: int = 64 * 2**20
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # PEM file of the CA certificates an https:// endpoint's certificate is verified against
    # (a self-hosted server with a private CA); None: botocore's (certifi's) bundle
    ca_bundle: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not (
            isinstance(self.endpoint_url, str)
            and self.endpoint_url.startswith(("http://", "https://"))
        ):
            shown = (
                redact_url(self.endpoint_url)
                if isinstance(self.endpoint_url, str)
                else type(self.endpoint_url).__name__
            )
            raise ConfigError(
                f"S3Config.endpoint_url must start with http:// or https://, got {shown!r}"
            )
        if self.endpoint_url is not None:
            try:
                parts = urlsplit(self.endpoint_url)
                _ = parts.port  # raises ValueError for a malformed port
            except ValueError:
                raise ConfigError(
                    f"S3Config.endpoint_url {redact_url(self.endpoint_url)!r} is not a valid URL"
                ) from None
            if parts.username is not None or parts.password is not None:
                raise ConfigError(
                    f"S3Config.endpoint_url {redact_url(self.endpoint_url)!r} embeds user "
                    "info; pass credentials as access_key_id / secret_access_key instead"
                )
            if not parts.hostname:
                raise ConfigError(
                    f"S3Config.endpoint_url {redact_url(self.endpoint_url)!r} has no host"
                )
            if "?" in self.endpoint_url or "#" in self.endpoint_url:
                # botocore cannot use one, and a query is where presigned tokens live: it
                # would be printed back verbatim in botocore's own error message.
                raise ConfigError(
                    f"S3Config.endpoint_url {redact_url(self.endpoint_url)!r} has a query "
                    "string or fragment (not shown); give the endpoint as scheme://host[:port]"
                    "[/path] and credentials as access_key_id / secret_access_key / "
                    "session_token"
                )
        if not isinstance(self.region, str) or not _REGION.fullmatch(self.region):
            raise ConfigError(
                f"S3Config.region must be a region name such as 'us-east-1' (letters, digits "
                f"and inner hyphens, at most 63, not all digits), got {self.region!r}"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "S3Config.access_key_id and S3Config.secret_access_key must be given together "
                "(or both left unset to use boto3's default credential chain)"
            )
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(
                f"S3Config.addressing_style must be 'auto', 'path' or 'virtual', "
                f"got {self.addressing_style!r}"
            )
        for name in ("connect_timeout_s", "read_timeout_s"):
            check_number(_OWNER, name, getattr(self, name), unit="seconds")
        check_int(_OWNER, "max_pool_connections", self.max_pool_connections, lo=1)
        check_int(
            _OWNER, "multipart_part_bytes", self.multipart_part_bytes, lo=MIN_PART, hi=MAX_PART
        )
        check_instance(_OWNER, "retry", self.retry, RetryPolicy)
        if self.ca_bundle is not None and not (
            isinstance(self.ca_bundle, str) and self.ca_bundle.strip()
        ):
            raise ConfigError(
                f"S3Config.ca_bundle must be the path of a PEM file of CA certificates (or None "
                f"for botocore's bundle), got {self.ca_bundle!r}"
            )

    def __repr__(self) -> str:
        # Secrets are never shown; the endpoint only without query or fragment.
        endpoint = None if self.endpoint_url is None else redact_url(self.endpoint_url)
        creds = "explicit" if self.access_key_id is not None else "boto3 default chain"
        return (
            f"S3Config(endpoint_url={endpoint!r}, region={self.region!r}, "
            f"credentials={creds!r}, addressing_style={self.addressing_style!r})"
        )


def error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def redirect_loop(exc: BaseException) -> bool:
    """Whether ``exc`` is botocore following a redirect to itself until the stack ran out:
    a bare RecursionError, or one the HTTP client wrapped (where the caller's stack was
    already deep, the recursion ends inside the HTTP client)."""
    from botocore.exceptions import HTTPClientError

    if isinstance(exc, HTTPClientError):
        exc = getattr(exc, "kwargs", {}).get("error")
    return isinstance(exc, RecursionError)


def _urllib3_dropped(exc: BaseException) -> bool:
    """Whether ``exc`` is urllib3's own error for a connection dropped (or timed out) while a
    reply's body was read where botocore does not wrap it: the error reply of a streaming
    operation (a GetObject answered 404 or 500) is read while botocore parses it, so a body
    cut short there surfaces as a bare ``urllib3.exceptions.ProtocolError``."""
    try:
        from urllib3.exceptions import ProtocolError, ReadTimeoutError
    except ImportError:  # pragma: no cover - urllib3 comes with botocore
        return False
    return isinstance(exc, (ProtocolError, ReadTimeoutError))


# ssl's reasons for a handshake with a server that does not speak TLS on that port (an
# http:// server behind an https:// URL): its reply is not a TLS record.
_NOT_TLS = {"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}


def tls_refusal(exc: BaseException) -> str | None:
    """Why the TLS connection of ``exc`` (botocore's SSLError) can never be made by a retry,
    and what to do, or None (a handshake cut short by a reset is transient): a certificate
    not verified (an unknown CA, a host name it does not name), a server that does not speak
    TLS there, a CA bundle that cannot be loaded."""
    import ssl

    from botocore.exceptions import SSLError

    if not isinstance(exc, SSLError):
        return None
    cause = getattr(exc, "kwargs", {}).get("error")  # urllib3's SSLError, wrapping the reason
    reason = next((a for a in getattr(cause, "args", ()) if isinstance(a, BaseException)), cause)
    if isinstance(reason, ssl.SSLCertVerificationError) or (
        isinstance(reason, ValueError) and type(reason).__name__ == "CertificateError"
    ):  # (urllib3's own host-name check of an IP address raises its CertificateError)
        return (
            "the server's certificate was not verified. Give the CA that signed it as "
            "S3Config.ca_bundle (--s3-ca-bundle on the command line), and an endpoint host "
            "that the certificate names"
        )
    if isinstance(reason, ssl.SSLError) and getattr(reason, "reason", None) in _NOT_TLS:
        return (
            "the server does not speak TLS at this address. Use http:// for a plain-HTTP "
            "server, or the port where it serves https"
        )
    if isinstance(reason, OSError) and (
        not isinstance(reason, ssl.SSLError) or getattr(reason, "library", None) in ("X509", "PEM")
    ):
        return (
            "the CA bundle could not be loaded. Give S3Config.ca_bundle (--s3-ca-bundle, or "
            "$AWS_CA_BUNDLE when it is unset) as a readable PEM file of CA certificates"
        )
    return None


def checksum_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is botocore's check of a reply body against the checksum the server sent
    with it (an object written whole): a body damaged on the way, which a retry reads again
    (one damaged in storage fails every attempt)."""
    from botocore.exceptions import FlexibleChecksumError

    return isinstance(exc, FlexibleChecksumError) and "did not match" in str(exc)


def is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if redirect_loop(exc):
        return False  # a redirect answers a request without applying it: no retry changes it
    if tls_refusal(exc) is not None:
        return False  # a certificate or a protocol no retry changes; nothing was sent
    if isinstance(exc, (ConnectionError, HTTPClientError, IncompleteReadError)):
        return True
    if _urllib3_dropped(exc) or checksum_mismatch(exc):
        return True
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        if code in UNSUPPORTED or status in UNSUPPORTED_STATUS:
            return False  # a refusal that no retry changes
        return code in TRANSIENT_CODES or code in IN_FLIGHTCONFLICT or status >= 500
    return False


def _may_have_arrived(exc: BaseException) -> bool:
    """Whether the request of an attempt that failed with ``exc`` (not a ClientError: no
    answer came) may have reached the server, which may apply it later: a transient failure
    but a connection that never opened, which sent nothing."""
    from botocore.exceptions import ConnectionError as NotConnected

    return is_transient(exc) and not isinstance(exc, NotConnected)


def scrub_endpoint(text: str, endpoint_url: str | None) -> str:
    """``text`` with every copy of ``endpoint_url`` (and of its query and fragment) replaced by
    :func:`redact_url`'s form: what botocore's messages may repeat verbatim."""
    if not endpoint_url:
        return text
    text = text.replace(endpoint_url, redact_url(endpoint_url))
    try:
        parts = urlsplit(endpoint_url)
    except ValueError:
        return text
    for secret in (parts.query, parts.fragment):
        if secret:
            text = text.replace(secret, "<redacted>")
    return text


def make_client(config: S3Config) -> Any:
    """A boto3 S3 client for ``config``; ConfigError when botocore refuses the settings."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, InvalidRegionError
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "S3 storage needs boto3: pip install 'deltasync[s3]' (boto3==1.43.117)"
        ) from exc
    try:
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token,
            region_name=config.region,
        )
        client_config = Config(
            # One attempt per call inside botocore: retries are ours, so they are bounded by
            # S3Config.retry and put_if_absent can tell a lost reply from a lost race.
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            max_pool_connections=config.max_pool_connections,
            s3={"addressing_style": config.addressing_style},
            # the endpoint is the config's alone (None: AWS), never $AWS_ENDPOINT_URL or a
            # profile's endpoint_url, which botocore would otherwise apply unseen
            ignore_configured_endpoint_urls=True,
        )
        return session.client(
            "s3", endpoint_url=config.endpoint_url, config=client_config, verify=config.ca_bundle
        )
    except InvalidRegionError as exc:
        raise ConfigError(
            f"S3Config.region {config.region!r} is refused by botocore: {exc}"
        ) from None
    except (BotoCoreError, ValueError) as exc:
        # e.g. "Invalid endpoint: URL": botocore repeats the URL, so it is scrubbed, and the
        # cause is dropped for the same reason (a traceback would print it again).
        why = scrub_endpoint(f"{type(exc).__name__}: {exc}", config.endpoint_url)
        raise ConfigError(
            f"S3 client could not be built from {config!r} (check S3Config.endpoint_url, "
            f"region and addressing_style): {why}"
        ) from None


def _read_at_most(body: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes of a response body, until it ends (one read may return fewer)."""
    chunks: list[bytes] = []
    n = 0
    while n < limit:
        chunk = body.read(limit - n)
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def _read_whole(response: Any, body: Any, limit: int) -> bytes:
    """:func:`_read_at_most` of a reply's body, which must not end before the reply's
    ``ContentLength`` does (a bounded read does not check it): a body cut short raises
    IncompleteReadError, which the retries take as a dropped connection."""
    data = _read_at_most(body, limit)
    size = response.get("ContentLength")
    if isinstance(size, int) and len(data) < min(size, limit):
        from botocore.exceptions import IncompleteReadError

        raise IncompleteReadError(actual_bytes=len(data), expected_bytes=size)
    return data


def _check_served(served: str, start: int, length: int, what: str) -> None:
    """A ranged reply's Content-Range must start where the range asked and end inside it: a
    server (or proxy) that serves another part of the object is refused, never read as it."""
    match = _CONTENT_RANGE.fullmatch(served.strip())
    if match is None or int(match[1]) != start or not start <= int(match[2]) < start + length:
        raise StoreError(
            f"{what}: the server answered Content-Range {served!r}, not a part of bytes "
            f"{start}-{start + length - 1}; check the endpoint, or a proxy in front of it"
        )


def _field(response: Any, name: str, what: str, url: str) -> Any:
    """``response[name]``; a reply without it is a StoreError (not an S3 server's reply)."""
    try:
        return response[name]
    except (KeyError, TypeError):
        raise StoreError(
            f"S3 {what} of {url}: the server's reply has no {name}; it does not answer as S3 "
            "does (check the endpoint, or a proxy in front of it)"
        ) from None


def multipart_etag(part_etags: Iterable[str]) -> str | None:
    """The ETag S3 gives an object completed from parts with these ETags (each the MD5 of its
    part): the MD5 of their digests end to end, a dash and their count, quoted. None when a
    part's ETag is not an MD5 (a server that names parts otherwise)."""
    try:
        digests = [bytes.fromhex(e.strip('"')) for e in part_etags]
    except (AttributeError, ValueError):
        return None
    if any(len(d) != 16 for d in digests):
        return None
    return f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(digests)}"'


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
        # A HEAD 404 cannot tell a missing key from a missing bucket: when the bucket was last
        # seen (monotonic seconds), so a bucket deleted under a waiting receiver is named.
        self._bucket_seen_at: float | None = None
        # set once the server refused a second conditional write (shared with with_prefix)
        self._conditional_honoured = threading.Event()

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}'{self._at()})"

    def _at(self) -> str:
        endpoint = self.config.endpoint_url
        return f" at {redact_url(endpoint)}" if endpoint else ""

    def _endpoint(self) -> str:
        endpoint = self.config.endpoint_url
        return redact_url(endpoint) if endpoint else "AWS S3"

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
        child._bucket_seen_at = self._bucket_seen_at
        child._conditional_honoured = self._conditional_honoured
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
            if checksum_mismatch(last):
                raise StoreError(
                    f"S3 {what} of {self._url(key)}: the body did not match the checksum the "
                    f"server sent with it, on each of {exc.attempts} attempts over "
                    f"{exc.elapsed_s:.1f} s ({last}): the object is damaged in storage, or "
                    "something on the way (a proxy) alters it; check the server and the path"
                ) from last
            raise StoreError(
                f"S3 {what} of {self._url(key)} failed after {exc.attempts} attempts over "
                f"{exc.elapsed_s:.1f} s: {type(last).__name__}: {self._scrub(last).rstrip('.')}. "
                "Is the server reachable? Raise S3Config.retry's deadline_s (--s3-retry-deadline "
                "on the command line) to wait longer"
            ) from last
        except ClientError as exc:
            raise self._map_client_error(what, key, exc) from exc
        except (BotoCoreError, RecursionError) as exc:
            why = tls_refusal(exc)
            if why is not None:
                raise StoreError(
                    f"S3 {what} of {self._url(key)} failed, not retried: no TLS connection to "
                    f"{self._endpoint()}: {why} ({self._scrub(exc)}); nothing was sent"
                ) from exc
            if not redirect_loop(exc):
                raise StoreError(
                    f"S3 {what} of {self._url(key)} failed: {self._scrub(exc)}"
                ) from exc
            # botocore follows a redirect by calling itself: a server that redirects to
            # itself ends here (a redirect answers a request without applying it)
            raise StoreError(
                f"S3 {what} of {self._url(key)} failed: the server kept redirecting the "
                "request (a redirect loop); check S3Config.endpoint_url and region"
            ) from None

    def _scrub(self, exc: BaseException) -> str:
        """``str(exc)`` of a botocore exception, with the endpoint as :func:`redact_url` prints
        it (S3Config refuses a query string; this is the backstop for what botocore echoes)."""
        return scrub_endpoint(str(exc), self.config.endpoint_url)

    def _map_client_error(self, what: str, key: str, exc: BaseException) -> StoreError:
        code, status = error_code(exc)
        if code == "NoSuchUpload":  # a 404 of a multipart upload, not of the key
            return StoreError(
                f"S3 {what} of {self._url(key)}: the server no longer knows the multipart "
                "upload (completed, aborted, or reaped by the bucket's lifecycle rules); "
                "write the key again"
            )
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
        if code in UNSUPPORTED or status in UNSUPPORTED_STATUS:
            need = (
                " deltasync commits a version with a conditional write (PutObject with "
                "If-None-Match: *); use an S3 server that supports conditional writes"
                if what == "put_if_absent"
                else ""
            )
            return StoreError(
                f"S3 {what} of {self._url(key)} was refused: the server does not implement "
                f"this request ({code or status}); nothing was stored.{need}"
            )
        if code in EXPIRED:
            return StoreError(
                f"S3 {what} of {self._url(key)} was refused ({code}): the session token has "
                "expired or is not valid. Renew the credentials (a new S3Config, or boto3's "
                "default chain with a source that refreshes them)"
            )
        return StoreError(
            f"S3 {what} of {self._url(key)} failed: {code or status}: {self._scrub(exc)}"
        )

    # --- reads --------------------------------------------------------------------------

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        full = self._full(check_key(key))
        check_max_bytes(key, max_bytes)

        def op(_: int) -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
            body = _field(response, "Body", "get", self._url(key))
            try:
                # The object's size comes with the response headers: refuse before the body.
                size = response.get("ContentLength")
                if max_bytes is not None and isinstance(size, int) and size > max_bytes:
                    raise too_large(key, self, size, max_bytes)
                if max_bytes is None:
                    return body.read()  # inside op: a connection drop mid-body is retried
                # A server that under-reports the length still cannot make us read more.
                data = _read_at_most(body, max_bytes + 1)
                if len(data) > max_bytes:
                    raise too_large(key, self, f"more than {max_bytes}", max_bytes)
                if isinstance(size, int) and len(data) != size:
                    # The body ended before its length: a connection dropped mid-transfer
                    # (a bounded read does not check the length itself). Retried like one.
                    from botocore.exceptions import IncompleteReadError

                    raise IncompleteReadError(actual_bytes=len(data), expected_bytes=size)
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
            body = _field(response, "Body", "get_range", self._url(key))
            try:
                # A server that ignores Range answers 200 with the whole object: refused
                # before its body is read (a 16-byte read must not buffer a 1 GB blob).
                served = response.get("ContentRange")
                if not served:
                    raise StoreError(
                        f"get_range({key!r}, {start}, {length}) of {self._url(key)}: the server "
                        "answered without a Content-Range, i.e. ignored the Range header; "
                        "deltasync needs an S3 server that serves byte ranges"
                    )
                _check_served(served, start, length, f"get_range({key!r}, {start}, {length})")
                # cut short: retried, never reported as a range past the end; a longer part
                # is reported below
                return _read_whole(response, body, length + 1)
            finally:
                body.close()

        data = self._call("get_range", key, op)
        if len(data) > length:
            raise StoreError(
                f"get_range({key!r}, {start}, {length}) of {self._url(key)}: the server sent "
                "more bytes than the range asked for"
            )
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
        size = _field(self._head("size", key), "ContentLength", "size", self._url(key))
        if not isinstance(size, int) or size < 0:
            raise StoreError(f"S3 size of {self._url(key)}: the server gave {size!r} bytes")
        return size

    def modified(self, key: str) -> float:
        """When the object was last written (POSIX seconds, the server's ``LastModified``:
        its clock, to the second). Raises KeyNotFoundError if absent."""
        stamp = _field(self._head("modified", key), "LastModified", "modified", self._url(key))
        try:
            return stamp.timestamp()
        except (AttributeError, OverflowError, OSError, ValueError):
            raise StoreError(
                f"S3 modified of {self._url(key)}: the server gave {stamp!r} as LastModified"
            ) from None

    def _head(self, what: str, key: str) -> dict:
        full = self._full(check_key(key))

        def op(_: int) -> dict:
            return self._client.head_object(Bucket=self.bucket, Key=full)

        try:
            head = self._call(what, key, op)
        except KeyNotFoundError:
            self._check_bucket(key)
            raise
        self._bucket_seen_at = time.monotonic()
        return head

    def _check_bucket(self, key: str) -> None:
        """After a HEAD answered 404 (which carries no error code): a missing bucket is a
        StoreError naming it, never "no such key" (a receiver would wait forever for a version
        in a bucket name with a typo, or in a bucket deleted while it waits). Asked again once
        the bucket was last seen more than BUCKET_RECHECK_S ago."""
        seen = self._bucket_seen_at
        if seen is not None and time.monotonic() - seen < BUCKET_RECHECK_S:
            return

        def op(_: int) -> None:
            self._client.head_bucket(Bucket=self.bucket)

        try:
            self._call("size", key, op)
        except KeyNotFoundError:
            raise StoreError(
                f"S3 bucket {self.bucket!r} does not exist (size of {self._url(key)}); check the "
                "store URL, or create the bucket"
            ) from None
        except StoreError:
            return  # the bucket question itself failed: the key's answer stands, asked again
        self._bucket_seen_at = time.monotonic()

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full_prefix = self._full(prefix) if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def op(_: int) -> list[str]:
            keys = []
            tokens: set[str] = set()
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Contents", ()):
                    if not obj["Key"].startswith(full_prefix):
                        raise StoreError(
                            f"S3 list of {self._url(prefix)}: the server listed "
                            f"{obj['Key']!r}, which is not under the prefix asked for; the "
                            "server does not implement ListObjectsV2's Prefix"
                        )
                    keys.append(obj["Key"][strip:])
                token = page.get("NextContinuationToken")
                if token is not None and token in tokens:
                    raise StoreError(
                        f"S3 list of {self._url(prefix)}: the server's continuation tokens "
                        f"loop (token {token[:40]!r} again after {len(tokens)} pages); the "
                        "listing would never end"
                    )
                tokens.add(token)
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
        self._check_conditional_writes(key)
        maybe_landed = False  # an attempt's request may have reached the server

        def op(attempt: int) -> None:
            nonlocal maybe_landed
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
            except ClientError as exc:
                code, status = error_code(exc)
                if maybe_landed and (code in CONFLICT or status == 412):
                    # taken: by our earlier attempt (its reply lost) or by another object. A
                    # read that fails is retried (transient) or ends without a verdict.
                    held = self._read_back(full, len(body))
                    if held == body:
                        return
                    if held is None:
                        raise StoreError(
                            f"S3 put_if_absent of {self._url(key)}: the key was taken, then "
                            "gone when read back"
                        ) from exc
                if is_transient(exc) and code not in IN_FLIGHTCONFLICT:
                    maybe_landed = True  # (a 409 is a refusal: this request stored nothing)
                raise
            except Exception as exc:
                maybe_landed = maybe_landed or _may_have_arrived(exc)
                raise

        try:
            self._call("put_if_absent", key, op)
        except CommitConflictError as exc:
            code = error_code(exc.__cause__)[0] if exc.__cause__ is not None else None
            if maybe_landed and code in IN_FLIGHTCONFLICT:
                # the conditional write still in flight behind the conflicts may be our own
                raise OutcomeUnknownError(
                    f"S3 put_if_absent of {self._url(key)}: another conditional write kept "
                    "conflicting, and an earlier attempt of this one may have reached the "
                    "server: the write still in flight may be ours, so the key may hold these "
                    "bytes now or later"
                ) from exc
            raise  # a verdict: the key holds another object
        except StoreError as exc:
            if not maybe_landed:
                raise
            raise OutcomeUnknownError(
                f"{exc}. An earlier attempt may have reached the server, which can still store "
                f"it: {self._url(key)} may hold these bytes now or later"
            ) from exc

    def _check_conditional_writes(self, for_key: str) -> None:
        """Before this client's first conditional write (of ``for_key``): the server must
        refuse a second ``PutObject`` with ``If-None-Match: *`` on a key that exists. A server
        that ignores the header would let a manifest be overwritten (two states under one
        version number); it is refused before anything of the caller's is written. The probe
        key is deleted. A probe that fails (a server that refuses the header, an outage) is a
        StoreError naming ``for_key`` too: nothing of it was written."""
        if self._conditional_honoured.is_set():
            return
        key = probe_key(uuid.uuid4().hex)
        full = self._full(key)
        try:
            self.put(key, b"probe")
            self._call(
                "put_if_absent",
                key,
                lambda _: self._client.put_object(
                    Bucket=self.bucket, Key=full, Body=b"probe again", IfNoneMatch="*"
                ),
            )
        except CommitConflictError:
            self._conditional_honoured.set()
        except StoreError as exc:
            raise StoreError(
                f"S3 put_if_absent of {self._url(for_key)}: nothing was stored; the check that "
                "the server honours conditional writes (If-None-Match: *, on a probe key under "
                f"probes/), made before this client's first one, failed: {exc}"
            ) from exc
        else:
            raise StoreError(
                f"the S3 server at {self._url(key)} ignores If-None-Match: a PutObject with "
                "If-None-Match: * replaced a key that exists. deltasync commits each version "
                "with such a conditional write, so on this server two trainers could commit "
                "one version number twice; nothing was written. Use an S3 server that honours "
                "conditional writes (or a proxy in front of it that passes the header on)"
            )
        finally:
            with contextlib.suppress(StoreError):
                self.delete(key)  # a probe left behind is harmless: nothing reads probes/

    def _read_back(self, full: str, expected: int) -> bytes | None:
        """At most ``expected + 1`` bytes of the object (enough to tell it from ours; a huge
        object planted there is never read whole); None when there is no such key. Any other
        failure is raised, for the caller's retries to judge."""
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full)
        except ClientError as exc:
            code, status = error_code(exc)
            if code in NOT_FOUND or (status == 404 and code != "NoSuchBucket"):
                return None
            raise
        body = _field(response, "Body", "read back", f"s3://{self.bucket}/{full}")
        try:
            return _read_whole(response, body, expected + 1)  # cut short: never another's
        finally:
            body.close()

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
            etag = _field(response, "ETag", "upload_part", self._url(key))
            parts.append({"PartNumber": number, "ETag": etag})

        try:
            for chunk in chunks:
                view = as_bytes(chunk)
                total += len(view)
                buf += view
                while len(buf) >= part_bytes:
                    if upload_id is None:
                        upload_id = self._create_upload(key, full)
                    upload(bytes(buf[:part_bytes]))
                    del buf[:part_bytes]
            if upload_id is None:
                self.put(key, bytes(buf))
                return total
            if buf or not parts:
                upload(bytes(buf))
            self._complete(key, full, upload_id, parts)
        except BaseException as exc:
            if upload_id is not None:
                self._abort(key, full, upload_id, retried=isinstance(exc, Exception))
            raise
        return total

    def _create_upload(self, key: str, full: str) -> str:
        """CreateMultipartUpload, retried; the new upload's id. An attempt whose reply was lost
        (the connection dropped or timed out after the request was sent) may have opened an
        upload whose id this call never learns: nobody would complete or abort it, and it would
        stay open until the bucket's lifecycle rules reap it. So after such an attempt the
        key's other uploads opened while this call ran, before the new one, are aborted (best
        effort; a blob key is written by one writer, so they are this call's own), and so
        are those opened while it ran when every attempt failed."""
        maybe_opened = False  # an attempt's request may have reached the server
        began = time.monotonic()

        def op(_: int) -> Any:
            nonlocal maybe_opened
            try:
                return self._client.create_multipart_upload(Bucket=self.bucket, Key=full)
            except Exception as exc:
                maybe_opened = maybe_opened or _may_have_arrived(exc)
                raise

        try:
            started = self._call("create_multipart_upload", key, op)
        except Exception:
            if maybe_opened:  # every attempt failed, and one may have opened an upload anyway
                self._abort_strays(key, full, None, window_s=time.monotonic() - began + 1.0)
            raise
        upload_id = _field(started, "UploadId", "create_multipart_upload", self._url(key))
        if maybe_opened:
            try:
                self._abort_strays(key, full, upload_id, window_s=time.monotonic() - began + 1.0)
            except BaseException:  # an interrupt: the caller never learns this upload's id
                self._abort(key, full, upload_id, retried=False)
                raise
        return upload_id

    def _abort_strays(self, key: str, full: str, upload_id: str | None, *, window_s: float) -> None:
        """Abort the uploads of ``full`` other than ``upload_id`` opened at most ``window_s``
        seconds before it, by the server's clock (both times come from one listing, so clocks
        never disagree; the server's are whole seconds, hence the caller's slack). One opened
        after it is not this call's (a lost attempt's request was sent before the retry's):
        another client streaming the key, whose upload must not be pulled from under it.
        ``upload_id`` None (the create failed: no upload is ours) measures from the key's newest
        upload, and aborts it too. A failure leaves them to the bucket's lifecycle rules."""

        def op(_: int) -> list[dict]:
            listed = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=full)
            return [u for u in listed.get("Uploads", ()) if u.get("Key") == full]

        with contextlib.suppress(Exception):  # the write itself stands, whatever this is
            uploads = self._call("list_multipart_uploads", key, op)
            if upload_id is None:
                ours = max(u["Initiated"] for u in uploads) if uploads else None
            else:
                ours = next(u["Initiated"] for u in uploads if u.get("UploadId") == upload_id)
            for stray in uploads:
                if stray.get("UploadId") == upload_id:
                    continue
                if 0 <= (ours - stray["Initiated"]).total_seconds() <= window_s:
                    self._abort(key, full, stray["UploadId"], retried=True)

    def _abort(self, key: str, full: str, upload_id: str, *, retried: bool) -> None:
        """AbortMultipartUpload, ``retried`` like any call (not after an interrupt, which is
        not held up by a store's retry deadline): a transient failure (a 503 SlowDown) must
        not leave the upload open, where a CompleteMultipartUpload of it still in flight could
        land later, over a newer write of the key. An abort that still fails (or finds the
        upload gone: completed or aborted already) is left to the bucket's lifecycle rules;
        the caller's error stands."""

        def op(_: int) -> None:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

        with contextlib.suppress(Exception):  # the caller's error stands, whatever this is
            if retried:
                self._call("abort_multipart_upload", key, op)
            else:
                op(0)

    def abort_uploads(self, prefix: str) -> int:
        """Abort every multipart upload still open of a key under ``prefix`` (a version's
        directory that retention deleted: nothing will complete them), returning how many. An
        upload whose create the server applied after its call had ended (so after put_stream's
        own sweep) stays open otherwise, until the bucket's lifecycle rules reap it. Best
        effort: a listing or an abort that fails leaves the rest to those rules."""
        check_prefix(prefix)
        full_prefix = self._full(prefix) if self.prefix else prefix

        def op(_: int) -> list[tuple[str, str]]:
            found: list[tuple[str, str]] = []
            marker: dict[str, str] = {}
            for _page in range(1000):  # a server whose markers never end is not followed
                listed = self._client.list_multipart_uploads(
                    Bucket=self.bucket, Prefix=full_prefix, **marker
                )
                found.extend(
                    (u["Key"], u["UploadId"])
                    for u in listed.get("Uploads", ())
                    if isinstance(u.get("Key"), str)
                    and u["Key"].startswith(full_prefix)
                    and isinstance(u.get("UploadId"), str)  # none: nothing to abort it by
                )
                if not listed.get("IsTruncated"):
                    break
                marker = {
                    "KeyMarker": listed.get("NextKeyMarker", ""),
                    "UploadIdMarker": listed.get("NextUploadIdMarker", ""),
                }
            return found

        try:
            uploads = self._call("list_multipart_uploads", prefix or "(all)", op)
        except StoreError as exc:
            log.warning("S3 multipart uploads under %s not swept: %s", self._url(prefix), exc)
            return 0
        for full, upload_id in uploads:
            self._abort(
                full[len(self.prefix) + 1 :] if self.prefix else full, full, upload_id, retried=True
            )
        return len(uploads)

    def _complete(self, key: str, full: str, upload_id: str, parts: list[dict]) -> None:
        """CompleteMultipartUpload, retried. A retry answered NoSuchUpload after an attempt
        that may have reached the server (its reply lost) means the upload was completed or
        aborted: the object is ours if its ETag is the one these parts make, else the
        upload's outcome is a StoreError (never "key not found", which it is not)."""
        from botocore.exceptions import ClientError

        sent = False

        def op(_: int) -> None:
            nonlocal sent
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as exc:
                if is_transient(exc):
                    sent = True
                raise

        try:
            self._call("complete_multipart_upload", key, op)
        except StoreError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, ClientError) and error_code(cause)[0] == "NoSuchUpload"):
                raise
            made = multipart_etag(p["ETag"] for p in parts)
            if sent and made is not None and self._etag(key) == made:
                return  # completed by the attempt whose reply was lost
            raise StoreError(
                f"S3 complete_multipart_upload of {self._url(key)}: the server no longer knows "
                "the upload (NoSuchUpload), and the key does not hold the object its parts "
                "make; write it again"
            ) from exc

    def _etag(self, key: str) -> str | None:
        """The object's ETag, or None where there is none (or it cannot be read now)."""
        try:
            etag = self._head("etag", key).get("ETag")
        except StoreError:
            return None
        return etag if isinstance(etag, str) else None

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
