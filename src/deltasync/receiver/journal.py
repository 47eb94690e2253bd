"""The receiver's local, durable record of where its live tensors are.

Two small JSON files in the receiver's state directory (names from :mod:`deltasync.names`):

- ``state.json``: the last VERIFIED version (its shard digest matched the manifest), that
  digest and its lineage's run id; ``dirty`` is set when the tensors are known not to hold
  that version (a torn apply that cannot be replayed, live tensors that no longer hash to it):
  the next pull restores the newest anchor, and until then the receiver reports no version;
- ``journal.json``: written, durably, BEFORE the first write into live tensors: the version
  the tensors held (``from_version``) and every step of the chain being applied (version,
  kind, base, shard digest, blob keys, sizes and digests). Present at start-up = a crash in
  the middle of an apply; the receiver replays the whole journaled chain. That is safe however
  far the crash got: each delta overwrites every element that changed in its step with its
  absolute value, elements outside all steps still hold ``from_version``, and an anchor rewrites
  everything; replaying the steps in order therefore ends at the journaled target whether the
  tensors held ``from_version``, any mix of the steps, or the target already.

Both files are records of :mod:`deltasync.atomic` (canonical JSON, written atomically
and durably). This module knows the records' fields; it knows nothing about stores or tensors.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync import names
from deltasync.atomic import (
    STATE_DIR_MODE,
    encode_record,
    read_record,
    remove_record,
    sweep_stale_temps,
    write_record,
)
from deltasync.commit import Manifest
from deltasync.commit.canonical import check_blob_digest, check_digest, check_int
from deltasync.errors import LocalStateError, ManifestError
from deltasync.exclusive import FileHold


@dataclass(frozen=True, kw_only=True)
class LocalState:
    receiver: str
    shard: str
    version: int | None  # last verified version; None before the first one
    state_digest: str | None
    dirty: bool = False
    run_id: str | None = None  # the lineage of ``version`` (None: not recorded)

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {
            "receiver": self.receiver,
            "shard": self.shard,
            "version": self.version,
            "state_digest": self.state_digest,
            "dirty": self.dirty,
        }
        if self.run_id is not None:
            obj["run_id"] = self.run_id
        return encode_record(obj)

    @classmethod
    def from_obj(cls, obj: Any) -> LocalState:
        required = {"receiver", "shard", "version", "state_digest", "dirty"}
        if not isinstance(obj, dict) or not required <= set(obj) <= required | {"run_id"}:
            raise ManifestError(
                "state file must hold receiver, shard, version, state_digest, dirty (and "
                "optionally run_id)"
            )
        run_id = obj.get("run_id")
        if run_id is not None:
            names.check_token("state run_id", run_id)
        version, digest = obj["version"], obj["state_digest"]
        if version is not None:
            check_int(version, what="state version", lo=0, hi=names.MAX_VERSION)
            check_digest(digest, what="state digest")
        if not isinstance(obj["dirty"], bool):
            raise ManifestError("state dirty must be a bool")
        return cls(
            receiver=names.check_token("receiver", obj["receiver"]),
            shard=names.check_token("shard", obj["shard"]),
            version=version,
            state_digest=digest if version is not None else None,
            dirty=obj["dirty"],
            run_id=run_id if version is not None else None,
        )


@dataclass(frozen=True, kw_only=True)
class JournalStep:
    version: int
    kind: str
    base_version: int | None
    shard_digest: str
    blobs: tuple[tuple[str, int, str], ...]  # (key, size, digest) of this shard's blobs

    @classmethod
    def of(cls, manifest: Manifest, shard: str) -> JournalStep:
        digest = manifest.shard_digests.get(shard)
        if digest is None:
            raise ManifestError(
                f"version {manifest.version} does not define receiver shard {shard!r}: the "
                "store holds another layout"
            )
        return cls(
            version=manifest.version,
            kind=manifest.kind,
            base_version=manifest.base_version,
            shard_digest=digest,
            blobs=tuple((b.key, b.size, b.digest) for b in manifest.blobs_for(shard)),
        )

    def to_obj(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind,
            "base_version": self.base_version,
            "shard_digest": self.shard_digest,
            "blobs": [list(b) for b in self.blobs],
        }

    @classmethod
    def from_obj(cls, obj: Any) -> JournalStep:
        if not isinstance(obj, dict) or set(obj) != {
            "version",
            "kind",
            "base_version",
            "shard_digest",
            "blobs",
        }:
            raise ManifestError("journal step has missing or unknown fields")
        blobs = []
        for b in obj["blobs"] if isinstance(obj["blobs"], list) else [None]:
            if not isinstance(b, list) or len(b) != 3 or not isinstance(b[0], str):
                raise ManifestError("journal blob must be [key, size, digest]")
            blobs.append(
                (
                    b[0],
                    check_int(b[1], what="journal blob size", lo=1, hi=2**63 - 1),
                    check_blob_digest(b[2], what="journal blob digest"),
                )
            )
        if obj["kind"] not in ("delta", "anchor"):
            raise ManifestError(f"journal step kind {obj['kind']!r}")
        return cls(
            version=check_int(obj["version"], what="journal version", lo=0, hi=names.MAX_VERSION),
            kind=obj["kind"],
            base_version=obj["base_version"],
            shard_digest=check_digest(obj["shard_digest"], what="journal shard digest"),
            blobs=tuple(blobs),
        )


@dataclass(frozen=True, kw_only=True)
class Journal:
    receiver: str
    shard: str
    from_version: int | None
    steps: tuple[JournalStep, ...]

    @property
    def target(self) -> int:
        return self.steps[-1].version

    def to_json(self) -> bytes:
        return encode_record(
            {
                "receiver": self.receiver,
                "shard": self.shard,
                "from_version": self.from_version,
                "steps": [s.to_obj() for s in self.steps],
            }
        )

    @classmethod
    def from_obj(cls, obj: Any) -> Journal:
        if not isinstance(obj, dict) or set(obj) != {"receiver", "shard", "from_version", "steps"}:
            raise ManifestError("journal must hold receiver, shard, from_version, steps")
        if not isinstance(obj["steps"], list) or not obj["steps"]:
            raise ManifestError("journal steps must be a non-empty list")
        fv = obj["from_version"]
        if fv is not None:
            check_int(fv, what="journal from_version", lo=0, hi=names.MAX_VERSION)
        return cls(
            receiver=names.check_token("receiver", obj["receiver"]),
            shard=names.check_token("shard", obj["shard"]),
            from_version=fv,
            steps=tuple(JournalStep.from_obj(s) for s in obj["steps"]),
        )


# What a refused receiver is told to do.
_SHARE_REMEDY = (
    "Each receiver needs its own state dir: give engine replicas distinct receiver ids (or "
    "state dirs), and stop the other process first when restarting"
)


class StateDir:
    """The state directory of one receiver: ``state.json`` and ``journal.json``."""

    def __init__(self, path: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.path = Path(path)
        self.durable = durable  # False skips fsync: scratch directories in tests only
        self._make()
        self._check()
        sweep_stale_temps((self.state_path, self.journal_path))  # killed writes' leftovers

    @property
    def state_path(self) -> Path:
        return self.path / names.STATE_FILE

    @property
    def journal_path(self) -> Path:
        return self.path / names.JOURNAL_FILE

    def read_state(self) -> LocalState | None:
        obj = read_record(self.state_path, follow_links=False)
        if obj is None:
            return None
        try:
            return LocalState.from_obj(obj)
        except ManifestError as exc:
            raise LocalStateError(f"{str(self.state_path)!r}: {exc}") from exc

    def write_state(self, state: LocalState) -> None:
        self.ensure()
        write_record(self.state_path, json.loads(state.to_json()), durable=self.durable)

    def read_journal(self) -> Journal | None:
        obj = read_record(self.journal_path, follow_links=False)
        if obj is None:
            return None
        try:
            return Journal.from_obj(obj)
        except ManifestError as exc:
            raise LocalStateError(f"{str(self.journal_path)!r}: {exc}") from exc

    def write_journal(self, journal: Journal) -> None:
        self.ensure()
        write_record(self.journal_path, json.loads(journal.to_json()), durable=self.durable)

    def lock(self, owner: str, remedy: str = _SHARE_REMEDY) -> None:
        """Hold this directory for this process (``owner``: the receiver, and ``remedy``,
        for the message of one refused): a second process whose receiver opened the same
        state dir would replay this one's journal as a crash's and overwrite its state file.
        LocalStateError naming the holder's pid if another process holds it; nothing is
        written then. A :class:`~deltasync.exclusive.FileHold` of
        :data:`~deltasync.names.LOCK_FILE`: receivers of one process reopening the directory
        share it, and it ends with the process or once no ``StateDir`` of it is left."""
        self._hold = FileHold(
            self.path / names.LOCK_FILE,
            what=f"receiver state dir {str(self.path)!r}",
            owner=owner,
            remedy=remedy,
        )

    def unlock(self) -> None:
        """This ``StateDir``'s hold of :meth:`lock` ends now (as when it is collected)."""
        hold = getattr(self, "_hold", None)
        if hold is not None:
            hold.release()

    def ensure(self) -> None:
        """The directory again, if something removed it behind a running receiver (a cleanup
        job, an emptied volume): its records are written there from then on, and this
        process's hold of it is taken again there (the lock it held went with the old
        directory's lock file)."""
        try:
            os.mkdir(self.path, STATE_DIR_MODE)
        except FileExistsError:
            self._check()  # a link swapped in for it since is refused, never written through
            return
        except OSError:  # its parent went too, or an error to name
            self._make()
        self._check()
        self._relock()

    def _make(self) -> None:
        """Create the directory and its missing parents (private), or LocalStateError."""
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
        except FileExistsError:
            return  # something else is there: _check names it
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            why = getattr(exc, "strerror", None) or exc
            raise LocalStateError(
                f"cannot create receiver state dir {str(self.path)!r}: {why}"
            ) from exc

    def _check(self) -> None:
        """The directory is one this user owns, private (group and other bits, e.g. of a
        ``mkdir`` under umask 002, are removed), else LocalStateError. A link there is
        followed only when this user made it (a state dir placed on another volume); one
        planted by another user would take this receiver's records, lock and journal removals
        to its target, and whoever else may write the directory could rewrite the record of
        what the tensors hold."""
        why = None
        try:
            link = os.lstat(self.path)
            if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
                why = f"a symbolic link of uid {link.st_uid}, not of this process's user"
            else:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    st = os.fstat(fd)
                    if st.st_uid != os.geteuid():
                        why = (
                            f"owned by uid {st.st_uid}, not by this process's user ({os.geteuid()})"
                        )
                    elif stat.S_IMODE(st.st_mode) & 0o077:
                        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)  # the owner's bits kept
                finally:
                    os.close(fd)
        except OSError as exc:
            if exc.errno != errno.ENOTDIR:
                raise LocalStateError(
                    f"cannot open receiver state dir {str(self.path)!r} or make it private: "
                    f"{exc.strerror or exc}"
                ) from exc
            why = "not a directory"
        if why is not None:
            raise LocalStateError(
                f"receiver state dir {str(self.path)!r} is {why}; nothing was written. Give the "
                "receiver a state dir of its own (deltasync creates a missing one, mode 0700), "
                "or remove this one"
            )

    def _relock(self) -> None:
        """Lock the remade directory's new lock file, if this process held the old one."""
        hold = getattr(self, "_hold", None)
        if hold is not None:
            hold.retake()  # another process may have taken it meanwhile

    def clear_journal(self) -> None:
        # Not fsynced: the state file written before it is what must survive a crash. A
        # removal lost to a power cut only brings the journal back, and replaying a whole
        # journaled chain is always correct (module docstring): one directory fsync less
        # per pull, and the next write_journal fsyncs the directory anyway.
        remove_record(self.journal_path, durable=False)
