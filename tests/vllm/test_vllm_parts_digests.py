"""vLLM tier: a vLLM CPU engine (backend ``deltasync``, through vLLM's weight-transfer API)
takes versions that two FSDP writers published WITHOUT the full state (each shard's digest a
parts digest, checked with the receiver layout; vLLM's padded vocabulary rows are in no part):
every version bit-exactly, a version whose writer-1 part digest is wrong refused by name with
the tensors unchanged, and the next anchor taken after it; a padding row scribbled in the
engine's embedding is seen as drift (the engine restores the newest anchor under the next
delta: exact, padding zero again) instead of the delta being applied over it."""

from __future__ import annotations

import pytest
import torch
from vllm_runs import TINY, run_job, same_bits

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

VERSIONS = 4  # anchor 0, deltas 1 and 2, anchor 3, delta 4; 5 is the wrong one, 6 an anchor
CONFIG = dict(
    TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-parts")
    return run_job(
        tmp,
        "parts",
        kind="parts",
        tmp=str(tmp),
        dtype="bfloat16",
        lr=1e-3,
        versions=VERSIONS,
        config=CONFIG,
    )


def test_every_parts_digest_version_lands_bit_exactly_in_the_engine(parts):
    for version in range(1, VERSIONS + 1):
        assert all(d.startswith("w2:") for d in parts["listed"][version].values())
        (state,) = parts["states"][version]
        assert state["weight_version"] == version
        assert same_bits(state["tensors"], parts["splits"][version]["tp0"]) == [], version
    # vLLM pads the vocabulary 203 -> 256 rows: rows no writer owns, zero in the engine
    embed = state["tensors"]["model.embed_tokens.weight"]
    assert embed.shape[0] == 256
    assert not embed[203:].view(torch.int16).any()


def test_a_version_with_a_wrong_part_digest_is_refused_by_name_and_changes_nothing(parts):
    wrong = VERSIONS + 1
    assert parts["listed"][wrong]["tp0"].startswith("w2:")
    error = parts["wrong_error"]
    assert error is not None, "the engine took a version whose parts digest is wrong"
    assert "IntegrityError" in error and f"versions [{wrong}]" in error, error
    (before,) = parts["states"][VERSIONS]
    (after,) = parts["states_after_wrong"]
    assert same_bits(after["tensors"], before["tensors"]) == []
    assert after["weight_version"] != wrong
    assert parts["weight_version_api_after_wrong"] != str(wrong)
    (state,) = parts["states_after_next"]
    assert state["weight_version"] == wrong + 1
    assert same_bits(state["tensors"], parts["splits_after_next"]["tp0"]) == []


def test_a_scribbled_padding_row_in_the_engine_is_restored_not_kept_under_the_next_delta(parts):
    assert parts["scribbled"] == [True]
    version = VERSIONS + 3
    assert parts["padding_error"] is None, parts["padding_error"]
    (state,) = parts["states_after_padding"]
    assert state["weight_version"] == version
    report = state["report"]  # seen: restored from the newest anchor (6), then the delta
    assert report["from_anchor"] and tuple(report["chain"]) == (version - 1, version), report
    assert same_bits(state["tensors"], parts["splits_after_padding"]["tp0"]) == []
