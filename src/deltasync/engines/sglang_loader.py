"""deltasync inside SGLang: a custom weight loader that pulls a version into the live params.

SGLang's route for custom weight updates: start the server with
``--custom-weight-loader deltasync.engines.sglang_loader.load_deltasync``, then call
``update_weights_from_tensor`` (HTTP ``/update_weights_from_tensor`` or
``Engine.update_weights_from_tensor``) with ``load_format`` set to that same dotted path and
the named tensors :func:`request_tensors` builds. SGLang then calls
``load_deltasync(model, named_tensors)`` on every TP rank's model runner; the tensors carry
only a small JSON request (store, receiver id, state dir, version). Each rank opens (once) a
:class:`~deltasync.Receiver` over its model's own parameters as targets and pulls the
version: staging, journal, scatter in place (O(changed)), digest check. A failure leaves the
rank at its previous verified version (or at none, as its registration then says).

SGLang calls a custom loader without a ``try`` and answers ``success: True`` whatever it
returns, and an exception there ends its scheduler (``Scheduler hit an exception``, then the
whole server). So :func:`load_deltasync` never raises a refusal: it logs it on the rank, and
the caller asks the store what every rank holds with :func:`check_taken` after each call
(every rank records the version it holds before its loader call returns). :func:`take_version`,
the same call with the rank given, raises. ``update_weights_from_disk`` is a full reload
through SGLang's model loader (O(model), what deltasync avoids); use it only to restart from a
dense checkpoint.

SGLang's Qwen3 / Qwen3-MoE conventions are vLLM's (its ``linear.py`` and
``vocab_parallel_embedding.py`` descend from vLLM's): fused ``qkv_proj`` (per rank q, k, v
heads; kv heads replicated when fewer than TP ranks, rank r holding kv head
``r // replicas``), merged ``gate_up_proj``, row-parallel ``o_proj``/``down_proj``, vocab
padded to 64 and split evenly, ``FusedMoE`` ``w13_weight``/``w2_weight``, tied ``lm_head``
being ``embed_tokens`` itself. So the vLLM receiver layout is SGLang's, with one exception:
when the 64-padded vocabulary does not divide by TP, SGLang pads to ``64 * tp`` (vLLM refuses
such a TP); :func:`sglang_layout` raises for that case rather than guess.

This module imports SGLang only inside :func:`load_deltasync` (to read the TP rank); it knows
the loader contract and the request, nothing of chains or digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltasync import (
    ModelSpec,
    PullReport,
    Receiver,
    ReceiverConfig,
    ReceiverLayout,
    names,
)
from deltasync.commit.catalog import Catalog
from deltasync.commit.signing import MIN_KEY_BYTES
from deltasync.engines.adapters import check_every_parameter_written
from deltasync.engines.agreement import (
    Gather,
    failed_ranks,
    group_gather,
    refused,
    unwritten_state,
)
from deltasync.engines.reloads import watch_loads
from deltasync.errors import (
    ApplyError,
    ConfigError,
    DeltaSyncError,
    KeyNotFoundError,
    StoreError,
    VersionError,
)
from deltasync.store import Store
from deltasync.store.factory import open_engine_store
from deltasync.validate import check_int

log = logging.getLogger(__name__)

LOADER = "deltasync.engines.sglang_loader.load_deltasync"
REQUEST_NAME = "deltasync.request"
_VOCAB_PAD = 64
_SHARD = "_deltasync_shard"  # the model attributes holding its shard and its update lock
_LOCK = "_deltasync_lock"
_UNREADABLE = "a request it could not read"  # what a rank was asked, for the other ranks


def new_request_id() -> str:
    """A fresh :attr:`SglangRequest.request_id` (128 random bits, hex)."""
    return secrets.token_hex(16)


@dataclass(frozen=True, kw_only=True)
class SglangRequest:
    """What one ``update_weights_from_tensor`` call asks every rank to do: take ``version``
    from ``store``; ranks ack as ``{receiver_id}-{shard}`` and keep their state in
    ``{state_dir}/{receiver_id}-{shard}``.

    ``request_id`` names this one request (fresh for every request built; pass it again only
    to resend the same request): a rank's registration names it once the rank has verified,
    while taking the request, the version it registers (:meth:`Receiver.answering`), and
    :func:`check_taken` accepts only those, so a registration left from an earlier request
    (the ranks reloaded since, or this request never reached them) is not taken for an
    answer. None (a request from a caller that names none) is checked by version and lineage
    alone."""

    store: str
    receiver_id: str
    state_dir: str
    version: int
    signing_key_hex: str | None = field(default=None, repr=False)
    s3: dict[str, Any] | None = field(default=None, repr=False)  # may hold credentials
    durable: bool = True
    request_id: str | None = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        for name in ("store", "receiver_id", "state_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "\x00" in value:
                raise ConfigError(
                    f"SglangRequest.{name} must be a non-empty string without NUL bytes"
                )
        try:  # a path component of the state dir: never a way out of it
            names.check_token("SglangRequest.receiver_id", self.receiver_id)
        except DeltaSyncError as exc:
            raise ConfigError(str(exc)) from None
        names.check_version_arg("SglangRequest", self.version)
        if self.request_id is not None:
            try:
                names.check_token("SglangRequest.request_id", self.request_id)
            except DeltaSyncError as exc:
                raise ConfigError(str(exc)) from None
        if self.signing_key_hex is not None:
            try:
                key = bytes.fromhex(self.signing_key_hex)
            except (TypeError, ValueError):
                key = b""
            if len(key) < MIN_KEY_BYTES:
                raise ConfigError(
                    "SglangRequest.signing_key_hex must be the hex of a key of at least "
                    f"{MIN_KEY_BYTES} bytes"
                )
        if self.s3 is not None and not isinstance(self.s3, dict):
            raise ConfigError("SglangRequest.s3 must be a dict of S3Config fields or None")
        if not isinstance(self.durable, bool):
            raise ConfigError(f"SglangRequest.durable must be a bool, got {self.durable!r}")

    def signing_key(self) -> bytes | None:
        return bytes.fromhex(self.signing_key_hex) if self.signing_key_hex else None

    def open_store(self) -> Store:
        """The store it names, which must exist (ConfigError otherwise, nothing created)."""
        return open_engine_store(self.store, self.s3, durable=self.durable, what="SglangRequest")

    def shard_receiver(self, shard: str, *, where: str) -> str:
        """The receiver id of ``shard``'s rank, ``{receiver_id}-{shard}``; ConfigError when
        it is too long to be a name (``where``: the rank or shard, in the message)."""
        rid = f"{self.receiver_id}-{shard}"
        try:
            names.check_token("receiver", rid)
        except DeltaSyncError:
            raise ConfigError(
                f"SglangRequest.receiver_id {self.receiver_id!r} is too long for {where}: its "
                f"receiver id {rid!r} must be at most 128 characters. Nothing was written"
            ) from None
        return rid

    def opening(self) -> dict[str, Any]:
        """Every field but the version and the request's id: what a rank's receiver is
        opened with."""
        fields = asdict(self)
        del fields["version"], fields["request_id"]
        return fields

    def asked(self) -> str:
        """What the TP ranks compare before any writes: the version and store by name, every
        field by a digest (the signing key is never shown)."""
        data = json.dumps(asdict(self), sort_keys=True).encode()
        return (
            f"version {self.version} of {self.store!r} "
            f"(request {hashlib.sha256(data).hexdigest()[:12]})"
        )


def request_tensors(request: SglangRequest) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of an ``update_weights_from_tensor`` call for :data:`LOADER`.

    Args:
        request: the version to take and where from.

    Returns:
        One ``(REQUEST_NAME, uint8 tensor of the request's JSON)`` pair (SGLang serializes
        tensors, not dicts; the same pair serves every TP rank).
    """
    data = json.dumps(asdict(request), sort_keys=True).encode()
    return [(REQUEST_NAME, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def parse_request(named_tensors: list[tuple[str, Any]]) -> SglangRequest:
    """The request in ``named_tensors`` (raises ConfigError naming what is wrong)."""
    try:
        found = [t for n, t in named_tensors if n == REQUEST_NAME]
    except (TypeError, ValueError):
        raise ConfigError(
            f"load_format {LOADER!r} expects named tensors as (name, tensor) pairs (build them "
            "with deltasync.engines.sglang_loader.request_tensors)"
        ) from None
    if len(found) != 1 or not isinstance(found[0], torch.Tensor) or found[0].dtype != torch.uint8:
        raise ConfigError(
            f"load_format {LOADER!r} expects exactly one {REQUEST_NAME!r} uint8 tensor "
            "(build it with deltasync.engines.sglang_loader.request_tensors)"
        )
    try:
        fields = json.loads(bytes(found[0].cpu().numpy().tobytes()).decode())
        if isinstance(fields, dict):  # a caller that names no request: every rank alike
            fields.setdefault("request_id", None)
        return SglangRequest(**fields)
    except (ValueError, TypeError, RecursionError) as exc:  # deep nesting: RecursionError
        raise ConfigError(f"{REQUEST_NAME!r} does not hold a deltasync request: {exc}") from None


def check_taken(request: SglangRequest) -> None:
    """After ``update_weights_from_tensor`` with :func:`request_tensors` of ``request``: return
    when every TP rank of the engine holds ``request.version``, as each rank's registration in
    the store says (written before its loader call returned, MAC-checked with the request's
    key), naming this request (``request.request_id``: the rank applied or re-hashed the
    version while taking it), of the lineage the store commits under that number now.

    Raises:
        ApplyError: naming each shard that does not hold it and what it holds instead, or
            whose registration does not answer the request (it did not reach the rank, the
            rank could not check or register the version while taking it, or a later request
            came); the reason is in the engine's log (``deltasync SGLang ...``). The next
            request brings every rank to the newest version.
        VersionError: ``request.version`` is not committed in the store.
        StoreError: a rank's registration could not be read (an outage): whether it took
            the version is unknown, not refused.
    """
    catalog = Catalog(request.open_store(), signing_key=request.signing_key())
    try:
        manifest = catalog.manifest(request.version, fresh=True)
    except KeyNotFoundError:
        raise VersionError(
            f"version {request.version} is not committed in the store {request.store!r}; no "
            "engine can hold it"
        ) from None
    shards = sorted(manifest.layout.shards if manifest.layout else manifest.shard_digests)
    missing = []
    for shard in shards:
        receiver = request.shard_receiver(shard, where=f"shard {shard!r}")
        try:
            record = catalog.receiver(receiver, strict=True)
        except StoreError as exc:  # not "no registration": nothing is known of that rank
            raise StoreError(
                f"receiver {request.receiver_id!r} shard {shard!r}: its registration could not "
                f"be read ({exc}), so whether it took version {request.version} is unknown; ask "
                "again (check_taken) once the store answers"
            ) from exc
        held = None if record is None else record.version_in(manifest.run_id)
        # the rank verified what it names while taking this request (not a registration an
        # earlier request left, nor one a refusal wrote before any check: Receiver.answering)
        answered = record is None or request.request_id in (None, record.request)
        if held != request.version:
            what = "no registration" if record is None else f"version {record.version}"
            if record is not None and held is None and record.version is not None:
                what += " of another lineage"
            if not answered:
                what += " (not registered for this request)"
            missing.append(f"shard {shard!r} holds {what}")
        elif not answered:
            missing.append(
                f"shard {shard!r} registered version {held} without answering this request: "
                "the request did not reach it, it could not check or register the version "
                "while taking it, or a later request came (it may hold other weights now, "
                "e.g. after update_weights_from_disk)"
            )
    if missing:
        raise ApplyError(
            f"receiver {request.receiver_id!r} did not take version {request.version}: "
            f"{'; '.join(missing)}. Why is in the engine's log (lines 'deltasync SGLang'); the "
            "next request brings every rank to the newest version"
        )


def sglang_layout(spec: ModelSpec, tp: int, ep: int = 1) -> ReceiverLayout:
    """SGLang's receiver layout for ``spec`` at this TP/EP: vLLM's (see the module docstring)."""
    padded = -(-spec.vocab_size // _VOCAB_PAD) * _VOCAB_PAD
    if padded % tp:
        raise ConfigError(
            f"SGLang pads a vocabulary of {spec.vocab_size} to a multiple of {_VOCAB_PAD * tp} at tp={tp} "
            f"({padded} does not divide by {tp}); deltasync has no layout for that padding"
        )
    return ReceiverLayout.build(spec, engine="vllm", tp=tp, ep=ep)


class _Agreement:
    """The two decisions every TP rank makes once per request, whatever its own path: before
    the first write (is every rank staged and verified?) and after it (did every rank
    finish?). SGLang replies to the caller with TP rank 0's result only and records the weight
    version from it, so no rank writes unless all can, and every rank fails the request when
    any rank failed (:mod:`.agreement`)."""

    def __init__(
        self,
        shard: str,
        version: int | None,
        gather: Gather | None,
        unverified: Callable[[], bool] = lambda: False,
        *,
        asked: str | None = None,
    ) -> None:
        self.shard = shard
        self.version = version
        self._gather = gather
        self._asked = asked  # what this rank was asked: every rank must be asked the same
        self._unverified = unverified  # does this rank hold no verified version now?
        self.staged = False  # the first decision was made

    def _round(self, error: BaseException | None) -> list[tuple[str, str]]:
        try:
            return failed_ranks(
                self.shard, error, self._gather, unverified=self._unverified(), asked=self._asked
            )
        except Exception as exc:  # a rank died or the group timed out
            what = "the update" if self.version is None else f"version {self.version}"
            raise ApplyError(
                f"shard {self.shard!r}: the TP ranks could not agree on taking {what} "
                f"({type(exc).__name__}: {exc}); restart the engine if a rank is gone"
            ) from exc

    def before_write(self) -> None:
        """The first decision, on a rank ready to write (raises if any rank is not)."""
        if self.staged:
            return
        self.staged = True
        failed = self._round(None)
        if failed:
            raise refused(self.version, failed, unwritten_state(failed))

    def finish(self, error: BaseException | None) -> None:
        """The decisions this rank has not made yet, with its outcome; raises if any rank
        failed (its own error first)."""
        before = None
        if not self.staged:  # never reached its first write: that decision is made now
            self.staged = True
            before = self._round(error)
        after = self._round(error)
        if error is not None:
            raise error
        if before:
            raise refused(self.version, before, unwritten_state(before))
        if before is None and after:  # it wrote: what the ranks that failed afterwards say
            raise refused(
                self.version,
                after,
                "this rank took it; the failed ranks say where they are, and the next "
                "request brings every rank to the newest version",
            )


class SglangShard:
    """One SGLang TP rank's receiver: the model's own parameters as targets."""

    def __init__(self, model: torch.nn.Module, hf_config: Any, *, tp_rank: int, tp: int) -> None:
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.layout = sglang_layout(self.spec, tp)
        shards = [s.id for s in self.layout.shards() if s.tp_rank == tp_rank]
        if not shards:
            raise ConfigError(f"tp_rank {tp_rank} is not a rank of tp={tp}: 0 <= tp_rank < tp")
        self.shard = shards[0]
        live = dict(model.named_parameters())
        self.targets: dict[str, torch.Tensor] = {}
        for name, spec in self.layout.local_specs(self.shard).items():
            p = live.get(name)
            if p is None:
                raise ConfigError(
                    f"the SGLang model has no parameter {name!r} of receiver shard {self.shard!r}"
                )
            if tuple(p.shape) != spec.shape or p.dtype != spec.dtype:
                raise ConfigError(
                    f"SGLang parameter {name!r} is {tuple(p.shape)} {p.dtype}; the layout of "
                    f"shard {self.shard!r} says {spec.shape} {spec.dtype} (serve in bfloat16)"
                )
            self.targets[name] = p.data
        check_every_parameter_written("SGLang", live, self.targets, self.shard)
        self.receiver: Receiver | None = None
        self.opened: dict[str, Any] | None = None  # the request fields it was opened with
        self._agreement: _Agreement | None = None  # the request being taken
        self._wrote = False  # the request being taken reached a write
        # SGLang's update_weights_from_disk runs the model's load_weights on this same model:
        # the rank stops holding its version as that returns, not at the next request
        watch_loads(model, self._reloaded)

    def _reloaded(self) -> None:
        """After a ``load_weights`` call: the version held is no longer what the rank computes
        with. Never raises (the reload must not fail on deltasync's records): a failure is
        logged, and the next request's check of the tensors finds the reload anyway."""
        receiver = self.receiver
        if receiver is None:
            return
        try:
            receiver.invalidate(
                "SGLang's load_weights (update_weights_from_disk) wrote the rank's weights"
            )
        except Exception as exc:
            log.warning(
                "deltasync SGLang shard %s: could not mark the version held dirty after a "
                "reload (%s: %s); the next request finds the reload when it checks the tensors",
                self.shard,
                type(exc).__name__,
                exc,
            )

    @contextlib.contextmanager
    def _pause(self) -> Iterator[None]:
        """The receiver's pause, entered right before its first write: every TP rank agrees
        first (a repair on opening or a second chain in the same pull proceeds as agreed)."""
        if self._agreement is not None:
            self._agreement.before_write()
        self._wrote = True
        yield

    def open(self, request: SglangRequest) -> Receiver:
        """The receiver of ``request`` (opened by the first request, then reused).

        A later request must name the same store, id, state dir, key, S3 settings and
        durability: a receiver opened otherwise would silently keep the first ones (a key
        added later would not be required, and a state dir changed would lose its journal's
        continuity). That is a ConfigError naming the fields; restart the engine to change
        them."""
        if self.receiver is not None:
            assert self.opened is not None
            changed = sorted(k for k, v in request.opening().items() if self.opened[k] != v)
            if changed:
                raise ConfigError(
                    f"SGLang rank shard {self.shard!r} was opened with other {changed} than "
                    "this request names; nothing was written. They are fixed for the engine's "
                    "life: restart it to change them"
                )
            return self.receiver
        rid = request.shard_receiver(self.shard, where="this rank")
        store = request.open_store()
        key_bytes = request.signing_key()
        if Catalog(store, signing_key=key_bytes).latest() is None:
            # before the receiver registers: a path to a directory that is no store (its
            # parent, a typo) gets nothing written into it
            raise VersionError(
                f"SGLang rank shard {self.shard!r}: the store {request.store!r} holds no committed "
                "version; check the path, or publish first. Nothing was written"
            )
        state_dir = Path(request.state_dir) / rid  # made by the receiver (a typed error)
        self.receiver = Receiver.for_layout(
            store,
            self.layout,
            self.shard,
            self.targets,
            str(state_dir),
            ReceiverConfig(
                receiver_id=rid,
                signing_key=key_bytes,
                durable=request.durable,
                restore_drift=True,  # after update_weights_from_disk: restored, not refused
            ),
            pause=self._pause,
        )
        self.opened = request.opening()
        return self.receiver

    def take(self, request: SglangRequest, gather: Gather | None = None) -> PullReport | None:
        """Pull ``request.version`` (the store's newest); None if already there.

        ``gather``: an all-gather over the engine's TP ranks (None: this rank alone, TP = 1).
        Every rank of a TP > 1 engine takes the request with it: no rank writes unless every
        rank staged and verified the version, every rank raises when one failed (SGLang
        replies with rank 0's result), and ranks handed different requests all raise."""
        agreement = _Agreement(
            self.shard,
            request.version,
            gather,
            unverified=lambda: self.receiver is not None and self.receiver.dirty,
            asked=request.asked(),
        )
        first = self.receiver is None
        self._wrote = False
        receiver: Receiver | None = None
        try:
            receiver = self.open(request)
            receiver.answering(request.request_id)
            # The journal of an earlier failed pull is this rank's own business: replayed
            # before the agreement, which is about the first write of the requested version
            # (agreeing at the replay's write let the others write while this rank went on to
            # fail the version it was asked for).
            receiver.replay_journal()
            self._agreement = agreement
            report = self._take(request)
        except BaseException as exc:  # an interrupt too: the other ranks wait for this answer
            self._agreement = None
            if first and not self._wrote:
                # a first request that failed before any write fixes nothing for the next
                self.receiver, self.opened = None, None
            elif receiver is not None and isinstance(exc, Exception):
                self._answer_refused(receiver)
            agreement.finish(exc)
            raise
        self._agreement = None
        agreement.finish(None)
        return report

    def _answer_refused(self, receiver: Receiver) -> None:
        """After a refused request: the registration says what the rank holds now (the pull
        may have refused before writing any record), naming the request only if the rank
        verified that version while taking it (:meth:`Receiver.answering`), so that
        check_taken says which version the rank holds. Best effort: the refusal is the
        request's answer already."""
        try:
            receiver.flush_records()
        except Exception as exc:
            log.warning(
                "deltasync SGLang shard %s: registration after the refusal not written: %s: %s",
                self.shard,
                type(exc).__name__,
                exc,
            )

    def _take(self, request: SglangRequest) -> PullReport | None:
        receiver = self.open(request)
        if self._holds(receiver, request.version):
            # its ack and registration again: one whose write failed before would leave
            # check_taken failing (and a trainer waiting for acks) for a version the rank holds
            receiver.flush_records()
            return None
        latest = receiver.catalog.latest()
        if latest is None:
            raise VersionError(
                f"SGLang rank shard {self.shard!r}: the store {request.store!r} holds no committed "
                "version; check the path, or publish first. Nothing was written"
            )
        if latest != request.version:
            raise VersionError(
                f"SGLang rank shard {self.shard!r}: version {request.version} is not the store's "
                f"newest committed version ({latest}); a receiver takes the newest. Nothing "
                "was written"
            )
        # exactly the requested version, even if a newer one commits while it is staged
        report = receiver.pull(version=request.version)
        log.info(
            "deltasync SGLang shard %s: version %s -> %s (%d elements, pause %.3f s)",
            self.shard,
            report.previous_version,
            report.version,
            report.elements_written,
            report.pause_s,
        )
        return report

    def _holds(self, receiver: Receiver, version: int) -> bool:
        """Does the rank verifiably hold ``version`` as the store commits it now: the same
        number, this shard's state digest and lineage in the manifest read afresh, and the
        live tensors hashing to it? After a store reset (a new lineage) the same number names
        other weights, which a rank still holding the old ones must pull, not answer as
        taken; after ``update_weights_from_disk`` (SGLang loads into the same model, so this
        shard and its receiver live on) the tensors hold the checkpoint's weights, and the
        scrub that finds it marks the receiver dirty, so the pull restores the version."""
        if receiver.dirty or receiver.version != version:
            return False
        # The tensors first: local, so a reload since is found whatever the store answers
        # (a manifest read that failed once skipped it, and the pull then found the version
        # held and wrote nothing over the checkpoint's weights).
        if not receiver.scrub():
            return False
        try:
            manifest = receiver.catalog.manifest(version, fresh=True)
        except DeltaSyncError:  # not committed (any more), or unreadable: pull decides
            return False
        return manifest.shard_digests.get(self.shard) == receiver.state_digest and (
            receiver.run_id in (None, manifest.run_id)
        )


def take_version(
    model: torch.nn.Module,
    named_tensors: list[tuple[str, Any]],
    *,
    tp_rank: int,
    tp: int,
    gather: Gather | None = None,
) -> PullReport | None:
    """:func:`load_deltasync` with the rank given (what it does once SGLang said where it is).

    ``gather``: the all-gather over the engine's TP ranks that :meth:`SglangShard.take`
    agrees with (required when ``tp > 1``). The shard is kept on the model object, so its
    receiver (journal, verified version) lives as long as the model runner."""
    check_int("take_version", "tp", tp, lo=1)
    check_int("take_version", "tp_rank", tp_rank, lo=0)
    if not 0 <= tp_rank < tp:  # also for a model whose shard was opened at another rank
        raise ConfigError(f"tp_rank {tp_rank} is not a rank of tp={tp}: 0 <= tp_rank < tp")
    if tp > 1 and gather is None:
        raise ConfigError(
            f"tp={tp}: take_version needs the TP ranks' gather (load_deltasync passes SGLang's "
            "TP CPU group), so that no rank takes a version another rank refused"
        )
    # One update at a time per model: two callers' pulls would interleave their writes
    # (SGLang runs one weight update per rank at a time; a direct caller may not).
    with model.__dict__.setdefault(_LOCK, threading.Lock()):
        request: SglangRequest | None = None
        shard = getattr(model, _SHARD, None)
        try:
            request = parse_request(named_tensors)
            if shard is None:
                shard = SglangShard(model, model.config, tp_rank=tp_rank, tp=tp)
        except BaseException as exc:  # the other ranks are waiting for this one's answer
            asked = _UNREADABLE if request is None else request.asked()
            version = None if request is None else request.version
            _Agreement(f"tp{tp_rank}", version, gather, asked=asked).finish(exc)
            raise
        setattr(model, _SHARD, shard)
        return shard.take(request, gather)


def load_deltasync(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader (``--custom-weight-loader`` and ``load_format``).

    Never raises a refusal (an interrupt still propagates): SGLang would end its scheduler.
    The rank logs it, stays at its previous verified version (or at none, as its registration
    says), and the caller learns it from :func:`check_taken`.

    Args:
        model: the rank's model (SGLang passes ``model_runner.model``).
        named_tensors: :func:`request_tensors` output.
    """
    from sglang.srt.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    tp = get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank()
    gather = group_gather(get_tp_group().cpu_group, tp) if tp > 1 else None
    try:
        take_version(model, named_tensors, tp_rank=rank, tp=tp, gather=gather)
    except Exception as exc:  # raised, it would end SGLang's scheduler (module docstring)
        log.error(
            "deltasync SGLang TP rank %d: the update was not taken (the caller's check_taken "
            "says so): %s: %s",
            rank,
            type(exc).__name__,
            exc,
        )
