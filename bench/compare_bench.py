"""``deltasync bench compare`` (also plain ``deltasync bench``): dense vs snapshot vs deltasync.

Presets: ``small`` (a tiny Qwen3, lr 3e-6, store unthrottled / 1 Gbit/s / in-cluster; a few
minutes here) and ``full`` (Qwen3-0.6B shape at lr 1e-6/3e-6/1e-5 and a Qwen3-MoE shape at
3e-6; store unthrottled / 1 / 10 Gbit/s and in-cluster) -- docs/benchmarks.md's run. The last
stdout line is JSON; its headline block is lr 3e-6 at the first emulated link rate.

Per system and path, in one run: ``trainer_overhead_s`` (wall time of a training step with
sync minus without: the trainer runs a stand-in forward/backward of ``--fwd-bwd-s`` after each
sync, once alone and once with the sync in flight), ``detect_s`` (the system's detection
alone), ``latency_s`` (= ``total_s``: end of the optimizer step -> every receiver verified at
v), ``floor_s`` and ``latency_over_floor`` (see ``compare/floor.py``), ``bytes``, and the peak
memory of each role (``trainer_overhead_bytes`` above model + optimizer,
``receiver_peak_rss_bytes``, ``receiver_overhead_bytes`` above interpreter + torch). Every
version is checked exact: each receiver's state digest against the trainer's dense split, and
every system (every round) must have run on the same versions: the digests of that dense split
at each version equal across them. A version that is not exact, warm-up included, marks its
system's rows and per-path JSON ``exact`` false and is named in the JSON's ``failures``.

Every flag is checked before anything is written or measured (``--out`` is created only
then): a bad value is a ConfigError (exit 2) naming the flag, never a run that measures
nothing and reports success. ``--link-gbps`` takes rates > 0 (the unthrottled store path runs
by default; ``--no-unthrottled`` skips it); a rate given twice runs once.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import asdict

from deltasync.errors import ConfigError
from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync_bench.common import emit_json
from deltasync_bench.compare.floor import floor_of, measure_memory_gbps
from deltasync_bench.compare.report import plot, table
from deltasync_bench.compare.run import PathSpec, RunConfig, SystemRun, medians, run_system
from deltasync_bench.compare.workload import MODELS, Workload

PRESETS = {
    "small": dict(
        models=["qwen3-small"], lrs=[3e-6], links=[1.0], steps=2, warmup=1, fwd_bwd_s=0.25
    ),
    "full": dict(
        models=["qwen3-0.6b", "qwen3-moe-small"],
        lrs=[1e-6, 3e-6, 1e-5],
        links=[1.0, 10.0],
        steps=2,
        warmup=1,
        moe_lrs=[3e-6],
        fwd_bwd_s=2.0,
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument(
        "--model", choices=sorted(MODELS), action="append", help="override the preset's models"
    )
    p.add_argument("--lr", type=float, action="append", help="override the preset's learning rates")
    p.add_argument("--link-gbps", type=float, action="append", help="emulated per-node link rates")
    p.add_argument("--steps", type=int, help="measured versions per path")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems this many times, alternating their order, and pool the versions "
        "(on a shared machine a slow minute then lands on every system; default 1)",
    )
    p.add_argument(
        "--warmup", type=int, help="untimed delta versions after the bootstrap (default: 1)"
    )
    p.add_argument(
        "--pre-steps",
        type=int,
        help="unsynced AdamW steps before version 0 (default 10; fewer move more elements "
        "per version, which favours the baselines)",
    )
    p.add_argument(
        "--no-unthrottled",
        action="store_true",
        help="skip the unthrottled store path (only the --link-gbps rates, and in-cluster)",
    )
    p.add_argument("--systems", default="dense,snapshot,deltasync")
    p.add_argument("--no-cluster", action="store_true", help="skip the in-cluster (gloo) path")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every role (default 1; the trainer's detection threads follow it)",
    )
    p.add_argument(
        "--fwd-bwd-s",
        type=float,
        help="seconds of the stand-in forward/backward after each sync (default: the preset's)",
    )
    p.add_argument(
        "--fwd-bwd-on",
        choices=["cpu", "device"],
        default="cpu",
        help="cpu: the forward/backward computes on the trainer's cores; device: the host "
        "waits, as for a GPU trainer, leaving its cores to a background publish",
    )
    p.add_argument("--out", default="bench_out", help="directory for the PNG plot")


def _floor(res: dict[str, dict], model_bytes: int, gbps: float | None, memory_gbps: float):
    """The path's floor from its measured medians: the fewest bytes any system sent, and the
    busiest shard's changed elements (the fewest any system reports: snapshot's exact change
    set, deltasync's; none when neither ran)."""
    payload = min(m["bytes"] for m in res.values())
    per_shard = [m["max_shard_elements"] for m in res.values() if m.get("max_shard_elements")]
    shard_elements = int(max(m["shard_bytes"] for m in res.values()) // 2)
    scatter = min(per_shard) if per_shard else 0
    return floor_of(
        trainer_elements=model_bytes // 2,
        payload_bytes=payload,
        link_gbps=gbps,
        memory_gbps=memory_gbps,
        shard_elements=shard_elements,
        scatter_elements=int(scatter),
    )


def _round_latencies(by_round: list[dict[str, SystemRun]], path: str) -> dict[str, list]:
    """Each system's median latency on ``path`` in each round (None: no version measured)."""
    out: dict[str, list] = {}
    for got in by_round:
        for s, one in got.items():
            recs = [r.total_s for r in one.records if r.path == path]
            out.setdefault(s, []).append(statistics.median(recs) if recs else None)
    return out


def _rounds_line(path: str, per_round: dict[str, list]) -> str:
    """One line per path: deltasync's latency ratio against each other system, round by round
    (the spread says how much of a pooled ratio is the machine)."""
    mine = per_round.get("deltasync")
    if mine is None:
        return f"  {path}: no deltasync rows"
    parts = []
    for s, theirs in per_round.items():
        if s == "deltasync":
            continue
        ratios = [
            f"{t / d:.2f}" if t is not None and d else "-"
            for t, d in zip(theirs, mine, strict=True)
        ]
        parts.append(f"vs {s} {' '.join(ratios)}")
    return f"  {path}, deltasync per round: {'; '.join(parts)}"


def _version_mismatches(by_round: list[dict[str, SystemRun]]) -> list[tuple[str, str]]:
    """``(system, message)`` for every system run whose trainer's BF16 params (the digests of
    their dense split) differ at some version from the first run's: systems are compared on
    the same versions, or not at all. Versions a failed run never reached are not compared."""
    runs = [
        (f"{s} (round {r + 1})" if len(by_round) > 1 else s, s, one)
        for r, got in enumerate(by_round)
        for s, one in got.items()
    ]
    if not runs:
        return []
    ref_label, _, ref = runs[0]
    out = []
    for label, system, one in runs[1:]:
        for version in sorted(one.expected.keys() & ref.expected.keys()):
            if one.expected[version] != ref.expected[version]:
                out.append(
                    (
                        system,
                        f"{label} v{version}: the trainer's BF16 params differ from "
                        f"{ref_label}'s (the systems did not run on the same versions)",
                    )
                )
                break
    return out


SYSTEMS = ("dense", "snapshot", "deltasync")


def _flag_int(flag: str, value: int, lo: int) -> int:
    if value < lo:
        raise ConfigError(f"{flag} must be an int >= {lo}, got {value}")
    return value


def _flag_number(flag: str, value: float, *, zero_ok: bool = False, hint: str = "") -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(
            f"{flag} must be a finite number {bound}, got {value}" + (f"; {hint}" if hint else "")
        )
    return value


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} exists and is not a directory; pass a directory")


def main(args: argparse.Namespace) -> int:
    # Every flag first: nothing is created or measured for a run that cannot start.
    _flag_int("--threads", args.threads, 1)
    _flag_int("--rounds", args.rounds, 1)
    _flag_int("--tp", args.tp, 1)
    pre = dict(PRESETS[args.preset])
    models = list(dict.fromkeys(args.model or pre["models"]))
    links = list(dict.fromkeys(args.link_gbps or pre["links"]))  # a rate given twice runs once
    for g in links:
        _flag_number(
            "--link-gbps",
            g,
            hint="the unthrottled store path runs by default (--no-unthrottled skips it)",
        )
    steps = pre["steps"] if args.steps is None else _flag_int("--steps", args.steps, 1)
    warmup = pre["warmup"] if args.warmup is None else _flag_int("--warmup", args.warmup, 0)
    if args.pre_steps is not None:
        _flag_int("--pre-steps", args.pre_steps, 0)
    for lr in args.lr or ():
        _flag_number("--lr", lr)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ConfigError(
            f"--systems: unknown system(s) {unknown} (choose from {', '.join(SYSTEMS)})"
            if unknown
            else "--systems names no system"
        )
    fwd_bwd_s = pre["fwd_bwd_s"] if args.fwd_bwd_s is None else args.fwd_bwd_s
    _flag_number("--fwd-bwd-s", fwd_bwd_s, zero_ok=True)
    _check_out(args.out)
    paths = [] if args.no_unthrottled else [PathSpec(kind="store")]
    paths += [PathSpec(kind="store", gbps=g) for g in links]
    if not args.no_cluster:
        paths.append(PathSpec(kind="cluster"))
    plan = []  # (model, lr, workload, run config), every one valid before anything runs
    for model in models:
        lrs = args.lr or (pre.get("moe_lrs", pre["lrs"]) if "moe" in model else pre["lrs"])
        for lr in dict.fromkeys(lrs):
            extra = {} if args.pre_steps is None else {"pre_steps": args.pre_steps}
            wl = Workload(model=model, lr=lr, **extra)
            cfg = RunConfig(
                workload=wl,
                systems=systems,
                paths=tuple(paths),
                tp=args.tp,
                steps=steps,
                warmup=warmup,
                fwd_bwd_s=fwd_bwd_s,
                fwd_bwd_on=args.fwd_bwd_on,
                threads=args.threads,
            )
            # the receivers' shards: a TP the model cannot be split by is refused here
            rlayout = ReceiverLayout.build(
                ModelSpec.from_hf_config(wl.hf_config()), engine="vllm", tp=args.tp
            )
            plan.append((model, lr, wl, cfg, len(rlayout.shards())))
    os.makedirs(args.out, exist_ok=True)
    memory_gbps = measure_memory_gbps()
    print(
        f"memory read bandwidth {memory_gbps:.1f} GB/s; forward/backward {fwd_bwd_s:g} s on "
        f"{args.fwd_bwd_on}"
    )
    runs, all_exact, headline, failures = [], True, None, []
    for model, lr, wl, cfg, n_rx in plan:
        print(f"== {model} lr={lr:g} TP={args.tp}: {', '.join(systems)}", flush=True)
        sys_runs = {s: SystemRun(system=s) for s in systems}
        by_round: list[dict[str, SystemRun]] = []
        for r in range(args.rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            if args.rounds > 1:
                print(f"-- round {r + 1} of {args.rounds}: {', '.join(order)}", flush=True)
            got = {s: run_system(cfg, s, n_rx) for s in order}
            by_round.append(got)
            for s, one in got.items():
                pooled = sys_runs[s]
                pooled.model_bf16_bytes = one.model_bf16_bytes
                pooled.records += one.records
                pooled.exact &= one.exact
                if one.bootstrap_rx_mem is not None:
                    pooled.bootstrap_rx_mem = max(
                        one.bootstrap_rx_mem, pooled.bootstrap_rx_mem or 0.0
                    )
                failures += one.failures
        for s, message in _version_mismatches(by_round):
            print(f"  NOT EXACT: {message}", flush=True)
            sys_runs[s].exact = False
            failures.append(message)
        model_bytes = next(iter(sys_runs.values())).model_bf16_bytes
        # the exact change set where snapshot ran (its bitwise diff), per path
        truth = sys_runs.get("snapshot", sys_runs[systems[0]]).records
        by_path, floors = {}, {}
        for path in paths:
            res = {}
            changed = [
                r.changed_elements
                for r in truth
                if r.path == path.label and r.changed_elements is not None
            ]
            for s, sr in sys_runs.items():
                recs = [r for r in sr.records if r.path == path.label]
                all_exact &= sr.exact
                if not recs:  # its run ended before this path (see NOT EXACT above)
                    print(f"  {s}: no version measured on {path.label}", flush=True)
                    continue
                m = medians(recs)
                m["changed_fraction"] = (
                    (sorted(changed)[len(changed) // 2] / (model_bytes / 2)) if changed else None
                )
                # not exact: any of its versions on this path, or any before (warm-up
                # included), since every later version builds on it
                m["exact"] = m["exact"] and sr.exact
                m["bootstrap_rx_mem_over_shard"] = sr.bootstrap_rx_mem
                res[s] = m
                all_exact &= m["exact"]
            if not res:
                continue
            fl = _floor(res, model_bytes, path.gbps, memory_gbps)
            floors[path.label] = fl.total_s
            for m in res.values():
                m["floor_s"] = fl.total_s
                m["latency_over_floor"] = m["total_s"] / fl.total_s if fl.total_s else None
            by_path[path.label] = res
            table(f"{model}, lr={lr:g}, {path.label}", res, model_bytes, fl.total_s)
            per_round = _round_latencies(by_round, path.label)
            if args.rounds > 1:
                print(_rounds_line(path.label, per_round), flush=True)
            runs.append(
                {
                    "model": model,
                    "lr": lr,
                    "path": path.label,
                    "link_gbps": path.gbps,
                    "model_bf16_bytes": model_bytes,
                    "floor": fl.to_json(),
                    "results": res,
                    "round_latency_s": per_round,
                }
            )
            if path.gbps == links[0] and (headline is None or not headline["preferred"]):
                # lr 3e-6 on the first emulated link; until one comes (another --lr, a
                # failed run), the first run on that link, in the same shape
                headline = {
                    "preferred": lr == 3e-6,
                    "workload": {**asdict(wl), "tp": args.tp, "model_bf16_bytes": model_bytes},
                    "link_gbps": path.gbps,
                    "floor": fl.to_json(),
                    "fwd_bwd_s": fwd_bwd_s,
                    "fwd_bwd_on": args.fwd_bwd_on,
                    "results": res,
                }
        png = plot(
            by_path,
            os.path.join(args.out, f"bench_{model}_lr{lr:g}.png"),
            f"{model}, lr={lr:g}, vLLM TP={args.tp}",
            floors,
        )
        if png:
            print(f"plot: {png}")
    if headline is None:  # no run on the first emulated link: the fields stay, empty
        headline = dict.fromkeys(("workload", "link_gbps", "floor", "fwd_bwd_s", "fwd_bwd_on"))
        headline["results"] = {}
    headline.pop("preferred", None)
    emit_json({**headline, "exact": all_exact, "failures": failures, "runs": runs})
    return 0 if all_exact else 1
