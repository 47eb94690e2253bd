"""Where an in-cluster receiver's live tensors stand, recorded before the first write.

Three facts (the first with its digests), kept in memory and, when a path is given, in one
record of :mod:`deltasync.atomic` (the file format the storage receiver's journal uses too):

- ``committed``: the version the tensors hold, jointly committed (None: nothing verified yet),
  with what the tensors hash to at that version when the receiver knows it: ``digest``, the
  shard's state digest, or ``part_digests``, every writer's part digest of the shard (both
  None: the version came without digests, so nothing was verified against it). They are what
  lets a receiver that reopens the file check that the tensors it was given still hold
  ``committed`` (a replacement process with freshly loaded tensors does not): see
  ``ClusterReceiver``;
- ``applying``: ``(version, base)`` of an apply that started and has not been committed: the
  tensors hold ``base`` overwritten at some of that version's elements. With it, ``window``:
  the writers' attempt-window token the apply came with. A retry on the same base converges
  from there because the writers resend the union of every attempt of that window with
  absolute values (see ``cluster_sender``); the preflight refuses a delta from another window
  (a restarted writer does not know what the attempt sent), so only an anchor repairs that;
- ``dirty``: the tensors are known not to hold ``committed`` in a way a retry cannot repair (a
  state digest mismatch): only an anchor is accepted.

Why not the storage path's ``receiver.journal``: that journal names the store keys of the chain
so that a restarted receiver can replay it from the store. In-cluster nothing is stored; the
only sources of repair are the trainer's retry of the same version and an anchor, which these
three facts are enough to decide between (``accepts``). The rule is the same: the journal is
written before the first byte of a live tensor changes.

The digests are noted in memory when the verify before write has checked them
(:meth:`ClusterJournal.verified`) and written with the commit of that version, so that the
recorded digests always describe ``committed``: a version committed without digests records
None, and the next verified one records its digests again. Journals written before the digests
existed read as None (unknown), as those written before windows read window 0.

One process at a time: a journal file is held by the process that opened it
(:class:`~deltasync.exclusive.FileHold` of ``<journal>.lock``), so two receiver ranks given one
path, or a replacement started while the process it replaces still runs, are refused by name
before either reads or writes the other's record.

This module knows files and versions; it knows nothing about tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltasync.atomic import REMEDY, encode_record, read_record, sweep_stale_temps, write_record
from deltasync.errors import AnchorRequiredError, ConfigError, LocalStateError, VersionError
from deltasync.exclusive import FileHold
from deltasync.format import BlobBaseMismatchError
from deltasync.names import MAX_VERSION
from deltasync.validate import check_instance


@dataclass(frozen=True)
class JournalState:
    committed: int | None
    applying: tuple[int, int] | None = None
    dirty: bool = False
    window: int = 0  # the writers' attempt window of ``applying`` (0: none or unknown)
    digest: str | None = None  # the state digest of ``committed`` (None: unknown)
    # every writer's part digest of ``committed``, in writer order (None: unknown)
    part_digests: tuple[str, ...] | None = None

    @property
    def checkable(self) -> bool:
        """Whether the journal knows what the tensors hash to at ``committed``."""
        return self.digest is not None or self.part_digests is not None

    def to_json(self) -> bytes:
        return encode_record(self.to_obj())

    def to_obj(self) -> dict[str, Any]:
        applying = None if self.applying is None else list(self.applying)
        return {
            "committed": self.committed,
            "applying": applying,
            "dirty": self.dirty,
            "window": self.window,
            "digest": self.digest,
            "part_digests": None if self.part_digests is None else list(self.part_digests),
        }

    @classmethod
    def from_json(cls, data: bytes, where: str) -> JournalState:
        try:
            return cls.from_obj(json.loads(data), where)
        except (ValueError, UnicodeDecodeError):
            return cls.from_obj(None, where)

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> JournalState:
        try:
            committed, applying, dirty = obj["committed"], obj["applying"], obj["dirty"]
            # absent in journals written before windows, or digests, existed
            window = obj.get("window", 0)
            digest, parts = obj.get("digest"), obj.get("part_digests")
            ok = (
                set(obj) - _OPTIONAL == {"committed", "applying", "dirty"}
                and type(window) is int
                and 0 <= window <= MAX_WINDOW
                and (digest is None or type(digest) is str)
                and (parts is None or (type(parts) is list and all(type(d) is str for d in parts)))
                and (
                    committed is None or (type(committed) is int and 0 <= committed <= MAX_VERSION)
                )
                and (applying is None or _possible_apply(applying, committed))
                and type(dirty) is bool
            )
        except (TypeError, KeyError):
            ok = False
        if not ok:
            raise LocalStateError(f"{where} is not a deltasync cluster journal: {REMEDY}")
        pair = None if applying is None else (applying[0], applying[1])
        return cls(
            committed=committed,
            applying=pair,
            dirty=dirty,
            window=window,
            digest=digest,
            part_digests=None if parts is None else tuple(parts),
        )


def _possible_apply(applying: Any, committed: Any) -> bool:
    """Whether ``applying`` is an apply :meth:`ClusterJournal.begin` could have recorded: a
    version above the committed one, on the committed one or as an anchor (base -1)."""
    if type(applying) is not list or len(applying) != 2:
        return False
    version, base = applying
    if type(version) is not int or type(base) is not int or not 0 <= version <= MAX_VERSION:
        return False
    above = committed is None or version > committed
    return above and (base == -1 or base == committed)


_OPTIONAL = {"window", "digest", "part_digests"}  # fields later versions of the format added
MAX_WINDOW = 2**63 - 1  # a window token travels in one int64 word of the preflight row
LOCK_SUFFIX = ".lock"  # the journal file's lock, beside it (one process per journal)
_SHARE_REMEDY = (
    "Each receiver rank needs its own journal_path, and a replacement starts once the process "
    "it replaces has ended"
)


class ClusterJournal:
    """The receiver's record of its state; durable when ``path`` is given.

    ``version`` is what the tensors hold when no journal file exists yet (None: nothing
    verified; the first sync must be an anchor). An existing file wins over ``version``
    (``reopened``); whether the tensors still hold what it says is for the receiver to check
    (``ClusterReceiver`` hashes them against the recorded digests and marks the journal dirty
    when they do not match or cannot be checked)."""

    def __init__(
        self,
        *,
        version: int | None,
        path: str | os.PathLike[str] | None = None,
        owner: str = "this receiver",
    ) -> None:
        if version is not None and (
            isinstance(version, bool)
            or not isinstance(version, int)
            or not 0 <= version <= MAX_VERSION
        ):
            raise ConfigError(
                f"journal version must be None or an int in 0..{MAX_VERSION}, got {version!r}"
            )
        if path is not None:
            check_instance("ClusterReceiver", "journal_path", path, (str, os.PathLike))
        self.path = None if path is None else Path(path)
        self._state = JournalState(committed=version)
        # the digests the verify before write found for the version being applied, in memory
        # until its commit writes them: (version, digest, part digests)
        self._verified: tuple[int, str | None, tuple[str, ...] | None] | None = None
        self.reopened = False  # the state was read from an existing file
        self._hold: FileHold | None = None
        if self.path is not None:
            # Before anything is read: another live process's journal is not this one's. Beside
            # the real file, so a symlink to it is held by the same lock.
            try:
                real = Path(os.path.realpath(self.path))
            except ValueError as exc:  # a NUL byte in the path
                raise LocalStateError(
                    f"cannot hold cluster receiver journal {str(self.path)!r}: {exc}"
                ) from None
            self._hold = FileHold(
                real.with_name(real.name + LOCK_SUFFIX),
                what=f"cluster receiver journal {str(self.path)!r}",
                owner=owner,
                remedy=_SHARE_REMEDY,
            )
            try:
                self._open()
            except BaseException:  # never opened: nothing of it is held
                self._hold.release()
                raise

    def _open(self) -> None:
        assert self.path is not None
        sweep_stale_temps([self.path])  # killed writes' leftovers
        obj = read_record(self.path)
        if obj is None:
            self._write(self._state)
        else:
            self._state = JournalState.from_obj(obj, repr(str(self.path)))
            self.reopened = True

    @property
    def state(self) -> JournalState:
        return self._state

    def close(self) -> None:
        """Release this journal's hold of its file (as when it is collected); idempotent."""
        if self._hold is not None:
            self._hold.release()

    def accepts(self, *, version: int, base: int, where: str) -> None:
        """Raise unless a blob bringing ``version`` on ``base`` (-1: anchor) may be applied."""
        s = self._state
        if s.committed is not None and version <= s.committed:
            raise VersionError(
                f"{where}: version {version} refused before any write: this receiver committed "
                f"version {s.committed}, and a version number names one state (the writers "
                f"must send a version above {s.committed})"
            )
        if base == -1:
            return
        if s.committed is None or s.dirty:
            why = (
                "holds no verified version"
                if s.committed is None
                else "is dirty (its tensors failed a state digest check, or could not be shown "
                f"to hold version {s.committed} when its journal was reopened)"
            )
            raise AnchorRequiredError(
                f"{where}: delta version {version} on base {base} refused before any write: this "
                f"receiver {why}; the writers must send an anchor (sync(anchor=True))"
            )
        if base != s.committed:
            raise BlobBaseMismatchError(
                f"{where}: version {version} applies on base {base}, this receiver holds "
                f"version {s.committed}; refused before any write (send an anchor, or the "
                "version this receiver is missing)"
            )

    def begin(self, version: int, base: int, *, window: int = 0) -> None:
        """Record the apply of ``version`` on ``base`` from the writers' attempt ``window``:
        call before the first write."""
        self._verified = None
        self._set(replace(self._state, applying=(version, base), window=window))

    def verified(
        self,
        version: int,
        *,
        digest: str | None,
        part_digests: tuple[str, ...] | None = None,
    ) -> None:
        """Note (in memory) what the tensors will hash to once ``version``, just verified
        before its write, is applied: its state ``digest`` and/or every writer's
        ``part_digests`` (None: not checked). The commit of ``version`` records them."""
        self._verified = (version, digest, part_digests)

    def commit(self, version: int) -> None:
        """Record ``version`` as committed, with the digests :meth:`verified` noted for it
        since the last ``begin`` (none noted: unknown, so a reopened journal cannot vouch for
        the tensors)."""
        noted, self._verified = self._verified, None
        digest, parts = (None, None) if noted is None or noted[0] != version else noted[1:]
        # The file is synced, its directory entry not: after a power loss the journal reads
        # this commit or the apply before it, whole either way, and the apply only means a
        # retry or an anchor (the next begin syncs the directory anyway).
        self._set(
            JournalState(committed=version, digest=digest, part_digests=parts), sync_dir=False
        )

    def mark_dirty(self) -> None:
        """No version from now on: in memory first, so that a journal file the disk refuses
        (its error raised) never leaves the receiver reporting a version its tensors are
        known not to hold."""
        self._verified = None
        self._state = replace(self._state, applying=None, dirty=True, window=0)
        if self.path is not None:
            self._write(self._state)

    def restore(self, state: JournalState) -> None:
        """Put back ``state``, recorded before a ``begin`` whose apply never wrote a byte (its
        verify refused the payload)."""
        self._verified = None
        self._set(state)

    def _set(self, state: JournalState, *, sync_dir: bool = True) -> None:
        if self.path is not None:
            self._write(state, sync_dir=sync_dir)
        self._state = state

    def _write(self, state: JournalState, *, sync_dir: bool = True) -> None:
        assert self.path is not None and self._hold is not None
        if not self._hold.held:  # closed: the file may be another process's by now
            raise LocalStateError(
                f"cluster receiver journal {str(self.path)!r} was closed; its receiver "
                "writes nothing more"
            )
        write_record(self.path, state.to_obj(), sync_dir=sync_dir)
