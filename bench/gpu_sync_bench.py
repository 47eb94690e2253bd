"""Store-path sync from a CUDA trainer: the streamed publish a GPU trainer actually runs.

A transformers Qwen3 model (a benchmark shape, random init) in fp32 on the GPU takes real
AdamW steps on seeded Gaussian gradients; ``TrainerSync.step_published`` detects on the GPU
(torch path), streams the versions to a local store, and two CPU receivers (vLLM TP=2 shards)
pull them. Each version is checked bit for bit against a dense split of the trainer's BF16
weights. Prints a table and ends with one JSON line. Runs on CPU too (for a dry run).

Two modes, each on its own store and receivers, one after the other on the same trainer:
``blocking`` (``overlap=False``: the stall is the whole publish) and ``overlap``
(``overlap=True``: the stall is ``step_published`` until it returns; the rest runs while the
trainer would run its next forward/backward, measured here as ``wait()``, and the latency is
stall + wait, the end of the optimizer step to the commit).

    python bench/gpu_sync_bench.py --model qwen3-0.6b --versions 3 --modes blocking,overlap
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
    ap.add_argument(
        "--modes",
        default="blocking,overlap",
        help="comma-separated: blocking (overlap=False), overlap (overlap=True)",
    )
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"blocking", "overlap"}:
        raise SystemExit(f"--modes takes blocking and/or overlap, got {args.modes!r}")
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
    numel = sum(p.numel() for _, p in named)
    version = 0

    def run(mode: str) -> dict:
        """Anchor, then ``args.versions`` deltas in ``mode``; each checked bit for bit."""
        nonlocal version
        root = tempfile.mkdtemp(prefix=f"ds-gpu-sync-{mode}-")
        store = LocalStore(root + "/store")
        tracker = AdamWTracker(opt, named)
        overlap = mode == "overlap"
        sync = TrainerSync(
            tracker,
            Publisher(
                store,
                receiver_layout=rl,
                trainer_layout=tl,
                config=PublisherConfig(anchor_every=10**6),
            ),
            params,
            overlap=overlap,
            optimizer=opt if overlap else None,
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
        version += 1
        first = version
        t = time.perf_counter()
        sync.step_published(version, anchor=True)
        sync.wait()
        anchor_s = time.perf_counter() - t
        for rx in receivers.values():
            rx.pull()

        rows = []
        exact = True
        for k in range(args.versions):
            version += 1
            step(version)
            prof = None
            if args.profile and k == args.versions - 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t = time.perf_counter()
            returned = sync.step_published(version)
            stall = time.perf_counter() - t
            (report,) = sync.wait() if overlap else returned
            latency = time.perf_counter() - t
            if prof is not None:
                import pstats

                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            pulls = []
            for rx in receivers.values():
                t = time.perf_counter()
                rx.pull()
                pulls.append(time.perf_counter() - t)
                exact &= rx.version == version
            cpu = {n: p.detach().to("cpu", torch.bfloat16) for n, p in named}
            expected = rl.split(tl.to_canonical(cpu))
            for sid, rx in receivers.items():
                for name, want in expected[sid].items():
                    got = rx.tensors[name].view(torch.int16)
                    exact &= torch.equal(got, want.view(torch.int16))
            rows.append(
                dict(
                    version=version,
                    stall_s=stall,
                    commit_s=latency,
                    pull_s=max(pulls),
                    build_s=report.build_s,
                    encode_s=report.encode_s,
                    upload_s=report.upload_s,
                    digest_s=report.digest_s,
                    bytes=report.bytes_sent,
                    elements=report.elements_sent,
                )
            )
        sync.close()
        tracker.close()
        return dict(mode=mode, first_version=first, anchor_s=anchor_s, exact=exact, rows=rows)

    runs = [run(mode) for mode in modes]
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(
        f"{args.model} on {name}: {numel / 1e6:.0f} M params, lr {args.lr}, vLLM TP=2 "
        "receivers on CPU, local store"
    )
    print(
        f"{'mode':>8} {'version':>7} {'stall s':>8} {'commit s':>9} {'build s':>8} "
        f"{'encode s':>9} {'upload s':>9} {'digest s':>9} {'pull s':>7} {'MiB':>8} {'changed':>8}"
    )
    for r in runs:
        for row in r["rows"]:
            print(
                f"{r['mode']:>8} {row['version']:>7} {row['stall_s']:>8.3f} "
                f"{row['commit_s']:>9.3f} {row['build_s']:>8.3f} {row['encode_s']:>9.3f} "
                f"{row['upload_s']:>9.3f} {row['digest_s']:>9.3f} {row['pull_s']:>7.3f} "
                f"{row['bytes'] / 2**20:>8.2f} {100 * row['elements'] / numel:>7.2f}%"
            )
    exact = all(r["exact"] for r in runs)
    print(f"exact on every version: {exact}")
    emit_json_line(
        {
            "bench": "gpu_sync",
            "device": name,
            "model": args.model,
            "lr": args.lr,
            "params": numel,
            "exact": exact,
            "modes": {
                r["mode"]: {
                    "anchor_s": round(r["anchor_s"], 3),
                    "median_stall_s": round(statistics.median(x["stall_s"] for x in r["rows"]), 4),
                    "median_commit_s": round(
                        statistics.median(x["commit_s"] for x in r["rows"]), 4
                    ),
                    "median_pull_s": round(statistics.median(x["pull_s"] for x in r["rows"]), 4),
                    "versions": r["rows"],
                }
                for r in runs
            },
        }
    )
    if not exact:
        raise SystemExit("receivers differ from the trainer's BF16 weights")


if __name__ == "__main__":
    main()
