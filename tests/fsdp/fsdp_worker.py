"""One torchrun rank of the tests in this folder (launched by ``fsdp_kit.torchrun``).

``--job MODEL:IMPL:MODE:DIR`` (repeatable, run in order in one launch):

- ``fsdp``: a config-built transformers model wrapped with ``fully_shard`` per decoder layer
  and at the root over all ranks, AdamW (IMPL: foreach / single / fused) with a scheduler;
  every rank tracks its local shards and is a writer; versions (2 optimizer steps for odd
  ones, anchors at 0 and 3, an in-place edit outside the optimizer at version 4) go through a
  local store in DIR to the receivers the test started. Rank 0 writes each version's oracle
  (a dense split of the gathered full state) before publishing it.
- ``gather`` / ``gather_overlap``: as ``fsdp``, but ``full_state`` is a callable that gathers
  (a collective over the ranks): without overlap ``p.full_tensor()`` of the fp32 masters, as
  docs/integration.md writes it; with ``TrainerSync(overlap=True)`` the library's
  ``gather_bf16`` kept by rank 0 alone (the other ranks' calls return ``{}``).
- ``parts``: as ``fsdp`` with ``TrainerSync(overlap=True)`` and no ``full_state`` at all:
  every writer states its part digests, the manifests list parts digests, nothing is gathered
  for the publish (rank 0 still gathers the state for the oracle, outside the publish).
- ``ddp``: the same model under DistributedDataParallel; one rank (0) writes.
- ``tracker``: a small ``nn.Sequential`` under ``fully_shard`` whose dim-0 sizes split
  unevenly over the ranks (one rank's shard of a 1-row weight is empty): the tracker's
  ``shards`` against ``torch.chunk``, zero missed elements through steps and through edits
  both via the DTensor and via ``to_local()``, and a tensor-parallel placement refused.
- ``hsdp`` (4 ranks): the same small model under ``fully_shard`` on a 2 x 2 (replicate, shard)
  mesh: each rank's ``shards`` name its shard coordinate and its replica, only replica 0
  writes (``publish_role``), and nothing is missed.
- ``cluster`` (4 ranks): ranks 0-1 train under FSDP2 on their own mesh and are the cluster
  writers, ranks 2-3 are the TP=2 receivers, in one process group; every version is checked
  against rank 0's gathered canonical state, broadcast to all.
- ``cluster_gather`` (4 ranks): the same, with ``full_state`` a callable that gathers over the
  writers' mesh (a collective): ``sync`` runs it on both writers.

Every rank also checks its tracker against an exact snapshot of the same params: zero missed
elements at every version. Exits non-zero (a failed assertion) on any miss or mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_kit import ANCHOR_EVERY, CONFIGS, VERSIONS, layouts

from deltasync import (
    AdamWTracker,
    ClusterConfig,
    ClusterReceiver,
    ClusterSender,
    ExchangeConfig,
    LocalStore,
    Publisher,
    PublisherConfig,
    SnapshotTracker,
    TrainerLayout,
    TrainerSync,
)
from deltasync.cluster import RolePlan
from deltasync.commit import Catalog
from deltasync.trainer import gather_bf16, publish_role

IMPLS = {"foreach": dict(foreach=True), "single": dict(foreach=False), "fused": dict(fused=True)}


def build(model: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in CONFIGS[model].items() if k != "model_type"}
    torch.manual_seed(0)  # identical initial weights on every rank
    if model == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**cfg))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))


def shard_fsdp(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


class Training:
    """Model + AdamW + scheduler + the tracker and its exact oracle, on this rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        impl: str,
        data_seed: int,
        forward: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.forward = forward or model  # a DDP wrapper all-reduces the gradients
        self.opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, **IMPLS[impl])
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 0.3 * s))
        self.tracker = AdamWTracker(self.opt, model.named_parameters(), strict=True)
        self.truth = SnapshotTracker(model.named_parameters())
        self.gen = torch.Generator().manual_seed(data_seed)
        self.vocab = model.config.vocab_size

    def advance(self, version: int) -> None:
        for _ in range(2 if version % 2 else 1):
            ids = torch.randint(0, self.vocab, (2, 10), generator=self.gen)
            self.opt.zero_grad()
            self.forward(input_ids=ids, labels=ids).loss.backward()
            self.opt.step()
            self.sched.step()
        if version == 4:  # an edit outside the optimizer: must be reported in full
            with torch.no_grad():
                self.model.model.layers[1].self_attn.o_proj.weight.mul_(1.01)

    def check_tracker(self, version: int) -> None:
        """Zero missed elements against the exact snapshot, then both advance their baseline
        only when the caller clears (the publisher path clears the tracker itself)."""
        got = self.tracker.changed()
        empty = torch.empty(0, dtype=torch.int64)
        for name, idx in self.truth.changed().items():
            missed = int((~torch.isin(idx, got.get(name, empty))).sum())
            assert missed == 0, f"v{version} {name}: {missed} changed elements missed"
        if version == 4:
            assert self.tracker.out_of_band, "the edit at version 4 was not seen"
        self.truth.clear()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gathered full parameters (a collective over the FSDP mesh for DTensors)."""
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach()
    return out


def oracle(model_name: str, full: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    spec, rl = layouts(model_name)
    canon = TrainerLayout(spec).to_canonical({n: t.to(torch.bfloat16) for n, t in full.items()})
    return rl.split(canon)


def run_store(model_name: str, impl: str, mode: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(model_name)
    if mode in ("fsdp", "gather", "gather_overlap", "parts"):
        from torch.distributed.device_mesh import init_device_mesh

        shard_fsdp(model, init_device_mesh("cpu", (world,)))
        train = Training(model, impl, data_seed=100 + rank)
        role = publish_role(train.tracker.shards)
        assert role.writes and (role.writer_rank, role.num_writers) == (rank, world), role
    else:  # DDP: replicated plain params; one rank writes
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        train = Training(model, impl, data_seed=100 + rank, forward=ddp)
        role = publish_role(train.tracker.shards, dp_rank=rank)
        assert role.writes == (rank == 0) and role.num_writers == 1, role
    _, rl = layouts(model_name)
    sync = None
    holder: dict[str, dict[str, torch.Tensor]] = {}
    if role.writes:
        config = PublisherConfig(
            writer_rank=role.writer_rank,
            num_writers=role.num_writers,
            session=f"{mode}-{impl}",
            anchor_every=ANCHOR_EVERY,
            max_staleness=0,
            staleness_timeout_s=60,
            marker_timeout_s=60,
        )
        pub = Publisher(LocalStore(out / "store", durable=False), receiver_layout=rl, config=config)
        overlap = mode in ("gather_overlap", "parts")
        sync = TrainerSync(
            train.tracker,
            pub,
            train.tracker.local_params,
            # a gathering callable is a collective: TrainerSync calls it on every writer
            full_state=None if mode == "parts" else _gathering(mode, train.model, rank, holder),
            overlap=overlap,
            optimizer=train.opt if overlap else None,
        )
    for v in range(VERSIONS):
        if v:
            train.advance(v)
        full = full_state(train.model)  # every rank: a collective under FSDP2
        if mode == "ddp":
            _assert_replicas_identical(full)
        train.check_tracker(v)
        if rank == 0:
            (out / "oracle").mkdir(exist_ok=True)
            torch.save(oracle(model_name, full), out / "oracle" / f"v{v}.pt")
        holder["full"] = full
        if sync is not None and sync.overlap:
            assert sync.step_published(v).version == v
        elif sync is not None:
            report = sync.step_published(v)[0]
            assert report.version == v
        else:
            train.tracker.clear()  # a non-writing replica keeps no backlog
    if sync is not None:
        reports = sync.wait()  # overlap: the last version settled
        assert sync.overlap == (reports is not None) and sync.baseline == VERSIONS - 1
        sync.close()
    if mode == "parts" and rank == 0:  # no full_state: every version lists parts digests
        catalog = Catalog(LocalStore(out / "store", durable=False))
        for v in range(VERSIONS):
            listed = catalog.manifest(v).shard_digests.values()
            assert all(d.startswith(f"w{world}:") for d in listed), (v, listed)
    print(f"rank {rank} {model_name}:{impl}:{mode} published {VERSIONS} versions", flush=True)


def _gathering(mode: str, model: torch.nn.Module, rank: int, holder: dict):
    """``gather``: the fp32 gather docs/integration.md shows first; ``gather_overlap``: the
    library's BF16 gather, kept by the committer alone; else the version's gathered state."""
    if mode == "gather":
        return lambda: full_state(model)
    if mode == "gather_overlap":
        return gather_bf16(model.named_parameters(), keep=rank == 0)
    return lambda: holder["full"]


def _assert_replicas_identical(full: dict[str, torch.Tensor]) -> None:
    """One rank writes replicated state: that is exact only if every replica holds its bits."""
    h = hashlib.sha256()
    for n in sorted(full):
        h.update(full[n].detach().contiguous().view(torch.int32).numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "DDP replicas diverged"


def run_cluster(model_name: str, impl: str, out: Path, gather: bool = False) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    spec, rl = layouts(model_name)
    writers = dist.new_group([0, 1])  # every rank creates every group
    plan = RolePlan.contiguous(num_writers=2, shards=[s.id for s in rl.shards()])
    config = ClusterConfig(
        exchange=ExchangeConfig(timeout_s=60),
        wait_for_version_s=90,
        commit_timeout_s=60,
        digest_every=2,
    )
    tl = TrainerLayout(spec)
    n_canon = sum(int(torch.Size(s).numel()) for s in spec.canonical_shapes().values())
    if rank < 2:
        from torch.distributed.device_mesh import DeviceMesh

        model = build(model_name)
        shard_fsdp(model, DeviceMesh.from_group(writers, "cpu"))
        train = Training(model, impl, data_seed=200 + rank)
        holder: dict[str, dict[str, torch.Tensor]] = {}
        sender = ClusterSender(
            train.tracker,
            train.tracker.local_params,
            plan=plan,
            trainer_layout=tl,
            receiver_layout=rl,
            version=None,
            config=config,
            full_state=(lambda: full_state(train.model)) if gather else (lambda: holder["full"]),
        )
    else:
        shard = plan.receiver(rank).shard
        specs = rl.local_specs(shard)
        receiver = ClusterReceiver(
            {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()},
            plan=plan,
            layout=rl,
            version=None,
            config=config,
        )
    for v in range(VERSIONS):
        bits = torch.empty(n_canon, dtype=torch.int16)
        if rank < 2:
            if v:
                train.advance(v)
            full = full_state(train.model)  # a collective over the writers' mesh only
            train.check_tracker(v)
            holder["full"] = full
            sender.sync(v, anchor=v % ANCHOR_EVERY == 0)
            if rank == 0:
                canon = tl.to_canonical({n: t.to(torch.bfloat16) for n, t in full.items()})
                bits = torch.cat([canon[n].reshape(-1).view(torch.int16) for n in sorted(canon)])
        else:
            receiver.sync()
            assert receiver.version == v, (receiver.version, v)
        dist.broadcast(bits.view(torch.uint8), src=0)  # gloo: no int16 collectives
        if rank >= 2:
            canon, at = {}, 0
            for name, shape in sorted(spec.canonical_shapes().items()):
                n = int(torch.Size(shape).numel())
                canon[name] = bits[at : at + n].view(torch.bfloat16).reshape(shape)
                at += n
            want = rl.split(canon)[shard]
            bad = [
                n
                for n, t in receiver.tensors.items()
                if not torch.equal(t.view(torch.int16), want[n].view(torch.int16))
            ]
            assert not bad, f"receiver {shard} v{v}: differs in {bad[:5]}"
    (sender if rank < 2 else receiver).close()  # its threads end before the group does
    what = "cluster_gather" if gather else "cluster"
    print(f"rank {rank} {what} {model_name}:{impl} synced {VERSIONS} versions", flush=True)


def run_tracker(impl: str, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltasync.errors import ConfigError

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 5), torch.nn.Linear(5, 1), torch.nn.Linear(1, 7)
    )
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **IMPLS[impl])
    tracker = AdamWTracker(opt, model.named_parameters(), strict=True)
    truth = SnapshotTracker(model.named_parameters())
    for name, p in model.named_parameters():
        shard = tracker.shards[name]
        rows = torch.arange(full_shapes[name][0]).chunk(world)
        want = rows[rank] if rank < len(rows) else torch.empty(0, dtype=torch.int64)
        start = int(want[0]) if want.numel() else full_shapes[name][0]
        assert (shard.row_start, shard.row_stop) == (start, start + want.numel()), (name, shard)
        assert shard.global_shape == full_shapes[name] and (shard.rank, shard.world_size) == (
            rank,
            world,
        )
        assert tuple(tracker.local_params()[name].shape) == tuple(p.to_local().shape)
    gen = torch.Generator().manual_seed(rank)
    empty = torch.empty(0, dtype=torch.int64)
    for v in range(4):
        for _ in range(1 + v % 2):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=gen)).pow(2).sum().backward()
            opt.step()
        with torch.no_grad():
            if v == 1:
                model[0].weight.mul_(0.5)  # through the DTensor
            if v == 2:
                model[2].bias.to_local()[:1].add_(1.0)  # through the local shard
        got = tracker.changed()
        for name, idx in truth.changed().items():
            assert int((~torch.isin(idx, got.get(name, empty))).sum()) == 0, (v, name)
        oob = set(tracker.out_of_band)
        assert oob == {1: {"0.weight"}, 2: {"2.bias"}}.get(v, set()), (v, oob)
        tracker.clear(), truth.clear()
    tp = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    try:
        AdamWTracker(torch.optim.AdamW([tp]), [("tp.weight", tp)])
    except ConfigError as exc:
        assert "'tp.weight'" in str(exc) and "Shard(dim=1)" in str(exc), exc
    else:
        raise AssertionError("a tensor-parallel placement was accepted")
    print(f"rank {rank} tracker {impl} ok", flush=True)


def run_hsdp(impl: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard_rank = divmod(rank, 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 5), torch.nn.Linear(5, 3))
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **IMPLS[impl])
    tracker = AdamWTracker(opt, model.named_parameters(), strict=True)
    truth = SnapshotTracker(model.named_parameters())
    for name, shard in tracker.shards.items():
        rows = torch.arange(full_shapes[name][0]).chunk(2)[shard_rank]
        assert (shard.row_start, shard.row_stop) == (int(rows[0]), int(rows[-1]) + 1), (name, shard)
        assert (shard.rank, shard.world_size, shard.replica, shard.replicas) == (
            shard_rank,
            2,
            replica,
            2,
        )
    role = publish_role(tracker.shards)
    assert role.writes == (replica == 0) and (role.writer_rank, role.num_writers) == (
        shard_rank,
        2,
    ), role
    gen = torch.Generator().manual_seed(rank)
    empty = torch.empty(0, dtype=torch.int64)
    for v in range(3):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen)).pow(2).sum().backward()
        opt.step()
        got = tracker.changed()
        for name, idx in truth.changed().items():
            assert int((~torch.isin(idx, got.get(name, empty))).sum()) == 0, (v, name)
        tracker.clear(), truth.clear()
    print(f"rank {rank} hsdp {impl} ok", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", action="append", required=True, help="MODEL:IMPL:MODE:DIR")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    try:
        for spec in args.job:
            model_name, impl, mode, out = spec.split(":", 3)
            if mode in ("cluster", "cluster_gather"):
                run_cluster(model_name, impl, Path(out), gather=mode == "cluster_gather")
            elif mode == "tracker":
                run_tracker(impl, Path(out))
            elif mode == "hsdp":
                run_hsdp(impl)
            else:
                run_store(model_name, impl, mode, Path(out))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
