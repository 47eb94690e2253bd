"""Store-path sync from a CUDA trainer: the streamed publish a GPU trainer actually runs.

A transformers Qwen3 model (a benchmark shape, random init) in fp32 on the GPU takes real
AdamW steps on seeded Gaussian gradients; ``TrainerSync.step_published`` detects on the GPU
(torch path), streams the versions to a local store, and two CPU receivers (vLLM TP=2 shards)
pull them. Each version is checked bit for bit against a dense split of the trainer's BF16
weights. Prints a table and ends with one JSON line. Runs on CPU too (for a dry run).

    python bench/gpu_sync_bench.py --model qwen3-0.6b --versions 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from deltasync import (
    AdamWTracker,
    LocalStore,
    ModelSpec,
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    ReceiverLayout,
    TrainerLayout,
    TrainerSync,
)
from deltasync.commands.apps import emit_json_line
from deltasync_bench.compare.workload import Workload, build_trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--pre-steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="cProfile the last publish")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = Workload(model=args.model, lr=args.lr)
    trainer = build_trainer(w).to(dev)
    named, params, opt = trainer.named, trainer.params(), trainer.opt

    def step(version: int) -> None:
        trainer.step(version)  # seeded on the device's own generator
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for k in range(args.pre_steps):
        step(-1 - k)
    spec = ModelSpec.from_hf_config(w.hf_config())
    tl, rl = TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", tp=2)
    root = tempfile.mkdtemp(prefix="ds-gpu-sync-")
    store = LocalStore(root + "/store")
    tracker = AdamWTracker(opt, named)
    sync = TrainerSync(
        tracker,
        Publisher(
            store, receiver_layout=rl, trainer_layout=tl, config=PublisherConfig(anchor_every=10**6)
        ),
        params,
    )
    receivers = {
        s.id: Receiver.for_layout(
            store,
            rl,
            s.id,
            {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in rl.local_specs(s.id).items()},
            f"{root}/rx-{s.id}",
            ReceiverConfig(receiver_id=f"rx-{s.id}", verify_on_open=False),
        )
        for s in rl.shards()
    }
    t = time.perf_counter()
    sync.step_published(0, anchor=True)
    anchor_s = time.perf_counter() - t
    for rx in receivers.values():
        rx.pull()

    rows = []
    exact = True
    for version in range(1, args.versions + 1):
        step(version)
        prof = None
        if args.profile and version == args.versions:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        (report,) = sync.step_published(version)
        stall = time.perf_counter() - t
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pulls = []
        for rx in receivers.values():
            t = time.perf_counter()
            rx.pull()
            pulls.append(time.perf_counter() - t)
        cpu = {n: p.detach().to("cpu", torch.bfloat16) for n, p in named}
        expected = rl.split(tl.to_canonical(cpu))
        for sid, rx in receivers.items():
            for name, want in expected[sid].items():
                exact &= torch.equal(rx.tensors[name].view(torch.int16), want.view(torch.int16))
        rows.append(
            dict(
                version=version,
                stall_s=stall,
                pull_s=max(pulls),
                build_s=report.build_s,
                encode_s=report.encode_s,
                upload_s=report.upload_s,
                digest_s=report.digest_s,
                bytes=report.bytes_sent,
                elements=report.elements_sent,
            )
        )

    numel = sum(p.numel() for _, p in named)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(
        f"{args.model} on {name}: {numel / 1e6:.0f} M params, lr {args.lr}, vLLM TP=2 "
        f"receivers on CPU, local store; anchor publish {anchor_s:.2f} s"
    )
    print(
        f"{'version':>7} {'stall s':>8} {'build s':>8} {'encode s':>9} {'upload s':>9} "
        f"{'digest s':>9} {'pull s':>7} {'MiB':>8} {'changed':>8}"
    )
    for r in rows:
        print(
            f"{r['version']:>7} {r['stall_s']:>8.3f} {r['build_s']:>8.3f} {r['encode_s']:>9.3f} "
            f"{r['upload_s']:>9.3f} {r['digest_s']:>9.3f} {r['pull_s']:>7.3f} "
            f"{r['bytes'] / 2**20:>8.2f} {100 * r['elements'] / numel:>7.2f}%"
        )
    print(f"exact on every version: {exact}")
    emit_json_line(
        {
            "bench": "gpu_sync",
            "device": name,
            "model": args.model,
            "lr": args.lr,
            "params": numel,
            "exact": exact,
            "anchor_s": round(anchor_s, 3),
            "median_stall_s": round(statistics.median(r["stall_s"] for r in rows), 4),
            "median_pull_s": round(statistics.median(r["pull_s"] for r in rows), 4),
            "versions": rows,
        }
    )
    if not exact:
        raise SystemExit("receivers differ from the trainer's BF16 weights")


if __name__ == "__main__":
    main()
