"""A complete in-cluster sync job for one rank: ``run_cluster_sync(rank, job)``.

The same function runs under ``torchrun`` (``deltasync cluster-worker``, or ``python -m
deltasync cluster-worker``) and under ``deltasync.exchange.spawn(run_cluster_sync,
world, job)``: it initialises from the launcher's environment, takes its role from a
:class:`RolePlan`, and runs ``job.versions`` versions (an anchor first).

Writers are FSDP-style: writer k of W holds only its dim-0 rows of every parameter of the
model (``job.model``, a Qwen3 / Qwen3-MoE config), as its own fp32 parameters with its own
``torch.optim.AdamW`` and ``AdamWTracker``. Each step draws seeded Gaussian gradients for the
full shapes and keeps its rows, so any W gives the same trajectory (no transformers model, no
hub: the point is AdamW's real update sparsity at ``job.lr``, not a useful model). Receivers
start empty and hold their shard's live tensors.

Writers send with ``ClusterSender(overlap=job.overlap)`` (on by default): ``sync`` returns once
the changes are captured, the rest runs in the background, and the next ``trainer.step`` (the
optimizer's pre-step hook) waits until the background no longer reads the params. Between the
sync and the next step the host waits ``job.fwd_bwd_s`` seconds, a stand-in for a GPU
trainer's forward/backward (its cores stay free, as a GPU trainer's host's do). Per delta
version the writer records what the trainer was kept from training: ``blocked_s`` (inside
``sync``), ``barrier_s`` (the next step's wait) and their sum ``overhead_s``; with
``job.measure_detection`` also ``detect_alone_s``, one extra detection pass before the sync
(the tracker answers the same again).

With ``job.check``, after the last version every writer broadcasts its BF16 rows and every
receiver compares its shard with a dense split of the whole state, bit for bit.

This module knows the job's loop; the trainer is :class:`deltasync_examples.models.SyntheticTrainer`
and the protocol is the library's ``ClusterSender`` / ``ClusterReceiver``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from deltasync import (
    AdamWTracker,
    ClusterConfig,
    ClusterReceiver,
    ClusterSender,
    ModelSpec,
    ReceiverLayout,
    TrainerLayout,
)
from deltasync.cluster import DEFAULT_DP_MODE, RolePlan, WriterRole
from deltasync.errors import ConfigError
from deltasync.exchange import init_from_env
from deltasync.layout import fsdp_dim0_rows
from deltasync_examples.models import TINY_QWEN3, SyntheticTrainer


@dataclass(frozen=True, kw_only=True)
class ClusterJob:
    """What every rank of one job runs; every rank must be given the same job."""

    model: Mapping = field(default_factory=lambda: dict(TINY_QWEN3))
    engine: str = "vllm"
    tp: int = 2
    ep: int = 1
    writers: int = 1
    replicas: int = 1
    dp_mode: str = DEFAULT_DP_MODE
    versions: int = 10  # deltas after the anchor
    lr: float = 1e-5
    grad_std: float = 1e-3
    seed: int = 0
    check: bool = True
    threads: int = 1  # torch intra-op threads per rank (ranks often share cores)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    overlap: bool = True  # ClusterSender(overlap=True): the trainer waits for detection at most
    fwd_bwd_s: float = 0.0  # stand-in forward/backward after each sync (the host waits)
    measure_detection: bool = False  # time one extra detection pass per version

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "writers", "replicas", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ClusterJob.{name} must be an int >= 1, got {v!r}")
        v = self.versions
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"ClusterJob.versions must be an int >= 0, got {self.versions!r}")
        for name in ("overlap", "measure_detection"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ClusterJob.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.fwd_bwd_s, (int, float)) or not 0 <= self.fwd_bwd_s < math.inf:
            raise ConfigError(f"ClusterJob.fwd_bwd_s must be a number >= 0, got {self.fwd_bwd_s!r}")
        for name in ("lr", "grad_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"ClusterJob.{name} must be a finite number > 0, got {v!r}")

    def layouts(self) -> tuple[TrainerLayout, ReceiverLayout]:
        spec = ModelSpec.from_hf_config(dict(self.model))
        return TrainerLayout(spec), ReceiverLayout.build(spec, self.engine, tp=self.tp, ep=self.ep)

    def plan(self) -> RolePlan:
        _, rl = self.layouts()
        return RolePlan.contiguous(
            num_writers=self.writers,
            shards=[s.id for s in rl.shards()],
            replicas=self.replicas,
            dp_mode=self.dp_mode,
        )


def run_cluster_sync(rank: int | None, job: ClusterJob) -> dict:
    """Run ``job`` as this process's rank (``rank`` None: from the launcher's environment);
    return this rank's summary (role, per-version reports, medians, exactness)."""
    torch.set_num_threads(job.threads)
    if not dist.is_initialized():
        init_from_env()
    rank = dist.get_rank() if rank is None else rank
    plan = job.plan()
    if dist.get_world_size() != plan.world_size:  # every rank alike, before any collective
        raise ConfigError(
            f"this job has {plan.world_size} ranks ({job.writers} writer(s) + "
            f"{plan.world_size - job.writers} receiver(s): tp={job.tp} x {job.replicas} "
            f"replica(s)), but the process group has {dist.get_world_size()}: start it with "
            f"torchrun --nproc-per-node {plan.world_size} (or change --writers/--tp/--replicas)"
        )
    tl, rl = job.layouts()
    role = plan.role(rank)
    reports: list = []
    if isinstance(role, WriterRole):
        trainer = SyntheticTrainer.gaussian(
            tl.param_shapes(),
            seed=job.seed,
            lr=job.lr,
            grad_std=job.grad_std,
            rows=(role.index, role.count),
        )
        tracker = AdamWTracker(trainer.opt, trainer.named)
        sender = ClusterSender(
            tracker,
            trainer.params(),
            plan=plan,
            trainer_layout=tl,
            receiver_layout=rl,
            version=None,
            config=job.cluster,
            group=None,
            overlap=job.overlap,
            optimizer=trainer.opt if job.overlap else None,
        )
        reports, steps = _train_and_send(job, trainer, tracker, sender)
        exact = _check(job, plan, tl, rl, rank, trainer.params(), None) if job.check else None
        summary = {
            "role": "writer",
            "writer": role.writer_id,
            "overlap": job.overlap,
            "median_step": {
                k: statistics.median(st[k] for st in steps)
                for k in steps[0]
                if all(st[k] is not None for st in steps)
            }
            if steps
            else {},
        }
    else:
        specs = rl.local_specs(role.shard)
        tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
        receiver = ClusterReceiver(tensors, plan=plan, layout=rl, version=None, config=job.cluster)
        for _ in range(job.versions + 1):
            reports.append(receiver.sync())
        exact = _check(job, plan, tl, rl, rank, None, receiver.tensors) if job.check else None
        summary = {"role": "receiver", "shard": role.shard, "replica": role.replica}
    deltas = reports[1:] or reports
    fields = [f for f, v in asdict(deltas[0]).items() if f.endswith("_s") and isinstance(v, float)]
    return {
        "rank": rank,
        **summary,
        "dp_mode": plan.dp_mode,
        "exact": exact,
        "median_delta": {f: statistics.median(getattr(r, f) for r in deltas) for f in fields},
        "bytes": [getattr(r, "bytes_sent", 0) or getattr(r, "payload_bytes", 0) for r in reports],
        "reports": [asdict(r) for r in reports],
    }


def _train_and_send(job, trainer, tracker, sender) -> tuple[list, list[dict]]:
    """The writer's loop: ``(one SendReport per version, per delta: what blocked the trainer)``.
    With overlap a version's report is known once it settled (the next sync waits for it)."""
    sent, steps = [], []
    for v in range(job.versions + 1):
        if v:
            trainer.step(v)  # overlap: its pre-step hook waits for the previous background
            if v > 1:
                steps[-1]["barrier_s"] = sender.barrier_wait_s
                steps[-1]["overhead_s"] = steps[-1]["blocked_s"] + steps[-1]["barrier_s"]
        detect_s = None
        if job.measure_detection and v:
            t = time.perf_counter()
            for _ in tracker.iter_changes():
                pass
            detect_s = time.perf_counter() - t
        t = time.perf_counter()
        sent.append(sender.sync(v, anchor=v == 0))
        blocked = time.perf_counter() - t
        if v:
            steps.append(
                {
                    "blocked_s": blocked,
                    "barrier_s": 0.0,
                    "overhead_s": blocked,
                    "detect_alone_s": detect_s,
                }
            )
        if job.fwd_bwd_s:
            time.sleep(job.fwd_bwd_s)
    sender.close()  # settles the last version (its barrier would be the next step's)
    reports = [s.result() if job.overlap else s for s in sent]
    return reports, steps[:-1] if job.overlap and len(steps) > 1 else steps


def _check(job, plan, tl, rl, rank, mine, tensors) -> bool | None:
    """Every writer broadcasts its BF16 rows; receivers compare their shard bit for bit."""
    shapes = tl.param_shapes()
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
    for w in plan.writers:
        for name, shape in shapes.items():
            start, stop = fsdp_dim0_rows(shape[0], w.index, w.count)
            n = (stop - start) * math.prod(shape[1:])
            if w.rank == rank:
                buf = mine[name].to(torch.bfloat16).reshape(-1).contiguous()
            else:
                buf = torch.empty(n, dtype=torch.bfloat16)
            if n:
                dist.broadcast(buf.view(torch.uint8), src=w.rank)  # gloo: no 16-bit types
            rows[name].append(buf.reshape(stop - start, *shape[1:]))
    if tensors is None:
        return None
    full = {n: torch.cat(parts) for n, parts in rows.items()}
    truth = rl.split(tl.to_canonical(full))[plan.receiver(rank).shard]
    return all(
        torch.equal(t.view(torch.int16), truth[n].view(torch.int16)) for n, t in tensors.items()
    )
