"""The role plan: which rank writes which trainer shard, which rank holds which receiver shard,
and so who sends what to whom. Pure: metadata in, tables out; no process group, no tensors.

Writers are the trainer ranks that each hold an FSDP dim-0 shard of every parameter
(``index`` of ``count``; one writer holding everything is ``index=0, count=1``). Receivers hold
one receiver shard each (a ``ReceiverLayout`` shard id such as ``tp1``); data-parallel replicas
of an engine hold identical shards and share the id, told apart by ``replica``.

Every writer produces one blob per receiver shard per version. How the replicas of a shard get
it is the ``dp_mode``:

- ``"direct"``: the writer sends its blob to every replica (one exchange; a writer's outgoing
  bytes grow with the number of replicas);
- ``"forward"``: the writer sends to replica 0 only, which forwards everything it received to
  the other replicas of its shard in a second exchange (writers send once; a second exchange
  of latency, and replica 0 re-sends the shard's bytes).

``docs/cluster.md`` has the measurement behind the default. Every rank derives the same plan
from the same arguments, and every rank of the group has a role, because every rank takes part
in every collective of a version.

:class:`ClusterConfig` (the timeouts, blob level and digest cadence of one rank's part) lives
here with the roles it configures.

This module knows ranks and shard ids; it knows nothing about layouts' contents or bytes on the
wire beyond the counts it is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from deltasync import names
from deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    ExchangeError,
    ManifestError,
    PeerFailedError,
)
from deltasync.exchange import ExchangeConfig
from deltasync.validate import check_bool, check_int, check_seconds

_OWNER = "ClusterConfig"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How one rank takes part in the in-cluster sync.

    exchange: chunking, pipelining and the per-wait timeout of every payload exchange.
    wait_for_version_s: how long a RECEIVER waits in the preflight of a version for the trainer
        to arrive (the trainer may still be training when the rollout workers are already
        waiting). It bounds nothing else: trainer ranks' preflight and every later wait of a
        version (both exchanges) use ``exchange.timeout_s``.
    commit_timeout_s: how long any rank waits in the joint commit for the slowest rank, which
        includes the receivers' decode, apply and digest. A rank that never arrives is named.
    level: zstd level of the blobs (1 = fast default, 0 = uncompressed).
    digest_every: expected digests go with every K-th version and with every anchor; 0 =
        never. On by default (every version): a single writer sends each receiver shard's state
        digest; several writers each send the digest of the part of every shard they own
        (``layout.part_digests``), or writer 0 the whole-state digests when given
        ``full_state``. A receiver always checks what it is sent, before it acknowledges.
        Part of every rank's fingerprint: writers and receivers are built with the same value
        (a receiver built to verify refuses writers that send no digests).
    max_decompressed_bytes: a receiver refuses a blob that declares a larger record section.
    encode_threads: how many of a version's per-shard blobs are encoded at once (1 = one
        after another, the default). More helps a node with cores to spare and several shards;
        each concurrent encode holds its own buffers (on this project's 2-core VM it gave no
        speed-up, and the trainer's peak memory read higher in the run that used it). The
        overlapped sender ignores it: it encodes batch by batch as it routes, on its one
        background thread (``cluster.capture``).
    part_bytes: the overlapped sender streams a delta's blobs in parts of about this many
        bytes, one exchange each, while it routes (``cluster.streaming``): it holds about a
        part or two instead of the whole payload. 0: one exchange of the whole blobs. Each
        part costs one more round-1 collective on every rank.
    digests_in_detection: a delta's whole-state digests (one writer, no ``full_state``;
        overlapped, inline or without overlap) are hashed by the detection pass from its own
        BF16 casts (``layout.digest_feed``) instead of by a second read of the parameters:
        ~0.2 CPU-s less per 0.6B version, but detection itself takes ~15% longer (where
        detection blocks ``sync``, so does that). False: the separate pass, beside detection
        or the routing.
    """

    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    wait_for_version_s: float = 600.0
    commit_timeout_s: float = 120.0
    level: int = 1
    digest_every: int = 1
    max_decompressed_bytes: int = 1 << 36
    encode_threads: int = 1
    part_bytes: int = 2 << 20
    digests_in_detection: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.exchange, ExchangeConfig):
            raise ConfigError(
                "ClusterConfig.exchange must be an ExchangeConfig, got "
                f"{type(self.exchange).__name__}"
            )
        check_seconds(_OWNER, "wait_for_version_s", self.wait_for_version_s)
        check_seconds(_OWNER, "commit_timeout_s", self.commit_timeout_s)
        check_int(_OWNER, "level", self.level, lo=0, hi=22)
        check_int(_OWNER, "encode_threads", self.encode_threads, lo=1, hi=1024)
        check_int(_OWNER, "part_bytes", self.part_bytes, lo=0, hi=1 << 40)
        check_int(_OWNER, "digest_every", self.digest_every, lo=0, hi=1 << 31)
        check_int(_OWNER, "max_decompressed_bytes", self.max_decompressed_bytes, lo=1, hi=1 << 62)
        check_bool(_OWNER, "digests_in_detection", self.digests_in_detection)

    def sends_digest(self, version: int, *, anchor: bool) -> bool:
        """Whether the writers attach expected digests to ``version``."""
        return self.digest_every > 0 and (anchor or version % self.digest_every == 0)


DP_MODES = ("direct", "forward")
DEFAULT_DP_MODE = "direct"  # measured: see docs/cluster.md "DP replicas"


@dataclass(frozen=True)
class WriterRole:
    """A trainer rank that sends: it holds dim-0 shard ``index`` of ``count`` of every param."""

    rank: int
    index: int
    count: int

    @property
    def writer_id(self) -> str:
        """The writer id in blob headers, as on the storage path (``w{index:05d}``)."""
        return names.writer_id(self.index)


@dataclass(frozen=True)
class ReceiverRole:
    """A rollout rank that holds receiver shard ``shard``; ``replica`` tells DP copies apart."""

    rank: int
    shard: str
    replica: int


Role = WriterRole | ReceiverRole


def _rank(value: object, world_size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < world_size:
        raise ConfigError(f"{what}: rank {value!r} is not in [0, {world_size})")
    return value


class RolePlan:
    """Roles of every rank of one process group, and the sends they imply."""

    def __init__(
        self,
        *,
        world_size: int,
        writers: Iterable[WriterRole],
        receivers: Iterable[ReceiverRole],
        dp_mode: str = DEFAULT_DP_MODE,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ConfigError(f"RolePlan.world_size must be an int >= 2, got {world_size!r}")
        if dp_mode not in DP_MODES:
            raise ConfigError(f"RolePlan.dp_mode must be one of {DP_MODES}, got {dp_mode!r}")
        self.world_size = world_size
        self.dp_mode = dp_mode
        self.writers = tuple(sorted(writers, key=lambda w: w.index))
        self.receivers = tuple(sorted(receivers, key=lambda r: (r.shard, r.replica)))
        self._by_rank: dict[int, Role] = {}
        for role in (*self.writers, *self.receivers):
            rank = _rank(role.rank, world_size, f"RolePlan {role}")
            if rank in self._by_rank:
                raise ConfigError(
                    f"RolePlan: rank {rank} has two roles: {self._by_rank[rank]} and {role}"
                )
            self._by_rank[rank] = role
        missing = [r for r in range(world_size) if r not in self._by_rank]
        if missing:
            raise ConfigError(
                f"RolePlan: ranks {missing} have no role; every rank of the group takes part in "
                "every collective of a version, so each must be a writer or a receiver"
            )
        self._check_writers()
        self._replicas = self._check_receivers()

    def _check_writers(self) -> None:
        if not self.writers:
            raise ConfigError("RolePlan needs at least one writer")
        count = self.writers[0].count
        indices = [w.index for w in self.writers]
        if any(w.count != count for w in self.writers) or indices != list(range(count)):
            raise ConfigError(
                f"RolePlan writers must hold dim-0 shards 0..count-1 exactly once with one "
                f"count; got {[(w.rank, w.index, w.count) for w in self.writers]}"
            )

    def _check_receivers(self) -> dict[str, tuple[ReceiverRole, ...]]:
        if not self.receivers:
            raise ConfigError("RolePlan needs at least one receiver")
        by_shard: dict[str, list[ReceiverRole]] = {}
        for r in self.receivers:
            try:
                names.check_token("shard", r.shard)
            except ManifestError as exc:
                raise ConfigError(f"RolePlan receiver on rank {r.rank}: {exc}") from None
            by_shard.setdefault(r.shard, []).append(r)
        for shard, roles in by_shard.items():
            if [r.replica for r in roles] != list(range(len(roles))):
                raise ConfigError(
                    f"RolePlan: replicas of shard {shard!r} must be numbered 0..n-1 once each, "
                    f"got {[(r.rank, r.replica) for r in roles]}"
                )
        return {s: tuple(rs) for s, rs in by_shard.items()}

    @classmethod
    def contiguous(
        cls,
        *,
        num_writers: int,
        shards: Sequence[str],
        replicas: int = 1,
        dp_mode: str = DEFAULT_DP_MODE,
    ) -> RolePlan:
        """Writers on ranks ``0..num_writers-1``, then one block of receivers per DP replica,
        each block holding ``shards`` in order (the usual torchrun placement)."""
        for name, v in (("num_writers", num_writers), ("replicas", replicas)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"RolePlan.contiguous {name} must be an int >= 1, got {v!r}")
        shards = list(shards)
        if len(set(shards)) != len(shards) or not shards:
            raise ConfigError(
                f"RolePlan.contiguous shards must be distinct and non-empty: {shards}"
            )
        writers = [WriterRole(rank=i, index=i, count=num_writers) for i in range(num_writers)]
        receivers = [
            ReceiverRole(rank=num_writers + d * len(shards) + i, shard=s, replica=d)
            for d in range(replicas)
            for i, s in enumerate(shards)
        ]
        return cls(
            world_size=num_writers + replicas * len(shards),
            writers=writers,
            receivers=receivers,
            dp_mode=dp_mode,
        )

    # ------------------------------------------------------------------ lookups

    def role(self, rank: int) -> Role:
        return self._by_rank[_rank(rank, self.world_size, "RolePlan.role")]

    def who(self, rank: int) -> str:
        """``rank R (writer w00000)`` or ``rank R (receiver tp0 replica 0)``, for messages."""
        role = self.role(rank)
        if isinstance(role, WriterRole):
            return f"rank {rank} (writer {role.writer_id})"
        return f"rank {rank} (receiver {role.shard} replica {role.replica})"

    def writer(self, rank: int) -> WriterRole:
        role = self.role(rank)
        if not isinstance(role, WriterRole):
            raise ConfigError(f"rank {rank} is not a writer in this plan: {role}")
        return role

    def receiver(self, rank: int) -> ReceiverRole:
        role = self.role(rank)
        if not isinstance(role, ReceiverRole):
            raise ConfigError(f"rank {rank} is not a receiver in this plan: {role}")
        return role

    def shards(self) -> list[str]:
        return sorted(self._replicas)

    def replicas(self, shard: str) -> tuple[ReceiverRole, ...]:
        return self._replicas[shard]

    def writer_ids(self) -> tuple[str, ...]:
        return tuple(w.writer_id for w in self.writers)

    def check_shards(self, shard_ids: Iterable[str]) -> None:
        """Refuse a plan whose receivers do not hold exactly the layout's shards."""
        layout = set(shard_ids)
        mine = set(self._replicas)
        if layout != mine:
            raise ConfigError(
                f"RolePlan receivers hold shards {sorted(mine)} but the receiver layout has "
                f"{sorted(layout)}: every layout shard needs a receiver and no receiver may hold "
                "an unknown shard"
            )

    # ------------------------------------------------------------------ who sends to whom

    @property
    def exchanges(self) -> int:
        """Payload exchanges per version: 2 when some replica gets its bytes forwarded."""
        forwarding = self.dp_mode == "forward" and any(len(r) > 1 for r in self._replicas.values())
        return 2 if forwarding else 1

    def first_hop(self) -> dict[int, str]:
        """``{receiver rank: shard}`` every writer sends its blob to in the first exchange."""
        if self.exchanges == 1:
            return {r.rank: r.shard for r in self.receivers}
        return {rs[0].rank: s for s, rs in self._replicas.items()}

    def forward_targets(self, rank: int) -> tuple[int, ...]:
        """Ranks this receiver forwards its shard's bytes to in the second exchange."""
        role = self.receiver(rank)
        if self.exchanges == 1 or role.replica != 0:
            return ()
        return tuple(r.rank for r in self._replicas[role.shard][1:])

    def sources(self, rank: int) -> tuple[int, ...]:
        """Ranks this receiver gets payloads from: the writers, or its forwarding replica."""
        role = self.receiver(rank)
        if self.exchanges == 2 and role.replica != 0:
            return (self._replicas[role.shard][0].rank,)
        return tuple(w.rank for w in self.writers)

    def traffic(self, blob_bytes: Mapping[tuple[int, str], int]) -> list[list[list[int]]]:
        """Bytes each rank sends each rank, per exchange, given ``blob_bytes[(writer index,
        shard)]`` (framing ignored). A model for comparing ``dp_mode``s, not a schedule."""
        w = self.world_size
        hops = [[[0] * w for _ in range(w)] for _ in range(self.exchanges)]
        for writer in self.writers:
            for dst, shard in self.first_hop().items():
                hops[0][writer.rank][dst] += blob_bytes.get((writer.index, shard), 0)
        if self.exchanges == 2:
            for shard, roles in self._replicas.items():
                total = sum(blob_bytes.get((wr.index, shard), 0) for wr in self.writers)
                for r in roles[1:]:
                    hops[1][roles[0].rank][r.rank] += total
        return hops

    def describe(self) -> str:
        parts = [f"w{w.index}@{w.rank}" for w in self.writers]
        parts += [f"{r.shard}/{r.replica}@{r.rank}" for r in self.receivers]
        return f"RolePlan({self.dp_mode}: {', '.join(parts)})"

    def __repr__(self) -> str:
        return self.describe()


def check_group(group, plan: RolePlan, rank: int) -> None:
    """Refuse a process group that does not match the role plan this rank was built for."""
    import torch.distributed as dist

    from deltasync.errors import ConfigError, ExchangeError

    if not dist.is_initialized():
        raise ExchangeError("torch.distributed is not initialized; call init_from_env() first")
    world, actual = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.world_size or actual != rank:
        raise ConfigError(
            f"this process is rank {actual} of a group of {world}, but was built as rank "
            f"{rank} of the role plan's {plan.world_size}"
        )


class GroupHealth:
    """Whether this rank's process group still carries the protocol. A collective or
    point-to-point wait that failed other than by a peer's reported failure (a timeout, a
    dead rank) leaves its operations posted: a later exchange on the group could take a
    message of the failed one for its own (with digests off, a stale payload of the same
    version and base would apply unnoticed). So the rank refuses the group until
    ``use_group`` hands it a new one."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.broken: str | None = None  # what broke it

    def check(self) -> None:
        if self.broken is not None:
            raise ExchangeError(
                f"{self.who}: the process group broke ({self.broken}) and still holds that "
                "exchange's posted operations. Nothing was sent; re-create the group and pass "
                "it to use_group() on every rank, then sync again"
            )

    def note(self, exc: BaseException, what: str) -> bool:
        """Record ``exc`` if it broke the group (an ExchangeError that no peer reported);
        whether it did."""
        broke = isinstance(exc, ExchangeError) and not isinstance(exc, PeerFailedError)
        if broke:
            self.broken = f"{what}: {type(exc).__name__}"
        return broke

    def reset(self) -> None:
        self.broken = None

    @contextlib.contextmanager
    def collectives(self, what: str) -> Iterator[None]:
        """Around a version's collectives: an interrupt (``KeyboardInterrupt``, ``SystemExit``)
        or an error deltasync did not raise (a ``MemoryError``, a backend's own exception)
        inside may leave an operation posted, or the other ranks in the next one, so it
        breaks the group as a failed wait does; a typed error is :meth:`note`'s to judge."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.broken = f"{what}: interrupted ({type(exc).__name__})"
            elif not isinstance(exc, DeltaSyncError):
                self.broken = f"{what}: {type(exc).__name__} ({str(exc)[:200]})"
            raise


def resolve_rank(rank: int | None, group) -> int:
    """``rank`` if given, else this process's rank in ``group`` (torch.distributed must be up)."""
    if rank is not None:
        return rank
    import torch.distributed as dist

    from deltasync.errors import ConfigError

    if not dist.is_initialized():
        raise ConfigError("pass rank, or initialize torch.distributed first (init_from_env())")
    return dist.get_rank(group)
