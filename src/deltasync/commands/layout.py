"""``deltasync layout split``: write a full HF checkpoint as per-receiver-shard safetensors.

    deltasync layout split --config CONFIG.json --checkpoint FULL.safetensors \\
        --engine vllm --tp N [--ep M] --out DIR

writes ``DIR/<shard id>.safetensors`` (the engine's local parameter names) for every distinct
shard and ``DIR/shards.json``. A thin projection of :func:`deltasync.layout.files.split_checkpoint`.
"""

from __future__ import annotations

import argparse

from deltasync.layout.receiver_layout import ENGINES


def _split(args: argparse.Namespace) -> int:
    from deltasync.layout.files import split_checkpoint

    shards = split_checkpoint(
        config=args.config,
        checkpoint=args.checkpoint,
        engine=args.engine,
        tp=args.tp,
        ep=args.ep,
        out=args.out,
    )
    print(f"wrote {len(shards)} shard(s) to {args.out}: {', '.join(s.id for s in shards)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layout", help="receiver layouts: split a full checkpoint into engine shards"
    )
    inner = p.add_subparsers(dest="layout_command", metavar="ACTION")
    inner.required = True
    s = inner.add_parser(
        "split",
        help="write a full HF-format bf16 checkpoint as one safetensors file per receiver shard",
        description="Split a full HF-named bf16 checkpoint into one safetensors file per distinct "
        "receiver shard (engine-local names) plus shards.json.",
    )
    s.add_argument("--config", required=True, help="transformers config.json of the model")
    s.add_argument(
        "--checkpoint",
        required=True,
        help="full checkpoint (.safetensors, checkpoint-format names)",
    )
    s.add_argument(
        "--engine", choices=ENGINES, default="vllm", help="receiver convention (default: vllm)"
    )
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size; 1 = off (default: 1)")
    s.add_argument("--out", required=True, help="output directory")
    s.set_defaults(func=_split)
