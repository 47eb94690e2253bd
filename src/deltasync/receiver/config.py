"""ReceiverConfig: the settings of one receiver, validated at construction.

Keyword-only and frozen; each error names the field. Nothing is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltasync import names
from deltasync.errors import ConfigError, ManifestError
from deltasync.manifest import ManifestLimits
from deltasync.manifest.signing import MIN_KEY_BYTES


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
        if self.signing_key is not None and (
            not isinstance(self.signing_key, bytes) or len(self.signing_key) < MIN_KEY_BYTES
        ):
            raise ConfigError(
                f"ReceiverConfig.signing_key must be bytes of at least {MIN_KEY_BYTES} bytes "
                "or None"
            )
        for name in ("verify_on_open", "durable"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ReceiverConfig.{name} must be a bool")
        if not isinstance(self.limits, ManifestLimits):
            raise ConfigError("ReceiverConfig.limits must be a ManifestLimits")
        v = self.max_decompressed_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(
                f"ReceiverConfig.max_decompressed_bytes must be an int >= 1, got {v!r}"
            )
