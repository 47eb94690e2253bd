"""Worker functions for the in-cluster promise tests: retries, preflight refusals, failures
that end within the exchange timeout naming the dead rank, and recovery (spawned processes).

Trainers are real: a config-built transformers Qwen3 stepped by ``torch.optim.AdamW`` (the
shared ``HFTrainer``), FSDP-style writers each tracking their dim-0 halves with a
``SnapshotTracker``. The check after a version is independent of the product's digests: the
trainer's canonical BF16 state, split by the layout, compared with ``torch.equal`` on int16
views. Workers return plain Python summaries; the test process asserts on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from kit import HFTrainer

from deltasync import (
    ClusterConfig,
    ClusterReceiver,
    ClusterSender,
    DeltaSyncError,
    ExchangeConfig,
    ModelSpec,
    ReceiverLayout,
    TrainerLayout,
)
from deltasync.cluster import RolePlan, cluster_sender
from deltasync.exchange import init_from_env
from deltasync.layout import fsdp_dim0_rows
from deltasync.trainer import AdamWTracker, SnapshotTracker

from cluster_testkit import (
    TINY,
    CorruptingReceiver,
    Setup,
    Trainer,
    broadcast_truth,
    empty_shard,
    expected_shard,
    mismatched,
    receiver_layout,
)


def outcome(call) -> dict:
    """Run ``call``; what it raised (type, message, anchor_required) and how long it took."""
    start = time.monotonic()
    try:
        call()
    except DeltaSyncError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "anchor_required": getattr(exc, "anchor_required", None),
            "elapsed_s": time.monotonic() - start,
        }
    return {"error": None, "elapsed_s": time.monotonic() - start}


def layouts(cfg: dict, tp: int) -> tuple[TrainerLayout, ReceiverLayout]:
    spec = ModelSpec.from_hf_config(cfg)
    return TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", tp=tp)


def zeros(rl: ReceiverLayout, shard: str) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in rl.local_specs(shard).items()}


def truth_bits(named: dict[str, torch.Tensor], tl: TrainerLayout) -> torch.Tensor:
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in named.items()}
    canon = tl.to_canonical(bf16)
    return torch.cat([canon[n].reshape(-1).view(torch.int16) for n in sorted(canon)])


def exact(tensors: dict[str, torch.Tensor], bits: torch.Tensor, tl, rl, shard: str) -> bool:
    shapes = tl.spec.canonical_shapes()
    canon, at = {}, 0
    for name in sorted(shapes):
        n = int(torch.Size(shapes[name]).numel())
        canon[name] = bits[at : at + n].view(torch.bfloat16).reshape(shapes[name])
        at += n
    want = rl.split(canon)[shard]
    return all(
        torch.equal(t.view(torch.int16), want[n].view(torch.int16)) for n, t in tensors.items()
    )


def share_truth(bits: torch.Tensor | None, tl: TrainerLayout) -> torch.Tensor:
    n = sum(int(torch.Size(s).numel()) for s in tl.spec.canonical_shapes().values())
    buf = bits if bits is not None else torch.empty(n, dtype=torch.int16)
    dist.broadcast(buf.view(torch.uint8), src=0)  # gloo has no int16 collectives
    return buf


# ---------------------------------------------------------------------- retries


@dataclass(frozen=True)
class RetrySetup:
    writers: int = 2
    tracker: str = "snapshot"  # or "adamw" (one writer watching the full params)
    lr: float = 1e-3
    timeout_s: float = 20.0

    def plan(self) -> RolePlan:
        return RolePlan.contiguous(num_writers=self.writers, shards=["tp0", "tp1"])

    def config(self) -> ClusterConfig:
        return ClusterConfig(
            exchange=ExchangeConfig(timeout_s=self.timeout_s),
            wait_for_version_s=60.0,
            commit_timeout_s=self.timeout_s,
        )


def run_retry(rank: int, setup: RetrySetup) -> dict:
    """Anchor 0, delta 1; version 2 is aborted (the last receiver's payload is corrupted while
    the other applies it); the trainer takes one more optimizer step and, so that the case the
    union exists for certainly occurs, puts some elements the attempt changed back to their
    version-1 bits; then ``sync()`` retries 2. Every receiver must end exact, bit for bit."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    plan = setup.plan()
    tl, rl = layouts(TINY, 2)
    out: dict = {"rank": rank, "steps": {}}
    if rank < setup.writers:
        hf = HFTrainer(lr=setup.lr, batch=(4, 16), data_seed=1234)
        role = plan.writer(rank)
        if setup.tracker == "adamw":
            params, tracker = hf.params, AdamWTracker(hf.opt, hf.model.named_parameters())
        else:
            params = {}
            for name, p in hf.params.items():
                start, stop = fsdp_dim0_rows(p.shape[0], role.index, role.count)
                params[name] = p.detach()[start:stop]
            tracker = SnapshotTracker(params.items())
        sender = ClusterSender(
            tracker,
            params,
            plan=plan,
            trainer_layout=tl,
            receiver_layout=rl,
            version=None,
            config=setup.config(),
        )

        def step(name: str, call) -> None:
            out["steps"][name] = outcome(call)
            share_truth(truth_bits(hf.params, tl) if rank == 0 else None, tl)

        step("anchor", lambda: sender.sync(0, anchor=True))
        hf.step()
        step("delta", lambda: sender.sync(1))
        base = {n: p.detach().to(torch.bfloat16).clone() for n, p in hf.params.items()}
        hf.step()
        attempt = {n: p.detach().to(torch.bfloat16).clone() for n, p in hf.params.items()}
        step("corrupted attempt", lambda: sender.sync(2))
        hf.step()
        reverted = 0
        with torch.no_grad():
            for n, p in hf.params.items():
                moved = torch.nonzero(
                    attempt[n].view(torch.int16).reshape(-1)
                    != base[n].view(torch.int16).reshape(-1)
                ).reshape(-1)[::7]  # every 7th element the attempt changed goes back
                p.view(-1)[moved] = base[n].reshape(-1)[moved].to(p.dtype)
                reverted += int(moved.numel())
        now = {n: p.detach().to(torch.bfloat16) for n, p in hf.params.items()}
        out["reverted"] = reverted
        out["back_at_base"] = sum(
            int(
                (
                    (attempt[n].view(torch.int16) != base[n].view(torch.int16))
                    & (now[n].view(torch.int16) == base[n].view(torch.int16))
                ).sum()
            )
            for n in now
        )
        out["pending_elements"] = sender.pending_elements
        step("retry", lambda: sender.sync())
        out["version"] = sender.version
        return out

    role = plan.receiver(rank)
    tensors = zeros(rl, role.shard)
    receiver = CorruptingReceiver(
        tensors, plan=plan, layout=rl, version=None, config=setup.config()
    )
    last = plan.receivers[-1].rank

    def step(name: str, corrupt: bool = False) -> None:
        receiver.corrupt_next = corrupt and rank == last
        result = outcome(receiver.sync)
        bits = share_truth(None, tl)
        result.update(
            exact=exact(receiver.tensors, bits, tl, rl, role.shard),
            version=receiver.version,
            committed=receiver.committed_version,
            journal=receiver.journal.state,
        )
        out["steps"][name] = result

    step("anchor")
    step("delta")
    step("corrupted attempt", corrupt=True)
    step("retry")
    return out


# ---------------------------------------------------------------------- preflight


def _mismatch(kind: str) -> tuple[dict, int]:
    """The model config and TP the odd receiver is built with for ``kind``."""
    cfg = dict(TINY, vocab_size=1000)
    if kind == "intermediate":
        return dict(cfg, intermediate_size=cfg["intermediate_size"] * 2), 2
    if kind == "tp":
        return cfg, 4
    if kind == "vocab":
        return dict(cfg, vocab_size=1010), 2  # vLLM pads both to 1024 rows: same shapes
    return cfg, 2


def run_preflight(rank: int, kinds: list[str]) -> dict:
    """1 writer (plain fp32 tensors, snapshot tracker), TP=2 receivers. An anchor, then for
    each kind a delta with rank 2 built differently (refused everywhere), then the delta with
    rank 2 back to the right build (it commits, exact)."""
    torch.set_num_threads(1)
    init_from_env(timeout_s=60)
    config = ClusterConfig(
        exchange=ExchangeConfig(timeout_s=10.0), wait_for_version_s=30.0, commit_timeout_s=10.0
    )
    cfg, _ = _mismatch("none")
    tl, rl = layouts(cfg, 2)
    plan = RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"])
    out: dict = {"rank": rank, "steps": {}}
    if rank == 0:
        gen = torch.Generator().manual_seed(0)
        full = {n: torch.randn(s, generator=gen) * 0.05 for n, s in tl.param_shapes().items()}
        sender = ClusterSender(
            SnapshotTracker(full.items()),
            full,
            plan=plan,
            trainer_layout=tl,
            receiver_layout=rl,
            version=None,
            config=config,
        )
        out["steps"]["anchor"] = outcome(lambda: sender.sync(0, anchor=True))
        for p in full.values():
            p.add_((torch.rand(p.shape, generator=gen) < 0.05) * 0.01)
        for kind in [*kinds, "fixed"]:
            out["steps"][kind] = outcome(lambda: sender.sync(1))
            share_truth(truth_bits(full, tl), tl)
        return out

    role = plan.receiver(rank)
    good = ClusterReceiver(zeros(rl, role.shard), plan=plan, layout=rl, version=None, config=config)
    out["steps"]["anchor"] = outcome(good.sync)
    for kind in [*kinds, "fixed"]:
        before = {n: t.clone() for n, t in good.tensors.items()}
        receiver = good
        if rank == 2 and kind != "fixed":
            odd_cfg, tp = _mismatch(kind)
            _, odd_rl = layouts(odd_cfg, tp)
            odd_plan = RolePlan.contiguous(num_writers=1, shards=[f"tp{r}" for r in range(tp)])
            receiver = ClusterReceiver(
                zeros(odd_rl, "tp1"),
                plan=odd_plan,
                layout=odd_rl,
                version=0,
                config=config,
                rank=2,
            )
        result = outcome(receiver.sync)
        bits = share_truth(None, tl)
        result["untouched"] = all(
            torch.equal(t.view(torch.int16), before[n].view(torch.int16))
            for n, t in good.tensors.items()
        )
        result["exact"] = exact(good.tensors, bits, tl, rl, role.shard)
        result["version"] = good.version
        out["steps"][kind] = result
    return out


# ---------------------------------------------------------------------- deaths and hangs


class DyingReceiver(ClusterReceiver):
    """Arms ``arm()`` right after its preflight, so a fault lands inside the exchange."""

    arm = None

    def receive(self, cleared=None):
        cleared = self._preflight() if cleared is None else cleared
        if self.arm is not None:
            self.arm()
            self.arm = None
        return super().receive(cleared)


# Into the exchange of version 2: round two of this small delta in 32-byte chunks took 0.29 s
# once on a quiet machine, so a fault armed 0.3 s in could land after it.
FAULT_AFTER_S = 0.1


def _arm(how: str, after_s: float) -> None:
    pid = os.getpid()
    if how == "kill":
        threading.Timer(after_s, lambda: os.kill(pid, signal.SIGKILL)).start()
        return
    # Stopped, it keeps its connections open: peers see silence, not a closed connection. It
    # is killed from outside later, since a stopped process runs no timer.
    subprocess.Popen(["sh", "-c", f"sleep {after_s + 8}; kill -9 {pid}"], start_new_session=True)
    threading.Timer(after_s, lambda: os.kill(pid, signal.SIGSTOP)).start()


def _join_group(store, prefix: str, rank: int) -> None:
    """Join a 3-rank gloo group under ``prefix`` of the shared store (a re-formed group takes
    a new prefix)."""
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=60),
    )


def _two_versions_sent(plan, tl, rl, config) -> tuple[HFTrainer, ClusterSender]:
    """The writer of a 3-rank group: versions 0 (an anchor) and 1 synced, then a step taken."""
    hf = HFTrainer(lr=1e-3, batch=(4, 16), data_seed=1234)
    sender = ClusterSender(
        SnapshotTracker(hf.params.items()),
        hf.params,
        plan=plan,
        trainer_layout=tl,
        receiver_layout=rl,
        version=None,
        config=config,
    )
    sender.sync(0, anchor=True)
    hf.step()
    sender.sync(1)
    hf.step()
    return hf, sender


def run_failure(rank: int, victim: int, how: str, timeout_s: float, standby: int | None) -> dict:
    """Ranks 0 (writer), 1, 2 (TP=2 receivers) form group 1. Anchor 0 and delta 1 commit;
    version 2 goes in 32-byte chunks (thousands of messages) and 0.1 s into its exchange
    rank ``victim`` is SIGKILLed (``how="kill"``) or stopped (``"hang"``). Survivors
    report what they raised and when. With a ``standby`` rank, the survivors then destroy the
    group and form group 2 with it in the victim's place: a retry of version 2 is refused
    everywhere (the replacement holds nothing), the anchor commits, every receiver is exact."""
    torch.set_num_threads(1)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    config = ClusterConfig(
        exchange=ExchangeConfig(timeout_s=timeout_s, max_chunk_bytes=32),
        wait_for_version_s=120.0,
        commit_timeout_s=timeout_s,
    )
    tl, rl = layouts(TINY, 2)
    plan = RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"])
    out: dict = {"rank": rank}

    def join(prefix: str, group_rank: int) -> None:
        _join_group(store, prefix, group_rank)

    sender = receiver = hf = None
    if rank != standby:
        join("group1", rank)
        if rank == 0:
            hf, sender = _two_versions_sent(plan, tl, rl, config)
            dist.barrier()
            if victim == 0:
                real = cluster_sender.exchange

                def exchange_then_fault(*args, **kwargs):
                    _arm(how, FAULT_AFTER_S)
                    cluster_sender.exchange = real
                    return real(*args, **kwargs)

                cluster_sender.exchange = exchange_then_fault
            out["fault"] = outcome(lambda: sender.sync(2))
        else:
            shard = plan.receiver(rank).shard
            receiver = DyingReceiver(
                zeros(rl, shard), plan=plan, layout=rl, version=None, config=config
            )
            receiver.sync()
            receiver.sync()
            dist.barrier()
            if victim == rank:
                receiver.arm = lambda: _arm(how, FAULT_AFTER_S)
            out["fault"] = outcome(receiver.sync)
            out["version_after_fault"] = receiver.version
            out["journal"] = receiver.journal.state
        if standby is None:
            return out
        dist.destroy_process_group()
    group_rank = victim if rank == standby else rank
    join("group2", group_rank)
    if group_rank == 0:
        sender.use_group(dist.group.WORLD)
        out["retry"] = outcome(lambda: sender.sync(2))
        out["anchor"] = outcome(lambda: sender.sync(2, anchor=True))
        share_truth(truth_bits(hf.params, tl), tl)
        out["version"] = sender.version
        return out
    shard = plan.receiver(group_rank).shard
    if rank == standby:
        receiver = ClusterReceiver(
            zeros(rl, shard), plan=plan, layout=rl, version=None, config=config
        )
    receiver.use_group(dist.group.WORLD)
    out["retry"] = outcome(receiver.sync)
    out["anchor"] = outcome(receiver.sync)
    bits = share_truth(None, tl)
    out["exact"] = exact(receiver.tensors, bits, tl, rl, shard)
    out["version"] = receiver.version
    return out


# ---------------------------------------------------------------------- a slow rank in the commit


def _stall_before_joint_commit(module, stall_s: float) -> None:
    """The next joint commit ``module`` (the sender's or the receiver's) enters starts with
    this process stopped (SIGSTOP) for ``stall_s``, as a GC pause or a slow host would; it is
    continued from outside, since a stopped process runs no timer."""
    real = module.joint_commit

    def stall(*args, **kwargs):
        module.joint_commit = real
        pid = os.getpid()
        subprocess.Popen(["sh", "-c", f"sleep {stall_s}; kill -CONT {pid}"], start_new_session=True)
        os.kill(pid, signal.SIGSTOP)
        return real(*args, **kwargs)

    module.joint_commit = stall


def run_slow_commit(rank: int, stall_s: float, timeout_s: float) -> dict:
    """Ranks 0 (writer), 1, 2 (TP=2 receivers). Anchor 0 and delta 1 commit; in delta 2 rank 2
    is stopped (SIGSTOP) just before the joint commit for ``stall_s`` > ``commit_timeout_s``,
    then continues. Every rank then re-forms the group, the trainer takes one more step and
    every rank syncs as the recovery recipe says (``sync()``; an anchor if that is refused).
    Each receiver records the state digest of its tensors under every version it reports."""
    from deltasync.cluster import cluster_receiver
    from deltasync.layout.digest import state_digest

    torch.set_num_threads(1)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    config = ClusterConfig(
        exchange=ExchangeConfig(timeout_s=timeout_s),
        wait_for_version_s=60.0,
        commit_timeout_s=timeout_s,
    )
    tl, rl = layouts(TINY, 2)
    plan = RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"])
    out: dict = {"rank": rank, "steps": [], "seen": []}

    def join(prefix: str) -> None:
        _join_group(store, prefix, rank)

    join("group1")
    if rank == 0:
        hf, sender = _two_versions_sent(plan, tl, rl, config)
        out["steps"].append(outcome(lambda: sender.sync(2)))
        dist.destroy_process_group()
        join("group2")
        sender.use_group(dist.group.WORLD)
        hf.step()
        retry = outcome(lambda: sender.sync())
        out["steps"].append(retry)
        if retry["error"] is not None:
            out["steps"].append(outcome(lambda: sender.sync(anchor=True)))
        out["version"] = sender.version
        share_truth(truth_bits(hf.params, tl), tl)
        return out

    shard = plan.receiver(rank).shard
    receiver = ClusterReceiver(zeros(rl, shard), plan=plan, layout=rl, version=None, config=config)

    def step() -> None:
        out["steps"].append(outcome(receiver.sync))
        if receiver.version is not None:
            out["seen"].append((receiver.version, state_digest(receiver.tensors)))

    step()
    step()
    if rank == 2:
        _stall_before_joint_commit(cluster_receiver, stall_s)
    step()
    dist.destroy_process_group()
    join("group2")
    receiver.use_group(dist.group.WORLD)
    step()
    if out["steps"][-1]["error"] is not None:
        step()
    bits = share_truth(None, tl)
    out["exact"] = exact(receiver.tensors, bits, tl, rl, shard)
    out["version"] = receiver.version
    return out


def run_late_writer_in_commit(rank: int, stall_s: float, timeout_s: float) -> dict:
    """Ranks 0, 1 (FSDP writers, snapshot trackers over their dim-0 halves), 2 (a TP=1
    receiver), digests on. Anchor 0 and delta 1 commit; in delta 2 writer 1 is stopped just
    before the joint commit for ``stall_s`` > ``commit_timeout_s``, then continues: writer 0 and
    the receiver give up without a verdict, writer 1 completes the all_gather from their rows
    and gets the abort for lateness. Every rank then re-forms the group, the trainers take one
    more step and every rank follows the recovery recipe (``sync()``; if that is refused,
    ``sync(anchor=True)`` on the writers and ``sync()`` on the receiver), two rounds at most.
    Every rank reports each step and its version; the receiver whether it holds the trainer's
    bits at the end."""
    torch.set_num_threads(1)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    setup = Setup(num_writers=2, tp=1, tracker="snapshot", digest_every=1, timeout_s=timeout_s)
    out: dict = {"rank": rank, "steps": []}
    _join_group(store, "group1", rank)
    if rank < 2:
        trainer = Trainer(setup, rank)
        sender = trainer.sender(setup)
        out["steps"].append(outcome(lambda: sender.sync(0, anchor=True)))
        trainer.step()
        out["steps"].append(outcome(lambda: sender.sync(1)))
        trainer.step()
        if rank == 1:
            _stall_before_joint_commit(cluster_sender, stall_s)
        out["steps"].append(outcome(lambda: sender.sync(2)))
        dist.destroy_process_group()
        _join_group(store, "group2", rank)
        sender.use_group(dist.group.WORLD)
        trainer.step()
        for _ in range(2):
            out["steps"].append(outcome(sender.sync))
            if out["steps"][-1]["error"] is None:
                break
            out["steps"].append(outcome(lambda: sender.sync(anchor=True)))
            if out["steps"][-1]["error"] is None:
                break
        out["version"] = sender.version
        broadcast_truth(trainer.canonical_bits() if rank == 0 else None)
        return out
    shard = setup.plan().receiver(rank).shard
    receiver = ClusterReceiver(
        empty_shard(setup, shard),
        plan=setup.plan(),
        layout=receiver_layout(setup),
        version=None,
        config=setup.config(),
    )
    for _ in range(3):
        out["steps"].append(outcome(receiver.sync))
    dist.destroy_process_group()
    _join_group(store, "group2", rank)
    receiver.use_group(dist.group.WORLD)
    for _ in range(4):  # as many as the writers' calls: each ends the same on every rank
        out["steps"].append(outcome(receiver.sync))
        if out["steps"][-1]["error"] is None:
            break
    out["version"] = receiver.version
    bits = broadcast_truth(None)
    out["exact"] = not mismatched(receiver.tensors, expected_shard(bits, setup, shard))
    return out
