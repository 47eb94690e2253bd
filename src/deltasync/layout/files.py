"""Dense split of a full HF-format checkpoint into per-shard safetensors files.

``split_checkpoint`` reads a transformers ``config.json`` and a full bf16 checkpoint with
checkpoint-format (canonical) names, splits it with a :class:`ReceiverLayout`, and writes
``<out>/<shard id>.safetensors`` per distinct shard (the engine's local parameter names) plus
``<out>/shards.json`` (``[{"id", "tp_rank", "ep_rank"}, ...]``). Each file is written to a
temporary name and renamed, so a reader never sees half a file.

The whole checkpoint is held in memory while splitting (this serves anchors, dense baselines
and tests, not the sparse sync path). This module is the only I/O in ``deltasync.layout``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from deltasync.atomic import write_atomic
from deltasync.errors import LayoutError
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.receiver_layout import ReceiverLayout, ShardInfo

SHARDS_FILE = "shards.json"


def load_config(path: str | os.PathLike[str]) -> ModelSpec:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise LayoutError(f"cannot read model config {str(path)!r}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise LayoutError(f"model config {str(path)!r} is not a JSON object")
    return ModelSpec.from_hf_config(cfg)


def load_canonical_checkpoint(
    path: str | os.PathLike[str], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """Read a full checkpoint and check it holds exactly the canonical bf16 tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise LayoutError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    if spec.tie_word_embeddings:
        # Like vLLM's loader: with tied embeddings a checkpoint's lm_head.weight is skipped.
        tensors.pop("lm_head.weight", None)
    shapes = spec.canonical_shapes()
    missing = [n for n in shapes if n not in tensors]
    extra = [n for n in tensors if n not in shapes]
    if missing or extra:
        raise LayoutError(
            f"checkpoint {str(path)!r} does not match its config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != spec.dtype:
            raise LayoutError(
                f"checkpoint tensor {name!r} is {tuple(t.shape)} {t.dtype}; the config says {shape} {spec.dtype}"
            )
    return tensors


def split_checkpoint(
    *,
    config: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    engine: str,
    tp: int,
    ep: int,
    out: str | os.PathLike[str],
) -> list[ShardInfo]:
    """Write one safetensors file per distinct receiver shard and ``shards.json``; return the shards."""
    from safetensors.torch import save_file

    spec = load_config(config)
    layout = ReceiverLayout.build(spec, engine, tp, ep)
    full = load_canonical_checkpoint(checkpoint, spec)
    shards = layout.split(full)
    del full
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for info in layout.shards():
        tensors = {n: t.contiguous() for n, t in shards.pop(info.id).items()}
        write_atomic(out_dir / f"{info.id}.safetensors", lambda p, t=tensors: save_file(t, str(p)))
    listing = json.dumps([s.to_json() for s in layout.shards()], indent=1) + "\n"
    write_atomic(out_dir / SHARDS_FILE, lambda p: p.write_text(listing, encoding="utf-8"))
    return layout.shards()
