"""Whether this process can write a CPU tensor's memory, asked without risking a crash.

A tensor over a read-only mapping (``torch.frombuffer`` of an ``mmap`` opened with
``ACCESS_READ``, a file mapped ``PROT_READ``) reads fine, and the first write into it (the C
scatter, torch's ``index_copy_`` alike) is a SIGSEGV that kills the whole process. Nothing in
a tensor's metadata says so, so every path that writes an engine's tensors asks
:func:`first_read_only` before its first write and refuses with a typed error instead.

The probe: the first and last byte of the tensor's extent are copied into a pipe and read back
into place. The kernel does both copies, so memory that cannot be read or written makes the
call fail with EFAULT instead of faulting the process, and the bytes written back are the
bytes that were there (the writing receiver is the only writer of these tensors). Cost: two
system calls for up to 512 tensors, plus ~2 us of Python per tensor probed; a tensor
torch allocated costs ~0.2 us (not probed, below).

Only storages torch did not allocate are probed: a storage torch can resize came from its own
CPU allocator (heap, or shared memory it mapped read-write), which is writable; the memory
torch was handed (``frombuffer``, ``from_file``, ``from_numpy``, ``torch.load(mmap=True)``) is
the kind that may be a read-only mapping. A tensor is one allocation, so its first and last
page tell whether its mapping is writable; a storage stitched from several mappings of
different protections (``MAP_FIXED`` over part of it, an ``mprotect`` of part of it), which no
allocator or loader makes, is not caught between its ends; nor is torch's own allocation
made read-only afterwards with ``mprotect``.

This module knows CPU memory and tensors; nothing about names, layouts or versions.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

# what a caller tells the user after naming the tensor
READ_ONLY_REMEDY = (
    "lies in read-only memory (a file or buffer mapped without write access, e.g. mmap "
    "ACCESS_READ or PROT_READ), and writing it would kill the process. Give the engine "
    "writable memory: a copy (tensor.clone()), or the file mapped copy-on-write (MAP_PRIVATE, "
    "mmap ACCESS_COPY, torch.load(mmap=True)) or read-write. Nothing was written"
)

_lock = threading.Lock()  # one probe at a time: the pipe carries one batch's bytes
_pipe: tuple[int, int, int] | None = None  # (pid, read end, write end)
_refused = False  # the system refused the probe's calls: logged once, checks skipped


def _batch_size() -> int:
    """Iovecs one readv/writev takes (IOV_MAX), kept under PIPE_BUF bytes so a batch is one
    atomic pipe write that never blocks."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        n = 16  # the POSIX minimum
    return max(1, min(n, 1024))


_BATCH = _batch_size()


def first_read_only(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor of ``named`` whose memory this process cannot write (a
    read-only mapping), or None. Tensors that are not dense CPU tensors torch was handed
    memory for are not probed (see the module doc); neither is anything when the system
    refuses the probe's pipe (logged once)."""
    names: list[str] = []
    cells: list[ctypes.Array] = []
    for name, t in named:
        ends = _probe_ends(t)
        if ends is not None:
            names += (name, name)
            cells += [(ctypes.c_char * 1).from_address(a) for a in ends]
    if not cells:
        return None
    bad = _first_unwritable(cells)
    return None if bad is None else names[bad]


def is_read_only(t: object) -> bool:
    """:func:`first_read_only` of one tensor, for the per-call checks of the write paths
    (~0.2 us for a tensor torch allocated)."""
    ends = _probe_ends(t)
    if ends is None:
        return False
    return _first_unwritable([(ctypes.c_char * 1).from_address(a) for a in ends]) is not None


def _probe_ends(t: object) -> tuple[int, int] | None:
    """The first and last byte address of ``t``'s extent, or None when it needs no probe."""
    # cheapest refusals first: this runs for every tensor of a shard before each pull
    if not isinstance(t, torch.Tensor) or not t.is_cpu:
        return None  # (a meta tensor is not on the CPU)
    try:
        if t.untyped_storage().resizable() or t.numel() == 0:
            return None
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None
    if t.is_contiguous():
        span = t.numel()
    else:  # the last element's offset + 1 (torch strides are never negative)
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    first = t.data_ptr()
    return first, first + span * t.element_size() - 1


def _first_unwritable(cells: list[ctypes.Array]) -> int | None:
    """The index of the first one-byte cell the kernel cannot read or write, or None."""
    global _refused
    with _lock:
        try:
            for lo in range(0, len(cells), _BATCH):
                bad = _first_fault(cells[lo : lo + _BATCH])
                if bad is not None:
                    return lo + bad
        except BaseException as exc:
            # The pipe may hold bytes not yet read back (an interrupt, KeyboardInterrupt
            # included, between the writev and the readv): the next probe would read them
            # into its own cells. Closed, it is opened empty again. The memory itself is as it
            # was: the readv writes back only the bytes it read from the same cells.
            _close_pipe()
            if not isinstance(exc, OSError):
                raise
            # refused (seccomp's EPERM/ENOSYS): no answer, not an error
            if not _refused:
                _refused = True
                log.warning(
                    "deltasync cannot probe whether tensors are writable (%s); a tensor in "
                    "read-only memory will not be refused before it is written",
                    exc,
                )
    return None


def _first_fault(batch: list[ctypes.Array]) -> int | None:
    """The index of the first cell of ``batch`` that faults, or None. The kernel's EFAULT for
    a call over many cells does not say which one (the pipe may answer it for a buffer copied
    in part), so a batch that faults is probed again cell by cell: the refusal path only."""
    if _round_trip(batch):
        return None
    for k, cell in enumerate(batch):
        if not _round_trip([cell]):
            return k
    return None  # no cell faults alone: the memory changed meanwhile


def _round_trip(cells: list[ctypes.Array]) -> bool:
    """Copy ``cells`` into the probe pipe and back into place: False when the kernel answered
    EFAULT (a cell it cannot read or write; the pipe, which may hold part of the bytes, is
    closed). Raises OSError for any other refusal."""
    ends = _open_pipe()
    if ends is None:
        return True  # no pipe: no answer (logged once)
    r, w = ends
    try:
        sent = os.writev(w, cells)  # reads each cell
        done = 0
        while sent == len(cells) and done < len(cells):
            done += os.readv(r, cells[done:])  # writes each cell back
    except OSError as exc:
        if exc.errno != errno.EFAULT:
            raise
        sent = -1
    if sent != len(cells):  # a fault (a batch is otherwise one atomic pipe write)
        _close_pipe()
        return False
    return True


def _open_pipe() -> tuple[int, int] | None:
    """This process's probe pipe (a child of a fork opens its own: the parent's ends are
    shared with the parent), or None when the system refuses one (logged once)."""
    global _pipe, _refused
    if _pipe is not None and _pipe[0] != os.getpid():
        _close_pipe()
    if _pipe is None:
        try:
            r, w = os.pipe()
        except OSError as exc:
            if not _refused:
                _refused = True
                log.warning(
                    "deltasync cannot open a pipe to probe whether tensors are writable (%s); "
                    "a tensor in read-only memory will not be refused before it is written",
                    exc,
                )
            return None
        _pipe = (os.getpid(), r, w)
    return _pipe[1], _pipe[2]


def _after_fork_in_child() -> None:
    """A fork while another thread was probing leaves the child that thread's ``_lock``
    held forever (and the parent's pipe): the child starts with a free lock, and its first
    probe opens its own pipe."""
    global _lock
    _lock = threading.Lock()
    _close_pipe()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_pipe() -> None:
    global _pipe
    if _pipe is not None:
        for fd in _pipe[1:]:
            try:
                os.close(fd)
            except OSError:
                pass
        _pipe = None
