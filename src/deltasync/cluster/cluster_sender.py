"""ClusterSender: a trainer rank's side of the in-cluster sync of one version.

``sync()`` runs, on one writer rank:

1. detection: the tracker's changed elements and their BF16 values since its baseline
   (``tracker.iter_changes()``); every element for an anchor;
2. routing: current BF16 values -> canonical -> every receiver shard
   (``layout.routing.shard_updates``, the storage path's own planning);
3. encoding: one blob per receiver shard (the storage path's wire format and header: version,
   base version, shard, writer ``w{index:05d}``), framed in an envelope per destination, with
   the shards' expected state digests from writer 0 when configured;
4. the exchange. If any of 1-3 raised, this rank passes the exception as its round-1 status,
   so every rank raises the same PeerFailedError before a payload byte moves, and nothing is
   applied anywhere; in ``forward`` mode it then takes part in the (empty, for it) second
   exchange;
5. the joint commit: only when every receiver reports its apply ok does the tracker's
   baseline advance (``clear()``) and ``version`` move on. Otherwise every rank raises, the
   tracker keeps its bits, and calling ``sync`` again retries the same version: the retry
   resends a superset of the elements as absolute values, so receivers that already applied
   the failed attempt converge too.

``payloads_for_version`` is steps 1-3 alone, with no collective (benchmarks time it). After an
ExchangeError that is not a PeerFailedError the group is broken: re-create it and pass the new
one to :meth:`use_group`.

This class knows the order of those steps; it holds no copy of the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from deltasync.cluster.envelope import pack_envelope
from deltasync.cluster.joint_commit import encode_commit_row, joint_commit
from deltasync.cluster.reports import Outgoing, SendReport
from deltasync.cluster.roles import ClusterConfig, RolePlan, check_group, resolve_rank
from deltasync.errors import AnchorRequiredError, ConfigError, SyncAbortedError, VersionError
from deltasync.exchange import exchange
from deltasync.format import encode_blobs
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.layout.digest import state_digests
from deltasync.layout.routing import checked_changes, every_element, shard_updates
from deltasync.trainer import Tracker

Params = Mapping[str, torch.Tensor]


class ClusterSender:
    """One writer rank of a :class:`RolePlan`.

    tracker: a :class:`~deltasync.trainer.Tracker` (``iter_changes()``, ``clear()``) watching
        ``params``, cleared at ``version``.
    params: this rank's named parameters (full names as ``model.named_parameters()`` gives
        them; under FSDP2 the local dim-0 shards, ``p.to_local()``), or a callable returning
        them.
    version: the version every receiver holds and the tracker's baseline; None when receivers
        hold nothing yet (the first sync must be an anchor).
    full_state: the FULL parameters (or a callable gathering them), needed by writer 0 for
        expected state digests when there are several writers (``config.digest_every``).
    """

    def __init__(
        self,
        tracker: Tracker,
        params: Params | Callable[[], Params],
        *,
        plan: RolePlan,
        trainer_layout: TrainerLayout,
        receiver_layout: ReceiverLayout,
        version: int | None,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        config: ClusterConfig | None = None,
        full_state: Params | Callable[[], Params] | None = None,
    ) -> None:
        self.rank = resolve_rank(rank, group)
        self.role = plan.writer(self.rank)
        plan.check_shards(s.id for s in receiver_layout.shards())
        self.plan = plan
        self.tracker = tracker
        self.trainer_layout = trainer_layout
        self.receiver_layout = receiver_layout
        self.config = config or ClusterConfig()
        self._params = params
        self._full_state = full_state
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, int) or version < 0
        ):
            raise ConfigError(f"ClusterSender version must be None or an int >= 0, got {version!r}")
        self.version = version
        self.use_group(group)

    def use_group(self, group: dist.ProcessGroup | None) -> None:
        """Sync over ``group`` from now on (e.g. a new group after a round-2 failure)."""
        self.group = group

    def _check_group(self) -> None:
        check_group(self.group, self.plan, self.rank)

    # ------------------------------------------------------------------ steps 1-3

    def payloads_for_version(self, version: int, *, anchor: bool = False) -> Outgoing:
        """Detect, route and encode ``version`` (on the committed version, or as an anchor)
        into ``{receiver rank: envelope}``. No collective; the tracker is not cleared."""
        base = self._base(version, anchor)
        params = self._params() if callable(self._params) else self._params
        t = time.perf_counter()
        values = None
        if anchor:
            changed = every_element(params)
        else:
            items = list(checked_changes(self.tracker.iter_changes()))
            changed = {name: idx for name, idx, _ in items}
            values = {name: vals for name, _, vals in items}
            del items
        detect_s = time.perf_counter() - t

        t = time.perf_counter()
        updates = shard_updates(
            changed, params, trainer_layout=self.trainer_layout,
            receiver_layout=self.receiver_layout, rank=self.role.index,
            world_size=self.role.count, values=values,
        )  # fmt: skip
        del changed, values
        build_s = time.perf_counter() - t

        t = time.perf_counter()
        digests = self._digests(params) if self._sends_digest(version, anchor) else {}
        digest_s = time.perf_counter() - t

        t = time.perf_counter()
        envelopes: dict[str, bytes] = {}
        shard_bytes: dict[str, int] = {}
        blobs = encode_blobs(
            {shard: updates[shard] for shard in self.plan.shards()}, version=version,
            base_version=base, writer=self.role.writer_id, level=self.config.level,
            threads=self.config.encode_threads,
        )  # fmt: skip
        for shard, blob in blobs:
            shard_bytes[shard] = len(blob)
            envelopes[shard] = pack_envelope([blob], state_digest=digests.get(shard))
        # DP replicas of a shard share one envelope object: no copy per replica.
        payloads = {dst: envelopes[shard] for dst, shard in self.plan.first_hop().items()}
        encode_s = time.perf_counter() - t
        return Outgoing(
            version=version, base=base, payloads=payloads, shard_bytes=shard_bytes,
            shard_elements={s: sum(u.nnz for u in us) for s, us in updates.items()},
            detect_s=detect_s, build_s=build_s, encode_s=encode_s, digest_s=digest_s,
        )  # fmt: skip

    def _base(self, version: int, anchor: bool) -> int:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be an int >= 0, got {version!r}")
        if anchor:
            return -1
        if self.version is None:
            raise AnchorRequiredError(
                "the receivers hold no committed version yet: the first sync must be an anchor "
                "(sync(anchor=True))"
            )
        if version <= self.version:
            raise VersionError(
                f"version {version} is not after the committed version {self.version}"
            )
        return self.version

    def _sends_digest(self, version: int, anchor: bool) -> bool:
        return self.role.index == 0 and self.config.sends_digest(version, anchor=anchor)

    def _digests(self, params: Params) -> dict[str, str]:
        if self.role.count == 1:
            full = params
        elif self._full_state is not None:
            full = self._full_state() if callable(self._full_state) else self._full_state
        else:
            raise ConfigError(
                "writer 0 of several needs full_state (the full parameters, or a callable "
                "gathering them) to send expected state digests; or set digest_every=0"
            )
        return state_digests(
            full, trainer_layout=self.trainer_layout, receiver_layout=self.receiver_layout
        )

    # ------------------------------------------------------------------ the whole version

    def sync(self, version: int | None = None, *, anchor: bool = False) -> SendReport:
        """Send ``version`` to every receiver and commit it jointly.

        Every rank of the group calls its ``sync`` for the same version; see the module
        docstring for what each failure leaves behind (SyncAbortedError on every rank).

        Args:
            version: the version to send (default: the committed version + 1, or 0).
            anchor: send every element (restores receivers that hold no verified version).

        Returns:
            A :class:`SendReport` with the version, base, bytes per receiver and timings.
        """
        self._check_group()
        if version is None:
            version = 0 if self.version is None else self.version + 1
        t0 = time.perf_counter()
        out, status = None, None
        try:
            out = self.payloads_for_version(version, anchor=anchor)
        except Exception as exc:  # noqa: BLE001 -- every rank raises it together in round 1
            status = exc
        t = time.perf_counter()
        got = exchange(
            out.payloads if out is not None else {}, group=self.group,
            config=self.config.exchange, status=status,
        )  # fmt: skip
        sent = got.stats.bytes_sent
        if self.plan.exchanges == 2:
            exchange({}, group=self.group, config=self.config.exchange)
        transfer_s = time.perf_counter() - t
        assert out is not None  # a failed status raised PeerFailedError in the exchange

        t = time.perf_counter()
        verdict = joint_commit(
            encode_commit_row(version=out.version, base=out.base), plan=self.plan, group=self.group,
            timeout_s=self.config.commit_timeout_s,
        )  # fmt: skip
        commit_s = time.perf_counter() - t
        if not verdict.ok:
            raise SyncAbortedError(
                verdict.message, failures=verdict.failures, anchor_required=verdict.anchor_required
            )
        # Every receiver holds the version: only now may the baseline move.
        self.tracker.clear()
        self.version = version
        return SendReport(
            version=version, base=out.base, anchor=anchor, bytes_sent=sent,
            shard_bytes=out.shard_bytes, elements=sum(out.shard_elements.values()),
            detect_s=out.detect_s, build_s=out.build_s, encode_s=out.encode_s,
            digest_s=out.digest_s, transfer_s=transfer_s, commit_s=commit_s,
            total_s=time.perf_counter() - t0,
        )  # fmt: skip
