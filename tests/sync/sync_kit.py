"""Test kit for tests/sync: receivers, fakes and children, over the shared kit (``tests/kit``).

- The tiny Qwen3 (``TINY``, ``tiny_spec``, ``layouts``), the trainers (``TinyTrainer``,
  ``HFTrainer``), the oracle ``expected_shards`` and the bitwise helpers come from ``kit``.
- ``GateStore`` / ``FaultyStore``: fakes over the Store protocol that stop at a chosen key
  (so a child can be killed exactly there) or inject failures.
- ``fork_child``: run a function in a forked process (torch is already imported, so a child
  starts in milliseconds instead of the ~5-10 s a fresh interpreter takes on this machine).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
import traceback
from collections.abc import Callable

import torch
from kit import (  # noqa: F401 - the shared kit, re-exported for the tests of this folder
    TINY_QWEN3,
    HFTrainer,
    TinyTrainer,
    assert_same_bits,
    bits,
    expected_shards,
    rconfig,
    same_bits,
    tiny_layouts,
    tiny_spec,
    zero_tensors,
)

from deltasync.errors import DeltaSyncError, StoreError
from deltasync.store import LocalStore

TINY = TINY_QWEN3
layouts = tiny_layouts
KEY = b"k" * 32  # HMAC key of the signed tests


def scratch_store(path) -> LocalStore:
    """A LocalStore without fsyncs (~8 ms each here): these tests kill processes, not power;
    the page cache survives SIGKILL. The end-to-end test keeps the durable default."""
    return LocalStore(path, durable=False)


# --- fakes over the Store protocol ---------------------------------------------------------


class _Wrapper:
    def __init__(self, inner) -> None:
        self.inner = inner

    def get_range(self, key, start, length):
        return self.inner.get_range(key, start, length)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        return self.inner.delete(key)

    def size(self, key):
        return self.inner.size(key)


class GateStore(_Wrapper):
    """Calls ``gate(op, key)`` before every write; ``put_stream`` also after its first chunk
    (op "mid-stream"), so a test can stop a writer in the middle of a blob. While
    ``reads_fail`` is set, ``get`` and ``list`` raise StoreError (an outage)."""

    def __init__(self, inner, gate: Callable[[str, str], None]) -> None:
        super().__init__(inner)
        self.gate = gate
        self.reads_fail = False

    def _read(self, what: str) -> None:
        if self.reads_fail:
            raise StoreError(f"injected: reading {what!r} failed")

    def get(self, key, **kwargs):  # max_bytes=...
        self._read(key)
        return self.inner.get(key, **kwargs)

    def list(self, prefix=""):
        self._read(prefix)
        return self.inner.list(prefix)

    def put(self, key, data):
        self.gate("put", key)
        return self.inner.put(key, data)

    def put_if_absent(self, key, data):
        self.gate("put_if_absent", key)
        return self.inner.put_if_absent(key, data)

    def put_stream(self, key, chunks):
        self.gate("put_stream", key)

        def gated():
            for i, c in enumerate(chunks):
                yield c
                if i == 0:
                    self.gate("mid-stream", key)

        return self.inner.put_stream(key, gated())


class FaultyStore(_Wrapper):
    """Injects failures with probability ``p`` per call, chosen by a seeded RNG:
    a write that fails before landing, a write that lands but reports failure (lost reply), a
    read that fails, and a blob read that comes back corrupted or truncated in transit."""

    def __init__(self, inner, *, p: float, seed: int) -> None:
        super().__init__(inner)
        self.p = p
        self.rng = random.Random(seed)
        self.enabled = True
        self.injected: dict[str, int] = {}

    def _roll(self, kind: str) -> bool:
        if self.enabled and self.rng.random() < self.p:
            self.injected[kind] = self.injected.get(kind, 0) + 1
            return True
        return False

    def get(self, key, **kwargs):  # max_bytes=...
        if self._roll("get-fails"):
            raise StoreError(f"injected: read of {key!r} failed")
        data = self.inner.get(key, **kwargs)
        if key.endswith(".blob") and len(data) > 8 and self._roll("blob-damaged"):
            if self.rng.random() < 0.5:
                return data[: self.rng.randrange(len(data))]
            pos = self.rng.randrange(len(data))
            return data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :]
        return data

    def _write(self, op, key, data):
        if self._roll("write-fails"):
            raise StoreError(f"injected: {op} of {key!r} failed before landing")
        getattr(self.inner, op)(key, data)
        if self._roll("lost-reply"):
            raise StoreError(f"injected: {op} of {key!r} landed but the reply was lost")

    def put(self, key, data):
        self._write("put", key, data)

    def put_if_absent(self, key, data):
        self._write("put_if_absent", key, data)

    def put_stream(self, key, chunks):
        data = b"".join(bytes(c) for c in chunks)
        self._write("put", key, data)
        return len(data)


# --- children -------------------------------------------------------------------------------


def _child_main(fn, args) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        fn(*args)
    except BaseException:  # report and exit non-zero: the parent asserts the exit code
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def fork_child(fn: Callable, *args) -> mp.Process:
    """Start ``fn(*args)`` in a forked process (exit code 0 iff it returned)."""
    proc = mp.get_context("fork").Process(target=_child_main, args=(fn, args), daemon=True)
    proc.start()
    return proc


def every_rank(call: Callable, world: int = 2) -> list:
    """``call(rank)`` on every rank at once (threads); each result or DeltaSyncError."""
    out: list = [None] * world

    def run(rank):
        try:
            out[rank] = call(rank)
        except DeltaSyncError as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def kill(proc: mp.Process) -> None:
    proc.kill()  # SIGKILL
    proc.join(10)
    assert proc.exitcode == -9, f"child exit code {proc.exitcode}, expected SIGKILL"


class RankTracker:
    """One FSDP writer's view of a whole-model tracker: the changed indices in its dim-0 rows
    (``fsdp_dim0_rows`` of ``rank`` in ``world``), local to them."""

    def __init__(self, inner, params, rank: int, world: int) -> None:
        self.inner, self.params, self.rank, self.world = inner, params, rank, world

    def iter_changes(self):
        from deltasync.layout import fsdp_dim0_rows

        for name, idx, vals in self.inner.iter_changes():
            p = self.params[name]
            start, stop = fsdp_dim0_rows(p.shape[0], self.rank, self.world)
            row = p[0].numel() if p.dim() > 1 else 1
            mine = (idx >= start * row) & (idx < stop * row)
            if bool(mine.any()):
                yield name, idx[mine] - start * row, vals[mine]

    def clear(self) -> None:
        self.inner.clear()
