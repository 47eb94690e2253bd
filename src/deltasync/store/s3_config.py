"""S3Config and how S3 failures are classified (transient, not found, conflict).

Kept apart from :mod:`deltasync.store.s3` so that configuration can be built, validated and
printed without boto3 installed; botocore is imported only inside the classifiers, which run
only after a boto3 call failed. Nothing here performs I/O except ``make_client``, which builds
(but does not contact) a boto3 client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from deltasync.errors import ConfigError
from deltasync.store.retry import RetryPolicy
from deltasync.validate import check_instance, check_int, check_number

_OWNER = "S3Config"

MIN_PART = 5 * 2**20  # S3's minimum size of every part but the last
MAX_PART = 5 * 2**30
NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
CONFLICT = {"PreconditionFailed", "412"}
IN_FLIGHTCONFLICT = {"ConditionalRequestConflict", "409"}
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
        if not isinstance(self.region, str) or not self.region:
            raise ConfigError(f"S3Config.region must be a non-empty string, got {self.region!r}")
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


def is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if isinstance(exc, (ConnectionError, HTTPClientError, IncompleteReadError)):
        return True
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        return code in TRANSIENT_CODES or code in IN_FLIGHTCONFLICT or status >= 500
    return False


def make_client(config: S3Config) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "S3 storage needs boto3: pip install 'deltasync[s3]' (boto3==1.43.117)"
        ) from exc
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
    )
    return session.client("s3", endpoint_url=config.endpoint_url, config=client_config)
