"""Worker functions for the in-cluster sync's multi-process tests (run in spawned processes),
and the one-process roles the single-process tests exchange payloads between by hand.

Every scenario runs a real trainer (a config-built transformers ``Qwen3ForCausalLM`` stepped by
``torch.optim.AdamW`` on random tokens) on the writer ranks and live vLLM-layout shards on the
receiver ranks, all in one gloo group started by ``deltasync.exchange.spawn``. Receivers start
empty (version None) and get an anchor first.

The check after a version is independent of the product's own digests: the trainer broadcasts
its whole canonical BF16 state (as int16 bits) over the group, every receiver splits it with
the layout and compares each local tensor with ``torch.equal`` on int16 views.

Workers return plain Python summaries that the test process asserts on.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from kit import TINY_QWEN3, HFTrainer

from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender, RolePlan
from deltasync.errors import DeltaSyncError, ExchangeError, PeerFailedError
from deltasync.exchange import ExchangeConfig, init_from_env
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout, fsdp_dim0_rows
from deltasync.layout.digest import state_digest

TINY = TINY_QWEN3


@dataclass(frozen=True, kw_only=True)
class Setup:
    num_writers: int = 1
    tp: int = 2
    replicas: int = 1
    dp_mode: str = "direct"
    versions: int = 10  # deltas after the anchor
    lr: float = 1e-3
    tracker: str = "adamw"  # "adamw", or "snapshot" over each writer's FSDP dim-0 slices
    digest_every: int = 0
    timeout_s: float = 20.0
    forward_from: int | None = None  # switch to dp_mode "forward" from this version on
    max_chunk_bytes: int = 64 << 20
    overlap: bool = False  # ClusterSender(overlap=True); each version settled before the check
    part_bytes: int = ClusterConfig.part_bytes  # an overlapped delta streams in parts of this
    detect_after_return: bool = False  # overlap scenario: the tracker holds the steps
    # per writer index: ClusterSender.inline_below (none given: 0, every overlapped version in
    # the background, however small this tiny model's deltas are)
    inline_below: tuple[int, ...] = ()
    # per writer index: ClusterSender.expect_small (none given: False)
    expect_small: tuple[bool, ...] = ()

    def world_size(self) -> int:
        return self.num_writers + self.tp * self.replicas

    def plan(self, version: int = 0) -> RolePlan:
        forward = self.forward_from is not None and version >= self.forward_from
        return RolePlan.contiguous(
            num_writers=self.num_writers,
            shards=[f"tp{r}" for r in range(self.tp)],
            replicas=self.replicas,
            dp_mode="forward" if forward else self.dp_mode,
        )

    def config(self) -> ClusterConfig:
        ex = ExchangeConfig(timeout_s=self.timeout_s, max_chunk_bytes=self.max_chunk_bytes)
        return ClusterConfig(
            exchange=ex,
            wait_for_version_s=max(self.timeout_s, 60.0),
            commit_timeout_s=self.timeout_s,
            digest_every=self.digest_every,
            part_bytes=self.part_bytes,
        )


def spec() -> ModelSpec:
    return ModelSpec.from_hf_config(TINY)


# ---------------------------------------------------------------------- trainer side


class Trainer:
    """The tiny Qwen3 and its AdamW; identical in every writer process (same seed, same data)."""

    def __init__(self, setup: Setup, rank: int) -> None:
        self.setup = setup
        self.hf = HFTrainer(lr=setup.lr, batch=(4, 16), data_seed=1234)
        self.model, self.named, self.opt = self.hf.model, self.hf.params, self.hf.opt
        self.layout = TrainerLayout(spec())
        writer = setup.plan().writer(rank)
        self.index = writer.index
        if setup.tracker == "adamw":
            from deltasync.trainer import AdamWTracker

            assert writer.count == 1, "the AdamW tracker here watches full params"
            self.params = self.named
            self.tracker = AdamWTracker(self.opt, self.model.named_parameters())
        else:
            from deltasync.trainer import SnapshotTracker

            # This writer's FSDP dim-0 shard of every param: views into the trained tensors.
            self.params = {}
            for name, p in self.named.items():
                start, stop = fsdp_dim0_rows(p.shape[0], writer.index, writer.count)
                self.params[name] = p.detach()[start:stop]
            self.tracker = SnapshotTracker(self.params.items())

    def step(self) -> None:
        self.hf.step()

    def canonical_bits(self) -> torch.Tensor:
        """The whole canonical BF16 state, flattened, as int16 bits (for the broadcast check)."""
        bf16 = {n: p.detach().to(torch.bfloat16) for n, p in self.named.items()}
        canon = self.layout.to_canonical(bf16)
        return torch.cat([canon[n].reshape(-1).view(torch.int16) for n in sorted(canon)])

    def sender(
        self, setup: Setup, *, version: int | None = None, plan_at: int = 0
    ) -> ClusterSender:
        return ClusterSender(
            self.tracker,
            self.params,
            plan=setup.plan(plan_at),
            trainer_layout=self.layout,
            receiver_layout=receiver_layout(setup),
            version=version,
            config=setup.config(),
            full_state=self.named,
            overlap=setup.overlap,
            optimizer=self.opt if setup.overlap else None,
            inline_below=setup.inline_below[self.index] if setup.inline_below else 0,
            expect_small=setup.expect_small[self.index] if setup.expect_small else False,
        )


def receiver_layout(setup: Setup) -> ReceiverLayout:
    return ReceiverLayout.build(spec(), "vllm", tp=setup.tp)


def broadcast_truth(bits: torch.Tensor | None) -> torch.Tensor:
    """Rank 0 (a writer) sends its canonical bits to everyone."""
    n = sum(int(torch.Size(s).numel()) for s in spec().canonical_shapes().values())
    buf = bits if bits is not None else torch.empty(n, dtype=torch.int16)
    dist.broadcast(buf.view(torch.uint8), src=0)  # gloo has no int16 collectives
    return buf


def expected_shard(bits: torch.Tensor, setup: Setup, shard: str) -> dict[str, torch.Tensor]:
    shapes = spec().canonical_shapes()
    canon, at = {}, 0
    for name in sorted(shapes):
        n = int(torch.Size(shapes[name]).numel())
        canon[name] = bits[at : at + n].view(torch.bfloat16).reshape(shapes[name])
        at += n
    return receiver_layout(setup).split(canon)[shard]


def mismatched(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return [
        n
        for n, t in tensors.items()
        if not torch.equal(t.view(torch.int16), expected[n].view(torch.int16))
    ]


def empty_shard(setup: Setup, shard: str) -> dict[str, torch.Tensor]:
    specs = receiver_layout(setup).local_specs(shard)
    return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


# ---------------------------------------------------------------------- scenario: many versions


def run_versions(rank: int, setup: Setup) -> dict:
    """An anchor, then ``setup.versions`` deltas, each checked bit for bit on every receiver.
    From ``setup.forward_from`` on, every rank switches to a plan in ``forward`` mode."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # several processes share two busy cores
    init_from_env(timeout_s=60)
    role = setup.plan().role(rank)
    out: dict = {"rank": rank, "versions": [], "bad": [], "digests": [], "exchanges": []}
    if rank < setup.num_writers:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        out["setup_s"] = time.perf_counter() - t0
        for v in range(setup.versions + 1):
            if v == setup.forward_from:
                sender.close()
                sender = trainer.sender(setup, version=sender.version, plan_at=v)
            if v:
                trainer.step()
            report = sender.sync(v, anchor=v == 0)
            if setup.overlap:  # the check below reads the group: settle the version first
                report = sender.wait()
            out["versions"].append(report.version)
            out["exchanges"].append(sender.plan.exchanges)
            out.setdefault("elements", []).append(report.elements)
            out.setdefault("reports", []).append(report)
            broadcast_truth(trainer.canonical_bits() if rank == 0 else None)
        return out
    tensors = empty_shard(setup, role.shard)
    receiver = None
    for v in range(setup.versions + 1):
        if receiver is None or v == setup.forward_from:
            receiver = ClusterReceiver(
                tensors,
                plan=setup.plan(v),
                layout=receiver_layout(setup),
                version=None if receiver is None else receiver.version,
                config=setup.config(),
            )
        report = receiver.sync()
        out["versions"].append(receiver.version)
        out.setdefault("reports", []).append(report)
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        bad = mismatched(receiver.tensors, truth)
        if bad:
            out["bad"].append((receiver.version, bad[:3]))
        out["digests"].append(state_digest(receiver.tensors))
    return out


# ---------------------------------------------------------------------- scenario: inline


def run_inline(rank: int, setup: Setup) -> dict:
    """1 overlapped writer whose ``inline_below`` is above every delta of the tiny model, TP=2
    receivers (ranks 1, 2). Versions: the anchor 0 and delta 1 in the background (no small
    delta seen yet), 2 inline; 3 inline with rank 2's payload corrupted, not settled: the
    failure must come at the writer's next call, ``sync(4)``, naming 3; then 4 (with 3's carry:
    the tracker was cleared when 3 was captured) again. The truth is broadcast after every
    attempt, each one already settled when inline."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    plan = setup.plan()
    out: dict = {"rank": rank, "steps": []}
    if rank == 0:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        for v in range(5):
            if v:
                trainer.step()
            step: dict = {"version": v}
            if v == 4:
                failed = _attempt(lambda: sender.sync(4))
                step["raised"] = failed["error"], failed.get("message")
            pending = sender.sync(v, anchor=v == 0)
            step["done_on_return"] = pending.done()
            if v != 3:
                report = sender.wait()
                step.update(inline=report.inline, stall_s=report.stall_s, total_s=report.total_s)
            step["version_after"] = sender.version
            out["steps"].append(step)
            broadcast_truth(trainer.canonical_bits())
        return out

    role = plan.receiver(rank)
    receiver = corrupting_receiver(setup, rank)
    for v in range(5):
        before = snapshot(receiver.tensors)
        receiver.corrupt_next = v == 3 and rank == 2
        result = _attempt(receiver.sync)
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        result.update(
            version_after=receiver.version,
            unchanged=not mismatched(receiver.tensors, before),
            exact=not mismatched(receiver.tensors, truth),
        )
        out["steps"].append(result)
    return out


# ---------------------------------------------------------------------- scenario: faults


class FailingTracker:
    """A real tracker whose ``iter_changes()`` raises once when armed (a detection failure)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fail_next = False

    def iter_changes(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("change detection blew up on purpose")
        return self.inner.iter_changes()

    def clear(self) -> None:
        self.inner.clear()


class CorruptingReceiver(ClusterReceiver):
    """Flips one byte inside the blob of the next payload it receives, when armed;
    ``save_next`` keeps a clean copy of the next payload first, and ``replay_next`` hands the
    saved one over instead of what arrived (a stale payload of an aborted attempt)."""

    corrupt_next = save_next = replay_next = False
    saved: dict | None = None

    def receive(self):
        got = super().receive()
        if self.save_next:
            self.save_next = False
            self.saved = {k: v.clone() for k, v in got.items()}
        if self.replay_next:
            self.replay_next = False
            assert self.saved is not None and set(self.saved) == set(got)
            for k, v in self.saved.items():
                got[k] = v.clone()
        if self.corrupt_next:
            self.corrupt_next = False
            payload = got[min(got)]
            payload[-40] ^= 0x10  # inside the blob's record section, before its digest
        return got


def corrupting_receiver(setup: Setup, rank: int) -> CorruptingReceiver:
    """Receiver ``rank`` of ``setup``'s plan, empty (version None), able to corrupt a payload."""
    return CorruptingReceiver(
        empty_shard(setup, setup.plan().receiver(rank).shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
    )


def _attempt(call) -> dict:
    start = time.monotonic()
    try:
        call()
    except DeltaSyncError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "peer_failed": isinstance(exc, PeerFailedError),
            "exchange_error": isinstance(exc, ExchangeError),
            "anchor_required": getattr(exc, "anchor_required", None),
            "elapsed_s": time.monotonic() - start,
        }
    return {"error": None, "elapsed_s": time.monotonic() - start}


def run_faults(rank: int, setup: Setup, dying_rank: int, death_after_s: float, notes: str) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Versions: anchor 0, delta 1; a failed detection
    of 2 then its retry; a corrupted payload on rank 2 for 3 then its retry; for 4 (with state
    digests) a corrupted payload on rank 2 (a clean copy kept), then a retry after another training step where
    rank 2 applies that stale payload instead of the one sent, then the retry; then rank
    ``dying_rank`` is SIGKILLed ``death_after_s`` into version 5's exchange (it pickles what it
    saw so far to ``notes`` first, since it cannot return it)."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    plan = setup.plan()
    out: dict = {"rank": rank, "steps": []}
    if rank == 0:
        trainer = Trainer(setup, rank)
        tracker = FailingTracker(trainer.tracker)
        trainer.tracker = tracker
        sender = trainer.sender(setup)

        def step(name: str, version: int, *, fail: bool = False, train: bool = True) -> None:
            if train:
                trainer.step()
            tracker.fail_next = fail
            result = _attempt(lambda: sender.sync(version, anchor=version == 0))
            result.update(name=name, version_after=sender.version)
            out["steps"].append(result)
            broadcast_truth(trainer.canonical_bits())

        step("anchor", 0, train=False)
        step("delta", 1)
        step("detection fails", 2, fail=True)
        step("retry after detection failure", 2, train=False)
        step("corrupt payload", 3)
        step("retry after corruption", 3, train=False)
        # version 4 with its state digests (this setup sends them with anchors only)
        sender = trainer.sender(replace(setup, digest_every=1), version=sender.version)
        step("save then corrupt", 4)
        step("stale payload replayed", 4)  # the trainer stepped since: 4 is another state
        step("retry after the stale payload", 4, train=False)
        # The last version is an anchor in 32-byte chunks: thousands of messages, so that the
        # death lands inside the exchange rather than before or after it.
        slow = replace(setup, max_chunk_bytes=32)
        sender = trainer.sender(slow, version=sender.version)
        dist.barrier()
        trainer.step()
        result = _attempt(lambda: sender.sync(5, anchor=True))
        result.update(name="receiver killed", version_after=sender.version)
        out["steps"].append(result)
        return out

    role = plan.receiver(rank)
    tensors = empty_shard(setup, role.shard)
    receiver = CorruptingReceiver(
        tensors, plan=plan, layout=receiver_layout(setup), version=None, config=setup.config()
    )

    def step(name: str, *, corrupt: bool = False, save: bool = False, replay: bool = False) -> None:
        before = snapshot(receiver.tensors)
        receiver.corrupt_next = corrupt and rank == 2
        receiver.save_next = save and rank == 2
        receiver.replay_next = replay and rank == 2
        result = _attempt(receiver.sync)
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        result.update(
            name=name,
            version_after=receiver.version,
            unchanged=not mismatched(receiver.tensors, before),
            exact=not mismatched(receiver.tensors, truth),
            journal=receiver.journal.state,
        )
        out["steps"].append(result)

    for name, corrupt in (
        ("anchor", False),
        ("delta", False),
        ("detection fails", False),
        ("retry after detection failure", False),
        ("corrupt payload", True),
        ("retry after corruption", False),
    ):
        step(name, corrupt=corrupt)
    digested = replace(setup, digest_every=1)
    receiver = CorruptingReceiver(
        tensors,
        plan=plan,
        layout=receiver_layout(digested),
        version=receiver.version,
        config=digested.config(),
    )
    step("save then corrupt", corrupt=True, save=True)
    step("stale payload replayed", replay=True)
    step("retry after the stale payload")
    slow = replace(setup, max_chunk_bytes=32)
    receiver = ClusterReceiver(
        tensors,
        plan=plan,
        layout=receiver_layout(slow),
        version=receiver.version,
        config=slow.config(),
    )
    if rank == dying_rank:
        with open(notes, "wb") as f:
            pickle.dump(out, f)
    dist.barrier()
    if rank == dying_rank:
        threading.Timer(death_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    result = _attempt(receiver.sync)
    result.update(name="receiver killed", version_after=receiver.version)
    out["steps"].append(result)
    return out


def run_death_in_retry(rank: int, setup: Setup) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0; delta 1 is aborted at the joint commit
    (rank 2's payload corrupted, the group stays usable); then, in the retry of 1, rank 2 is
    SIGKILLed before it reaches the exchange. The others report what they raised."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank, "steps": []}
    if rank == 0:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        sender.sync(0, anchor=True)
        trainer.step()
        out["steps"].append(_attempt(lambda: sender.sync(1)))
        out["steps"].append(_attempt(lambda: sender.sync(1)))
        return out
    receiver = corrupting_receiver(setup, rank)
    receiver.sync()
    receiver.corrupt_next = rank == 2
    out["steps"].append(_attempt(receiver.sync))
    if rank == 2:
        cleared = receiver._preflight()
        os.kill(os.getpid(), signal.SIGKILL)
        receiver.receive(cleared)  # not reached
    out["steps"].append(_attempt(receiver.sync))
    return out


def _two_versions_sent(setup: Setup, rank: int) -> tuple[Trainer, ClusterSender]:
    """Writer ``rank``'s trainer and sender after anchor 0 and delta 1."""
    trainer = Trainer(setup, rank)
    sender = trainer.sender(setup)
    sender.sync(0, anchor=True)
    trainer.step()
    sender.sync(1)
    return trainer, sender


def run_writer_death(rank: int, setup: Setup, linger_s: float = 0.0) -> dict:
    """``setup.num_writers`` writers (snapshot trackers over their FSDP slices), TP=2 receivers.
    Anchor 0 and delta 1 commit; in delta 2 writer 1 is SIGKILLed between the two rounds of
    the exchange (round 1 done, none of its payloads sent). The others report what they
    raised: a writer may finish its own round 2 and wait in the joint commit, where the
    receivers (failing in round 2) never arrive. Every survivor stays up ``linger_s`` after
    its failure, keeping its connections open as an engine's process does."""
    from deltasync.exchange import rounds

    real = rounds.run_schedule

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)  # not reached

    def arm() -> None:
        rounds.run_schedule = die

    return _writer_1_killed_in_delta_2(rank, setup, arm, linger_s)


def _writer_1_killed_in_delta_2(
    rank: int, setup: Setup, arm: Callable[[], None], linger_s: float = 0.0
) -> dict:
    """Writers (rank 1 among them) and TP=2 receivers: anchor 0 and delta 1 commit, then
    writer 1 runs ``arm`` (which makes it SIGKILL itself somewhere in delta 2) and every rank
    syncs delta 2, reporting what it raised and the version it holds after; every survivor then
    stays up ``linger_s``, its connections open, as a trainer's or engine's process does."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank < setup.num_writers:
        trainer, sender = _two_versions_sent(setup, rank)
        trainer.step()
        if rank == 1:
            arm()
        out["fault"] = _attempt(lambda: sender.sync(2))
        out["version_after"] = sender.version
        time.sleep(linger_s)
        return out
    receiver = corrupting_receiver(setup, rank)  # never armed: a plain ClusterReceiver
    receiver.sync()
    receiver.sync()
    out["fault"] = _attempt(receiver.sync)
    out["version_after"] = receiver.version
    time.sleep(linger_s)
    return out


def _anchor_then_delta(setup: Setup) -> dict:
    """The writer (rank 0): anchor 0, a training step, then what its sync of delta 1 raised."""
    trainer = Trainer(setup, 0)
    sender = trainer.sender(setup)
    sender.sync(0, anchor=True)
    trainer.step()
    return _attempt(lambda: sender.sync(1))


def run_stall_in_round_one(rank: int, setup: Setup, stall_s: float) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0; in delta 1 rank 2 stops (SIGSTOP)
    inside round 1 of the exchange, after marking its arrival, and is SIGKILLed ``stall_s``
    later from outside. The others report what they raised."""
    from deltasync.exchange import rounds

    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        out["fault"] = _anchor_then_delta(setup)
        return out
    receiver = corrupting_receiver(setup, rank)
    receiver.sync()
    if rank == 2:
        real = rounds._round_one

        def stall(*args, **kwargs):
            pid = os.getpid()
            subprocess.Popen(
                ["sh", "-c", f"sleep {stall_s}; kill -9 {pid}"], start_new_session=True
            )
            os.kill(pid, signal.SIGSTOP)
            return real(*args, **kwargs)  # not reached

        rounds._round_one = stall
    out["fault"] = _attempt(receiver.sync)
    return out


def run_forwarder_death(rank: int, setup: Setup) -> dict:
    """1 writer, TP=2 receivers in 2 replicas, dp_mode "forward": ranks 1, 2 are replica 0
    (they receive the writer's payloads and forward them), ranks 3, 4 replica 1 (they send
    and receive nothing in the first exchange). In the anchor rank 1 (a forwarder) is
    SIGKILLed between the rounds of the first exchange (round 1 done, no payload received),
    once ranks 3 and 4 have arrived in the forward exchange. The writer's send to rank 1 fails
    and it leaves its note in the first exchange; with ``setup.max_chunk_bytes`` below a
    shard's anchor it never sends rank 2 its later chunks, so rank 2 fails there too (after
    the writer's note, when the writer's connections close). Neither arrives in the forward
    exchange, where ranks 3, 4 wait in a ring all_gather that rank 1 has no part in: rank 3
    fails when rank 2 closes its connections (after its note), rank 4 when the writer does (rank
    2's note follows within moments: both react to the writer's closing). The others report
    what they raised."""
    from deltasync.exchange import rounds
    from deltasync.exchange.notes import group_store

    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        sender = Trainer(setup, rank).sender(setup)
        dist.barrier()  # every rank built: the preflight waits for none of them
        out["fault"] = _attempt(lambda: sender.sync(0, anchor=True))
        return out
    receiver = ClusterReceiver(
        empty_shard(setup, setup.plan().receiver(rank).shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
    )
    dist.barrier()
    if rank != 1:
        out["fault"] = _attempt(receiver.sync)
        return out
    cleared = receiver._preflight()
    # The replicas' arrival marks in the forward exchange (exchange.notes' keys): waiting for
    # them, not for a time, makes the kill land while they wait there on every run.
    arrived = [f"deltasync/{cleared.tag}-x2/in/{r}" for r in (3, 4)]
    real = rounds.run_schedule

    def die(*args, **kwargs):
        try:
            group_store(None).wait(arrived, timedelta(seconds=30))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)  # not reached

    rounds.run_schedule = die
    receiver.receive(cleared)  # not returned from
    return out


def run_replacement_writer(rank: int, setup: Setup) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). A writer commits anchor 0 and deltas 1, 2; then
    its replacement, restored from the checkpoint of version 1 (it never learned that 2
    committed), trains on and tries ``sync()``, ``sync(anchor=True)`` (both numbered 2) and
    ``sync(3, anchor=True)``. Every rank reports each attempt; the receivers also every
    (version, state digest) they held and, at the end, the check against the trainer's bits."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank, "steps": []}
    attempts = 6
    if rank == 0:
        first = Trainer(setup, rank)
        sender = first.sender(setup)
        out["steps"].append(_attempt(lambda: sender.sync(0, anchor=True)))
        for v in (1, 2):
            first.step()
            out["steps"].append(_attempt(lambda v=v: sender.sync(v)))
        restored = Trainer(setup, rank)
        restored.step()  # the checkpoint of version 1: the same seed and data
        replacement = restored.sender(setup, version=1)
        restored.step()
        restored.step()
        out["steps"].append(_attempt(replacement.sync))
        out["steps"].append(_attempt(lambda: replacement.sync(anchor=True)))
        out["steps"].append(_attempt(lambda: replacement.sync(3, anchor=True)))
        out["version"] = replacement.version
        broadcast_truth(restored.canonical_bits())
        return out
    receiver = corrupting_receiver(setup, rank)
    seen = []
    for _ in range(attempts):
        out["steps"].append(_attempt(receiver.sync))
        if receiver.version is not None:
            seen.append((receiver.version, state_digest(receiver.tensors)))
    bits = broadcast_truth(None)
    expected = expected_shard(bits, setup, setup.plan().receiver(rank).shard)
    out["seen"], out["version"] = seen, receiver.version
    out["mismatched"] = mismatched(receiver.tensors, expected)
    return out


def run_trainer_late(rank: int, setup: Setup, late_s: float) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0; then the trainer does not come back for
    ``late_s`` while the receivers wait for its next version at most ``setup.timeout_s``
    (``wait_for_version_s``). The receivers report what they raised."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        sender = Trainer(setup, rank).sender(setup)
        dist.barrier()  # built on every rank: only the wait after the anchor is timed
        sender.sync(0, anchor=True)
        time.sleep(late_s)  # still alive: the receivers' wait times out, no connection closes
        return out
    receiver = ClusterReceiver(
        empty_shard(setup, setup.plan().receiver(rank).shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=replace(setup.config(), wait_for_version_s=setup.timeout_s),
    )
    dist.barrier()
    receiver.sync()
    out["fault"] = _attempt(receiver.sync)
    out["version_after"] = receiver.version
    return out


def run_receiver_late(rank: int, setup: Setup, late_s: float) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0; then receiver rank 2 comes to version
    1's preflight ``late_s`` after the others, past the writer's wait there (``timeout_s``),
    within the receivers' (``wait_for_version_s``). Every rank reports what it raised."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        out["fault"] = _anchor_then_delta(setup)
        time.sleep(late_s)  # the trainer lives on: no connection closes under the receivers
        return out
    receiver = corrupting_receiver(setup, rank)  # never armed: a plain ClusterReceiver
    receiver.sync()
    if rank == 2:
        time.sleep(late_s)
    out["fault"] = _attempt(receiver.sync)
    out["version_after"] = receiver.version
    return out


def one_process_roles(
    full: dict[str, torch.Tensor],
    plan: RolePlan,
    config: ClusterConfig,
    *,
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
    full_state: bool,
    **receiver_options: object,
) -> tuple[list[ClusterSender], dict[int, ClusterReceiver]]:
    """Senders (FSDP dim-0 parts of ``full``, viewed so each writer sees the trained values,
    with exact snapshot trackers) and empty receivers of ``plan``, for one process."""
    from deltasync.trainer import SnapshotTracker

    senders = []
    for w in plan.writers:
        mine = {}
        for n, p in full.items():
            start, stop = fsdp_dim0_rows(p.shape[0], w.index, w.count)
            mine[n] = p[start:stop]
        senders.append(
            ClusterSender(
                SnapshotTracker(mine.items()),
                mine,
                plan=plan,
                rank=w.rank,
                trainer_layout=trainer_layout,
                receiver_layout=receiver_layout,
                version=None,
                config=config,
                full_state=full if full_state else None,
            )
        )
    receivers = {
        r.rank: ClusterReceiver(
            {
                n: torch.zeros(s.shape, dtype=s.dtype)
                for n, s in receiver_layout.local_specs(r.shard).items()
            },
            plan=plan,
            rank=r.rank,
            layout=receiver_layout,
            version=None,
            config=config,
            **receiver_options,
        )
        for r in plan.receivers
    }
    return senders, receivers


def run_unreadable_payload(rank: int, setup: Setup, streamed: bool) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2): anchor 0, then version 1 with rank 2's payload
    replaced on the wire by 10 bytes that cannot hold an envelope's framing (``streamed``:
    every part to rank 2 dropped but a 10-byte last one), then every rank retries version 1
    and checks its tensors bitwise. The writer's module-level ``exchange`` is wrapped in this
    process only: what a faulty sender would put on the wire."""
    import deltasync.cluster.cluster_sender as sender_module
    import deltasync.cluster.streaming as streaming_module

    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank, "steps": []}
    if rank == 0:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        module = streaming_module if streamed else sender_module
        real, armed = module.exchange, [False]

        def faulty(payloads, **kwargs):
            if armed[0] and 2 in payloads:
                payloads = dict(payloads)
                if kwargs.get("more"):
                    del payloads[2]
                else:
                    payloads[2], armed[0] = b"garbage!!!", False
            return real(payloads, **kwargs)

        module.exchange = faulty

        def sync(version: int, *, fault: bool = False) -> None:
            armed[0] = fault
            result = _attempt(lambda: (sender.sync(version, anchor=version == 0), sender.wait()))
            result.update(version_after=sender.version)
            out["steps"].append(result)
            broadcast_truth(trainer.canonical_bits())

        sync(0)
        trainer.step()
        sync(1, fault=True)
        sync(1)
        return out
    role = setup.plan().receiver(rank)
    receiver = ClusterReceiver(
        empty_shard(setup, role.shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
    )
    for _ in range(3):
        result = _attempt(receiver.sync)
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        result.update(version_after=receiver.version, exact=not mismatched(receiver.tensors, truth))
        out["steps"].append(result)
    return out


def run_death_between_versions(rank: int, setup: Setup, refused_first: bool = False) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0 and delta 1 commit (``refused_first``:
    then version 2 is refused in its preflight, the writer's detection having failed); then
    receiver rank 2 is SIGKILLed before version 2's preflight. The others report what they
    raised there."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        trainer, sender = _two_versions_sent(setup, rank)
        trainer.step()
        if refused_first:
            real = sender.payloads_for_version

            def failing(*args, **kwargs):
                sender.payloads_for_version = real
                raise RuntimeError("injected: detection failed")

            sender.payloads_for_version = failing
            out["refused"] = _attempt(lambda: sender.sync(2))
        t = time.monotonic()
        out["fault"] = _attempt(lambda: sender.sync(2))
        out["elapsed_s"] = time.monotonic() - t
        out["version_after"] = sender.version
        return out
    receiver = corrupting_receiver(setup, rank)  # never armed: a plain ClusterReceiver
    receiver.sync()
    receiver.sync()
    if refused_first:
        out["refused"] = _attempt(receiver.sync)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = time.monotonic()
    out["fault"] = _attempt(receiver.sync)
    out["elapsed_s"] = time.monotonic() - t
    out["version_after"] = receiver.version
    return out


def run_writer_death_in_preflight(rank: int, setup: Setup, linger_s: float = 0.0) -> dict:
    """Writers 0, 1 (snapshot trackers over their FSDP halves), TP=2 receivers (ranks 2, 3).
    Anchor 0 and delta 1 commit; in delta 2 writer 1 marks its arrival in the preflight and is
    SIGKILLed before its row goes out. In the 4-rank all_gather only its ring neighbours see
    the connection close; the others report what they raised, then stay up ``linger_s``."""
    from deltasync.cluster import preflight as preflight_module

    real = preflight_module.FailureNotes.arrive

    def arrive_then_die(notes) -> None:
        real(notes)
        os.kill(os.getpid(), signal.SIGKILL)

    def arm() -> None:
        preflight_module.FailureNotes.arrive = arrive_then_die

    return _writer_1_killed_in_delta_2(rank, setup, arm, linger_s)


def run_replacement_then_death(rank: int, setup: Setup, late_s: float, die_after_s: float) -> dict:
    """1 writer, TP=2 receivers (ranks 1, 2). Anchor 0 and delta 1 commit; the writer then
    replaces its ClusterSender with a new one on the same group and comes to version 2's
    preflight ``late_s`` later; receiver rank 2 is SIGKILLed ``die_after_s`` into its wait
    there. The others report what they raised."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    out: dict = {"rank": rank}
    if rank == 0:
        trainer, sender = _two_versions_sent(setup, rank)
        sender.close()
        sender = trainer.sender(setup, version=1)  # the replacement, on the same group
        trainer.step()
        time.sleep(late_s)
        out["fault"] = _attempt(lambda: sender.sync(2))
        return out
    receiver = corrupting_receiver(setup, rank)  # never armed: a plain ClusterReceiver
    receiver.sync()
    receiver.sync()
    if rank == 2:
        threading.Timer(die_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    out["fault"] = _attempt(receiver.sync)
    return out


class EnginePause:
    """An engine's pause hook (``ClusterReceiver(pause=...)``) that fails as engines' hooks do:
    with ``refuse`` set its entry raises a RuntimeError (not a deltasync error) once; with
    ``swallow`` set its exit logs and suppresses what the writes inside it raised."""

    def __init__(self) -> None:
        self.refuse = self.swallow = False

    def __call__(self) -> EnginePause:
        return self

    def __enter__(self) -> None:
        if self.refuse:
            self.refuse = False
            raise RuntimeError("the engine refuses to pause")

    def __exit__(self, kind, exc, tb) -> bool:
        return self.swallow and exc is not None


def run_engine_pause_faults(rank: int, setup: Setup) -> dict:
    """1 writer, TP=2 receivers. Anchor 0; delta 1, which rank 2's pause hook refuses (a
    RuntimeError), then its retry; delta 2, whose scatter on rank 2 raises at the second
    tensor inside a pause hook that suppresses it, then its retry."""
    import deltasync.cluster.cluster_receiver as cluster_receiver

    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    plan = setup.plan()
    out: dict = {"rank": rank, "steps": []}
    # (step, version, whether the trainer steps before it)
    steps = (
        ("anchor", 0, False),
        ("pause refused", 1, True),
        ("retry", 1, False),
        ("scatter error suppressed", 2, True),
        ("retry 2", 2, False),
    )
    if rank == 0:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        for name, version, train in steps:
            if train:
                trainer.step()
            result = _attempt(lambda: sender.sync(version, anchor=version == 0))  # noqa: B023
            out["steps"].append({**result, "name": name, "version_after": sender.version})
            broadcast_truth(trainer.canonical_bits())
        return out
    role = plan.receiver(rank)
    pause = EnginePause()
    receiver = ClusterReceiver(
        empty_shard(setup, role.shard),
        plan=plan,
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
        pause=pause,
    )
    scatter = cluster_receiver.apply_pieces
    for name, _, _ in steps:
        pause.refuse = rank == 2 and name == "pause refused"
        pause.swallow = rank == 2 and name == "scatter error suppressed"
        calls = [0]

        def failing_scatter(*args, **kwargs):
            calls[0] += 1  # noqa: B023
            if calls[0] == 2:  # noqa: B023
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return scatter(*args, **kwargs)

        cluster_receiver.apply_pieces = failing_scatter if pause.swallow else scatter
        result = _attempt(receiver.sync)
        truth = expected_shard(broadcast_truth(None), setup, role.shard)
        result.update(
            name=name,
            version_after=receiver.version,
            exact=not mismatched(receiver.tensors, truth),
        )
        out["steps"].append(result)
    return out


def run_refused_writer_with_gathering_full_state(rank: int, setup: Setup) -> dict:
    """Writers 0, 1 (snapshot trackers over their FSDP halves) given a ``full_state`` callable
    that runs a collective over the two writers (an all_reduce on their own group, as a
    ``full_tensor()`` gather does), TP=2 receivers. Anchor 0 commits; then writer 0 sends
    version 1 and writer 1, refusing (its own check: version 0 is not after its committed 0),
    sends version 0. Each rank reports what it raised and after how long."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    writers = dist.new_group([0, 1], timeout=timedelta(seconds=60))  # every rank joins this
    role = setup.plan().role(rank)
    out: dict = {"rank": rank}
    if rank < setup.num_writers:
        trainer = Trainer(setup, rank)
        calls = []

        def gathering() -> dict[str, torch.Tensor]:
            calls.append(time.monotonic())
            dist.all_reduce(torch.ones(1), group=writers)  # a collective every writer joins
            return trainer.named

        sender = ClusterSender(
            trainer.tracker,
            trainer.params,
            plan=setup.plan(),
            trainer_layout=trainer.layout,
            receiver_layout=receiver_layout(setup),
            version=None,
            config=setup.config(),
            full_state=gathering,
            overlap=setup.overlap,
            optimizer=trainer.opt if setup.overlap else None,
        )
        sender.sync(0, anchor=True)
        if setup.overlap:
            sender.wait()
        trainer.step()

        def refused_or_sent() -> None:
            sender.sync(0 if rank == 1 else 1)
            if setup.overlap:
                sender.wait()

        out["fault"] = _attempt(refused_or_sent)
        out["gathers"] = len(calls)
        sender.close()
        return out
    receiver = ClusterReceiver(
        empty_shard(setup, role.shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
    )
    receiver.sync()
    out["fault"] = _attempt(receiver.sync)
    out["version_after"] = receiver.version
    return out
