"""vLLM tier: deltas applied through the worker extension give the outputs of a fresh engine.

Run with ``pytest tests/vllm -m vllm`` after ``scripts/vllm_env.sh``: the engines run in
``.venv-vllm`` (one subprocess each), this module in whichever venv runs pytest.
A config-built tiny Qwen3 (head_dim 64: the CPU attention kernels' smallest) is trained with
AdamW; version 0 is written as a checkpoint and served; N deltas go through the wire format
into the engine with ``collective_rpc``; a second engine is started fresh from the dense BF16
checkpoint of version N. Greedy tokens and the top-5 logprobs of every step must be equal
(exact floats), and the engine's shard tensors must equal the dense split bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync.demo.policy import PolicyConfig
from deltasync.format import TensorUpdate, encode_blob
from deltasync.layout import ReceiverLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from engines_helpers import TinyTrainer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

JOB = Path(__file__).with_name("vllm_job.py")
VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [100, 3, 55, 9, 12, 200, 4]]
N_DELTAS = 3


def _config() -> dict:
    return PolicyConfig(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=256, vocab_size=203,
    ).hf_config()  # fmt: skip


def _save_checkpoint(directory: Path, cfg: dict, canonical: dict) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in canonical.items()}, str(directory / "model.safetensors")
    )
    (directory / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Versions 0..N as checkpoints and delta blobs, from a real AdamW run."""
    tmp = tmp_path_factory.mktemp("vllm")
    cfg = _config()
    trainer = TinyTrainer(cfg, lr=2e-3)
    layout = ReceiverLayout.build(trainer.spec, engine="vllm", tp=1)
    specs = layout.local_specs("tp0")
    canonical = {0: trainer.canonical_bf16()}
    _save_checkpoint(tmp / "v0", cfg, canonical[0])
    blobs = []
    for version in range(1, N_DELTAS + 1):
        trainer.step()
        routed = layout.route_changes(trainer.canonical_changes())["tp0"]
        updates = [
            TensorUpdate(name=n, shape=specs[n].shape, dtype=torch.bfloat16, indices=i, values=v)
            for n, (i, v) in routed.items()
        ]
        path = tmp / f"v{version}.blob"
        path.write_bytes(
            encode_blob(
                updates, version=version, base_version=version - 1, shard="tp0", writer="w0"
            )
        )
        blobs.append([version, str(path)])
    canonical[N_DELTAS] = trainer.canonical_bf16()
    _save_checkpoint(tmp / f"v{N_DELTAS}", cfg, canonical[N_DELTAS])
    for v in (0, N_DELTAS):
        torch.save(layout.split(canonical[v]), tmp / f"split{v}.pt")
    return {"tmp": tmp, "blobs": blobs, "layout": layout}


def _job(run, name: str, **spec) -> dict:
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: run scripts/vllm_env.sh first"
    tmp = run["tmp"]
    spec = {"prompts": PROMPTS, "max_tokens": 6, "out": str(tmp / f"{name}.pt"), **spec}
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(JOB), str(tmp / f"{name}.json")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(spec["out"], weights_only=False)


def _assert_state_is_the_split(state, split: dict, dtype: torch.dtype) -> None:
    version, tensors = state
    assert version == N_DELTAS
    assert set(tensors) == set(split)
    for name, t in tensors.items():
        expected = split[name].to(dtype)  # fp32 engines hold the BF16 values widened (exact)
        view = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(t.view(view), expected.view(view)), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_after_deltas_generates_exactly_what_a_fresh_engine_at_that_version_does(run, dtype):
    tmp = run["tmp"]
    fresh = _job(run, f"fresh-{dtype}", checkpoint=str(tmp / f"v{N_DELTAS}"), dtype=dtype)
    synced = _job(
        run, f"synced-{dtype}", checkpoint=str(tmp / "v0"), dtype=dtype, mode="auto", version=0,
        load=str(tmp / "split0.pt"), blobs=run["blobs"],
    )  # fmt: skip
    (prep,) = synced["prepare"]
    if dtype == "float32":
        # oneDNN packs fp32 weights on every x86 CPU: this is the repack path, for real.
        assert prep["mode"] == "repack" and prep["packed"], prep
    assert synced["written"] > 0
    _assert_state_is_the_split(
        synced["state"], torch.load(tmp / f"split{N_DELTAS}.pt")["tp0"], getattr(torch, dtype)
    )
    assert synced["tokens"] == fresh["tokens"]
    assert synced["logprobs"] == fresh["logprobs"]
    assert synced["before"][1] != fresh["logprobs"]  # the deltas changed what the model says


def test_unpacked_mode_holds_the_split_and_matches_an_unpacked_engine_loaded_densely(run):
    tmp = run["tmp"]
    common = {"dtype": "float32", "mode": "unpacked"}
    dense = _job(
        run, "unpacked-dense", checkpoint=str(tmp / "v0"), version=N_DELTAS,
        load=str(tmp / f"split{N_DELTAS}.pt"), **common,
    )  # fmt: skip
    synced = _job(
        run, "unpacked-synced", checkpoint=str(tmp / "v0"), version=0,
        load=str(tmp / "split0.pt"), blobs=run["blobs"], **common,
    )  # fmt: skip
    assert synced["prepare"][0]["mode"] == "unpacked"
    _assert_state_is_the_split(
        synced["state"], torch.load(tmp / f"split{N_DELTAS}.pt")["tp0"], torch.float32
    )
    assert synced["tokens"] == dense["tokens"]
    assert synced["logprobs"] == dense["logprobs"]
