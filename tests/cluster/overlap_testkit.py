"""Worker function for the overlapped in-cluster sender's multi-process test (spawned processes).

One gloo group: rank 0 trains the tiny Qwen3 (transformers, AdamW, AdamWTracker) and sends with
``ClusterSender(overlap=True, optimizer=opt)``; ranks 1 and 2 hold the vLLM TP=2 shards and sync
as usual. State digests are on (the default). Versions, in order:

- 0: the anchor; 1-3: deltas, the receivers entering each sync 0.3 s late (so the exchange
  cannot have finished when the trainer's ``sync`` returns);
- 4: the background's read of the params is slowed by 1.5 s and the trainer steps right away: the
  optimizer's pre-step hook must hold the step until the background no longer reads them;
- 5: detection fails after 3 parameters, when the background has already taken the first
  (it routes each parameter as it is captured): the writer's ``sync`` returns, every rank's
  version 5 fails in the preflight with the writer's error (the writer learns it at its next
  call), nothing is applied, and 5 sent again (the tracker kept its changes) is exact;
- 6: rank 2 corrupts its payload, the joint commit fails in the background; the trainer learns
  it at its next ``sync`` (for 7), then calls ``sync(7)`` again, whose carry must repair rank 2
  (it never applied 6, and the tracker was cleared when 6 was captured);
With ``Setup.detect_after_return`` the tracker holds the optimizer's steps for the sender
(``hold_steps``), so each delta's detection goes on after ``sync`` returns.

- 8: an anchor in 32-byte chunks, rank 2 SIGKILLed 0.25 s into it; the trainer learns it at its
  next call (it pickles what it saw first, since it cannot return it). With ``part_bytes``
  below ``STREAMED_BELOW`` (deltas in many parts) version 8 is a delta instead, so the death
  lands in the middle of its parts.

The writer's tracker counts which stream the sender asks it for (positions only, never values),
and after each capture the writer records the carry's elements and bytes (about one byte per
changed element).

After every committed version the trainer broadcasts its canonical BF16 bits (the oracle,
independent of the product's digests; over the group only once its version has settled) and
each receiver compares its shard on int16 views.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from kit import HFTrainer

from deltasync.cluster import ClusterReceiver, ClusterSender
from deltasync.errors import DeltaSyncError, ExchangeError
from deltasync.exchange import init_from_env
from deltasync.exchange.notes import group_store
from deltasync.layout import TrainerLayout
from deltasync.trainer import AdamWTracker
from deltasync.trainer.positions import Positions

from cluster_testkit import (
    Setup,
    broadcast_truth,
    corrupting_receiver,
    expected_shard,
    mismatched,
    receiver_layout,
    spec,
)

LATE_S = 0.3  # receivers' late arrival in versions 1-3
STREAMED_BELOW = 64 << 10  # part_bytes under which a tiny delta goes in many parts
SLOW_READ_S = 1.5  # the background's slowed read of the params in version 4
DEATH_AFTER_S = 0.25


def _failure(exc: BaseException, start: float) -> dict:
    return {
        "error": type(exc).__name__,
        "message": str(exc),
        "version": getattr(exc, "version", None),
        "anchor_required": getattr(exc, "anchor_required", None),
        "group_broken": getattr(exc, "group_broken", None),
        "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
        "exchange_error": isinstance(exc, ExchangeError),
        "elapsed_s": time.monotonic() - start,
    }


def _outcome(call) -> dict:
    """``{"error": None}`` if ``call()`` returns, else :func:`_failure` of the DeltaSyncError it
    raised (timed from the call)."""
    start = time.monotonic()
    try:
        call()
        return {"error": None}
    except DeltaSyncError as exc:
        return _failure(exc, start)


class CountingTracker:
    """A real AdamWTracker that counts which of its streams were asked for."""

    def __init__(self, inner: AdamWTracker) -> None:
        self.inner = inner
        self.calls = {"iter_changes": 0, "iter_changed": 0, "iter_positions": 0}
        self.fail_after: int | None = None  # the next positions stream raises after as many

    def iter_changes(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        self.calls["iter_changes"] += 1
        return self.inner.iter_changes()

    def iter_changed(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.calls["iter_changed"] += 1
        return self.inner.iter_changed()

    def iter_positions(self) -> Iterator[tuple[str, Positions]]:
        self.calls["iter_positions"] += 1
        fail_after, self.fail_after = self.fail_after, None
        for k, item in enumerate(self.inner.iter_positions()):
            if k == fail_after:
                raise RuntimeError("detection failed on purpose midway")
            yield item

    def clear(self) -> None:
        self.inner.clear()

    def mark_changed(self, *names: str) -> None:
        self.inner.mark_changed(*names)


class HoldingTracker(CountingTracker):
    """A CountingTracker that holds the optimizer's steps for the sender (``hold_steps``):
    its detection goes on after ``sync`` returns. With a ``gate``, that detection starts only
    once the gate is set (so a test sees ``sync`` return first, however fast detection is)."""

    gate: threading.Event | None = None

    def hold_steps(self, optimizer, wait):
        return self.inner.hold_steps(optimizer, wait)

    def iter_positions(self) -> Iterator[tuple[str, Positions]]:
        gate, self.gate = self.gate, None
        if gate is not None:
            assert gate.wait(30), "the gate was never opened"
        yield from super().iter_positions()


class _Writer:
    def __init__(self, setup: Setup) -> None:
        self.hf = HFTrainer(lr=setup.lr, batch=(4, 16), data_seed=1234)
        self.layout = TrainerLayout(spec())
        kind = HoldingTracker if setup.detect_after_return else CountingTracker
        self.tracker = kind(AdamWTracker(self.hf.opt, self.hf.model.named_parameters()))
        self.slow_next_read = False
        self.step_saw_released: list[bool] = []

    def params(self) -> dict[str, torch.Tensor]:
        """The sender's params callable: the caller's capture takes their names, the
        background reads them (the slowed read is the background's)."""
        if self.slow_next_read and threading.current_thread() is not threading.main_thread():
            self.slow_next_read = False
            time.sleep(SLOW_READ_S)
        return self.hf.params

    def bits(self) -> torch.Tensor:
        bf16 = {n: p.detach().to(torch.bfloat16) for n, p in self.hf.params.items()}
        canon = self.layout.to_canonical(bf16)
        return torch.cat([canon[n].reshape(-1).view(torch.int16) for n in sorted(canon)])

    def sender(self, setup: Setup, version: int | None) -> ClusterSender:
        sender = ClusterSender(
            self.tracker,
            self.params,
            plan=setup.plan(),
            trainer_layout=self.layout,
            receiver_layout=receiver_layout(setup),
            version=version,
            config=setup.config(),
            overlap=True,
            optimizer=self.hf.opt,
            inline_below=setup.inline_below[0] if setup.inline_below else 0,
        )

        def record(*_: object) -> None:  # runs after the sender's own pre-step hook
            pending = sender.in_flight
            self.step_saw_released.append(pending is None or pending.released())

        self.hf.opt.register_step_pre_hook(record)
        return sender


def _run_writer(setup: Setup, notes: str) -> dict:
    del notes
    w = _Writer(setup)
    sender = w.sender(setup, None)
    out: dict = {"versions": {}}

    def settle(version: int, bits: torch.Tensor | None = None) -> None:
        report = sender.wait()
        assert report is not None and report.version == version
        out["versions"][version] = {
            "stall_s": report.stall_s,
            "overlapped": report.overlapped,
            "total_s": report.total_s,
            "elements": report.elements,
            "version_after": sender.version,
            "exchanges": report.exchanges,
        }
        broadcast_truth(w.bits() if bits is None else bits)

    pending = sender.sync(0, anchor=True)
    settle(0)
    for v in (1, 2, 3):
        w.hf.step()
        gate = threading.Event()
        if isinstance(w.tracker, HoldingTracker):
            w.tracker.gate = gate
        pending = sender.sync(v)
        out.setdefault("returned_before_done", []).append(not pending.done())
        out.setdefault("returned_before_detected", []).append(not pending.detected())
        gate.set()
        out.setdefault("captured_s", []).append(pending.captured_s)
        assert pending.wait_detected(30)  # the carry is the capture from here on
        out.setdefault("carry", []).append((sender.pending_elements, sender.carry_bytes))
        settle(v)
    out["keys_after_3"] = group_store(None).num_keys()  # every rank has committed 3 by now
    dist.barrier()  # counted before a receiver's next preflight marks its arrival

    # 4: the background reads the params slowly; the next optimizer step must wait for it.
    w.hf.step()
    w.slow_next_read = True
    pending = sender.sync(4)
    # another group while 4 is in flight on this one: refused, the group kept
    out["use_group_in_flight"] = _outcome(lambda: sender.use_group(None))
    bits4 = w.bits()  # reading alongside the background is fine; the step would change them
    w.step_saw_released.clear()
    w.hf.step()  # its pre-step hook is the barrier
    out["barrier"] = {
        "step_saw_released": list(w.step_saw_released),
        "barrier_wait_s": sender.barrier_wait_s,
    }
    settle(4, bits4)
    # 5: detection fails midway while the background already routes what it was handed.
    w.tracker.fail_after = 3
    pending = sender.sync(5)  # the step above is version 5's
    out["detection_failed"] = _outcome(sender.wait)
    out["detection_failed"]["version_after"] = sender.version
    pending = sender.sync(5)  # the tracker kept 5's changes
    settle(5)

    # 6: rank 2 corrupts its payload; the joint commit fails in the background.
    w.hf.step()
    pending = sender.sync(6)
    assert pending.wait_detected(30)
    out["pending_after_6"] = sender.pending_elements
    out["carry_bytes_after_6"] = sender.carry_bytes
    w.hf.step()
    out["after_failure"] = _outcome(lambda: sender.sync(7))
    out["after_failure"]["version_after"] = sender.version
    pending = sender.sync(7)  # the retry: 7's changes and 6's carry
    settle(7)
    out["keys_after_7"] = group_store(None).num_keys()
    dist.barrier()

    # 8: an anchor (or, streamed, a delta in parts) in 32-byte chunks (thousands of
    # messages); rank 2 dies inside it.
    sender.close()
    slow = replace(setup, max_chunk_bytes=32)
    sender = w.sender(slow, sender.version)
    dist.barrier()
    w.hf.step()
    pending = sender.sync(8, anchor=setup.part_bytes >= STREAMED_BELOW)
    out["kill_returned_before_done"] = not pending.done()
    out["after_kill"] = _outcome(lambda: sender.sync(9))
    out["after_kill"]["version_after"] = sender.version
    out["pending_after_kill"] = sender.pending_elements
    # the group broke and still holds that exchange's posted operations: refused at once
    out["same_group"] = _outcome(lambda: sender.sync(9))
    out["tracker_calls"] = dict(w.tracker.calls)
    return out


def _run_receiver(rank: int, setup: Setup, notes: str) -> dict:
    plan = setup.plan()
    role = plan.receiver(rank)
    receiver = corrupting_receiver(setup, rank)
    out: dict = {"versions": {}, "bad": []}

    def check() -> None:
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        bad = mismatched(receiver.tensors, truth)
        out["versions"][receiver.version] = not bad
        if bad:
            out["bad"].append((receiver.version, bad[:3]))

    for v in range(8):
        if v in (1, 2, 3):
            time.sleep(LATE_S)
        if v == 5:  # the writer's detection fails: nothing moves, then 5 again
            try:
                receiver.sync()
                out["detection_failed"] = {"error": None}
            except DeltaSyncError as exc:
                out["detection_failed"] = {"error": type(exc).__name__, "message": str(exc)}
            out["detection_failed"]["version_after"] = receiver.version
        if v == 6:
            receiver.corrupt_next = rank == 2
            try:
                receiver.sync()
                out["corrupted"] = {"error": None}
            except DeltaSyncError as exc:
                out["corrupted"] = {"error": type(exc).__name__}
            out["corrupted"]["version_after"] = receiver.version
            continue  # nothing committed: the trainer broadcasts nothing
        receiver.sync()
        check()
        if v in (3, 7):
            dist.barrier()  # while the writer counts the group store's keys

    slow = replace(setup, max_chunk_bytes=32)
    receiver = ClusterReceiver(
        receiver.tensors,
        plan=plan,
        layout=receiver_layout(slow),
        version=receiver.version,
        config=slow.config(),
    )
    if rank == 2:
        with open(notes, "wb") as f:
            pickle.dump(out, f)
    dist.barrier()
    if rank == 2:
        threading.Timer(DEATH_AFTER_S, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    out["killed"] = _outcome(receiver.sync)
    out["same_group"] = _outcome(receiver.sync)  # refused at once, as on the writer
    return out


def run_overlap(rank: int, setup: Setup, notes: str) -> dict:
    """1 overlapped writer (rank 0) + vLLM TP=2 receivers (ranks 1, 2); see the module
    docstring for the versions."""
    torch.set_num_threads(1)  # several processes share two busy cores
    init_from_env(timeout_s=60)
    if rank == 0:
        return {"rank": 0, **_run_writer(setup, notes)}
    return {"rank": rank, **_run_receiver(rank, setup, notes)}


def _anchored(setup: Setup, writer: _Writer) -> ClusterSender:
    """``writer``'s sender with version 0 (the anchor) settled and checked, and one step taken."""
    sender = writer.sender(setup, None)
    sender.sync(0, anchor=True)
    sender.wait()
    broadcast_truth(writer.bits())
    writer.hf.step()
    return sender


def _retried(writer: _Writer, sender: ClusterSender, out: dict) -> dict:
    """After version 1 failed: one more step, then version 1 again (both steps' changes)."""
    out["failed"]["version_after"] = sender.version
    writer.hf.step()
    sender.sync(1)
    report = sender.wait()
    out["retry"] = {"version": report.version, "elements": report.elements}
    out["retry"]["anchor"] = report.anchor
    broadcast_truth(writer.bits())
    sender.close()
    return out


def _run_edit_writer(setup: Setup) -> dict:
    w = _Writer(setup)
    sender = _anchored(setup, w)
    victim = list(w.hf.params)[-1]
    if isinstance(w.tracker, HoldingTracker):
        w.tracker.gate = gate = threading.Event()  # detection starts after the write
    else:
        w.slow_next_read = True  # detected already: the background reads after the write
    sender.sync(1)
    with torch.no_grad():  # against the contract: the version still reads the params
        w.hf.params[victim].mul_(1.5)
    if isinstance(w.tracker, HoldingTracker):
        gate.set()
    out = {"failed": _outcome(sender.wait), "victim": victim}
    out["marked"] = list(w.tracker.inner.out_of_band)
    return _retried(w, sender, out)


def _run_retry_receiver(rank: int, setup: Setup) -> dict:
    """The anchor, a version 1 that fails on every rank, then version 1 again; each committed
    version checked against the trainer's broadcast bits."""
    receiver = corrupting_receiver(setup, rank)
    role = setup.plan().receiver(rank)
    out: dict = {"versions": {}}

    def check() -> None:
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        out["versions"][receiver.version] = mismatched(receiver.tensors, truth)

    receiver.sync()
    check()
    out["failed"] = _outcome(receiver.sync)
    out["failed"]["version_after"] = receiver.version
    receiver.sync()
    check()
    return out


def run_edit(rank: int, setup: Setup) -> dict:
    """1 overlapped writer (rank 0) + vLLM TP=2 receivers: version 1's params are written in
    place after ``sync`` returned, before the version read them (detection held at a gate
    when the tracker holds the steps, else the background's read slowed); then 1 again."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    if rank == 0:
        return {"rank": 0, **_run_edit_writer(setup)}
    return {"rank": rank, **_run_retry_receiver(rank, setup)}


class _CtrlCAfterClear(CountingTracker):
    """A CountingTracker whose next ``clear()`` is followed by a Ctrl-C, once armed."""

    armed = False

    def clear(self) -> None:
        super().clear()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def _run_interrupted_writer(setup: Setup, anchor: bool) -> dict:
    w = _Writer(setup)
    w.tracker = tracker = _CtrlCAfterClear(w.tracker.inner)
    sender = _anchored(setup, w)
    tracker.armed = True
    out: dict = {"interrupted": False}
    try:
        sender.sync(1, anchor=anchor)
    except KeyboardInterrupt:
        out["interrupted"] = True
    out["failed"] = _outcome(sender.wait)  # returns: nothing waits for the capture forever
    return _retried(w, sender, out)


def _run_anchor_receiver(rank: int, setup: Setup) -> dict:
    """The anchor, then the next version (an interrupted anchor attempt sent nothing)."""
    receiver = corrupting_receiver(setup, rank)
    role = setup.plan().receiver(rank)
    out: dict = {"versions": {}}
    for _ in range(2):
        receiver.sync()
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        out["versions"][receiver.version] = mismatched(receiver.tensors, truth)
    return out


def run_interrupted(rank: int, setup: Setup, anchor: bool) -> dict:
    """1 overlapped writer (rank 0) whose ``sync(1)`` is interrupted right after the tracker's
    ``clear()``, + vLLM TP=2 receivers (ranks 1, 2). A delta's version 1 fails on every rank,
    and sent again it holds both steps' changes, bit-exact; an anchor's attempt sends nothing,
    and the retry (asked as a delta) goes out as an anchor."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    if rank == 0:
        return {"rank": 0, **_run_interrupted_writer(setup, anchor)}
    if anchor:
        return {"rank": rank, **_run_anchor_receiver(rank, setup)}
    return {"rank": rank, **_run_retry_receiver(rank, setup)}


def _interrupted_after(setup: Setup, step: str) -> tuple[_Writer, ClusterSender, dict]:
    """``setup``'s writer with versions 0 and 1 committed, whose inline version 2 is
    interrupted (a Ctrl-C) right after ``cluster_sender``'s ``step`` (``preflight``,
    ``joint_commit``) returned on every rank; ``{"interrupted", "failed"}``."""
    import deltasync.cluster.cluster_sender as cluster_sender

    w = _Writer(setup)
    sender = _anchored(setup, w)
    sender.sync(1)  # in the background; the next delta, below inline_below, runs inline
    sender.wait()
    w.hf.step()
    real = getattr(cluster_sender, step)

    def done_then_interrupted(*args, **kwargs):
        setattr(cluster_sender, step, real)
        real(*args, **kwargs)  # every rank has gone through it
        raise KeyboardInterrupt  # before this writer goes on

    setattr(cluster_sender, step, done_then_interrupted)
    out: dict = {"interrupted": False}
    try:
        sender.sync(2)
    except KeyboardInterrupt:
        out["interrupted"] = True
    out["failed"] = _outcome(sender.wait)
    return w, sender, out


def _run_preflight_interrupted_writer(setup: Setup) -> dict:
    _w, sender, out = _interrupted_after(setup, "preflight")
    out["after"] = _outcome(sender.sync)  # the receivers are in round 1: never a preflight
    sender.close()
    return out


def _run_preflight_interrupted_receiver(rank: int, setup: Setup) -> dict:
    receiver = corrupting_receiver(setup, rank)
    receiver.sync()
    broadcast_truth(None)
    receiver.sync()
    out = {"stalled": _outcome(receiver.sync)}  # round 1 of 2: the writer never comes
    out["after"] = _outcome(receiver.sync)
    out["version"] = receiver.version
    return out


def run_preflight_interrupted(rank: int, setup: Setup) -> dict:
    """1 overlapped writer (rank 0) interrupted right after version 2's preflight (inline, on
    its thread), + vLLM TP=2 receivers gone on to the exchange: the writer's group is broken,
    and no rank posts a collective the others do not (a preflight meeting round 1 aborted a
    receiver's process in gloo)."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    if rank == 0:
        return {"rank": 0, **_run_preflight_interrupted_writer(setup)}
    return {"rank": rank, **_run_preflight_interrupted_receiver(rank, setup)}


def _run_commit_interrupted_writer(setup: Setup) -> dict:
    w, sender, out = _interrupted_after(setup, "joint_commit")
    out["attempts"] = []
    sender.use_group(dist.new_group(list(range(setup.world_size()))))  # the error's remedy
    anchor = False
    for _ in range(2):  # the errors' remedies: sync again, then with anchor=True if asked
        try:
            sender.sync(anchor=anchor)
            report = sender.wait()
            out["attempts"].append(("ok", report.version))
        except DeltaSyncError as exc:
            anchor = any(getattr(e, "anchor_required", False) for e in (exc, exc.__cause__))
            out["attempts"].append(("failed", f"{type(exc).__name__}: {exc}"))
    out["version"] = sender.version
    broadcast_truth(w.bits())
    sender.close()
    return out


def _run_commit_interrupted_receiver(rank: int, setup: Setup) -> dict:
    receiver = corrupting_receiver(setup, rank)
    role = setup.plan().receiver(rank)
    receiver.sync()
    out: dict = {"versions": [receiver.version]}
    out["mismatched"] = mismatched(
        receiver.tensors, expected_shard(broadcast_truth(None), setup, role.shard)
    )
    for _ in range(2):  # 1, 2 (the writer interrupted)
        receiver.sync()
        out["versions"].append(receiver.version)
    receiver.use_group(dist.new_group(list(range(setup.world_size()))))
    for _ in range(2):  # a refused delta, the anchor
        outcome = _outcome(receiver.sync)
        out["versions"].append(receiver.version if outcome["error"] is None else None)
    truth = expected_shard(broadcast_truth(None), setup, role.shard)
    out["mismatched"] += mismatched(receiver.tensors, truth)
    return out


def run_commit_interrupted(rank: int, setup: Setup) -> dict:
    """1 overlapped writer (rank 0) interrupted in the joint commit of version 2 (inline, on
    its thread) once every rank had the verdict, + vLLM TP=2 receivers: the receivers hold 2;
    the writer's group is broken, and on a new one it never sends the number 2 again and,
    following its errors' remedies, commits again, every receiver exact."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    if rank == 0:
        return {"rank": 0, **_run_commit_interrupted_writer(setup)}
    return {"rank": rank, **_run_commit_interrupted_receiver(rank, setup)}
