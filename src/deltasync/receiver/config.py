"""ReceiverConfig: the settings of one receiver, validated at construction.

Keyword-only and frozen; each error names the field. Nothing is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltasync import names
from deltasync.commit import ManifestLimits
from deltasync.commit.signing import MIN_KEY_BYTES
from deltasync.errors import ConfigError, ManifestError
from deltasync.validate import check_bool, check_instance, check_int, check_signing_key

_OWNER = "ReceiverConfig"


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig:
    """- ``receiver_id``: this receiver's name in acks and registrations (data-parallel
      replicas of one shard need distinct ids);
    - ``signing_key``: when set, every manifest must carry a valid HMAC-SHA256 signature;
    - ``verify_on_open``: hash the live tensors at construction and compare with the digest
      of the version the state file records; a mismatch marks the state dirty (the next pull
      restores the newest anchor);
    - ``limits``: bounds on manifests; ``max_decompressed_bytes``: bound per blob;
    - ``durable``: fsync the journal and state file (False only for tests on scratch disks:
      a power loss could then lose the journal and hide a torn apply).
    """

    receiver_id: str
    signing_key: bytes | None = field(default=None, repr=False)
    verify_on_open: bool = True
    limits: ManifestLimits = field(default_factory=ManifestLimits)
    max_decompressed_bytes: int = 1 << 36
    durable: bool = True

    def __post_init__(self) -> None:
        try:
            names.check_token("receiver", self.receiver_id)
        except ManifestError as exc:
            raise ConfigError(f"ReceiverConfig.receiver_id: {exc}") from None
        check_signing_key(_OWNER, self.signing_key, min_bytes=MIN_KEY_BYTES)
        for name in ("verify_on_open", "durable"):
            check_bool(_OWNER, name, getattr(self, name))
        check_instance(_OWNER, "limits", self.limits, ManifestLimits)
        check_int(_OWNER, "max_decompressed_bytes", self.max_decompressed_bytes, lo=1)
