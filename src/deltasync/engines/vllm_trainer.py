"""deltasync as a vLLM weight-transfer backend (trainer side): tell the engines which version.

The trainer publishes with :class:`~deltasync.TrainerSync` (the store carries the bytes); this
engine only drives vLLM's control plane, through any ``VLLMWeightSyncClient`` (four methods:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``):

- offline: :class:`LLMClient` wraps a ``vllm.LLM`` in the same process;
- ``vllm serve`` (started with ``VLLM_SERVER_DEV_MODE=1``, which mounts the RL routes):
  :class:`HTTPClient`, vLLM's ``HTTPVLLMWeightSyncClient`` plus ``/reset_prefix_cache``,
  ``/pause`` and ``/resume``.

Per version, :meth:`DeltaSyncTrainerEngine.send_weights` runs ``start_weight_update`` ->
``update_weights(phase="stage")`` (the workers fetch and verify while serving) ->
[``/pause?mode=keep`` over HTTP] -> ``update_weights(phase="apply")`` (the scatter) ->
``finish_weight_update(weight_version=str(version))`` -> reset the prefix cache (cached KV
blocks were computed with the old weights) -> [``/resume``]. :meth:`stage` and :meth:`apply`
split it, so a trainer can stage, keep training, and apply later. An apply that fails after a
worker's first write sets vLLM's weight version to :data:`UNVERIFIED`; one refused before any
write (a corrupted blob, a failed verify) leaves it naming the version the workers hold.

vLLM's worker refuses a call out of order (an apply with no update open, a second update
opened) on every TP rank, before the backend runs, and its multiprocess executor then reads
each later call's reply from the call before. So this engine keeps the update it opened:
:meth:`~DeltaSyncTrainerEngine.apply` without a staged update is a ConfigError before any
RPC, and a second :meth:`~DeltaSyncTrainerEngine.stage` closes the first one (dropped, nothing
written) before it opens its own. A trainer restarted while its predecessor's update was
open (killed between stage and apply) cannot see it: vLLM offers no query. Call the
client's ``finish_weight_update()`` once before its first update, or restart the engines.
Closing this engine's update behind it (the client's own ``finish_weight_update``) is the
mirror case: at TP > 1 the close that the next stage sends is then refused on every rank.

Only the sender (trainer rank 0) touches the client; every rank may call the methods. This
module imports vLLM (its base classes); it knows the control-plane order, nothing of stores.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from deltasync.engines.agreement import NOTHING_WRITTEN
from deltasync.engines.vllm_backend import DeltaSyncInitInfo
from deltasync.errors import ApplyError, ConfigError, DeltaSyncError
from deltasync.names import check_version_arg

log = logging.getLogger(__name__)

# vLLM's weight version after a failed apply: not a version number, since a worker may hold
# part or all of the version that failed; the next successful apply names its version again.
UNVERIFIED = "unverified"


@dataclass
class DeltaSyncTrainerInitInfo(TrainerInitInfo):
    """The engines' :class:`~deltasync.engines.vllm_backend.DeltaSyncInitInfo` fields, plus
    ``rank`` (this trainer rank; rank 0 drives the engines) and ``pause_mode``: vLLM's pause
    mode around the scatter for clients that offer ``pause``/``resume`` (``"keep"`` freezes
    in-flight requests and resumes them; None: no pause call)."""

    backend: ClassVar[str] = "deltasync"

    store: str
    receiver_id: str
    state_dir: str
    signing_key_hex: str | None = None
    s3: dict[str, Any] | None = None
    path: str = "auto"
    durable: bool = True
    layout: str | None = None
    stage_timeout_s: float = 600.0
    pause_mode: str | None = "keep"

    def worker_init_info(self) -> dict[str, Any]:
        """The dict each worker's ``init_weight_transfer_engine`` receives (validated here)."""
        info = {k: v for k, v in asdict(self).items() if k not in ("rank", "pause_mode")}
        DeltaSyncInitInfo(**info)
        return info


class DeltaSyncTrainerEngine(TrainerWeightTransferEngine[DeltaSyncTrainerInitInfo]):
    """Trainer side of backend ``"deltasync"``; see the module docstring."""

    init_info_cls = DeltaSyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        pause_mode: str | None = "keep",
    ) -> None:
        if source is not None:
            raise ConfigError(
                "backend 'deltasync' takes no WeightSource: the trainer publishes with "
                "TrainerSync and send_weights(version) names the version"
            )
        super().__init__(client=client, source=None, is_sender=is_sender)
        self.pause_mode = pause_mode
        self.last_timings: dict[str, float] = {}
        # One update at a time: two threads' calls interleaved at the workers (vLLM's
        # multiprocess executor then leaves a reply unread and the other call waits forever).
        self._lock = threading.RLock()
        # The version staged in the update this engine opened (None: none open). vLLM's worker
        # refuses an update call out of order on every TP rank, before the backend can answer
        # from the last rank only, and its executor then reads each later call's reply from
        # the call before: so an out-of-order call never reaches vLLM.
        self._open: int | None = None
        # An apply whose finish_weight_update failed: vLLM's session may still be open, so the
        # next stage closes it first (as it closes a staged update never applied).
        self._unfinished = False

    @classmethod
    def trainer_init(
        cls,
        init_info: DeltaSyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Build the engine; the sender initialises every worker's receiver.

        Args:
            init_info: the store, receiver id and state dir the workers use.
            client: vLLM's control plane (:class:`LLMClient`, :class:`HTTPClient`, Ray...).
            source: must be None (the store carries the weights).

        Returns:
            A ready engine; call :meth:`send_weights` after each ``step_published``.
        """
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            pause_mode=init_info.pause_mode,
        )
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine(init_info.worker_init_info())
            except Exception as exc:
                if isinstance(exc, DeltaSyncError):
                    raise
                # vLLM's multiprocess executor re-raises a worker's error as RuntimeError, HTTP
                # as a status 500; a transport error may have reached no worker or some
                raise ConfigError(
                    f"init_weight_transfer_engine failed: {type(exc).__name__}: "
                    f"{_failure_text(exc)}. An init a worker refused leaves every worker's "
                    "receiver as it was; after a lost connection, init again"
                ) from exc
        return engine

    def send_weights(self, version: int) -> None:  # type: ignore[override]
        """Make every engine worker take committed ``version`` (stage, then apply).

        Args:
            version: a version ``TrainerSync.step_published`` has committed; the newest one.
        """
        with self._lock:
            self.stage(version)
            self.apply(version)

    def stage(self, version: int) -> None:
        """Open an update and let the workers fetch and verify ``version`` while serving.
        A failed stage closes the update it opened (nothing was written), so the next call
        can open one."""
        check_version_arg("DeltaSyncTrainerEngine.stage", version)  # before any RPC
        if not self.is_sender:
            return
        with self._lock:
            t0 = time.perf_counter()
            if self._open is not None or self._unfinished:
                # staged and never applied: dropped, nothing written; or an applied update
                # whose finish failed
                if self._open is not None:
                    log.warning(
                        "staging version %d drops version %d, staged and never applied",
                        version,
                        self._open,
                    )
                self._open = None
                self._unfinished = False
                # best effort: a client that closed it behind this engine (vLLM's own
                # finish_weight_update) gets a refusal here, and the stage goes on
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
            try:
                self.client.start_weight_update()
            except Exception as exc:
                # With TP > 1 a refusal (an engine whose backend is not initialised) comes from
                # the last rank only, and the others opened vLLM's session: closed here, or
                # every later start is refused there
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                _raise_typed(exc, version, "start")
                raise
            try:
                self.client.update_weights({"version": version, "phase": "stage"})
            except Exception as exc:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                _raise_typed(exc, version, "stage")
                raise
            self._open = version
            self.last_timings = {"stage_call_s": time.perf_counter() - t0}

    def apply(self, version: int) -> None:
        """Write the staged ``version`` (the engine's pause), finish, reset the prefix cache.
        Raises what a worker raised; the workers then hold their previous verified version."""
        check_version_arg("DeltaSyncTrainerEngine.apply", version)  # before any RPC
        if not self.is_sender:
            return
        with self._lock:
            if self._open is None:
                raise ConfigError(
                    f"DeltaSyncTrainerEngine.apply({version}): no update is staged on this "
                    f"engine; call stage({version}) first, or send_weights({version}) for both. "
                    "Nothing was sent to the engines"
                )
            self._open = None  # closed by the apply, whatever it answers
            self._apply(version)

    def _apply(self, version: int) -> None:
        t0 = time.perf_counter()
        pause = getattr(self.client, "pause", None) if self.pause_mode else None
        if pause is not None:
            try:
                pause(self.pause_mode)
            except BaseException as exc:
                # Before any write, with the update this engine opened still open in vLLM:
                # close it (the staged version is dropped) or every later start is refused.
                # The pause may have landed with its reply lost: resume either way.
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                self._resume_after_failure(version)
                if isinstance(exc, Exception):
                    raise ApplyError(
                        f"version {version} was not taken (pause; {NOTHING_WRITTEN}): "
                        f"{type(exc).__name__}: {_failure_text(exc)}"
                    ) from exc
                raise
        try:
            t1 = time.perf_counter()
            try:
                self.client.update_weights({"version": version, "phase": "apply"})
            except BaseException as exc:
                # With TP > 1 only the last worker raises (vLLM's multiprocess executor stops
                # reading replies at the first failed rank); the others still hold an open
                # update session. Close it there; the failed rank refuses this call.
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                if NOTHING_WRITTEN not in _failure_text(exc):
                    self._unverified(version)
                if isinstance(exc, Exception):
                    _raise_typed(exc, version, "apply")
                raise
            apply_s = time.perf_counter() - t1
            try:
                self.client.finish_weight_update(weight_version=str(version))
                finish_error = None
            except Exception as exc:
                # Every rank holds the version now: vLLM's weight version must name it, and the
                # session it may have left open is closed by the next stage.
                finish_error = exc
                self._unfinished = True
                with contextlib.suppress(Exception):
                    self.client.update_weight_version(str(version))
            reset = getattr(self.client, "reset_prefix_cache", None)
            if reset is not None:
                # vLLM keeps its prefix cache while running requests hold blocks (the clients
                # preempt them): later requests would reuse KV computed with the previous
                # version's weights
                try:
                    failed, cause = reset() is False, None
                except Exception as exc:
                    failed, cause = True, exc
                if failed:
                    why = (
                        ""
                        if cause is None
                        else f" ({type(cause).__name__}: {_failure_text(cause)})"
                    )
                    if finish_error is not None:  # named here too: this error replaces it
                        why += (
                            f", and finish_weight_update failed ({type(finish_error).__name__}: "
                            f"{_failure_text(finish_error)}; the next update closes vLLM's "
                            "session)"
                        )
                    raise ApplyError(
                        f"version {version} was taken, but vLLM did not reset its prefix "
                        f"cache{why}: cached KV blocks computed with the previous weights may "
                        "be reused; reset it (reset_prefix_cache) before serving"
                    ) from cause
            if finish_error is not None:
                raise ApplyError(
                    f"version {version} was written and verified on every rank, but "
                    f"finish_weight_update failed: {type(finish_error).__name__}: "
                    f"{_failure_text(finish_error)}. The next update closes vLLM's session"
                ) from finish_error
        except BaseException:
            if pause is not None:
                self._resume_after_failure(version)  # the apply's own error is the one raised
            raise
        if pause is not None:
            try:
                self.client.resume()
            except Exception as exc:
                raise ApplyError(
                    f"version {version} was taken by every rank, but the engine did not resume "
                    f"after its pause: {type(exc).__name__}: {_failure_text(exc)}. Resume it "
                    "(/resume) before serving"
                ) from exc
        self.last_timings.update(apply_call_s=apply_s, apply_total_s=time.perf_counter() - t0)
        log.info("engines took version %d (apply %.3f s)", version, apply_s)

    def _resume_after_failure(self, version: int) -> None:
        """Resume the engine after a failed apply (a pause whose reply was lost may have
        landed), without letting a failed resume replace the apply's own error: logged."""
        try:
            self.client.resume()
        except Exception as exc:
            log.error(
                "the engine did not resume after the failed apply of version %d (%s: %s); "
                "resume it (/resume) before serving",
                version,
                type(exc).__name__,
                _failure_text(exc),
            )

    def _unverified(self, version: int) -> None:
        """After a failed apply that does not say no rank wrote anything, a worker may hold
        part or all of ``version`` (a scatter stopped midway, its state file not written):
        vLLM's weight version, which tags every output, must not go on naming the previous
        one. It becomes :data:`UNVERIFIED` until an apply succeeds; where the client cannot
        set it, a warning says so."""
        try:
            self.client.update_weight_version(UNVERIFIED)
        except Exception as exc:  # AttributeError too: a client without that call
            log.warning(
                "applying version %d failed and vLLM's weight version could not be set to %r "
                "(%s: %s): it may still name the previous version while a worker holds part "
                "of %d",
                version,
                UNVERIFIED,
                type(exc).__name__,
                exc,
                version,
            )


def _raise_typed(exc: Exception, version: int, phase: str) -> None:
    """A failed update as the caller catches it: anything but deltasync's own error (vLLM's
    executor re-raising a worker's error as ``RuntimeError`` at TP > 1, an HTTP error with the
    worker's error in its body) is raised as an :class:`ApplyError` with that text; deltasync's
    own is left to the caller to re-raise as it is."""
    if not isinstance(exc, DeltaSyncError):
        raise ApplyError(
            f"version {version} was not taken ({phase}): {type(exc).__name__}: {_failure_text(exc)}"
        ) from exc


def _failure_text(exc: BaseException) -> str:
    """What a failed call says: the exception's message and, over HTTP, the reply's body."""
    response = getattr(exc, "response", None)
    body = getattr(response, "text", None)
    return f"{exc} {body}" if isinstance(body, str) else str(exc)


class LLMClient:
    """``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process.

    ``LLM`` calls are synchronous: nothing generates while an update runs, so there is no
    pause to request; the prefix cache is reset through ``LLM.reset_prefix_cache``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    def reset_prefix_cache(self) -> bool:
        """Reset vLLM's prefix cache; requests in flight are preempted (their KV blocks were
        computed with the old weights and would keep the cache alive). Returns vLLM's answer."""
        return bool(self.llm.reset_prefix_cache(reset_running_requests=True))


class HTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client plus the routes this backend's sequence uses (all mounted by
    ``VLLM_SERVER_DEV_MODE=1``): ``/reset_prefix_cache``, ``/pause``, ``/resume``."""

    def reset_prefix_cache(self) -> bool:
        """Reset the server's prefix cache, preempting requests in flight (their KV blocks were
        computed with the old weights and would keep the cache alive). Returns its answer."""
        import requests

        response = requests.post(
            f"{self.base_url}/reset_prefix_cache?reset_running_requests=true",
            timeout=self.timeout,
        )
        if response.status_code == 409:  # releases that check: running requests kept it
            return False
        response.raise_for_status()
        if not response.content:  # releases that answer an empty 200 (they do not check)
            return True
        return bool(response.json().get("success", False))

    def update_weight_version(self, new_version: str) -> None:
        self._post("update_weight_version", {"new_version": new_version})

    def pause(self, mode: str = "keep") -> None:
        self._post(f"pause?mode={mode}")

    def resume(self) -> None:
        self._post("resume")
