"""deltasync as a vLLM weight-transfer backend (worker side): versions pulled from a store.

vLLM's four-phase weight-transfer API calls, on every worker:

1. ``init_weight_transfer_engine(init_info)`` -> :meth:`DeltaSyncWeightTransferEngine.init_transfer_engine`:
   find this worker's receiver shard (:class:`~deltasync.engines.vllm_shard.VllmShard`: TP/EP
   rank from vLLM's parallel state, layout from its HF config, the live parameters as targets)
   and open a :class:`~deltasync.Receiver` on the store named in ``init_info``
   (:class:`DeltaSyncInitInfo`);
2. per update ``start_weight_update()``: begin a session (nothing is read yet);
3. ``update_weights(update_info)`` (:class:`DeltaSyncUpdateInfo`), one or two calls:

   - ``{"version": N, "phase": "stage"}`` starts the pull on a worker-side thread and returns at
     once: the manifests, blobs, digests and decoding are fetched and checked while the
     engine keeps serving; the thread then waits before its first write (its errors are
     raised by the apply call);
   - ``{"version": N}`` (phase ``"apply"``) waits for the staged pull (or stages now if
     nothing was staged), at most ``DeltaSyncInitInfo.stage_timeout_s`` (a store that does not
     answer fails the update, every rank's, instead of holding vLLM's RPC loop), then the TP
     ranks agree (one flag each, reduced over vLLM's TP CPU
     group): if any rank failed to stage, no rank writes; otherwise each writes: journal,
     scatter in place, post-load refresh of packed CPU kernels, digest check. vLLM runs this
     RPC between model steps, so this call is the engine's pause; with ``"stage"`` first it
     covers the scatter only.

4. ``finish_weight_update()``: close the session and record the verified version
   (:attr:`DeltaSyncWeightTransferEngine.weight_version`). The prefix cache is the
   scheduler's, not the worker's: the trainer side resets it after this call
   (:mod:`deltasync.engines.vllm_trainer`).

``version`` must be the newest committed version of the store: a receiver pulls the newest
version, and takes nothing else. Any failure raises through vLLM's API (the RPC re-raises on
the caller) and leaves the worker at its previous verified version: a bad manifest, blob or
chain is found while staging, before anything is written.

Registered as backend ``"deltasync"`` by :mod:`deltasync.engines.vllm_plugin` (a
``vllm.general_plugins`` entry point). This module imports vLLM: only vLLM's factory loads it.
It knows the weight-transfer protocol and the pull's threading; stores, chains and digests are
the Receiver's, kernels and layouts the shard's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltasync import ModelSpec, PullReport, Receiver, ReceiverConfig, names
from deltasync.atomic import InBackground
from deltasync.engines.agreement import (
    failed_ranks,
    group_gather,
    refused,
    unwritten_state,
)
from deltasync.engines.reloads import loads_of, watch_loads
from deltasync.engines.vllm_shard import ShardPlace, VllmShard
from deltasync.errors import ApplyError, ConfigError, DeltaSyncError, VersionError
from deltasync.layout.probed import load_receiver_layout
from deltasync.names import check_version_arg
from deltasync.store.factory import open_engine_store
from deltasync.validate import check_seconds

log = logging.getLogger(__name__)

PHASES = ("stage", "apply")

# How long a cancelled staging thread is waited for (at most; the stage timeout if shorter)
# before it is left behind: one parked at its gate ends at once, one inside a store call that
# does not return must not hold vLLM's RPC loop. The next staging waits for it (on its own
# thread) before it touches the receiver, which takes one pull at a time.
STOP_WAIT_S = 10.0

# Ends a refusal of start_weight_update / update_weights raised at TP > 1 (by the last rank
# only): the ranks that returned keep vLLM's session open, so a caller of vLLM's own API must
# close it before the next start (DeltaSyncTrainerEngine does), or the executor's replies shift.
SESSION_NOTE = (
    " (TP > 1: call finish_weight_update once before the next start_weight_update; the other "
    "ranks keep vLLM's session of this update open, and this rank refuses that call)"
)


@dataclass
class DeltaSyncInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` receives (JSON-safe: it also travels over HTTP).

    - ``store``: the store URL the trainer publishes to (a path, ``file://``, ``s3://``);
    - ``receiver_id``: this engine replica's name; each worker acks as
      ``{receiver_id}-{shard}`` (data-parallel replicas need distinct ids);
    - ``state_dir``: a directory of this engine's own; each worker keeps its journal and
      verified version in ``{state_dir}/{receiver_id}-{shard}``;
    - ``signing_key_hex``: the manifests' HMAC key as hex, when the trainer signs;
    - ``s3``: :class:`~deltasync.S3Config` fields for an ``s3://`` store;
    - ``path``: ``"auto"``, ``"inplace"`` or ``"repack"`` (see :mod:`.vllm_shard`);
    - ``durable``: fsync the journal and state file (False only on scratch disks);
    - ``layout``: a layout file the publisher uses too (probed from this engine's own loader:
      :func:`~deltasync.engines.vllm_probe.probe_vllm_layout`, or ``deltasync layout probe``);
      None: the ``vllm`` convention's table (hand-written for Qwen3/Qwen3-MoE);
    - ``stage_timeout_s``: the longest an apply waits for its staged pull to be fetched and
      verified, and again for its write to end: a store that does not answer (an endpoint
      that accepts the connection and never replies, a hung NFS read, a ``Store`` without
      timeouts) then fails the update on every TP rank, nothing written, instead of holding
      vLLM's worker forever. Give it the time a full anchor of one shard takes to fetch.
    """

    store: str
    receiver_id: str
    state_dir: str
    # secrets: never in the repr (it lands in vLLM's logs and tracebacks)
    signing_key_hex: str | None = field(default=None, repr=False)
    s3: dict[str, Any] | None = field(default=None, repr=False)
    path: str = "auto"
    durable: bool = True
    layout: str | None = None
    stage_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("store", "receiver_id", "state_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"DeltaSyncInitInfo.{name} must be a non-empty string")
        try:  # a path component of the state dir: never a way out of it
            names.check_token("DeltaSyncInitInfo.receiver_id", self.receiver_id)
        except DeltaSyncError as exc:
            raise ConfigError(str(exc)) from None
        if self.s3 is not None and not isinstance(self.s3, dict):
            raise ConfigError("DeltaSyncInitInfo.s3 must be a dict of S3Config fields or None")
        if not isinstance(self.durable, bool):
            raise ConfigError("DeltaSyncInitInfo.durable must be a bool")
        if self.layout is not None and (not isinstance(self.layout, str) or not self.layout):
            raise ConfigError("DeltaSyncInitInfo.layout must be a layout file's path or None")
        check_seconds("DeltaSyncInitInfo", "stage_timeout_s", self.stage_timeout_s)

    def signing_key(self) -> bytes | None:
        if self.signing_key_hex is None:
            return None
        try:
            return bytes.fromhex(self.signing_key_hex)
        except ValueError:
            raise ConfigError("DeltaSyncInitInfo.signing_key_hex is not hex") from None


@dataclass
class DeltaSyncUpdateInfo(WeightTransferUpdateInfo):
    """What one ``update_weights`` call receives: the version to take and the phase."""

    version: int
    phase: str = "apply"
    extra: dict[str, Any] = field(default_factory=dict)  # ignored; room for later fields

    def __post_init__(self) -> None:
        check_version_arg("DeltaSyncUpdateInfo", self.version)
        if self.phase not in PHASES:
            raise ConfigError(
                f"DeltaSyncUpdateInfo.phase must be one of {PHASES}, got {self.phase!r}"
            )


def _rpc(method: Callable[..., None]) -> Callable[..., None]:
    """An RPC vLLM calls on every worker: a check that failed alike on every TP rank returns
    here on all but the last (``DeltaSyncWeightTransferEngine._entry``)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except _Answered:
            return

    return call


class _StagedPull:
    """One pull on its own thread, held before its first write until :meth:`release`.

    The Receiver enters :meth:`gate` right before its scatter (after the journal is written);
    the gate waits there until the worker thread, inside ``update_weights``, releases it. Once
    cancelled it never writes: a thread that reaches the gate (or a journal's replay) after
    that, however late its store call returns, is refused there."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.started = time.monotonic()
        self.waiting_for: _StagedPull | None = None  # an older pull still in the receiver
        self.written: tuple[int, tuple[int | None, ...]] | None = None  # _written_stamp at start
        self.committed: tuple[str, str | None] | None = None  # (run id, shard digest) staged
        self.staged = threading.Event()
        self._go = threading.Event()
        self._cancelled = False
        self.report: PullReport | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    @contextlib.contextmanager
    def gate(self) -> Iterator[None]:
        self.staged.set()
        self._go.wait()
        self.refuse_if_cancelled()
        yield

    def refuse_if_cancelled(self) -> None:
        if self._cancelled:
            raise ApplyError(
                f"the staged update to version {self.version} was cancelled before its first "
                "write; nothing was written, and nothing is left to replay"
            )

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def left_as(self) -> str:
        """How it was left, for a message: cancelled (it never writes), or released (it wrote)
        with the records after its scatter still going to the store."""
        return "cancelled" if self._cancelled else "written, its records not yet in the store"

    def release(self) -> None:
        self._go.set()

    def cancel(self) -> None:
        self._cancelled = True  # before the gate opens: whoever passes it sees the flag
        self._go.set()

    def stop(self, wait_s: float) -> bool:
        """Cancel it and wait up to ``wait_s`` for its thread to end; True when it has. Either
        way nothing of it is written after (it is never released once cancelled)."""
        self.cancel()
        assert self.thread is not None
        self.thread.join(wait_s)
        return not self.thread.is_alive()


class DeltaSyncWeightTransferEngine(WeightTransferEngine[DeltaSyncInitInfo, DeltaSyncUpdateInfo]):
    """The worker side of backend ``"deltasync"``; see the module docstring."""

    init_info_cls = DeltaSyncInitInfo
    update_info_cls = DeltaSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.shard: VllmShard | None = None
        self._shard_key: tuple[Any, ...] | None = None  # what self.shard was built from
        self.receiver: Receiver | None = None
        self.weight_version: int | None = None  # recorded by the apply, and the finish
        self.last_report: PullReport | None = None
        self.last_update_s = 0.0  # wall time of the last apply call (this worker)
        self.last_pause_s = 0.0  # the scatter and kernel refresh (this worker)
        self._staged: _StagedPull | None = None
        # Per staging thread: its pull (``staged``) and, once its journal's replay is done,
        # the gate its scatter waits at (``gate``). Kept on the thread, not the engine: a
        # pull left inside a store call must find its own, cancelled, pull when it returns.
        self._local = threading.local()
        # Pulls cancelled while their thread was still inside the receiver (a store call that
        # did not return): the next staging waits for them before it touches the receiver.
        self._left: list[_StagedPull] = []
        self._stage_timeout_s = DeltaSyncInitInfo.stage_timeout_s  # the init's, once given
        self._touched: set[str] = set()
        self._active = False
        # _written_stamp when this worker last verified what it holds (an init, an apply):
        # moved since, something else wrote the weights (vLLM's reload_weights between
        # versions), and the version held is no longer what the engine computes with
        self._verified: tuple[int, tuple[int | None, ...]] | None = None
        watch_loads(model, self._after_load)

    # --- phase 1 --------------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> DeltaSyncInitInfo | _Refused:
        """vLLM's worker parses the init info before :meth:`init_transfer_engine`, outside it:
        raised there, a refusal comes from every TP rank, and vLLM's multiprocess executor
        then reads each later call's reply from the call before (every update fails, or
        reports another call's outcome, for the engine's life). So a refusal is carried into
        :meth:`init_transfer_engine`, which raises it from the last rank only."""
        try:
            return super().parse_init_info(init_dict)
        except Exception as exc:
            return _Refused(exc)

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltaSyncUpdateInfo:
        """:class:`DeltaSyncUpdateInfo` from the request's dict; a dict it does not take (an
        unknown or missing field, another type than a dict) is a ConfigError naming the
        fields it takes, as for the init info (vLLM's own parser raises a bare ValueError)."""
        if not isinstance(update_dict, dict):
            raise ConfigError(
                f"update_weights: update_info must be a dict, got {type(update_dict).__name__}"
            )
        try:
            return DeltaSyncUpdateInfo(**update_dict)
        except TypeError as exc:
            taken = ", ".join(f.name for f in fields(DeltaSyncUpdateInfo))
            raise ConfigError(
                f"update_weights: update_info {sorted(map(str, update_dict))} is not a "
                f"DeltaSyncUpdateInfo ({exc}); its fields are {taken} (later ones go in "
                "'extra'). Nothing was written"
            ) from None

    @_rpc
    def init_transfer_engine(self, init_info: DeltaSyncInitInfo | _Refused) -> None:
        """Build this worker's shard and its receiver. Args: ``init_info``, see
        :class:`DeltaSyncInitInfo`. Again on a worker that has them (a restarted trainer):
        a staged update is cancelled first (nothing of it was written), and an init refused
        on any TP rank keeps the shard and receiver every rank had."""
        self._cancel_staged()
        self._active = False
        built, error = None, None
        try:
            place = ShardPlace.from_vllm(self.parallel_config)
        except DeltaSyncError as exc:  # pipeline parallelism: refused alike on every worker
            place, error = _tp_place(), exc
        try:
            if error is not None:
                raise error
            if isinstance(init_info, _Refused):
                if isinstance(init_info.error, DeltaSyncError):
                    raise init_info.error
                raise ConfigError(f"init_weight_transfer_engine: {init_info.error}")
            self._refuse_while_inside("init_weight_transfer_engine")
            built = self._build(init_info, place)
        except Exception as exc:
            error = exc
        failures = failed_ranks(
            f"tp{place.tp_rank}",
            error,
            group_gather(_tp_cpu_group(), place.tp) if place.tp > 1 else None,
        )
        with self._entry("init_weight_transfer_engine", place):
            if error is not None:
                raise error
            if failures:
                raise ConfigError(
                    "init_weight_transfer_engine failed on "
                    + "; ".join(f"{shard}: {why}" for shard, why in failures)
                    + "; every rank kept its previous receiver"
                )
        assert built is not None
        self.shard, self.receiver = built
        self._shard_key = (init_info.layout, init_info.path, place)
        self._stage_timeout_s = init_info.stage_timeout_s
        self.weight_version = self.receiver.version
        self._verified = self._written_stamp()
        log.info(
            "deltasync receiver %s on %s: shard %s, path %s, at version %s",
            self.receiver.config.receiver_id,
            init_info.store,
            self.shard.shard,
            self.shard.path,
            self.weight_version,
        )

    def _build(self, init_info: DeltaSyncInitInfo, place: ShardPlace) -> tuple[VllmShard, Receiver]:
        """This worker's shard and its receiver, replacing nothing yet. The shard this worker
        has is kept when it was built alike (a restarted trainer) and the engine still
        computes with what it last wrote: its BF16 masters hold the packed kernels' values,
        which a new shard could not read back from them. When something else wrote the
        engine's weights meanwhile (vLLM's ``reload_weights``), a new shard is built from the
        engine as it is, and its receiver holds no version until an update restores one."""
        same = self._shard_key == (init_info.layout, init_info.path, place)
        drifted = self.shard.drifted() if self.shard is not None and same else []
        if drifted:
            log.warning(
                "deltasync shard %s: the engine no longer computes with the weights it last "
                "took (%s, ...: reloaded by something else); building the shard anew",
                self.shard.shard,
                ", ".join(drifted[:3]),
            )
        if self.shard is not None and same and not drifted:
            shard = self.shard
        else:
            eager = bool(getattr(self.model_config, "enforce_eager", False))
            hf_config = self.model_config.hf_config
            layout = None
            if init_info.layout is not None:
                spec = ModelSpec.from_hf_config(hf_config)
                layout = load_receiver_layout(init_info.layout, spec)
            shard = VllmShard(
                self.model, hf_config, place, layout=layout, path=init_info.path, eager=eager
            )
        store = open_engine_store(
            init_info.store, init_info.s3, durable=init_info.durable, what="DeltaSyncInitInfo"
        )
        rid = f"{init_info.receiver_id}-{shard.shard}"
        state_dir = Path(init_info.state_dir) / rid  # made by the receiver (a typed error)
        receiver = Receiver.for_layout(
            store,
            shard.layout,
            shard.shard,
            shard.targets,
            str(state_dir),
            ReceiverConfig(
                receiver_id=rid,
                signing_key=init_info.signing_key(),
                durable=init_info.durable,
                restore_drift=True,  # weights vLLM reloaded itself are restored, not refused
            ),
            pause=functools.partial(self._pause, shard),  # this shard's kernels, refreshed
            on_tensor_written=self._touched.add,
        )
        return shard, receiver

    def _receiver(self) -> Receiver:
        if self.receiver is None:
            raise ConfigError(
                "backend 'deltasync' is not initialised: call init_weight_transfer_engine "
                "with DeltaSyncInitInfo fields first"
            )
        return self.receiver

    # --- phases 2-4 -----------------------------------------------------------------------

    @_rpc
    def start_weight_update(self) -> None:
        with self._entry("start_weight_update"):
            self._receiver()
            self._cancel_staged()
            self._active = True

    @_rpc
    def update_weights(self, update_info: dict[str, Any]) -> None:
        with self._entry("update_weights"):
            parsed = self.parse_update_info(update_info)
        self.receive_weights(parsed)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()  # the scatter ran on the staging thread's stream

    @_rpc
    def receive_weights(self, update_info: DeltaSyncUpdateInfo) -> None:
        """Stage or apply ``update_info.version``; raises on any failure, with every rank at
        its previous verified version when staging failed anywhere."""
        with self._entry("update_weights"):
            receiver = self._receiver()
            if not self._active:
                raise ConfigError("call start_weight_update before update_weights")
        version = update_info.version
        if update_info.phase == "stage":
            self._cancel_staged()
            self._staged = self._start_staging(receiver, version)
            return
        t0 = time.perf_counter()
        # Every wait of this call (vLLM's RPC loop: the engine serves nothing meanwhile) ends
        # by this deadline; one that runs out fails the update like a failed staging.
        deadline = time.monotonic() + self._stage_timeout_s
        staged, self._staged = self._staged, None
        if staged is not None and staged.version != version:
            self._drop(staged)
            staged = None
        if staged is None:  # nothing staged while serving: stage now, inside this call
            staged = self._start_staging(receiver, version)
        # fetched and verified (held before its first write), failed, or out of time
        error = self._await(staged, deadline)
        # (A pull left inside the store still holds the receiver: staging again would only
        # wait for it again, and this one's error names it.)
        settled = error is None and not self._still_inside()
        committed = self._committed_before(receiver, version, deadline) if settled else None
        if isinstance(committed, BaseException):
            error = committed
        elif settled and staged.committed != committed:
            # The store was reset under the staged version (another run's version N, or none):
            # what was staged is not what the store commits as N now. Staged again, from what
            # the store holds now (a version no longer the newest is refused by name).
            staged, error = self._restage(staged, receiver, version, deadline)
        if settled and error is None and staged.written != self._written_stamp():
            # Something wrote the engine's weights after the staging began (vLLM's
            # reload_weights, another backend): what it verified is not what the engine holds.
            # Staged again, from a receiver that holds no version: the newest anchor and the
            # chain, verified against the weights as they are now. (RPCs run one at a time on
            # this thread, so nothing writes them between this check and the release.)
            staged, error = self._restage(
                staged,
                receiver,
                version,
                deadline,
                drifted=f"the engine's weights were written by something else after version "
                f"{version} was staged",
            )
        if error is None:
            error = staged.error
        # Every TP rank writes, or none does: each rank's staging outcome is gathered over
        # vLLM's own CPU group. (Every rank makes exactly these two collectives per apply, so
        # none can hang on a rank that returned early; every wait before each is bounded.)
        failures = self._gather_failures(error, version)
        if failures:
            self._drop(staged)  # never released: whenever its thread reaches the gate, refused
            self._fail(version, failures, error, written=False)
            return
        staged.release()
        # The scatter is local, but the records after it (ack, registration) go to the store:
        # bounded as the staging was, and a thread still inside then is left (and waited for
        # by the next staging) with the update failed as one that wrote.
        staged.thread.join(self._stage_timeout_s)
        error = staged.error
        if staged.thread.is_alive():
            self._left.append(staged)
            error = ApplyError(
                f"version {version} on shard {self.shard.shard!r}: the write was released but "
                f"its pull had not ended {self._stage_timeout_s:.1f} s later (DeltaSyncInitInfo"
                ".stage_timeout_s; after the scatter it records the version in the store, "
                "which does not answer): the shard may hold part or all of it and reports "
                "only what it verified; check the store, then update again"
            )
        failures = self._gather_failures(error, version)  # after the first write
        if failures:
            self._fail(version, failures, error, written=True)
            return
        self._verified = self._written_stamp()
        report = staged.report
        self.last_update_s = time.perf_counter() - t0
        self.last_report = report
        if report.version != version:
            self.weight_version = receiver.version  # as in _fail
            raise VersionError(
                f"shard {self.shard.shard!r} now holds version {report.version} (verified), not "
                f"the requested {version}: the store committed a newer version meanwhile"
            )
        # Held and verified from here on, whether or not finish_weight_update ever comes (a
        # trainer killed or a request lost after the apply): never the version before it.
        self.weight_version = receiver.version
        log.info(
            "deltasync shard %s: version %s -> %s (chain %s, %d elements, pause %.3f s)",
            self.shard.shard,
            report.previous_version,
            report.version,
            report.chain,
            report.elements_written,
            self.last_pause_s,
        )

    def _gather_failures(self, error: BaseException | None, version: int) -> list[tuple[str, str]]:
        """Every TP rank's ``(shard, error)``, for the ranks whose pull failed (every rank,
        when the ranks were asked for different versions)."""
        gather = None
        if self.shard.place.tp > 1:
            gather = group_gather(_tp_cpu_group(), self.shard.place.tp)
        unverified = self._receiver().dirty
        return failed_ranks(
            self.shard.shard, error, gather, unverified=unverified, asked=f"version {version}"
        )

    def _fail(
        self,
        version: int,
        failed: list[tuple[str, str]],
        own: BaseException | None,
        *,
        written: bool,
    ) -> None:
        """Raise the update's failure on this worker, or (TP > 1) only on the last rank.

        vLLM 0.32's multiprocess executor stops reading worker replies at the first rank that
        failed, and the next RPC then reads the rest: so one rank (the last, read last) raises,
        naming every rank's error, and the others log and return. The trainer engine closes
        the session with ``finish_weight_update`` (see :mod:`.vllm_trainer`)."""
        receiver = self._receiver()
        # What the tensors hold now, whatever the trainer does next: vLLM drops the session
        # of a failed update, so finish_weight_update (which records it otherwise) may never
        # come, and the version reported must not be the one from before a torn write.
        self.weight_version = self._held_version(receiver)
        if written:
            state = (
                "some ranks wrote part or all of it and then failed; they report no version "
                "until the next update repairs them"
            )
        else:
            state = unwritten_state(failed)
        error = refused(version, failed, state)
        if self.shard.place.tp == 1 and own is not None:
            raise error from own
        if self.shard.place.tp_rank != self.shard.place.tp - 1:
            log.error(
                "deltasync shard %s (at version %s): %s",
                self.shard.shard,
                receiver.version,
                error,
            )
            return
        raise ApplyError(f"{error}{SESSION_NOTE if self.shard.place.tp > 1 else ''}")

    @_rpc
    def finish_weight_update(self) -> None:
        with self._entry("finish_weight_update"):
            receiver = self._receiver()
            self._active = False  # the session ends here either way
            if self._staged is not None:
                # The update is abandoned, not refused: vLLM closes its session only when this
                # returns (a raise here left every later start_weight_update refused).
                staged = self._staged.version
                self._cancel_staged()
                self._forget_if_reloaded()  # a reload while it was staged: nothing is held
                log.warning(
                    "deltasync shard %s: finish_weight_update with version %d staged and never "
                    "applied: the staged update is dropped, nothing was written; the engine "
                    "stays at version %s",
                    self.shard.shard if self.shard is not None else "?",
                    staged,
                    receiver.version,
                )
            self.weight_version = self._held_version(receiver)

    def _after_load(self) -> None:
        """After each call of the model's ``load_weights`` (vLLM's ``reload_weights``): the
        engine no longer computes with the version this worker verified, so it stops reporting
        it at once, not only at the next update (its ``weight_version``, and the receiver's
        version, state file and registration, which a trainer counts). With a pull staged on
        its thread the receiver is busy: the apply stages again (its written stamp moved), and
        a ``finish_weight_update`` that drops it stops holding the version then."""
        if self.receiver is None:
            return
        self.weight_version = None
        self._forget_if_reloaded()
        if self._staged is None and not self._still_inside():
            self.weight_version = self._held_version(self.receiver)

    def _held_version(self, receiver: Receiver) -> int | None:
        """The version to report: the receiver's, or None when something wrote the engine's
        weights since this worker last verified what it holds (``load_weights``, another
        backend) and the receiver may not have been told (a pull left inside it refused the
        invalidate, or kept a restage from running it): it would still name the version from
        before that write. The next pull restores it."""
        if self._verified is not None and self._written_stamp() != self._verified:
            return None
        return receiver.version

    def _forget_if_reloaded(self) -> None:
        """Stop holding the verified version when ``load_weights`` ran since this worker last
        verified what it holds (nothing staged: the receiver is this thread's). Never raises:
        a reload must not fail on deltasync's records (a failure is logged; the next update
        finds the load count moved and restores the newest anchor anyway)."""
        receiver = self.receiver
        if receiver is None or self._staged is not None or self._verified is None:
            return
        if loads_of(self.model) == self._verified[0]:
            return
        try:
            receiver.invalidate(
                "vLLM's load_weights (reload_weights) wrote the engine's weights since this "
                "worker last verified them"
            )
        except Exception as exc:
            log.warning(
                "deltasync shard %s: could not mark the version held dirty after a reload "
                "(%s: %s); the next update restores the newest anchor",
                self.shard.shard if self.shard is not None else "?",
                type(exc).__name__,
                exc,
            )

    @contextlib.contextmanager
    def _entry(self, call: str, place: ShardPlace | None = None) -> Iterator[None]:
        """An RPC's checks that fail alike on every TP rank (its input, the session's state):
        raised by the last rank (of the last pipeline stage) only, logged by the others, also
        before the first init. vLLM 0.32's multiprocess executor
        stops reading replies at the first rank that failed and the next RPC reads the rest,
        so an error raised on every rank would be read as the reply of the calls after it (a
        later failure hidden behind a stale success), as in :meth:`_fail`."""
        try:
            yield
        except Exception as exc:
            if place is None:
                # before the first init too (an engine restarted under a running trainer):
                # raised on every rank, the refusal would shift every later reply by one
                place = self.shard.place if self.shard is not None else _tp_place()
            if place.tp_rank != place.tp - 1 or not _last_stage():
                log.error("deltasync %s on TP rank %d: %s", call, place.tp_rank, exc)
                raise _Answered from exc
            if (
                place.tp > 1
                and call in ("start_weight_update", "update_weights")
                and isinstance(exc, ConfigError)
            ):
                raise type(exc)(f"{exc}{SESSION_NOTE}") from exc
            raise

    def shutdown(self) -> None:
        self._cancel_staged()
        self._active = False

    # --- the pull -------------------------------------------------------------------------

    def _committed_as(self, receiver: Receiver, version: int) -> tuple[str, str | None] | None:
        """``version`` as the store commits it now: its lineage and this shard's state digest
        (None: not committed, or unreadable)."""
        try:
            manifest = receiver.catalog.manifest(version, fresh=True)
        except DeltaSyncError:
            return None
        assert self.shard is not None
        return manifest.run_id, manifest.shard_digests.get(self.shard.shard)

    @staticmethod
    def _check_newest(receiver: Receiver, version: int) -> None:
        latest = receiver.catalog.latest()
        if latest is None or latest < version:
            raise VersionError(
                f"version {version} is not committed in the store (newest: {latest}); publish "
                "it (TrainerSync.step_published) before telling the engines to take it"
            )
        if latest > version:
            raise VersionError(
                f"version {version} is older than the store's newest committed version {latest}; "
                f"a receiver takes the newest: request version {latest}. Nothing was written"
            )

    def _pull(
        self, receiver: Receiver, version: int, gate: _StagedPull | None = None
    ) -> PullReport:
        # One pull at a time per worker: a staging thread waits for the pulls cancelled before
        # it to end (``_outlive``) before it pulls. Exactly ``version``, even if a newer one
        # commits while it is staged.
        self._check_engine(receiver, version)
        # The journal of an interrupted write is this rank's own repair, replayed before the
        # gate: the ranks' agreement is about the first write of the requested version (at the
        # replay's write the others were let write while this rank then failed to stage it).
        self._local.staged, self._local.gate = gate, None
        self._touched.clear()
        if receiver.replay_journal() is not None and gate is not None:
            gate.written = self._written_stamp()  # the replay's own writes are not foreign
        self._local.gate = gate
        self._touched.clear()
        return receiver.pull(version=version)

    def _check_engine(self, receiver: Receiver, version: int) -> None:
        """Before a pull trusts the version held: the engine still computes with it. Weights
        written by something else (vLLM's ``reload_weights``) leave BF16 masters that still
        hash to it (:meth:`VllmShard.drifted` looks at the engine side) and, asked for the
        version held, a receiver that would answer "nothing new" without reading a tensor (a
        scrub hashes them). Either way the receiver stops holding it and the pull restores
        the newest anchor, then the chain to ``version``."""
        drifted = self.shard.drifted()
        if drifted:
            receiver.invalidate(
                f"the engine no longer computes with the weights of {', '.join(drifted[:3])}"
                f"{', ...' if len(drifted) > 3 else ''} as last written (reloaded by something "
                "else)"
            )
        elif self._verified is not None and self._written_stamp() != self._verified:
            # a load_weights call or an in-place write since this worker last verified them:
            # noticed here, not only by a verify pass that a failed fetch never reaches
            receiver.invalidate(
                "the engine's weights were written by something else (vLLM's reload_weights, "
                "a load_weights call) since it last verified them"
            )
        elif receiver.version == version and not receiver.dirty:
            receiver.scrub()

    def _written_stamp(self) -> tuple[int, tuple[int | None, ...]]:
        """What moves when anything writes the weights: the model's ``load_weights`` calls
        (every vLLM loader, ``reload_weights`` included, writes through it, often into
        ``param.data``, which no version counter sees) and the version counters of the
        engine's parameters and of this shard's targets (``param.copy_``, a kernel-format
        reload). The receiver's own scatter moves neither (its kernels write raw memory), and
        only between staging and apply is it compared."""
        tensors = list(self.model.parameters())
        if self.receiver is not None:
            tensors.extend(self.receiver.tensors.values())
        return loads_of(self.model), tuple(_version_of(t) for t in tensors)

    def _start_staging(
        self, receiver: Receiver, version: int, drifted: str | None = None
    ) -> _StagedPull:
        """``version`` staged on a thread of its own (``drifted``: why the receiver no longer
        holds its version, for :meth:`Receiver.invalidate` first, on that thread)."""
        staged = _StagedPull(version)
        staged.written = self._written_stamp()
        older = self._still_inside()

        def run() -> None:
            try:
                if self.device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(self.device)
                self._outlive(staged, older)
                if drifted is not None:
                    receiver.invalidate(drifted)
                self._check_newest(receiver, version)
                staged.committed = self._committed_as(receiver, version)
                staged.report = self._pull(receiver, version, staged)
            except BaseException as exc:  # re-raised on the worker thread by the apply call
                staged.error = exc
            finally:
                staged.staged.set()

        staged.thread = threading.Thread(target=run, name="deltasync-stage", daemon=True)
        staged.thread.start()
        return staged

    def _restage(
        self,
        staged: _StagedPull,
        receiver: Receiver,
        version: int,
        deadline: float,
        drifted: str | None = None,
    ) -> tuple[_StagedPull, ApplyError | None]:
        """``staged`` dropped and ``version`` staged again, waited for until ``deadline``
        (``drifted``: why the receiver no longer holds its version, for
        :meth:`Receiver.invalidate` first); the new pull and the error of a wait that ran
        out (None: it staged or failed)."""
        self._drop(staged)
        staged = self._start_staging(receiver, version, drifted)
        return staged, self._await(staged, deadline)

    def _await(self, staged: _StagedPull, deadline: float) -> ApplyError | None:
        """Wait until ``staged`` is held at its gate or failed, at most until ``deadline``;
        out of time, it is cancelled (whenever its thread reaches the gate, it is refused
        there: nothing of it is ever written) and left, and the error says why."""
        if staged.staged.wait(max(0.0, deadline - time.monotonic())):
            return None
        self._drop(staged, wait_s=0.0)
        older = staged.waiting_for
        why = (
            f"it was still waiting for the pull of version {older.version} left before it "
            f"({older.left_as}), whose store call has not returned"
            if older is not None
            else "a store call has not returned (an endpoint that accepts the connection and "
            "never answers, a hung network filesystem, a Store without timeouts)"
        )
        return self._out_of_time(staged.version, why)

    def _out_of_time(self, version: int, why: str) -> ApplyError:
        held = self._held_version(self._receiver())
        stays = "holds no verified version" if held is None else f"stays at version {held}"
        return ApplyError(
            f"version {version} on shard {self.shard.shard!r}: not staged within "
            f"{self._stage_timeout_s:.1f} s (DeltaSyncInitInfo.stage_timeout_s): {why}. The "
            f"staged pull is cancelled and never writes: nothing was written, the shard {stays}"
            ". Check the store (endpoint, network, mount), or "
            "raise stage_timeout_s for a slower one, then update again"
        )

    def _committed_before(
        self, receiver: Receiver, version: int, deadline: float
    ) -> tuple[str, str | None] | BaseException | None:
        """:meth:`_committed_as`, read on a worker thread and waited for until ``deadline``:
        an ApplyError when the store did not answer by then, or what the read raised (a
        ``Store``'s own error: failed like a staging, naming it, not as a timeout)."""
        answer: list[tuple[str, str | None] | None] = []
        read = InBackground(
            lambda: answer.append(self._committed_as(receiver, version)), name="deltasync-read"
        )
        error = read.wait(max(0.0, deadline - time.monotonic()))
        if read.finished:
            return error if error is not None else answer[0]
        return self._out_of_time(
            version, "its manifest, read again before the ranks agree, has not come back"
        )

    def _outlive(self, staged: _StagedPull, older: list[_StagedPull]) -> None:
        """On ``staged``'s thread, before it touches the receiver: wait for the pulls
        cancelled before it whose thread is still inside the receiver (a Receiver takes one
        call at a time and refuses a second), at most the stage timeout; ApplyError naming
        the one still inside after that. Stops early once ``staged`` is cancelled too."""
        deadline = time.monotonic() + self._stage_timeout_s
        for old in older:
            staged.waiting_for = old
            while old.thread.is_alive() and not staged.cancelled:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApplyError(
                        f"version {staged.version}: the pull of version {old.version} "
                        f"({old.left_as}, begun {time.monotonic() - old.started:.1f} s ago) is "
                        "still inside its "
                        f"store call after this one waited {self._stage_timeout_s:.1f} s for it "
                        "(DeltaSyncInitInfo.stage_timeout_s), and a receiver takes one pull at "
                        "a time: nothing was fetched or written. The store does not answer: "
                        "check it (endpoint, network, mount), then update again; restart the "
                        "engine if it never returns"
                    )
                old.thread.join(min(left, 0.5))
            staged.refuse_if_cancelled()
        staged.waiting_for = None

    def _still_inside(self) -> list[_StagedPull]:
        """The pulls left (cancelled, or released and still recording) whose thread has not
        ended yet."""
        self._left = [p for p in self._left if p.thread.is_alive()]
        return list(self._left)

    def _refuse_while_inside(self, call: str) -> None:
        inside = self._still_inside()
        if inside:
            old = inside[-1]
            raise ApplyError(
                f"{call}: the pull of version {old.version} ({old.left_as}, begun "
                f"{time.monotonic() - old.started:.1f} s ago) is still inside the receiver (a "
                "fetch still running, or a store call that has not returned), and a new "
                "receiver would share the state dir with it; nothing was changed. Call again "
                "once it has ended; if the store does not answer, check it (endpoint, network, "
                "mount), or restart the engine"
            )

    def _drop(self, staged: _StagedPull, wait_s: float | None = None) -> None:
        """Cancel ``staged`` (it never writes after) and wait for its thread a bounded time
        (``wait_s``; default :data:`STOP_WAIT_S`, or the stage timeout if shorter); a thread
        still inside a store call then is left, and the next staging waits for it."""
        if any(p is staged for p in self._left):
            return
        if wait_s is None:
            wait_s = min(STOP_WAIT_S, self._stage_timeout_s)
        if staged.stop(wait_s):
            return
        self._left.append(staged)
        log.warning(
            "deltasync shard %s: the staged pull of version %d is cancelled but its thread is "
            "still inside the receiver (a fetch still running, or a store call that has not "
            "returned); it never writes, and the next staging waits for it",
            self.shard.shard if self.shard is not None else "?",
            staged.version,
        )

    def _cancel_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._drop(staged)

    @contextlib.contextmanager
    def _pause(self, shard: VllmShard) -> Iterator[None]:
        """The receiver's pause: entered right before the scatter, left after it (a journal's
        replay too: refused, as the gate refuses, once the pull is cancelled)."""
        staged = getattr(self._local, "staged", None)
        gate, self._local.gate = getattr(self._local, "gate", None), None
        if staged is not None:
            staged.refuse_if_cancelled()
        with gate.gate() if gate is not None else contextlib.nullcontext():
            t = time.perf_counter()
            yield
            # Packed CPU kernels are rebuilt from the masters that changed, before the
            # engine may compute again (vLLM's post-load processing; see vllm_shard).
            shard.refresh(self._touched)
            self.last_pause_s = time.perf_counter() - t


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for a tensor without one (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass(frozen=True)
class _Refused:
    """Init info that :class:`DeltaSyncInitInfo` refused, carried to the init call."""

    error: Exception


class _Answered(Exception):
    """Raised out of an RPC's check on a TP rank that is not the last: its :func:`_rpc`
    wrapper returns normally there (the last rank raises the error)."""


def _tp_place() -> ShardPlace:
    """This worker's TP rank and size from vLLM's parallel state (no shard built yet)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return ShardPlace(
        tp_rank=get_tensor_model_parallel_rank(), tp=get_tensor_model_parallel_world_size()
    )


def _last_stage() -> bool:
    """Whether this worker is in the last pipeline stage (vLLM's executor reads the replies of
    the stages in order, the last one last; PP > 1 is refused, by that stage only)."""
    from vllm.distributed import get_pp_group

    group = get_pp_group()
    return group.rank_in_group == group.world_size - 1


def _tp_cpu_group() -> Any:
    from vllm.distributed import get_tp_group

    return get_tp_group().cpu_group
