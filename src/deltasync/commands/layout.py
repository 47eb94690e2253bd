"""``deltasync layout``: probe an engine's layout, split a checkpoint into shards, merge it back.

    deltasync layout probe --config CONFIG.json --engine {transformers,vllm-reference} \\
        [--tp N] [--ep M] [--out LAYOUT.json] [--cache DIR]
    deltasync layout split --config CONFIG.json --checkpoint CKPT \\
        (--engine {hf,vllm} --tp N [--ep M] | --layout LAYOUT.json) --out DIR
    deltasync layout merge --config CONFIG.json --shards DIR \\
        (--engine {hf,vllm} | --layout LAYOUT.json) --out FULL.safetensors

``probe`` learns the layout from the engine's own loader and prints it as JSON (or saves it
with ``--out``; ``--cache`` reuses an earlier probe of the same config, engine and parallel
sizes). ``split`` takes a ``.safetensors`` file, a sharded checkpoint's
``model.safetensors.index.json`` or a checkpoint directory, and writes
``DIR/<shard id>.safetensors`` (the engine's local parameter names) for every distinct shard and
``DIR/shards.json``; ``merge`` is its inverse. Thin projections of
:mod:`deltasync.layout.probed` and :mod:`deltasync.layout.files`.
"""

from __future__ import annotations

import argparse
import json
import sys

from deltasync.layout.receiver_layout import ENGINES


def _count(text: str) -> int:
    """An element count as --help and the README write it: ``33554432`` or ``2^25``."""
    base, caret, exp = text.strip().partition("^")
    try:
        if not caret:
            return int(base)
        if base.strip() == "2" and exp.strip().isdigit() and int(exp) <= 62:
            return 2 ** int(exp)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not an element count (an int, or 2^N)")


PROBE_ENGINES = ("transformers", "vllm-reference", "vllm")


def _probe(args: argparse.Namespace) -> int:
    from deltasync.layout.files import load_config_dict
    from deltasync.layout.probe import ProbeConfig
    from deltasync.layout.probed import ProbeCache, layout_to_json, probe_engine_layout, save_layout

    cfg = load_config_dict(args.config)
    probe_config = ProbeConfig(round_elements=args.round_elements)
    if args.engine == "vllm":
        layout, key, seconds = _probe_vllm(cfg, args, probe_config)
    else:
        layout, key, seconds = probe_engine_layout(
            cfg,
            args.engine,
            tp=args.tp,
            ep=args.ep,
            config=probe_config,
            cache=ProbeCache(args.cache) if args.cache else None,
        )
    if args.out:
        save_layout(args.out, layout.table, layout.shards(), key)
        blocks = sum(len(p) for p in layout.table.placements.values())
        print(
            f"probed {len(layout.table.src_shapes)} tensors into {len(layout.shards())} shard(s) "
            f"({blocks} blocks) in {seconds:.2f} s: {args.out}"
        )
    else:
        sys.stdout.write(json.dumps(layout_to_json(layout.table, layout.shards(), key)) + "\n")
    return 0


def _probe_vllm(cfg: dict, args: argparse.Namespace, probe_config) -> tuple:
    """Probe a real vLLM engine started for ``cfg`` (random weights), through the cache."""
    import time

    from deltasync.engines.vllm_probe import probe_vllm_config, vllm_probe_key
    from deltasync.errors import LayoutError
    from deltasync.layout.probed import ProbeCache

    if args.ep != 1:
        raise LayoutError(
            "--engine vllm probes tensor parallelism only (--ep 1): expert parallelism inside "
            "vLLM has not run here; --engine vllm-reference probes EP layouts"
        )
    key = vllm_probe_key(cfg, tp=args.tp)  # first: names the remedy when vLLM is missing
    t0 = time.perf_counter()
    cache = ProbeCache(args.cache) if args.cache else None
    layout = probe_vllm_config(cfg, tp=args.tp, config=probe_config, cache=cache)
    return layout, key, time.perf_counter() - t0


def _split(args: argparse.Namespace) -> int:
    from deltasync.layout.files import split_checkpoint

    shards = split_checkpoint(
        config=args.config,
        checkpoint=args.checkpoint,
        engine=args.engine,
        tp=args.tp,
        ep=args.ep,
        out=args.out,
        layout_file=args.layout,
    )
    print(f"wrote {len(shards)} shard(s) to {args.out}: {', '.join(s.id for s in shards)}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from deltasync.layout.files import merge_checkpoint

    res = merge_checkpoint(
        config=args.config,
        shards_dir=args.shards,
        engine=args.engine,
        out=args.out,
        layout_file=args.layout,
    )
    print(
        f"merged {len(res['shards'])} shard(s) into {res['tensors']} tensors "
        f"({res['elements']} elements): {args.out}"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layout",
        help="receiver layouts: probe an engine's loader, split a checkpoint into shards, merge",
    )
    inner = p.add_subparsers(dest="layout_command", metavar="ACTION")
    inner.required = True

    pr = inner.add_parser(
        "probe",
        help="learn a receiver layout from an engine's own weight loader; print or save JSON",
        description="Drive the engine model's load_weights with element-identifying values and "
        "write the layout it produced as JSON (the table split/merge and receivers use).",
    )
    pr.add_argument("--config", required=True, help="transformers config.json of the model")
    pr.add_argument(
        "--engine",
        choices=PROBE_ENGINES,
        default="vllm-reference",
        help="transformers: the transformers class's own loading (the trainer / hf layout); "
        "vllm-reference: deltasync's vLLM-convention reference loader (default); "
        "vllm: the installed vLLM's own model class, in an engine started for the probe",
    )
    pr.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    pr.add_argument("--ep", type=int, default=1, help="expert-parallel size; 1 = off (default: 1)")
    pr.add_argument("--out", help="write the layout JSON here (default: print it)")
    pr.add_argument("--cache", help="probe cache directory (one file per config/engine/sizes)")
    pr.add_argument(
        "--round-elements",
        type=_count,
        default=1 << 25,
        help="checkpoint elements fed per probe round, an int or 2^N; bounds memory "
        "(default: 2^25)",
    )
    pr.set_defaults(func=_probe)

    s = inner.add_parser(
        "split",
        help="write a full HF-format bf16 checkpoint as one safetensors file per receiver shard",
        description="Split a full HF-named bf16 checkpoint (a .safetensors file, a "
        "model.safetensors.index.json or a directory) into one safetensors file per distinct "
        "receiver shard (engine-local names) plus shards.json.",
    )
    s.add_argument("--config", required=True, help="transformers config.json of the model")
    s.add_argument(
        "--checkpoint",
        required=True,
        help="full checkpoint: .safetensors file, model.safetensors.index.json or directory",
    )
    s.add_argument(
        "--engine", choices=ENGINES, default="vllm", help="receiver convention (default: vllm)"
    )
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size; 1 = off (default: 1)")
    s.add_argument("--layout", help="split by this probed layout file instead of --engine/--tp")
    s.add_argument("--out", required=True, help="output directory")
    s.set_defaults(func=_split)

    m = inner.add_parser(
        "merge",
        help="rebuild the full checkpoint from the shard files 'layout split' wrote",
        description="Merge DIR/<shard id>.safetensors (listed in DIR/shards.json) back into one "
        "full checkpoint with checkpoint-format names; replicas must agree bit for bit.",
    )
    m.add_argument("--config", required=True, help="transformers config.json of the model")
    m.add_argument("--shards", required=True, help="directory written by 'layout split'")
    m.add_argument(
        "--engine", choices=ENGINES, default="vllm", help="receiver convention (default: vllm)"
    )
    m.add_argument("--layout", help="the probed layout file the shards were split by")
    m.add_argument("--out", required=True, help="full checkpoint to write (.safetensors)")
    m.set_defaults(func=_merge)
