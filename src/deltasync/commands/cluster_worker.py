"""``deltasync cluster-worker``: one rank of an in-cluster sync job, for torchrun.

    torchrun --standalone --nproc-per-node=3 -m deltasync.commands.cluster_worker --tp 2

(or ``deltasync cluster-worker ...`` under torchrun). Ranks ``0..writers-1`` train FSDP-style
shards with real AdamW steps and send every version; the others are receivers (``--tp`` shards
x ``--replicas``). Each rank prints one JSON line with its median timings per delta version and
its bitwise check; rank 0 also prints a one-line summary. A thin projection of
:class:`deltasync_examples.cluster_job.ClusterJob`, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from deltasync.cluster.roles import DEFAULT_DP_MODE, DP_MODES
from deltasync.commands.apps import import_app
from deltasync.jsonline import emit_json_line


def _run(args: argparse.Namespace) -> int:
    from deltasync import ClusterConfig, ExchangeConfig

    app = import_app("deltasync_examples.cluster_job", "cluster-worker")
    model = dict(app.TINY_QWEN3)
    if args.config:
        with open(args.config) as f:
            model = json.load(f)
    job = app.ClusterJob(
        model=model,
        tp=args.tp,
        writers=args.writers,
        replicas=args.replicas,
        dp_mode=args.dp_mode,
        versions=args.versions,
        lr=args.lr,
        check=not args.no_check,
        threads=args.threads,
        cluster=ClusterConfig(
            exchange=ExchangeConfig(timeout_s=args.timeout_s, max_chunk_bytes=args.chunk_mib << 20),
            commit_timeout_s=args.timeout_s,
            digest_every=args.digest_every,
        ),
    )
    summary = app.run_cluster_sync(None, job)
    summary.pop("reports")
    emit_json_line(summary)
    if summary["rank"] == 0:
        med = summary["median_delta"]
        print(
            f"cluster-worker: {job.versions} deltas, {job.writers} writer(s) -> tp={job.tp} x "
            f"{job.replicas} replica(s) ({summary['dp_mode']}): "
            f"median sync {med['total_s'] * 1e3:.1f} ms "
            f"(stall {sum(med[k] for k in ('detect_s', 'build_s', 'encode_s')) * 1e3:.1f} ms, "
            f"transfer {med['transfer_s'] * 1e3:.1f} ms, commit {med['commit_s'] * 1e3:.1f} ms)",
            file=sys.stderr,
        )
    return 0 if summary["exact"] in (True, None) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="transformers config.json of a Qwen3/Qwen3-MoE (default: tiny)")
    p.add_argument("--tp", type=int, default=2, help="receiver tensor-parallel size (default: 2)")
    p.add_argument("--writers", type=int, default=1, help="FSDP trainer ranks (default: 1)")
    p.add_argument("--replicas", type=int, default=1, help="DP replicas of each shard (default: 1)")
    p.add_argument("--dp-mode", choices=DP_MODES, default=DEFAULT_DP_MODE)
    p.add_argument("--versions", type=int, default=10, help="delta versions after the anchor")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default: 1e-5)")
    p.add_argument(
        "--digest-every",
        type=int,
        default=1,
        help="send expected digests every K versions (default: 1; 0 = never)",
    )
    p.add_argument("--timeout-s", type=float, default=60.0, help="every wait's timeout")
    p.add_argument("--chunk-mib", type=int, default=64, help="exchange chunk size in MiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-check", action="store_true", help="skip the final bitwise check")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster-worker", help="one rank of an in-cluster sync job (run under torchrun)"
    )
    add_arguments(p)
    p.set_defaults(func=_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="deltasync cluster-worker")
    add_arguments(parser)
    raise SystemExit(_run(parser.parse_args()))
