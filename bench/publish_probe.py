"""Where one store-path version's trainer memory and background CPU go, in one process.

The store path as users run it (``AdamWTracker`` + ``TrainerSync(overlap=True)`` +
``Publisher`` on a local store, vLLM TP=2), on a Qwen3 shape with Qwen3-0.6B's vocabulary and
width and ``--layers`` decoder layers (the embedding, the trainer's memory peak, is the
0.6B's), under real AdamW steps. Per measured version:

- *capture*: the time ``step_published`` blocked (detection, positions only), and the peak RSS
  above the trimmed baseline while it ran;
- *background*: the process CPU seconds from the end of the capture to the commit (the caller
  only waits meanwhile, so they are the background's: value reads, routing, encoding, uploads,
  the digest pass, the commit), the kernel's share of them (``background_sys_s``: page
  faults on fresh buffers, frees back to the system), its wall time, and the peak RSS above
  the baseline;
- *total*: from the call to the commit (the background may start before the capture ends:
  once a delta outgrows ``inline_below`` it takes each parameter as it is captured);
- *kept*: the RSS above the baseline once the version committed (its positions are dropped
  then): heap the allocator kept after the version's buffers were freed;
- the publisher's own phase timings (build, encode, digest, upload, commit).

Memory is reported as a fraction of the BF16 model (the issue's unit). ``--profile`` runs the
last version's background thread under cProfile and prints the top functions by cumulative
time (the digest and upload threads are not in it). Ends with one JSON line. Every version is
checked as published: after the timed part a real ``Receiver`` per shard pulls it from the
store, and its tensors must equal a dense split of the trainer's BF16 params bit for bit
(``exact``; a refused pull counts as not exact). A run that is not exact prints ``exact: NO``
and exits 1.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import tempfile
import time
from contextlib import ExitStack

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
from deltasync_bench.compare.memory import current_rss, peak_rss, reset_peak, trim
from deltasync_bench.compare.workload import Workload, build_trainer
from deltasync_examples.oracle import dense_shards, same_bits


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (0.6B: 28)")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--pre-steps", type=int, default=3)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--digest-pass",
        action="store_true",
        help="hash the shard digests in a separate pass (digests_in_detection=False)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the last background")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--sort", default="cumulative", choices=("cumulative", "tottime"), help="profile order"
    )
    return ap.parse_args()


def _pulled_exact(receivers: dict, live: dict, truth: dict, version: int) -> bool:
    """Every receiver pulls ``version`` from the store; exact when each reached it and holds
    ``truth`` (the dense split of the trainer's BF16 params) bit for bit. A refused pull (the
    receiver's own digest check) is reported and counts as not exact."""
    exact = True
    for shard, rx in receivers.items():
        try:
            got = rx.pull().version
        except Exception as exc:  # the receiver refused what was published
            print(f"v{version} {shard}: pull refused: {type(exc).__name__}: {exc}", flush=True)
            exact = False
            continue
        if got != version or not same_bits(live[shard], truth[shard]):
            print(f"v{version} {shard}: reached v{got}, not bit-exact vs a dense split")
            exact = False
    return exact


def main() -> int:
    a = _args()
    torch.set_num_threads(a.threads)
    w = Workload(
        model=a.model, lr=a.lr, pre_steps=a.pre_steps, hf_overrides={"num_hidden_layers": a.layers}
    )
    trainer = build_trainer(w)
    for s in range(w.pre_steps):
        trainer.step(-1 - s)
    params = trainer.params()
    spec = ModelSpec.from_hf_config(w.hf_config())
    tlayout = TrainerLayout.build(spec)
    rlayout = ReceiverLayout.build(spec, engine="vllm", tp=a.tp)
    bf16_bytes = 2 * sum(p.numel() for p in params.values())
    tracker = AdamWTracker(trainer.opt, trainer.named)
    rows = []
    exact = True
    with ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory())
        rx_root = stack.enter_context(tempfile.TemporaryDirectory())
        store = LocalStore(root)
        pub = Publisher(
            store,
            receiver_layout=rlayout,
            trainer_layout=tlayout,
            config=PublisherConfig(anchor_every=1_000_000, session="probe"),
        )
        sync = TrainerSync(
            tracker,
            pub,
            params,
            overlap=True,
            optimizer=trainer.opt,
            digests_in_detection=not a.digest_pass,
        )
        sync.step_published(0, anchor=True)
        sync.wait()
        # The checking receivers (untimed): one per shard, pulling each version after its row.
        live = {
            s.id: {
                n: torch.zeros(p.shape, dtype=p.dtype) for n, p in rlayout.local_specs(s.id).items()
            }
            for s in rlayout.shards()
        }
        receivers = {
            sid: Receiver.for_layout(
                store,
                rlayout,
                sid,
                tensors,
                f"{rx_root}/{sid}",
                ReceiverConfig(receiver_id=f"rx-{sid}"),
            )
            for sid, tensors in live.items()
        }
        exact = _pulled_exact(receivers, live, dense_shards(params, tlayout, rlayout), 0)
        for v in range(1, a.versions + 1):
            trainer.step(v)
            trim()
            base = current_rss()
            reset_peak()
            profiling = a.profile and v == a.versions
            if profiling:  # the background's own thread under the profiler
                prof = cProfile.Profile()
                background = sync._background

                def profiled(*args, _run=background, _prof=prof):
                    _prof.enable()
                    try:
                        return _run(*args)
                    finally:
                        _prof.disable()

                sync._background = profiled  # type: ignore[method-assign]
            c0, t0 = time.process_time(), time.perf_counter()
            pending = sync.step_published(v)
            captured_s = time.perf_counter() - t0
            capture_cpu = time.process_time() - c0
            cap_peak = peak_rss() - base
            reset_peak()
            c1, t1 = time.process_time(), time.perf_counter()
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            reports = sync.wait() or []
            bg_cpu = time.process_time() - c1
            u2 = resource.getrusage(resource.RUSAGE_SELF)
            bg_wall = time.perf_counter() - t1
            total = time.perf_counter() - t0
            total_cpu = time.process_time() - c0
            kept = current_rss() - base  # committed: the carry is gone, this is what stays
            del pending
            row = dict(
                version=v,
                captured_s=captured_s,
                capture_cpu_s=capture_cpu,
                capture_mem=cap_peak / bf16_bytes,
                background_cpu_s=bg_cpu,
                background_sys_s=u2.ru_stime - u1.ru_stime,
                background_faults=u2.ru_minflt - u1.ru_minflt,
                background_wall_s=bg_wall,
                total_s=total,
                total_cpu_s=total_cpu,
                background_mem=(peak_rss() - base) / bf16_bytes,
                kept_mem=kept / bf16_bytes,
            )
            rep = reports[0]
            row.update(
                elements=rep.elements_sent,
                mib=rep.bytes_sent / 2**20,
                build_s=rep.build_s,
                encode_s=rep.encode_s,
                digest_s=rep.digest_s,
                upload_s=rep.upload_s,
                commit_s=rep.commit_s,
            )
            truth = dense_shards(params, tlayout, rlayout)
            row["exact"] = _pulled_exact(receivers, live, truth, v)
            exact = exact and row["exact"]
            rows.append(row)
            print(
                " ".join(
                    f"{k}={val:.3f}" if isinstance(val, float) else f"{k}={val}"
                    for k, val in row.items()
                ),
                flush=True,
            )
            if profiling:
                del sync._background
                pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)
        sync.close()
        pub.close()
    print("exact:", "yes" if exact else "NO")
    print(
        json.dumps(
            dict(
                bench="publish_probe",
                model=a.model,
                layers=a.layers,
                bf16_bytes=bf16_bytes,
                exact=exact,
                versions=rows,
            )
        )
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
