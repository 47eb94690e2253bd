"""``deltasync bench fsdp``: the store path from FSDP2 writers: every version's shard digests
from the full parameters (``full_state``, gathered on every writer's caller thread), against
parts digests (no ``full_state``: each writer hashes its own rows, nothing is gathered).

Launches ``--ranks`` gloo ranks on the CPU (``torch.distributed.run``); each wraps a
config-built transformers Qwen3 in ``fully_shard`` (per decoder layer, then the root), trains
it with AdamW on random tokens and publishes its dim-0 shard through
``TrainerSync(overlap=True)`` (writer ``rank`` of ``--ranks``; rank 0 commits). Three phases
in one launch, each on a fresh local store and starting with an anchor (not measured): the
``full_state`` callable gathers the fp32 masters on every rank (``p.full_tensor()``), then
``deltasync.trainer.gather_bf16`` kept by rank 0 alone, then ``parts``: no ``full_state``
(the manifest lists parts digests; ``gather_s`` is 0). Per version, on every rank: ``blocked_s`` (the ``step_published`` call),
``gather_s`` (the callable alone, inside it), ``detect_s`` (the tracker's pass,
``PendingVersion.detect_s``), ``commit_s`` (from the call to the commit on every writer) and
the rank's peak RSS above its RSS before the call, over the BF16 model's bytes. A table per
phase gives the median version (the largest rank's figures), and ``blocked / detect``: the
trainer's wait against detection alone (one writer's store path needs no gather at all).

Exact: after each version's measurements rank 0 pulls it into every TP=2 vLLM-layout
receiver shard (in process, not timed) and compares each, bit for bit, with the dense split of
the fp32 parameters gathered for the check; the run exits 1 on any difference. Ends with one
JSON line. Every flag is checked before anything starts (a ConfigError naming it, exit 2).

    deltasync bench fsdp --ranks 2 --layers 4 --hidden 512 --vocab 16000 --versions 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltasync.errors import ConfigError
from deltasync.validate import check_int, check_number
from deltasync_bench.common import emit_json, print_table, qwen3_config

PHASES = ("fp32", "bf16", "parts")  # the full_state of each phase (parts: none), in run order
_OWNER = "deltasync bench fsdp"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2, help="FSDP ranks, each a writer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--versions", type=int, default=5, help="per phase, the anchor included")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--timeout-s", type=float, default=600.0, help="the whole launch")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set on the launched ranks


def _check(args: argparse.Namespace) -> None:
    check_int(_OWNER, "--ranks", args.ranks, lo=2, hi=16)
    check_int(_OWNER, "--layers", args.layers, lo=1, hi=256)
    check_int(_OWNER, "--hidden", args.hidden, lo=128, hi=1 << 16)
    if args.hidden % 128:  # heads of 64, an even number of them: the receivers are TP=2
        raise ConfigError(f"{_OWNER}: --hidden must be a multiple of 128, got {args.hidden}")
    check_int(_OWNER, "--vocab", args.vocab, lo=64, hi=1 << 20)
    check_int(_OWNER, "--versions", args.versions, lo=2, hi=1000)
    check_number(_OWNER, "--lr", args.lr)
    check_number(_OWNER, "--timeout-s", args.timeout_s, unit="seconds")


def _hf_config(args: argparse.Namespace) -> dict:
    return qwen3_config(layers=args.layers, hidden=args.hidden, vocab=args.vocab)


# ---------------------------------------------------------------------- the launcher


def main(args: argparse.Namespace) -> int:
    _check(args)
    if args.worker:
        _worker(args, Path(args.worker))
        return 0
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-fsdp-") as root:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.ranks}",
            "-m",
            "deltasync",
            "bench",
            "fsdp",
            *("--ranks", str(args.ranks), "--layers", str(args.layers)),
            *("--hidden", str(args.hidden), "--vocab", str(args.vocab)),
            *("--versions", str(args.versions), "--lr", repr(args.lr)),
            *("--worker", root),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
        print(f"launching {args.ranks} gloo ranks (FSDP2, CPU)", flush=True)
        launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            stdout, stderr = launcher.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM first: the launcher stops its ranks (a SIGKILL would leave them running)
            launcher.terminate()
            try:
                launcher.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.communicate()
            print(f"the ranks did not finish in {args.timeout_s:g} s", file=sys.stderr)
            emit_json({"exact": False, "failures": ["timed out"]})
            return 1
        result = Path(root) / "result.json"
        if launcher.returncode != 0 or not result.exists():
            said = stdout.decode(errors="replace") + stderr.decode(errors="replace")
            sys.stderr.write(said[-8000:])
            errors = [line for line in said.splitlines() if line.startswith("deltasync: error:")]
            why = f"the ranks exited {launcher.returncode}" + (f": {errors[0]}" if errors else "")
            emit_json({"exact": False, "failures": [why]})
            return 1
        out = json.loads(result.read_text())
    return _report(out)


def _report(out: dict) -> int:
    model_bytes = out["model_bf16_bytes"]
    summary = {}
    for phase in (p for p in PHASES if p in out["phases"]):
        rows, per_version = [], out["phases"][phase]
        for v in per_version:
            rows.append(
                [
                    v["version"],
                    f"{v['blocked_s']:.3f}",
                    f"{v['gather_s']:.3f}",
                    f"{v['detect_s']:.3f}",
                    f"{v['commit_s']:.3f}",
                    f"{100 * v['mem_bytes'] / model_bytes:.1f}%",
                    f"{100 * v['mem_rank0_bytes'] / model_bytes:.1f}%",
                    "yes" if v["exact"] else "NO",
                ]
            )
        print_table(
            (
                "FSDP writers, no full_state: parts digests"
                if phase == "parts"
                else f"FSDP writers, full_state gathered in {phase}"
            )
            + " (largest rank per version)",
            [
                "version",
                "blocked s",
                "gather s",
                "detect s",
                "commit s",
                "trainer +mem",
                "rank 0 +mem",
                "exact",
            ],
            rows,
        )
        med = {
            k: statistics.median(v[k] for v in per_version)
            for k in ("blocked_s", "gather_s", "detect_s", "commit_s", "mem_bytes")
        }
        med["blocked_over_detect"] = med["blocked_s"] / max(med["detect_s"], 1e-9)
        med["mem_fraction"] = med["mem_bytes"] / model_bytes
        med["exact"] = all(v["exact"] for v in per_version)
        summary[phase] = med
    print_table(
        "medians (the anchor not measured)",
        ["full_state", "blocked s", "gather s", "detect s", "blocked / detect", "trainer +mem"],
        [
            [
                phase,
                f"{m['blocked_s']:.3f}",
                f"{m['gather_s']:.3f}",
                f"{m['detect_s']:.3f}",
                f"{m['blocked_over_detect']:.1f}x",
                f"{100 * m['mem_fraction']:.1f}%",
            ]
            for phase, m in summary.items()
        ],
    )
    exact = all(m["exact"] for m in summary.values())
    print("exact:", "yes" if exact else "NO")
    emit_json(
        {
            "exact": exact,
            "ranks": out["ranks"],
            "model_bf16_bytes": model_bytes,
            "medians": summary,
            "versions": out["phases"],
        }
    )
    return 0 if exact else 1


# ---------------------------------------------------------------------- one rank


def _worker(args: argparse.Namespace, root: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {phase: _phase(args, root / phase, phase, rank, world) for phase in PHASES}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            model_bytes = sum(2 * n for n in _shapes_numel(args))
            phases = {
                phase: [
                    _largest(versions)
                    for versions in zip(*(g[phase] for g in gathered), strict=True)
                ]
                for phase in PHASES
            }
            result = {"ranks": world, "model_bf16_bytes": model_bytes, "phases": phases}
            (root / "result.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _shapes_numel(args: argparse.Namespace) -> list[int]:
    from deltasync.layout import ModelSpec, TrainerLayout

    shapes = TrainerLayout(ModelSpec.from_hf_config(_hf_config(args))).param_shapes()
    return [int(torch.Size(s).numel()) for s in shapes.values()]


def _largest(ranks: tuple[dict, ...]) -> dict:
    """One version over the ranks: the largest time and memory of any rank; exact from rank 0
    (which checked it)."""
    out = {k: max(r[k] for r in ranks) for k in ("blocked_s", "gather_s", "detect_s", "commit_s")}
    out["mem_bytes"] = max(r["mem_bytes"] for r in ranks)
    out["mem_rank0_bytes"] = ranks[0]["mem_bytes"]
    out["version"] = ranks[0]["version"]
    out["exact"] = ranks[0]["exact"]
    return out


def _phase(args: argparse.Namespace, store_dir: Path, phase: str, rank: int, world: int) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deltasync import LocalStore, Publisher, PublisherConfig, TrainerSync
    from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
    from deltasync.trainer import AdamWTracker, gather_bf16
    from deltasync_bench.compare.memory import current_rss, peak_rss, reset_peak, trim
    from deltasync_examples.models import build_model

    hf = _hf_config(args)
    model = build_model(hf, seed=0)  # the same initial weights on every rank
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
    tracker = AdamWTracker(opt, model.named_parameters(), strict=True)
    spec = ModelSpec.from_hf_config(hf)
    tl, rl = TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", tp=2)
    store_dir.mkdir(parents=True, exist_ok=True)
    store = LocalStore(str(store_dir), durable=False)
    config = PublisherConfig(
        writer_rank=rank, num_writers=world, session=f"bench-{phase}", anchor_every=1000
    )
    gather = (
        gather_bf16(model.named_parameters(), keep=rank == 0)
        if phase == "bf16"
        else lambda: {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    )
    timed = {"gather_s": 0.0}

    def full_state() -> dict:
        t = time.perf_counter()
        try:
            return gather()
        finally:
            timed["gather_s"] = time.perf_counter() - t

    sync = TrainerSync(
        tracker,
        Publisher(store, receiver_layout=rl, config=config),
        tracker.local_params,
        full_state=None if phase == "parts" else full_state,
        overlap=True,
        optimizer=opt,
    )
    receivers = _receivers(store, rl, store_dir) if rank == 0 else {}
    gen = torch.Generator().manual_seed(100 + rank)
    records = []
    for v in range(args.versions):
        if v:
            ids = torch.randint(0, args.vocab, (2, 32), generator=gen)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        trim()
        rss0 = current_rss()
        reset_peak()
        t = time.perf_counter()
        pending = sync.step_published(v, anchor=v == 0)
        blocked = time.perf_counter() - t
        pending.result()
        commit = time.perf_counter() - t
        mem = peak_rss() - rss0
        pending.wait_detected()
        record = {
            "version": v,
            "blocked_s": blocked,
            "gather_s": timed["gather_s"],
            "detect_s": pending.detect_s or 0.0,
            "commit_s": commit,
            "mem_bytes": mem,
            "exact": True,
        }
        # the check, not timed: the fp32 masters gathered (a collective), split, compared
        full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            record["exact"] = _pulled_exactly(receivers, tl, rl, full)
        del full
        dist.barrier()
        if v:  # the anchor is a warm-up: every element, and the first gather
            records.append(record)
    sync.close()
    return records


def _receivers(store, rl, store_dir: Path) -> dict:
    from deltasync import Receiver, ReceiverConfig

    out = {}
    for shard in rl.shards():
        specs = rl.local_specs(shard.id)
        tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
        out[shard.id] = Receiver.for_layout(
            store,
            rl,
            shard.id,
            tensors,
            str(store_dir.parent / f"rx-{store_dir.name}-{shard.id}"),
            ReceiverConfig(receiver_id=f"bench-{shard.id}", durable=False),
        )
    return out


def _pulled_exactly(receivers: dict, tl, rl, full: dict) -> bool:
    canon = tl.to_canonical({n: t.to(torch.bfloat16) for n, t in full.items()})
    want = rl.split(canon)
    ok = True
    for shard, rec in receivers.items():
        rec.pull()
        for name, t in rec.tensors.items():
            ok &= torch.equal(t.view(torch.int16), want[shard][name].view(torch.int16))
    return ok
