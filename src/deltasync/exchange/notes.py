"""Bounded waits: every wait of the exchange ends within its timeout with an error that names
what it waited for (the round, the message, the peer).

Measured with torch 2.13 on CPU: gloo honours ``Work.wait(timeout)`` for send, receive and
all_gather, raising RuntimeError ("Timed out waiting 1000ms for recv operation to complete",
"Operation timed out!"). A gloo send waits for the matching receive, so sends time out too.
A timed-out gloo wait closes the connection to that peer ("Application timeout caused pair
closure"), and a peer whose process died surfaces at once as "Connection closed by peer".
After any round-2 failure the group must be treated as broken and re-created.

``abandon`` uses that closing on purpose: when one message fails, a rank gives up its other
unfinished messages with a near-zero wait, which closes those connections, so the peers on
the other side fail within moments instead of each waiting out its own timeout. It does this
for gloo only; NCCL aborts its communicator on a timeout by itself.

Failure notes: when a wait of an exchange (or of the in-cluster joint commit) fails on a
rank, the rank leaves a note in the process group's key-value store naming the peer it
suspects, and follows the others' notes, so that every survivor names the rank that actually
died or hung, not a peer that merely gave up on it.

Why: after a rank dies, gloo tells only the ranks that were talking to it ("connection
closed"). A rank that gives up closes its own connections, so its peers see a closed connection
too and would blame it. Each rank writes its note *before* it closes anything, so a chain such
as "rank 1 suspects rank 0; rank 0's note suspects rank 2; rank 2 left none" ends at the
culprit whoever reads it. For collectives (round 1, the joint commit) a rank cannot tell which
peer is missing; every rank marks its arrival instead, and a rank that never arrived is named
(when all arrived, the single rank that left no note while the others gave up is; of several
silent ones, the one whose process on this machine is gone or stopped; of several that never
arrived, likewise by their arrival marks in the exchanges before).

Keys, under the group's store: ``deltasync/{tag}/in/{rank}`` (arrived: ``pid start-time
machine``, see ``_process_mark``) and
``deltasync/{tag}/fail/{rank}`` holding ``"{suspect}|{text}"`` (suspect -1: unknown). ``tag``
is chosen by the caller, the same on every rank and fresh for each exchange (the in-cluster sync
uses its preflight's window token, the version, a fresh token of the attempt and the step),
so neither the notes of an earlier group nor those of an aborted attempt of the same version
are ever read. The store is the one the group was created with (torchrun's agent store,
``exchange.spawn``'s); when there is none to reach, notes are skipped and an error names only
the peer this rank waited on.

This module knows works, store keys and text (and, to tell a dead peer on this machine from
a waiting one, /proc); it knows nothing about payloads or schedules.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deltasync.errors import ExchangeError, ExchangeTimeoutError

log = logging.getLogger(__name__)

_TEXT_LIMIT = 2000
GRACE_S = 0.5  # how long in all a failing rank polls arrivals and notes before blaming
_TIMEOUT_WORDS = ("timed out", "timeout")
_CLOSED_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused")


def wait(work: dist.Work, *, timeout_s: float, what: str, peers: str) -> None:
    """Wait for ``work`` at most ``timeout_s``; raise a typed error naming ``what`` and ``peers``.

    what: the operation, e.g. "exchange round 2, batch 3 of 9: receive of chunk 2/5 (1024 bytes)
        from rank 4"; peers: who could be at fault, e.g. "rank 4".
    """
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout_s))
    except (
        RuntimeError
    ) as exc:  # gloo and NCCL raise RuntimeError (or DistBackendError, a subclass)
        raise failure(exc, what=what, peers=peers, timeout_s=timeout_s) from exc
    if finished is False:  # some backends report a timeout by returning False
        raise ExchangeTimeoutError(_timeout_message(what, peers, timeout_s))


def abandon(works: Iterable[dist.Work], *, backend: str) -> None:
    """Give up unfinished works after a failure; on gloo this closes their connections."""
    if "gloo" not in backend:
        return
    for work in works:
        try:
            work.wait(timeout=timedelta(milliseconds=1))
        except RuntimeError:
            pass  # expected: the point is the side effect of closing the connection


def failure(exc: RuntimeError, *, what: str, peers: str, timeout_s: float) -> ExchangeError:
    """The typed error for a backend's RuntimeError about ``what``."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    lowered = text.lower()
    if any(word in lowered for word in _CLOSED_WORDS):
        return ExchangeError(
            f"{what}: the connection closed ({first}); {peers} died or gave up on the exchange. "
            "Re-create the process group before exchanging again"
        )
    if any(word in lowered for word in _TIMEOUT_WORDS):
        return ExchangeTimeoutError(_timeout_message(what, peers, timeout_s))
    return ExchangeError(f"{what} failed: {first}. Re-create the process group before retrying")


def _timeout_message(what: str, peers: str, timeout_s: float) -> str:
    return (
        f"{what}: not finished within timeout_s={timeout_s:g} s; {peers} may be dead, stuck, or "
        "not running the same exchange. Re-create the process group before exchanging again"
    )


# --- failure notes ---------------------------------------------------------------------------


def group_store(group: dist.ProcessGroup | None) -> Any:
    """The key-value store ``group`` was created with, or None if it cannot be reached."""
    try:  # a private torch API: without it, notes are skipped (errors stay correct, less precise)
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_process_group_store(
            group if group is not None else c10d._get_default_group()
        )
    except Exception:
        return None


class FailureNotes:
    """The notes of one exchange (or commit) of one group, as ``rank`` of ``world`` sees them.

    earlier: the tags of the exchanges this rank finished just before this one (a version's
    exchanges before its joint commit). A rank that never arrived here but left a note in one
    of them failed there, alive: when that leaves one rank that never arrived, it is named."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        tag: str,
        rank: int,
        world: int,
        earlier: Iterable[str] = (),
    ) -> None:
        self._store = group_store(group)
        self._prefix = f"deltasync/{tag}"
        self._earlier = tuple(f"deltasync/{t}" for t in earlier)
        self.rank = rank
        self.world = world

    def _set(self, key: str, value: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"{self._prefix}/{key}", value)
        except Exception as exc:
            log.warning(
                "could not write %s/%s to the process group's store: %s", self._prefix, key, exc
            )
            self._store = None

    def _get(self, key: str, prefix: str | None = None) -> str | None:
        if self._store is None:
            return None
        full = f"{self._prefix if prefix is None else prefix}/{key}"
        try:
            if not self._store.check([full]):
                return None
            return self._store.get(full).decode("utf-8", "replace")
        except Exception:
            return None

    def arrive(self) -> None:
        """Mark that this rank entered the exchange (read by ranks whose collective fails),
        with where its process runs (``_process_mark``)."""
        self._set(f"in/{self.rank}", _process_mark())

    def post(self, suspect: int | None, text: str) -> None:
        """Leave this rank's note; call before closing any connection."""
        self._set(f"fail/{self.rank}", f"{-1 if suspect is None else suspect}|{text[:_TEXT_LIMIT]}")

    def _note(self, rank: int, prefix: str | None = None) -> tuple[int | None, str] | None:
        raw = self._get(f"fail/{rank}", prefix)
        if raw is None:
            return None
        head, _, text = raw.partition("|")
        try:
            suspect = int(head)
        except ValueError:
            suspect = -1
        return (None if suspect < 0 else suspect), text

    def culprit(self, suspect: int | None) -> tuple[int | None, list[str]]:
        """Follow suspects from this rank's own through the notes.

        Returns the rank at the end of the chain (one that left no note: dead or hung; None
        when nobody can tell) and the notes passed on the way, as text. Every wait here polls
        up to one shared deadline, ``GRACE_S`` from the call: a survivor raises within its
        timeout plus one grace, however many steps it takes (waiting for arrivals, then for a
        note that the rank that never arrived cannot have left, would be two graces).
        """
        if self._store is None:
            return suspect, []
        deadline = time.monotonic() + GRACE_S
        trail: list[str] = []
        seen = {self.rank}
        current = suspect
        if current is None:
            missing, trail = self._never_arrived(deadline)
            if not missing and not trail:
                missing = self._silent(deadline)
            if len(missing) > 1:
                # A rank held in an earlier exchange (a send to a receiver that gave up there,
                # alive) leaves no note until its own wait ends: of the ranks that never
                # arrived, the one whose process is gone is the one to name.
                gone = _processes_gone({r: self._earlier_mark(r) for r in missing})
                missing = gone if len(gone) == 1 else missing
            if len(missing) == 1:
                current = missing[0]
            elif missing:
                return None, [f"ranks {missing} never arrived"]
        while current is not None and current not in seen:
            note = self._note(current)
            while note is None and time.monotonic() < deadline:
                time.sleep(0.02)  # its own wait may fail a moment after ours
                note = self._note(current)
            if note is None:
                return current, trail
            seen.add(current)
            nxt, text = note
            trail.append(f"rank {current} reported: {text}")
            if nxt is None:
                return None, trail
            current = nxt
        return None, trail

    def _never_arrived(self, deadline: float) -> tuple[list[int], list[str]]:
        """The ranks that had not arrived by ``deadline`` (polling while any is missing) and,
        when several had not, without those that left a note in an earlier exchange (failed
        there, alive; read during the same wait), with those notes as text."""
        notes: dict[int, str] = {}
        while True:
            missing = [r for r in range(self.world) if self._get(f"in/{r}") is None]
            if len(missing) > 1:
                self._read_earlier(missing, notes)
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if len(missing) <= 1:
            return missing, []
        left = [r for r in missing if r not in notes]
        return left, [f"rank {r} reported: {notes[r]}" for r in sorted(notes) if r in missing]

    def _earlier_mark(self, rank: int) -> str | None:
        """``rank``'s arrival mark in the latest earlier exchange it entered, if any."""
        for prefix in reversed(self._earlier):
            mark = self._get(f"in/{rank}", prefix)
            if mark is not None:
                return mark
        return None

    def _read_earlier(self, ranks: list[int], notes: dict[int, str]) -> None:
        """Add to ``notes`` the note each of ``ranks`` left in an earlier exchange, if any."""
        for r in ranks:
            for prefix in self._earlier:
                note = None if r in notes else self._note(r, prefix)
                if note is not None:
                    notes[r] = note[1]

    def _silent(self, deadline: float) -> list[int]:
        """Every rank arrived: the one other rank that left no note by ``deadline``, as a list
        (empty when none or several did). A rank that gave up on the collective leaves its
        note before closing anything; one that died or stopped inside it cannot, and a rank
        that finished it leaves none either, so only a single silent rank is named.

        Several silent ranks: in a ring all_gather only the dead rank's two neighbours see its
        connection close, while the other live ranks still wait inside the collective (and
        leave their notes only once those neighbours give up). Of silent ranks whose arrival
        mark shows a process on this machine (``_process_mark``), the one whose process is gone
        or stopped is named, when it is the only such one."""
        while True:
            silent = [r for r in range(self.world) if r != self.rank and self._note(r) is None]
            if len(silent) <= 1:
                return silent
            if time.monotonic() >= deadline:
                gone = _processes_gone({r: self._get(f"in/{r}") for r in silent})
                return gone if len(gone) == 1 else []
            time.sleep(0.02)


@functools.cache
def _machine() -> str:
    """This process's machine and PID namespace (a pid means one process only within both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""  # no /proc: nothing to compare a peer's mark with


# _start_time's answer for a process that exists but whose /proc entry cannot be read
_UNTOLD = ("?", "?")


def _start_time(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc``; None when it is gone, and
    :data:`_UNTOLD` when its entry cannot be read while the process exists (``/proc`` mounted
    with ``hidepid`` hides another user's processes; ``kill(pid, 0)`` still tells)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        try:
            os.kill(pid, 0)  # no signal sent: only whether the process exists
        except ProcessLookupError:
            return None
        except OSError:  # EPERM: another user's process, alive
            return _UNTOLD
        return _UNTOLD
    return fields[0], fields[19]


def _process_mark() -> str:
    """An arrival mark's value: ``pid start-time machine`` ("1" where /proc is missing)."""
    machine = _machine()
    here = _start_time(os.getpid()) if machine else None
    return "1" if here is None else f"{os.getpid()} {here[1]} {machine}"


# How long a process must stay stopped to count as stopped: a sampling profiler (py-spy's
# default) ptrace-stops a live one for a few ms a sample, a debugger's breakpoint for good.
STOPPED_FOR_S = 0.25


def _processes_gone(marks: dict[int, str | None]) -> list[int]:
    """The ranks whose arrival mark names a process on this machine that has ended (or is a
    zombie, or stays stopped for ``STOPPED_FOR_S``, all watched at once: a stopped one costs
    the caller that long once). A rank whose process cannot be told is never one."""
    pids: dict[int, tuple[int, str]] = {}
    for rank, mark in marks.items():
        parts = (mark or "").split(" ")
        if len(parts) == 3 and parts[2] and parts[2] == _machine() and parts[0].isdigit():
            pids[rank] = (int(parts[0]), parts[1])
    gone: list[int] = []
    until = time.monotonic() + STOPPED_FOR_S
    while pids:
        for rank, (pid, started) in list(pids.items()):
            now = _start_time(pid)
            if now is _UNTOLD:
                pass  # exists, and nothing more can be told: never named
            elif now is None or now[1] != started or now[0] in ("Z", "X"):
                gone.append(rank)
            elif now[0] in ("T", "t") and time.monotonic() < until:
                continue  # stopped so far: watched again
            elif now[0] in ("T", "t"):
                gone.append(rank)  # stopped throughout (SIGSTOP, a debugger's breakpoint)
            del pids[rank]
        if pids:
            time.sleep(0.005)
    return sorted(gone)


def _process_gone(mark: str | None) -> bool:
    """Whether the process that left arrival ``mark`` runs on this machine and has ended (or
    is a zombie, or stays stopped): False whenever that cannot be told."""
    return bool(_processes_gone({0: mark}))


def part_tag(tag: str, k: int) -> str:
    """The tag of exchange ``k`` of the version attempt ``tag`` (0: the one every version has;
    a streamed version has one per part, ``cluster.streaming``)."""
    return f"{tag}-x1" if k == 0 else f"{tag}-x1.{k}"


class NoteLedger:
    """The version attempts (their tags, ``Cleared.tag``) under which this rank left marks in
    the group's store: an arrival mark for every exchange and joint commit it entered, and a
    note for one it failed in. A version's marks are read only while that version runs, so
    once a later version's joint commit has gathered every rank's row they can go, also those
    of attempts that failed before their joint commit: without that the store (torchrun's
    agent's) grows by a key per rank and exchange for as long as the job runs."""

    def __init__(self) -> None:
        self._tags: list[str] = []
        self._preflights = 0  # preflights entered since the newest tag began (or the group)
        self._fresh_group = True  # no preflight passed on the current group yet
        self._adopt = True  # a new role object takes its rank's record on its first preflight

    def begin(self, tag: str, group: dist.ProcessGroup | None, rank: int) -> None:
        """This rank starts the exchanges of the attempt ``tag`` (its preflight passed)."""
        if tag not in self._tags:
            self._tags.append(tag)
        self._preflights = 0
        self._fresh_group = False
        self._adopt = False
        self._record(group, rank)

    def preflight_tag(self, group: dist.ProcessGroup | None, rank: int) -> str | None:
        """The tag of the preflight this rank enters now, the same on every rank of the group:
        derived from the newest attempt every rank began (a preflight's verdict is the same
        on all) and the preflights entered since (every rank enters each, a refusal
        included). A role object made on a group already in use (a replacement sender in the
        same process) takes up where its rank's last one left off: the record in the group's
        store, ``deltasync/preflight/{rank}``. None on a group where no preflight passed yet
        (a new group starts on a fresh store prefix): that preflight's failure names no rank."""
        if self._adopt:
            self._adopt = False
            self._take_record(group, rank)
        if self._fresh_group or not self._tags:
            return None
        self._preflights += 1
        self._record(group, rank)
        return f"{self._tags[-1]}-pre{self._preflights}"

    def new_group(self, group: dist.ProcessGroup | None, rank: int) -> None:
        """This rank syncs over another group from now on (``group``), or its preflight
        failed (the ranks may then disagree on whether it passed): no preflight tag until one
        passes."""
        self._fresh_group = True
        self._adopt = False
        self._record(group, rank)

    def _record(self, group: dist.ProcessGroup | None, rank: int) -> None:
        """This rank's preflight state in the group's store, for the next object of its rank."""
        store = group_store(group)
        if store is None:
            return
        state = "-" if self._fresh_group or not self._tags else self._tags[-1]
        try:
            store.set(f"deltasync/preflight/{rank}", f"{state}|{self._preflights}")
        except Exception:
            return  # no record: a later object of this rank starts without a tag

    def _take_record(self, group: dist.ProcessGroup | None, rank: int) -> None:
        store = group_store(group)
        key = f"deltasync/preflight/{rank}"
        try:
            if store is None or not store.check([key]):
                return
            tag, _, count = store.get(key).decode("utf-8", "replace").rpartition("|")
            preflights = int(count)
        except Exception:
            return
        if tag and tag != "-":
            self._tags = [tag]
            self._preflights = preflights
            self._fresh_group = False

    def settle(self, group: dist.ProcessGroup | None, rank: int) -> None:
        """Every rank has finished the attempts before the newest one begun: delete this
        rank's marks under them. A store that cannot delete keeps them."""
        store = group_store(group)
        if store is None or not self._tags:
            return
        *done, current = self._tags
        try:
            for tag in done:
                _delete_marks(store, tag, rank)
        except Exception:
            return  # kept, and retried at the next settle
        self._tags = [current]


def _delete_marks(store: Any, tag: str, rank: int) -> None:
    """Delete ``rank``'s marks under the attempt ``tag``: its exchanges' (entered in order, so
    the first one it never entered ends them), the forwarding round's and the joint commit's."""
    k = 0
    while True:
        exchange = part_tag(tag, k)
        store.delete_key(f"deltasync/{exchange}/fail/{rank}")
        if not store.delete_key(f"deltasync/{exchange}/in/{rank}"):
            break
        k += 1
    for last in (f"{tag}-x2", f"{tag}-commit"):
        store.delete_key(f"deltasync/{last}/in/{rank}")
        store.delete_key(f"deltasync/{last}/fail/{rank}")
    k = 1  # the preflights entered after this attempt began, in order
    while store.delete_key(f"deltasync/{tag}-pre{k}/in/{rank}"):
        store.delete_key(f"deltasync/{tag}-pre{k}/fail/{rank}")
        k += 1


def close_pairs(group: dist.ProcessGroup | None) -> None:
    """Close this rank's gloo connections to every other rank of ``group`` (a receive from each
    abandoned at once, see :func:`abandon`). After a collective failed on a closed connection:
    in a ring all_gather only the dead rank's neighbours see it close, and the other ranks would
    wait there for their own timeout; closing passes the failure on around the ring."""
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        return
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group or dist.group.WORLD):
        if peer == me:
            continue
        try:
            work = dist.irecv(torch.empty(1, dtype=torch.uint8), src=peer, group=group)
        except RuntimeError:
            continue  # that connection is already gone
        abandon([work], backend=backend)


def blame(
    notes: FailureNotes | None,
    suspect: int | None,
    text: str,
    *,
    then: Callable[[], None] | None = None,
) -> str:
    """Post this rank's note and return the text naming the culprit to put in its error.
    ``then``: run once the note is posted, before the others' notes are read (e.g.
    :func:`close_pairs`: a note goes before any connection closes)."""
    if notes is None:
        return text
    notes.post(suspect, text)
    if then is not None:
        then()
    culprit, trail = notes.culprit(suspect)
    if culprit is None and not trail:
        return text
    head = (
        f"rank {culprit} died or stopped responding"
        if culprit is not None
        else "the failing rank could not be determined"
    )
    seen = f" ({'; '.join(trail)})" if trail else ""
    return f"{head}{seen}. This rank (rank {notes.rank}): {text}"


@contextmanager
def naming(what: str) -> Iterator[None]:
    """Put ``what`` (e.g. ``"version 7"``) in front of the message of a plain exchange error
    or timeout raised inside: the waits name the round and the peer, not what the caller was
    moving. Errors that already say it (``SyncAbortedError`` and the other subclasses) pass."""
    try:
        yield
    except (ExchangeError, ExchangeTimeoutError) as exc:
        if type(exc) not in (ExchangeError, ExchangeTimeoutError) or str(exc).startswith(what):
            raise
        raise type(exc)(f"{what}: {exc}") from exc
