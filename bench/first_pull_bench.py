"""``deltasync bench first-pull``: a store receiver's first pull (the anchor restore every
starting or restarting receiver makes), its peak memory against its shard, and its time.

Publishes a config-built Qwen3's BF16 weights (random, std 0.02) into a fresh local store:
an anchor (version 0), then ``--deltas`` versions that each rewrite ``--changed`` of every
tensor's elements. With ``--writers N`` (above 1) every version is published by N
FSDP writers, each from its own dim-0 rows of every parameter (one ``Publisher`` per rank,
``writer_rank``/``num_writers``, on threads of this process, without ``full_state``): the
manifests then list parts digests, which the receiver checks with its layout. Then, per case, a fresh process takes its RSS as the base, builds the
receiver's live tensors (zeros) and the receiver, and pulls with
``Receiver.for_layout(...).pull(target)``, as users run it (default ``ReceiverConfig``
but the receiver id): ``anchor`` pulls version 0 alone, ``catch-up`` the anchor and every
delta after it in one chain. Its peak is ``VmHWM`` (reset before the pull) above the base, so
the shard itself counts 1.0x: #15's bound for a receiver is 1.1x. Repeated ``--repeat`` times
per case (fresh processes); the table gives the largest peak and the fastest wall time.

Exact: after each pull the worker compares every live tensor with the dense split of the
published parameters on int16 views; the run exits 1 on any difference. Ends with one JSON
line. Every flag is checked before anything starts (a ConfigError naming it, exit 2).

    deltasync bench first-pull --layers 6 --hidden 1024 --vocab 32000 --deltas 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from deltasync.errors import ConfigError
from deltasync.validate import check_int, check_number
from deltasync_bench.common import emit_json, print_table, qwen3_config

CASES = ("anchor", "catch-up")
TARGET = 1.1  # #15: a receiver's peak, its shard included
_OWNER = "deltasync bench first-pull"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=1, help="the receivers' TP (shard tp0 is pulled)")
    p.add_argument("--deltas", type=int, default=8, help="versions after the anchor")
    p.add_argument("--changed", type=float, default=0.01, help="fraction rewritten per delta")
    p.add_argument(
        "--writers", type=int, default=1, help="FSDP dim-0 writers per version (parts digests)"
    )
    p.add_argument("--repeat", type=int, default=2, help="pulls per case, fresh processes")
    p.add_argument("--timeout-s", type=float, default=600.0, help="each pull's process")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # (root, case) of one pull


def _check(args: argparse.Namespace) -> None:
    check_int(_OWNER, "--layers", args.layers, lo=1, hi=256)
    check_int(_OWNER, "--hidden", args.hidden, lo=128, hi=1 << 16)
    if args.hidden % 128:  # heads of 64, an even number of them (TP 2 divides them)
        raise ConfigError(f"{_OWNER}: --hidden must be a multiple of 128, got {args.hidden}")
    check_int(_OWNER, "--vocab", args.vocab, lo=64, hi=1 << 20)
    check_int(_OWNER, "--tp", args.tp, lo=1, hi=8)
    if (args.hidden // 64) % args.tp or max(1, args.hidden // 128) % args.tp:
        raise ConfigError(
            f"{_OWNER}: --tp {args.tp} does not divide the {args.hidden // 64} attention heads "
            f"and {max(1, args.hidden // 128)} KV heads of --hidden {args.hidden}"
        )
    check_int(_OWNER, "--deltas", args.deltas, lo=0, hi=1000)
    check_number(_OWNER, "--changed", args.changed)
    if args.changed > 1:
        raise ConfigError(f"{_OWNER}: --changed is a fraction in (0, 1], got {args.changed!r}")
    check_int(_OWNER, "--writers", args.writers, lo=1, hi=8)
    check_int(_OWNER, "--repeat", args.repeat, lo=1, hi=100)
    check_number(_OWNER, "--timeout-s", args.timeout_s, unit="seconds")


def _layouts(args: argparse.Namespace):
    from deltasync import ModelSpec, ReceiverLayout, TrainerLayout

    config = qwen3_config(layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    spec = ModelSpec.from_hf_config(config)
    return TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", args.tp)


# ---------------------------------------------------------------------- the run


def main(args: argparse.Namespace) -> int:
    _check(args)
    if args.worker:
        root, case = args.worker
        _pull(args, Path(root), case)
        return 0
    with tempfile.TemporaryDirectory(prefix="deltasync-bench-first-pull-") as root:
        t0 = time.perf_counter()
        published = _publish(args, Path(root))
        print(
            f"published an anchor and {args.deltas} deltas ({published / 2**20:.1f} MiB of "
            f"blobs for every shard) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        runs: dict[str, list[dict]] = {case: [] for case in CASES}
        for k in range(args.repeat):
            for case in CASES:
                got = _launch(args, Path(root), case, k)
                if got is None:
                    emit_json({"exact": False, "failures": [f"the {case} pull failed"]})
                    return 1
                runs[case].append(got)
    return _report(runs, writers=args.writers)


def _publish(args: argparse.Namespace, root: Path) -> int:
    """Publish the anchor and the deltas; save the receiver shard each case must end at."""
    from deltasync import LocalStore

    tl, rl = _layouts(args)
    gen = torch.Generator().manual_seed(0)
    params = {
        name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        for name, shape in tl.param_shapes().items()
    }
    store = LocalStore(str(root / "store"), durable=False)
    publish = _publishers(args, store, rl, params)
    publish(0, [], anchor=True)
    torch.save(rl.split(tl.to_canonical(params))["tp0"], root / "anchor.pt")
    for version in range(1, args.deltas + 1):
        changes = []
        for name, p in params.items():
            flat = p.view(-1)
            n = max(1, int(flat.numel() * args.changed))
            idx = torch.randperm(flat.numel(), generator=gen)[:n].sort().values
            flat[idx] = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
            changes.append((name, idx, flat[idx].clone()))
        publish(version, changes)
    torch.save(rl.split(tl.to_canonical(params))["tp0"], root / "catch-up.pt")
    return sum(store.size(key) for key in store.list() if key.endswith(".blob"))


def _publishers(args: argparse.Namespace, store, rl, params: dict[str, torch.Tensor]):
    """``publish(version, changes, anchor=False)`` of the ``--writers`` publishers: one
    ``Publisher`` over ``params`` (one writer), or one per FSDP rank over its dim-0 rows of
    every parameter (views: ``params`` written in place is what each rank publishes next),
    each given its part of ``changes`` (full-parameter flat indices) in its own flat indices,
    all at once on threads (a version commits once every writer's marker is stored)."""
    from deltasync import Publisher, PublisherConfig
    from deltasync.layout import fsdp_dim0_rows

    world = args.writers
    if world == 1:
        pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=1 << 20))
        return lambda version, changes, anchor=False: pub.publish(
            version, changes, params, anchor=anchor
        )
    pubs, rows = [], []
    for rank in range(world):
        config = PublisherConfig(
            writer_rank=rank, num_writers=world, session="bench", anchor_every=1 << 20
        )
        pubs.append(Publisher(store, receiver_layout=rl, config=config))
        rows.append({n: fsdp_dim0_rows(p.shape[0], rank, world) for n, p in params.items()})
    local = [{n: p[slice(*rows[k][n])] for n, p in params.items()} for k in range(world)]

    def own(rank: int, changes: list) -> list:
        out = []
        for name, idx, values in changes:
            per = params[name].numel() // max(1, params[name].shape[0])
            lo, hi = (r * per for r in rows[rank][name])
            keep = (idx >= lo) & (idx < hi)
            if bool(keep.any()):
                out.append((name, idx[keep] - lo, values[keep]))
        return out

    def publish(version: int, changes: list, anchor: bool = False) -> None:
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                pubs[rank].publish(version, own(rank, changes), local[rank], anchor=anchor)
            except BaseException as exc:  # re-raised on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    return publish


def _launch(args: argparse.Namespace, root: Path, case: str, k: int) -> dict | None:
    cmd = [sys.executable, "-m", "deltasync", "bench", "first-pull"]
    cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    cmd += ["--vocab", str(args.vocab), "--tp", str(args.tp), "--deltas", str(args.deltas)]
    cmd += ["--changed", repr(args.changed), "--writers", str(args.writers)]
    cmd += ["--worker", str(root), f"{case}"]
    env = {**os.environ, "DELTASYNC_BENCH_RUN": str(k)}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        print(f"the {case} pull did not finish in {args.timeout_s:g} s", file=sys.stderr)
        return None
    result = root / f"{case}.json"
    if done.returncode != 0 or not result.exists():
        said = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        sys.stderr.write(said[-8000:])
        return None
    got = json.loads(result.read_text())
    result.unlink()
    return got


def _pull(args: argparse.Namespace, root: Path, case: str) -> None:
    """One pull in this fresh process; its figures go to ``root/<case>.json``."""
    from deltasync import LocalStore, Receiver, ReceiverConfig
    from deltasync_bench.compare.memory import current_rss, peak_rss, reset_peak, trim

    _, rl = _layouts(args)
    specs = rl.local_specs("tp0")
    expected = torch.load(root / f"{case}.pt")
    state = tempfile.mkdtemp(prefix=f"rx-{case}-", dir=root)
    trim()
    base = current_rss()  # before the live tensors exist: the peak counts them
    reset_peak()
    tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
    shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    receiver = Receiver.for_layout(
        LocalStore(str(root / "store")),
        rl,
        "tp0",
        tensors,
        state,
        ReceiverConfig(receiver_id=f"first-pull-{case}-{os.environ.get('DELTASYNC_BENCH_RUN')}"),
    )
    t0 = time.perf_counter()
    report = receiver.pull(0 if case == "anchor" else None)
    wall = time.perf_counter() - t0
    peak = peak_rss()
    receiver.close()
    out = {
        "case": case,
        "exact": _same_bits(tensors, expected),
        "chain": list(report.chain),
        "shard_bytes": shard_bytes,
        "peak_bytes": peak - base,
        "peak_over_shard": (peak - base) / shard_bytes,
        "wall_s": wall,
        "stage_s": report.stage_s,
        "verify_s": report.verify_s,
        "pause_s": report.pause_s,
        "bytes_fetched": report.bytes_fetched,
    }
    (root / f"{case}.json").write_text(json.dumps(out))


def _same_bits(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``expected``, and no other, bit for bit (int16 views: BF16)."""
    return set(expected) == set(tensors) and all(
        torch.equal(tensors[n].view(torch.int16), expected[n].view(torch.int16)) for n in tensors
    )


def _report(runs: dict[str, list[dict]], *, writers: int = 1) -> int:
    rows, cases = [], []
    for case, got in runs.items():
        worst = max(got, key=lambda r: r["peak_over_shard"])
        fastest = min(got, key=lambda r: r["wall_s"])
        exact = all(r["exact"] for r in got)
        rows.append(
            [
                case,
                len(worst["chain"]),
                f"{worst['shard_bytes'] / 2**20:.1f}",
                f"{worst['bytes_fetched'] / 2**20:.1f}",
                f"{worst['peak_over_shard']:.2f}x",
                f"{fastest['wall_s']:.2f}",
                f"{fastest['stage_s']:.2f} / {fastest['verify_s']:.2f} / {fastest['pause_s']:.2f}",
                "yes" if exact else "NO",
            ]
        )
        cases.append(
            {
                "case": case,
                "versions": len(worst["chain"]),
                "shard_bytes": worst["shard_bytes"],
                "bytes_fetched": worst["bytes_fetched"],
                "peak_over_shard": worst["peak_over_shard"],
                "peaks_over_shard": [r["peak_over_shard"] for r in got],
                "wall_s": fastest["wall_s"],
                "stage_s": fastest["stage_s"],
                "verify_s": fastest["verify_s"],
                "pause_s": fastest["pause_s"],
                "exact": exact,
            }
        )
    print_table(
        f"a receiver's first pull, {writers} writer(s) (peak RSS with its shard, target <= "
        f"{TARGET}x)",
        [
            "case",
            "versions",
            "shard MiB",
            "fetched MiB",
            "peak / shard",
            "wall s",
            "stage / verify / pause s",
            "exact",
        ],
        rows,
    )
    exact = all(c["exact"] for c in cases)
    worst = max(c["peak_over_shard"] for c in cases)
    failures = [f"{c['case']}: the receiver's tensors differ" for c in cases if not c["exact"]]
    emit_json(
        {
            "exact": exact,
            "failures": failures,
            "writers": writers,
            "cases": cases,
            "first_pull_peak_over_shard": worst,
            "target_peak_over_shard": TARGET,
            "met": worst <= TARGET,
        }
    )
    return 0 if exact else 1
