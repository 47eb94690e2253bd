"""Layout probe cost: seconds and peak memory to learn a Qwen3-0.6B-shaped model's layouts.

The model: hidden 1024, 28 layers, 16 q / 8 kv heads of 128, intermediate 3072, vocabulary
151936, tied embeddings (596 M parameters). Each case runs in its own child process, so its
peak RSS is its own:

- ``vllm-reference tp=T``: ``probe_shard`` on :class:`VllmReferenceLoader` for every TP rank
  in turn (one rank's model alive at a time), assembled into one table;
- ``transformers``: ``probe_shard`` on the transformers ``Qwen3ForCausalLM`` (built on the meta
  device, then given uninitialised storage: no random init);
- ``cache hit``: reading the probed TP-2 layout back from a :class:`ProbeCache` file.

Reported per case: probe seconds, passes, the model's own RSS, the process's peak RSS and the
probe's extra peak (peak minus the model alone), and whether the learned table equals the
hand-written one (``vllm`` rules / ``hf`` rules) block for block: a probe that is fast but wrong
fails the run.

    python bench/probe_bench.py [--tp 1 2] [--round-elements 33554432]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from deltasync_bench.common import emit_json, print_table

QWEN3_06B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "tie_word_embeddings": True,
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _same(a, b) -> bool:
    def key(t):
        placements = {
            n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in t.placements.items()
        }
        return placements, t.dst_shapes, t.aliases

    return key(a) == key(b)


def run_case(case: str, tp: int, round_elements: int, cache_dir: str) -> dict:
    """One case in this process; returns its measurements."""
    from deltasync.layout import ModelSpec, ShardInfo
    from deltasync.layout.hf_model import build_hf_table
    from deltasync.layout.probe import ProbeConfig, probe_shard
    from deltasync.layout.probed import ProbeCache, assemble_table, probe_key
    from deltasync.layout.reference_loader import VllmReferenceLoader
    from deltasync.layout.vllm_rules import build_vllm_table, vllm_shards

    spec = ModelSpec.from_hf_config(QWEN3_06B)
    canon = spec.canonical_shapes()
    config = ProbeConfig(round_elements=round_elements)
    out: dict = {"case": case, "tp": tp}
    base = _rss()
    if case == "vllm-reference":
        probes, seconds, model_rss = {}, 0.0, 0
        for sid, t, e in vllm_shards(spec, tp, 1):
            loader = VllmReferenceLoader(spec, tp=tp, tp_rank=t, ep=1, ep_rank=e)
            model_rss = max(model_rss, _rss() - base)
            t0 = time.perf_counter()
            probes[sid] = probe_shard(loader, canon, config=config)
            seconds += time.perf_counter() - t0
            del loader
        table = assemble_table(canon, probes)
        out["exact"] = _same(table, build_vllm_table(spec, tp, 1))
        out["passes"] = sum(p.passes for p in probes.values())
        shards = [ShardInfo(sid, t, e) for sid, t, e in vllm_shards(spec, tp, 1)]
        ProbeCache(cache_dir).put(probe_key(QWEN3_06B, case, {"tp": tp, "ep": 1}), table, shards)
    elif case == "transformers":
        import transformers

        from deltasync.layout.hf_model import TransformersLoader, empty_model

        model = empty_model(transformers.AutoConfig.for_model(**QWEN3_06B))
        model_rss = _rss() - base
        t0 = time.perf_counter()
        probe = probe_shard(TransformersLoader(model), canon, config=config)
        seconds = time.perf_counter() - t0
        table = assemble_table(canon, {"tp0": probe})
        out["exact"] = _same(table, build_hf_table(spec))
        out["passes"] = probe.passes
    elif case == "cache-hit":
        key = probe_key(QWEN3_06B, "vllm-reference", {"tp": tp, "ep": 1})
        model_rss = 0
        t0 = time.perf_counter()
        hit = ProbeCache(cache_dir).get(key)
        seconds = time.perf_counter() - t0
        out["exact"] = hit is not None and _same(hit[0], build_vllm_table(spec, tp, 1))
        out["passes"] = 0
    else:
        raise SystemExit(f"unknown case {case!r}")
    out.update(
        seconds=round(seconds, 3),
        model_rss_mib=round(model_rss / 2**20, 1),
        peak_rss_mib=round(_peak() / 2**20, 1),
        probe_extra_mib=round(max(0, _peak() - base - model_rss) / 2**20, 1),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--round-elements", type=int, default=1 << 25)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:  # child process: one case, one JSON line
        res = run_case(args.case, args.tp[0], args.round_elements, args.cache_dir)
        print(json.dumps(res), flush=True)
        return
    results = []
    with tempfile.TemporaryDirectory() as cache_dir:
        plan = [("vllm-reference", tp) for tp in args.tp] + [("transformers", 1)]
        plan.append(("cache-hit", args.tp[-1]))
        for case, tp in plan:
            cmd = [
                sys.executable,
                __file__,
                "--case",
                case,
                "--tp",
                str(tp),
                "--round-elements",
                str(args.round_elements),
                "--cache-dir",
                cache_dir,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"case {case} tp={tp} failed")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = [
        [
            r["case"],
            r["tp"],
            r["seconds"],
            r["passes"],
            r["model_rss_mib"],
            r["peak_rss_mib"],
            r["probe_extra_mib"],
            r["exact"],
        ]
        for r in results
    ]
    print_table(
        "layout probe, Qwen3-0.6B shape (596 M parameters)",
        [
            "case",
            "tp",
            "seconds",
            "passes",
            "model MiB",
            "peak RSS MiB",
            "probe extra MiB",
            "equals hand table",
        ],
        rows,
    )
    ok = all(r["exact"] for r in results)
    emit_json(
        {
            "bench": "probe",
            "model": "qwen3-0.6b-shape",
            "round_elements": args.round_elements,
            "exact": ok,
            "cases": results,
        }
    )
    if not ok:
        raise SystemExit("a probed table differs from the hand-written one")


if __name__ == "__main__":
    main()
