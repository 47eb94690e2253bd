"""Receiver: keeps one inference shard's live tensors at the newest committed version.

``pull()``:

1. read the newest committed version (``LATEST`` plus any manifest right after it) and plan
   the chain from the local version (:meth:`Catalog.chain`: deltas in order, or the newest
   anchor on the way and the deltas after it);
2. stage (the engine keeps serving): verify each manifest (signature when a key is set) and
   the chain's bases, fetch and verify every blob, decode against the shard's tensor specs,
   fold the chain into one update per tensor (:mod:`deltasync.receiver.staging`);
3. write the journal durably, then scatter into the live tensors: the pause;
4. hash the resulting state and compare with the manifest's shard digest;
5. write the ack, the state file, clear the journal, refresh the registration, and only then
   report the new version.

A failure before step 3 leaves the tensors untouched. A digest mismatch in step 4 raises
IntegrityError and marks the local state dirty (version stays the last verified one; the next
pull restores the newest anchor). A crash during step 3 leaves the journal, and the next
Receiver on the same state dir repairs before anything else (see :mod:`.journal` for why
replaying the whole journaled chain is always correct); if the journaled blobs are gone, it
restores the newest anchor instead.

:class:`ReceiverConfig` (its settings) and :class:`PullReport` (what one pull did) live here
with the receiver. This class knows the order of those steps; fetching, folding and files live
in the modules it calls. It holds no copy of the model: only the staged updates of one pull.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deltasync import names
from deltasync.commit import AckRecord, Manifest, ManifestLimits, ReceiverRecord
from deltasync.commit.catalog import Catalog
from deltasync.commit.signing import MIN_KEY_BYTES
from deltasync.errors import (
    ConfigError,
    FormatError,
    IntegrityError,
    KeyNotFoundError,
    LocalStateError,
    ManifestError,
    VersionError,
)
from deltasync.format import TensorSpec, apply_updates, check_tensors_match, fold_chain
from deltasync.layout import ReceiverLayout
from deltasync.layout.digest import state_digest
from deltasync.receiver.journal import Journal, JournalStep, LocalState, StateDir
from deltasync.receiver.staging import check_chain, fetch_version
from deltasync.store import Store
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


@dataclass(frozen=True, kw_only=True)
class PullReport:
    version: int | None  # the verified version the tensors hold now
    previous_version: int | None  # what they held before (None: nothing verified)
    chain: tuple[int, ...] = ()  # versions applied, in order (first may be an anchor)
    from_anchor: bool = False
    repaired: bool = False  # this finished an apply a crash interrupted
    bytes_fetched: int = 0
    elements_written: int = 0
    stage_s: float = 0.0  # fetch, verify, decode, fold: the engine keeps serving
    pause_s: float = 0.0  # scatter into the live tensors: the engine must not read them
    verify_s: float = 0.0  # digest of the resulting state (after the pause)
    total_s: float = 0.0

    @property
    def changed(self) -> bool:
        return bool(self.chain)


log = logging.getLogger(__name__)

PauseContext = Callable[[], contextlib.AbstractContextManager]
# Errors that mean "the journaled chain cannot be replayed from the store any more".
_UNREPLAYABLE = (KeyNotFoundError, FormatError, ManifestError, VersionError)


class Receiver:
    """One receiver shard. ``tensors`` are the live local tensors (storage names, BF16), written
    in place; ``state_dir`` is this receiver's own durable directory.

    ``pause`` is the engine's "stop reading weights" context, entered only around the scatter;
    ``on_tensor_written(name)`` is called after each tensor is written (progress, tests)."""

    def __init__(
        self,
        store: Store,
        *,
        shard: str,
        tensors: Mapping[str, torch.Tensor],
        state_dir: str,
        config: ReceiverConfig,
        specs: Mapping[str, TensorSpec] | None = None,
        pause: PauseContext | None = None,
        on_tensor_written: Callable[[str], None] | None = None,
    ) -> None:
        try:
            self.shard = names.check_token("shard", shard)
        except ManifestError as exc:
            raise ConfigError(f"Receiver shard: {exc}") from None
        self.store = store
        self.config = config
        self.tensors = dict(tensors)
        self.specs = dict(specs) if specs is not None else {
            n: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in self.tensors.items()
        }  # fmt: skip
        self._check_tensors()
        self._pause = pause or contextlib.nullcontext
        self._on_tensor = on_tensor_written
        self.catalog = Catalog(store, signing_key=config.signing_key, limits=config.limits)
        self.dir = StateDir(state_dir, durable=config.durable)
        state = self.dir.read_state()
        mine = (config.receiver_id, self.shard)
        if state is not None and (state.receiver, state.shard) != mine:
            raise LocalStateError(
                f"state dir {str(self.dir.path)!r} belongs to receiver {state.receiver!r} shard "
                f"{state.shard!r}, not {config.receiver_id!r} shard {self.shard!r}"
            )
        self._state = state or LocalState(
            receiver=config.receiver_id, shard=self.shard, version=None, state_digest=None
        )
        self.last_repair: PullReport | None = None
        journal = self.dir.read_journal()
        if journal is not None:
            self.heartbeat()  # retention keeps what a registered receiver still needs
            self.last_repair = self._repair(journal)
        else:
            if (
                config.verify_on_open
                and self._state.version is not None
                and not self._state.dirty
                and state_digest(self.tensors) != self._state.state_digest
            ):
                self._set_state(dirty=True)
            self.heartbeat()

    @classmethod
    def for_layout(
        cls,
        store: Store,
        layout: ReceiverLayout,
        shard: str,
        tensors: Mapping[str, torch.Tensor],
        state_dir: str,
        config: ReceiverConfig,
        **kwargs,
    ) -> Receiver:
        """A receiver whose expected tensors are ``layout``'s local specs of ``shard``."""
        return cls(
            store, shard=shard, tensors=tensors, state_dir=state_dir, config=config,
            specs=layout.local_specs(shard), **kwargs,
        )  # fmt: skip

    def _check_tensors(self) -> None:
        check_tensors_match(
            self.tensors, self.specs, what=f"receiver shard {self.shard!r}",
            hint="pass storage names only; tied aliases share storage and need no entry",
        )  # fmt: skip

    # --- state ------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The last verified version (see :attr:`dirty`)."""
        return self._state.version

    @property
    def state_digest(self) -> str | None:
        """The digest of :attr:`version`'s state, as verified."""
        return self._state.state_digest

    @property
    def dirty(self) -> bool:
        """True when the tensors are known not to hold :attr:`version` (a failed apply)."""
        return self._state.dirty

    def _set_state(self, **changes) -> None:
        fields = {
            "receiver": self._state.receiver, "shard": self._state.shard,
            "version": self._state.version, "state_digest": self._state.state_digest,
            "dirty": self._state.dirty,
        }  # fmt: skip
        fields.update(changes)
        new = LocalState(**fields)
        self.dir.write_state(new)
        self._state = new

    def heartbeat(self) -> None:
        """Register (or refresh) this receiver and the version it verifiably holds."""
        rec = ReceiverRecord(
            receiver=self.config.receiver_id, shard=self.shard,
            version=None if self.dirty else self.version, updated_at=time.time(),
        )  # fmt: skip
        self.store.put(rec.key, rec.to_json())

    # --- pull -------------------------------------------------------------------------

    def pull(self) -> PullReport:
        """Bring the tensors to the newest committed version; see the module docstring.

        Repairs an interrupted apply first (its journal), then applies the chain from the
        local version, or from the newest anchor when the local state cannot be a base.

        Returns:
            A :class:`PullReport`: the version now held, the chain applied, bytes fetched,
            elements written and the stage / pause / verify times.
        """
        t0 = time.perf_counter()
        journal = self.dir.read_journal()
        if journal is not None:  # an earlier pull of this process failed after its journal
            return self._repair(journal)
        local = None if self.dirty else self.version
        latest = self.catalog.latest()
        if latest is None or latest == local:
            self.heartbeat()
            return PullReport(
                version=self.version, previous_version=self.version,
                total_s=time.perf_counter() - t0,
            )  # fmt: skip
        manifests = self.catalog.chain(local, latest)
        if manifests and manifests[0].kind == "anchor":
            why = (
                "it holds no verified version" if self.version is None
                else "its state is dirty" if self.dirty
                else f"the chain from version {local} starts over at an anchor"
            )  # fmt: skip
            log.info(
                "receiver %r shard %r: restoring anchor %d (%s), then %d version(s) to %d",
                self.config.receiver_id, self.shard, manifests[0].version, why,
                len(manifests) - 1, latest,
            )  # fmt: skip
        return self._run(manifests, local, t0, repaired=False)

    def _run(
        self, manifests: list[Manifest], from_version: int | None, t0: float, *, repaired: bool
    ) -> PullReport:
        previous = self.version
        check_chain(manifests, from_version, self.shard)
        t = time.perf_counter()
        steps, fetched = [], 0
        for m in manifests:
            updates, n = fetch_version(
                self.store, m, self.shard, self.specs,
                max_decompressed_bytes=self.config.max_decompressed_bytes,
            )  # fmt: skip
            steps.append((m.kind, updates))
            fetched += n
        final = fold_chain(steps, self.specs)
        del steps
        stage_s = time.perf_counter() - t

        target = manifests[-1]
        self.dir.write_journal(Journal(
            receiver=self.config.receiver_id, shard=self.shard, from_version=from_version,
            steps=tuple(JournalStep.of(m, self.shard) for m in manifests),
        ))  # fmt: skip
        t = time.perf_counter()
        written = 0
        with self._pause():
            for update in final:
                written += apply_updates([update], self.tensors)
                if self._on_tensor is not None:
                    self._on_tensor(update.name)
        pause_s = time.perf_counter() - t
        del final

        t = time.perf_counter()
        digest = state_digest(self.tensors)
        verify_s = time.perf_counter() - t
        expected = target.shard_digests[self.shard]
        if digest != expected:
            log.error(
                "receiver %r shard %r: state digest after version %d does not match the "
                "manifest; marked dirty, the next pull restores the newest anchor",
                self.config.receiver_id, self.shard, target.version,
            )  # fmt: skip
            self._set_state(dirty=True)
            self.dir.clear_journal()
            self.heartbeat()
            raise IntegrityError(
                f"receiver {self.config.receiver_id!r} shard {self.shard!r}: after applying "
                f"versions {[m.version for m in manifests]} the state digest is {digest}, but "
                f"manifest {target.version} says {expected}. The tensors no longer hold version "
                f"{previous}; it stays the last verified version and the next pull restores "
                "the newest anchor. Check that publisher and receiver use the same layout"
            )
        total_s = time.perf_counter() - t0
        ack = AckRecord(
            version=target.version, receiver=self.config.receiver_id, shard=self.shard,
            state_digest=digest, created_at=time.time(), pause_s=pause_s, total_s=total_s,
        )  # fmt: skip
        self.store.put(ack.key, ack.to_json())
        self._set_state(version=target.version, state_digest=digest, dirty=False)
        self.dir.clear_journal()
        self.heartbeat()
        return PullReport(
            version=target.version, previous_version=previous,
            chain=tuple(m.version for m in manifests), from_anchor=manifests[0].kind == "anchor",
            repaired=repaired, bytes_fetched=fetched, elements_written=written,
            stage_s=stage_s, pause_s=pause_s, verify_s=verify_s,
            total_s=time.perf_counter() - t0,
        )  # fmt: skip

    # --- repair -----------------------------------------------------------------------

    def _repair(self, journal: Journal) -> PullReport:
        """Finish an apply a crash interrupted: replay the journaled chain (see journal.py),
        or, if the store no longer has it, restore the newest anchor."""
        t0 = time.perf_counter()
        if journal.shard != self.shard or journal.receiver != self.config.receiver_id:
            raise LocalStateError(
                f"journal in {str(self.dir.path)!r} is for receiver {journal.receiver!r} shard "
                f"{journal.shard!r}, not this one"
            )
        try:
            manifests = [self.catalog.manifest(s.version) for s in journal.steps]
            for m, step in zip(manifests, journal.steps, strict=True):
                if JournalStep.of(m, self.shard) != step:
                    raise ManifestError(
                        f"manifest {m.version} no longer matches the journal (the store was "
                        "rewritten under this receiver)"
                    )
            log.warning(
                "receiver %r shard %r: found the journal of an interrupted apply (versions %s "
                "from %s); replaying it", self.config.receiver_id, self.shard,
                [s.version for s in journal.steps], journal.from_version,
            )  # fmt: skip
            return self._run(manifests, journal.from_version, t0, repaired=True)
        except _UNREPLAYABLE as exc:
            log.warning(
                "receiver %r shard %r: the journaled chain %s cannot be replayed (%s: %s); "
                "marking the state dirty and restoring the newest anchor",
                self.config.receiver_id, self.shard, [s.version for s in journal.steps],
                type(exc).__name__, exc,
            )  # fmt: skip
        # The tensors are a mix of journaled steps that can no longer be fetched: only a full
        # anchor can restore them. Record that durably before dropping the journal.
        self._set_state(dirty=True)
        self.dir.clear_journal()
        self.heartbeat()
        latest = self.catalog.latest()
        if latest is None:
            raise VersionError(
                "the journaled versions are gone and the store has no committed version: "
                "this receiver cannot be repaired until an anchor is published"
            )
        manifests = self.catalog.chain(None, latest)
        log.info(
            "receiver %r shard %r: restoring anchor %d (its state is dirty: the journal could "
            "not be replayed), then %d version(s) to %d", self.config.receiver_id, self.shard,
            manifests[0].version, len(manifests) - 1, latest,
        )  # fmt: skip
        return self._run(manifests, None, t0, repaired=True)
