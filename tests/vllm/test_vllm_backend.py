"""vLLM tier: versions taken through vLLM's weight-transfer API (backend ``deltasync``) give
exactly the engine a fresh start from that version's checkpoint gives.

Run with ``pytest tests/vllm -m vllm`` after ``scripts/vllm_env.sh``: the engines run in
``.venv-vllm`` (one subprocess each, ``vllm_job.py``), this module in whichever venv runs
pytest. A config-built tiny Qwen3 (head_dim 64: the CPU attention kernels' smallest) is
trained with AdamW in the job; every version is published to a directory store with
TrainerSync and taken by ``LLM(..., weight_transfer_config={"backend": "deltasync"})`` through
the four phases. Per engine dtype:

- BF16: the parameters the engine computes with are the receiver's targets (on this AVX2 CPU
  vLLM's BF16 linear layers fall back to ``F.linear``, which reads them; where they pack,
  the ``repack`` path below takes over);
- float32: vLLM's CPU backend packs every linear weight (oneDNN), so the receiver writes BF16
  masters and the backend re-runs vLLM's post-load processing for the touched layers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from vllm_runs import TINY, as_rule_names, run_job, same_bits, table_key

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

VERSIONS = 3
CONFIG = dict(
    TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
)


MOE_CONFIG = dict(
    CONFIG,
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
_FRESH: dict[tuple, dict] = {}  # fresh engines by (checkpoint bytes, dtype, tp): started once


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def run(request, tmp_path_factory):
    """The synced engine's record, and a fresh engine started from the last good version."""
    dtype = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-{dtype}")
    synced = run_job(
        tmp,
        "synced",
        kind="synced",
        tmp=str(tmp),
        dtype=dtype,
        lr=1e-3,
        versions=VERSIONS,
        config=CONFIG,
        apply_fail_check=True,
        reinit_check=True,
        foreign_reload_check=True,
        stage_reload_check=True,
        failed_reload_check=True,
        store_reset_check=True,
        reload_report_check=True,
    )
    return {"dtype": dtype, "synced": synced, "fresh": _fresh(tmp, VERSIONS, dtype)}


def _fresh(tmp: Path, version: int, dtype: str, tp: int = 1) -> dict:
    """A fresh engine from the dense checkpoint of ``version`` in ``tmp`` (one per distinct
    checkpoint: the trainers are seeded, so several runs write the same bytes)."""
    ckpt = tmp / f"v{version}"
    digest = hashlib.sha256(
        (ckpt / "model.safetensors").read_bytes() + (ckpt / "config.json").read_bytes()
    ).hexdigest()
    key = (digest, dtype, tp)
    if key not in _FRESH:
        _FRESH[key] = run_job(tmp, "fresh", kind="fresh", checkpoint=str(ckpt), dtype=dtype, tp=tp)
    return _FRESH[key]


def _serves(live: dict, split: dict) -> bool:
    """Does the engine compute with ``split``: its non-empty parameters (packed kernels keep
    theirs apart) equal the BF16 split, widened exactly to their dtype?"""
    served = {n: t for n, t in live.items() if t.numel()}
    widened = {n: split[n].to(t.dtype) for n, t in served.items()}
    return bool(served) and same_bits(served, widened) == []


def test_each_version_through_vllms_api_generates_what_a_fresh_engine_at_that_version_does(run):
    synced, fresh = run["synced"], run["fresh"]
    tokens, logprobs = synced["gen"][VERSIONS]
    assert tokens == fresh["gen"][0]
    assert logprobs == fresh["gen"][1]  # exact floats: same kernels on the same bits
    assert synced["gen"][0] != synced["gen"][VERSIONS]  # the versions changed what it says


def test_the_workers_tensors_equal_the_dense_split_bitwise_and_vllm_records_the_version(run):
    state = run["synced"]["state"]
    assert state["shard"] == "tp0"
    assert same_bits(state["tensors"], run["synced"]["split"]) == []
    assert state["weight_version"] == VERSIONS
    assert run["synced"]["weight_version_api"] == str(VERSIONS)
    # the raw receiver pulled the same versions into plain tensors: same bits
    assert same_bits(run["synced"]["raw_tensors"], run["synced"]["split"]) == []


def test_every_update_after_the_first_applies_one_delta(run):
    chains = [t["worker_report"]["chain"] for t in run["synced"]["timings"]]
    # the first update restores the anchor the engine's checkpoint came from, then deltas
    assert chains == [(0, 1)] + [(v,) for v in range(2, VERSIONS + 1)]
    assert all(t["worker_report"]["elements_written"] > 0 for t in run["synced"]["timings"])


def test_an_engine_serves_its_previous_version_while_the_next_one_is_staged(run):
    # version 2 was staged, then the engine generated, then it was applied
    assert run["synced"]["gen_while_staging"] == run["synced"]["gen"][1]
    assert run["synced"]["gen"][2] != run["synced"]["gen"][1]


def test_a_failed_apply_leaves_no_version_named_and_the_retry_takes_it(run):
    """The worker scattered the version and could not write its state file: the worker and
    vLLM's own weight version (which tags every output) stop naming the previous version,
    and the same version sent again is taken, bitwise."""
    synced = run["synced"]
    assert "LocalStateError" in synced["apply_fail_error"], synced["apply_fail_error"]
    assert synced["weight_versions_after_apply_fail"] == [None]
    assert synced["weight_version_api_after_apply_fail"] == "unverified"
    retried = VERSIONS + 2
    assert synced["weight_version_api_after_retry"] == str(retried)
    for state in synced["states_after_retry"]:
        assert state["weight_version"] == retried
        assert same_bits(state["tensors"], synced["splits_after_retry"][state["shard"]]) == []


def test_a_trainer_restart_cancels_a_staged_update_and_a_refused_init_changes_nothing(run):
    synced = run["synced"]
    for held, after in zip(synced["reinit_held"], synced["reinit_states"], strict=True):
        assert after["weight_version"] == held["weight_version"]  # the staged one not applied
        assert same_bits(after["tensors"], held["tensors"]) == [], after["shard"]
    assert "ConfigError" in synced["bad_init_error"], synced["bad_init_error"]
    assert (
        "stroe" in synced["bad_inits"]["store"] and "check the path" in synced["bad_inits"]["store"]
    )
    assert "not a safe name" in synced["bad_inits"]["receiver_id"], synced["bad_inits"]
    assert synced["bad_inits_created"] == []
    unknown = synced["unknown_update_field"]
    assert unknown.startswith("ConfigError") and "'hint'" in unknown, unknown
    assert "version, phase, extra" in unknown, unknown
    mixed = synced["mixed_update_keys"]
    assert mixed.startswith("ConfigError") and "'1'" in mixed, mixed
    shown = synced["init_info_repr"]  # the signing key and S3 secrets were printed
    assert "engine0" in shown and "ab" * 32 not in shown, shown
    assert "hidden-secret" not in shown and "AKIA-not-shown" not in shown, shown
    taken = synced["reinit_held"][0]["weight_version"] + 1
    for state, live in zip(synced["after_reinit_states"], synced["after_reinit_live"], strict=True):
        split = synced["after_reinit_splits"][state["shard"]]
        assert state["weight_version"] == taken
        assert same_bits(state["tensors"], split) == [], state["shard"]
        # what vLLM computes with (non-empty parameters: packed kernels keep theirs apart)
        served = {n: t.to(torch.bfloat16) for n, t in live.items() if t.numel()}
        assert served and same_bits(served, {n: split[n] for n in served}) == [], state["shard"]


def test_weights_reloaded_by_vllms_own_loader_are_restored_not_reported_as_held(run):
    """vLLM's ``reload_weights`` put the version-0 checkpoint back into the engine. The
    version the workers held was then asked for again: it was answered as held, a success
    naming weights the engine no longer served (float32: the BF16 masters still hashed to
    it; a re-init trusted them too). Each time the workers restore it, bit for bit."""
    synced = run["synced"]
    held = synced["foreign_held"]
    assert synced["foreign_gen_reloaded"] != synced["foreign_gen_before"]  # it did reload
    assert synced["foreign_after_reinit"] == [None]  # a re-init no longer trusts them
    for when in ("after_send", "after_resend"):
        states, lives = synced[f"foreign_{when}"], synced[f"foreign_live_{when}"]
        for state, live in zip(states, lives, strict=True):
            split = synced["foreign_splits"][state["shard"]]
            assert state["weight_version"] == held, when
            assert same_bits(state["tensors"], split) == [], (when, state["shard"])
            assert _serves(live, split), (when, state["shard"])  # what vLLM computes with
        assert synced[f"foreign_gen_{when}"] == synced["foreign_gen_before"], when
    assert synced["foreign_version_api"] == str(held)


def test_weights_reloaded_by_vllms_own_loader_take_the_next_version_in_one_update(run):
    """Reloaded, then asked for the next version: on the in-place path (BF16) the update was
    refused ("every rank stays at its previous verified version", while the worker held none
    and vLLM still named the old version); the workers now restore the anchor and the chain
    in that same update, bit for bit."""
    synced = run["synced"]
    assert synced["foreign_next_error"] is None, synced["foreign_next_error"]
    nxt = synced["foreign_held"] + 1
    for state, live in zip(synced["foreign_next_states"], synced["foreign_next_live"], strict=True):
        split = synced["foreign_next_splits"][state["shard"]]
        assert state["weight_version"] == nxt and state["report"]["from_anchor"], state["report"]
        assert same_bits(state["tensors"], split) == [], state["shard"]
        assert _serves(live, split), state["shard"]
    assert synced["foreign_next_version_api"] == str(nxt)


def test_weights_reloaded_between_stage_and_apply_are_staged_again_not_written_over(run):
    """vLLM's ``reload_weights`` ran after the workers staged (fetched and verified) a
    version and before its apply: the delta was written onto the reloaded weights, and the
    workers, the receiver and vLLM all named the version. The apply now stages again."""
    synced = run["synced"]
    version = synced["stage_reload_version"]
    for key in ("stage_reload", "stage_reload_held"):
        for state, live in zip(synced[f"{key}_states"], synced[f"{key}_live"], strict=True):
            split = synced["stage_reload_splits"][state["shard"]]
            assert state["weight_version"] == version, (key, state["report"])
            assert state["report"]["from_anchor"], (key, state["report"])
            assert same_bits(state["tensors"], split) == [], (key, state["shard"])
            assert _serves(live, split), (key, state["shard"])
        assert synced[f"{key}_version_api"] == str(version), key


def test_a_staged_update_abandoned_by_finish_closes_vllms_session(run):
    """finish_weight_update with a staged, never applied update was refused, which left
    vLLM's session open: every later update failed with vLLM's untyped RuntimeError. It now
    drops the staged update (nothing written) and the next update lands."""
    synced = run["synced"]
    version = synced["stage_reload_version"]
    assert synced["abandoned_states"] == [version] * len(synced["abandoned_states"])
    assert synced["abandoned_error"] is None, synced["abandoned_error"]
    for state in synced["abandoned_after"]:
        assert state["weight_version"] == version + 1, state["report"]
        assert same_bits(state["tensors"], synced["abandoned_splits"][state["shard"]]) == []


def test_weights_reloaded_before_an_update_that_fails_early_are_not_reported_as_a_version(run):
    # between stage and apply, and between versions: the update failed before any verify, and
    # the worker, vLLM and the error went on naming the version verified before the reload
    synced = run["synced"]
    for case, got in synced["failed_reload"].items():
        assert got["error"] is not None and got["error"].startswith("ApplyError"), (case, got)
        assert "no rank wrote anything; every rank stays" not in got["error"], (case, got)
        assert got["versions"] == [None], (case, got)
        assert got["version_api"] == "unverified", (case, got)
    for state, live in zip(
        synced["failed_reload_states"], synced["failed_reload_live"], strict=True
    ):
        assert state["weight_version"] == synced["failed_reload_version"]
        split = synced["failed_reload_splits"][state["shard"]]
        assert same_bits(state["tensors"], split) == [] and _serves(live, split)


def test_weights_reloaded_by_vllms_own_loader_are_not_reported_as_held_until_restored(run):
    """A reload with no update after it (between versions, or while a staged update that the
    client then abandons waits): the worker stops reporting the version at once."""
    synced = run["synced"]
    assert synced["reload_report_between"] == [(None, None)]
    assert synced["reload_report_abandoned"] == [(None, None)]
    held = synced["reload_report_version"] - 1
    assert synced["reload_report_restored"] == [(held, held)]
    for state, live in zip(
        synced["reload_report_after"], synced["reload_report_live"], strict=True
    ):
        assert state["weight_version"] == synced["reload_report_version"]
        split = synced["reload_report_splits"][state["shard"]]
        assert same_bits(state["tensors"], split) == []
        assert _serves(live, split)  # what vLLM computes with


def test_a_version_staged_before_a_store_reset_is_neither_written_nor_reported(run):
    # the apply wrote the dead run's version and reported a number the store did not hold
    synced = run["synced"]
    assert synced["reset_error"] is not None and "not committed" in synced["reset_error"]
    (live,) = synced["reset_live"]
    assert _serves(live, synced["reset_held_splits"]["tp0"])
    for state in synced["reset_after"]:  # the new run's versions are taken from its anchor
        assert state["weight_version"] == 1
        assert same_bits(state["tensors"], synced["reset_after_splits"][state["shard"]]) == []


def test_a_corrupted_blob_raises_through_vllms_api_and_leaves_the_previous_version(run):
    synced = run["synced"]
    assert synced["corrupt_error"] is not None
    assert "DigestMismatchError" in synced["corrupt_error"], synced["corrupt_error"]
    after = synced["state_after_corrupt"]
    assert after["weight_version"] == VERSIONS
    # refused before any write: vLLM's own weight version still names what the worker holds
    assert synced["weight_version_api_after_corrupt"] == str(VERSIONS)
    assert same_bits(after["tensors"], synced["split"]) == []
    assert synced["gen_after_corrupt"] == synced["gen"][VERSIONS]


def test_the_write_path_matches_what_vllms_cpu_kernels_do_with_the_weights(run):
    state = run["synced"]["state"]
    if run["dtype"] == "float32":
        # oneDNN packs fp32 linear weights on every x86 CPU: BF16 masters + repack, for real
        assert state["path"] == "repack"
        assert "model.layers.0.self_attn.qkv_proj.weight" in state["packed"]
        assert set(state["mirrored"]) == set(state["tensors"])
    elif state["path"] == "inplace":
        assert state["packed"] == [] and state["mirrored"] == []
    else:  # a CPU whose BF16 kernels pack (AVX512-BF16 / AMX)
        assert state["path"] == "repack" and state["packed"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``vllm serve`` (its OpenAI server, RL routes on) driven over HTTP, and a fresh engine."""
    tmp = tmp_path_factory.mktemp("vllm-served")
    served = run_job(
        tmp,
        "served",
        kind="served",
        tmp=str(tmp),
        dtype="bfloat16",
        lr=1e-3,
        versions=VERSIONS,
        config=CONFIG,
    )
    return {"served": served, "fresh": _fresh(tmp, VERSIONS, "bfloat16")}


def test_vllm_serve_takes_each_version_over_http_and_answers_like_a_fresh_engine(served):
    out = served["served"]
    tokens, logprobs = out["gen"][VERSIONS]
    assert tokens == served["fresh"]["gen"][0]
    assert logprobs == served["fresh"]["gen"][1]
    assert out["gen"][0] != out["gen"][VERSIONS]
    assert out["weight_info"] == {"weight_version": str(VERSIONS)}


def test_vllm_serve_answers_http_500_for_a_corrupted_blob_and_keeps_serving_the_last_version(
    served,
):
    out = served["served"]
    assert out["corrupt_error"] is not None and out["corrupt_error"].startswith("HTTP 500")
    assert "does not match the manifest's digest" in out["corrupt_error"]
    assert out["paused_after_corrupt"] == {"is_paused": False}  # resumed after the failure
    assert out["weight_info_after_corrupt"] == {"weight_version": str(VERSIONS)}
    assert out["gen_after_corrupt"] == out["gen"][VERSIONS]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The trainer engine over a client whose pause, finish, cache reset or resume fails in
    transport once, and an update taken while a request is in flight (a 300-token prompt in
    the prefix cache)."""
    tmp = tmp_path_factory.mktemp("vllm-client-faults")
    config = dict(CONFIG, max_position_embeddings=512)  # room for the cached prompt
    return run_job(
        tmp, "faults", kind="client_faults", tmp=str(tmp), dtype="bfloat16", lr=1e-2, config=config
    )


def test_an_update_with_a_request_in_flight_leaves_no_kv_of_the_old_weights_in_the_cache(faults):
    """vLLM refuses to reset its prefix cache while running requests hold blocks: the reset
    after the update was ignored, and a request sharing the cached prompt computed with the
    previous version's KV under the new version's tag."""
    assert faults["inflight_error"] is None
    assert faults["inflight_version_api"] == "1"
    assert faults["inflight_after"] == faults["inflight_truth"]  # exact floats


def test_a_failed_pause_closes_the_update_it_opened_and_the_next_one_lands(faults):
    """The pause failed after the stage opened vLLM's update session: the session stayed open
    and every later update was refused ("a weight update is already active"), with an untyped
    error first."""
    assert faults["pause_error"].startswith("ApplyError"), faults["pause_error"]
    assert "version 2 was not taken" in faults["pause_error"]
    assert faults["pause_held"] == [(1, 1)]  # nothing written
    assert faults["pause_version_api"] == "1"
    assert faults["after_pause_error"] is None
    assert faults["after_pause_version_api"] == "2"


def test_a_failed_finish_after_the_write_reports_the_version_written(faults):
    """The finish failed after every rank wrote and verified version 3: the workers and vLLM's
    own tag went on naming version 2, and the session left open refused every later update."""
    assert faults["finish_error"].startswith("ApplyError"), faults["finish_error"]
    assert "version 3 was written and verified" in faults["finish_error"]
    assert faults["finish_held"] == [(3, 3)]
    assert faults["finish_version_api"] == "3"
    (state,) = faults["finish_states"]
    assert same_bits(state["tensors"], faults["finish_splits"][state["shard"]]) == []
    assert faults["after_finish_error"] is None
    assert faults["after_finish_version_api"] == "4"
    (state,) = faults["after_finish_states"]
    assert state["weight_version"] == 4
    assert same_bits(state["tensors"], faults["after_finish_splits"][state["shard"]]) == []


def test_a_failed_cache_reset_or_resume_is_typed_and_never_hides_the_updates_own_error(faults):
    assert faults["reset_error"].startswith("ApplyError"), faults["reset_error"]
    assert "version 5 was taken, but vLLM did not reset its prefix cache" in faults["reset_error"]
    assert faults["reset_version_api"] == "5"
    # the corrupted blob's refusal, not the ConnectionError of the resume after it
    assert faults["resume_error"].startswith("ApplyError"), faults["resume_error"]
    assert "does not match the manifest's digest" in faults["resume_error"]
    assert faults["resume_held"] == [(5, 5)]


def test_a_version_out_of_range_is_refused_before_any_request_and_the_next_update_lands(served):
    # 2**64 reached vLLM as an HTTP 400 that left the update session open: every later
    # update failed ("a weight update is already active")
    out = served["served"]
    error = out["huge_version_error"]
    assert error is not None and error.startswith("ConfigError") and "version" in error, error
    assert out["weight_info_after_huge"] == {"weight_version": str(VERSIONS + 2)}


@pytest.fixture(scope="module", params=["qwen3-moe", "tp2"])
def variant(request, tmp_path_factory):
    """Qwen3-MoE (vLLM 0.32 names its experts ``mlp.experts.routed_experts.w13_weight``) and
    TP=2 (two worker processes, each its own shard), two versions each. Both publish with the
    layout probed from the running engine's workers (and the workers hold the same file)."""
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    moe = request.param == "qwen3-moe"
    tp = 1 if moe else 2
    synced = run_job(
        tmp,
        "synced",
        kind="synced",
        tmp=str(tmp),
        dtype="bfloat16",
        lr=1e-3,
        versions=2,
        config=MOE_CONFIG if moe else CONFIG,
        tp=tp,
        probe_layout=True,
        race_check=not moe,
        order_check=not moe,
    )
    return {"synced": synced, "fresh": _fresh(tmp, 2, "bfloat16", tp=tp), "tp": tp}


def test_qwen3_moe_and_tp2_engines_take_versions_exactly_refuse_a_corrupted_one_and_races(variant):
    synced, fresh = variant["synced"], variant["fresh"]
    assert synced["gen"][2] == fresh["gen"]  # tokens and logprobs, exact
    assert synced["gen"][0] != synced["gen"][2]
    states = synced["states"]
    assert [s["shard"] for s in states] == [f"tp{r}" for r in range(variant["tp"])]
    for state in states:
        assert same_bits(state["tensors"], synced["splits"][state["shard"]]) == []
        assert state["weight_version"] == 2
    assert "DigestMismatchError" in synced["corrupt_error"]
    assert synced["gen_after_corrupt"] == synced["gen"][2]
    # only tp0's blob was corrupted; with TP=2 the ranks agree first, so tp1 wrote nothing
    for after in synced["states_after_corrupt"]:
        assert after["weight_version"] == 2
        assert same_bits(after["tensors"], synced["splits"][after["shard"]]) == [], after["shard"]
    if variant["tp"] > 1:
        # vLLM's executor re-raised the worker's error as a RuntimeError
        assert synced["corrupt_error"].startswith("ApplyError"), synced["corrupt_error"]
        # two threads sending the next version to the one engine: one of them waited forever
        assert not synced["race_hung"] and synced["race_errors"] == [], synced["race_errors"]
        for state in synced["race_states"]:
            assert state["weight_version"] == 4
            assert same_bits(state["tensors"], synced["race_splits"][state["shard"]]) == []
        assert synced["race_version_api"] == "4"
        # calls vLLM refuses on every rank: the replies stayed in step, every update lands
        # (vLLM's own API: its executor re-raises the last rank's ConfigError as RuntimeError)
        assert "not a safe name" in synced["order_bad_init"], synced["order_bad_init"]
        one_rank = synced["order_init_one_rank"]
        assert one_rank.startswith("ConfigError") and "engine0-tp1" in one_rank, one_rank
        unstaged = synced["order_apply_unstaged"]
        assert unstaged.startswith("ConfigError") and "no update is staged" in unstaged, unstaged
        assert synced["order_apply"] is None, synced["order_apply"]
        assert synced["order_version_api"] == str(synced["order_version"])
        for state in synced["order_states"]:
            assert state["weight_version"] == synced["order_version"]
            assert same_bits(state["tensors"], synced["order_splits"][state["shard"]]) == []
        # rank 0 torn mid-scatter, then a version it cannot stage: no rank writes it (rank 0
        # replays its journal first, on its own)
        assert synced["torn_error"] is not None
        assert "DigestMismatchError" in synced["replay_error"], synced["replay_error"]
        for state, live in zip(synced["replay_states"], synced["replay_live"], strict=True):
            assert _serves(live, synced["replay_torn_splits"][state["shard"]]), state["shard"]
        for state in synced["order_final_states"]:
            assert state["weight_version"] == synced["order_final_version"]
            assert same_bits(state["tensors"], synced["order_final_splits"][state["shard"]]) == []


def test_the_layout_probed_from_every_worker_equals_the_hand_written_table(variant):
    from deltasync.layout import ModelSpec
    from deltasync.layout.probed import layout_from_json
    from deltasync.layout.vllm_rules import build_vllm_table

    tp = variant["tp"]
    config = CONFIG if tp > 1 else MOE_CONFIG
    table, shards, _ = layout_from_json(variant["synced"]["probed_layout"])
    assert [(s.id, s.tp_rank, s.ep_rank) for s in shards] == [(f"tp{r}", r, 0) for r in range(tp)]
    got = table_key(table)
    if tp == 1:  # the MoE engine: vLLM's live expert names, the rules' geometry
        got = as_rule_names(got)
    assert got == table_key(build_vllm_table(ModelSpec.from_hf_config(config), tp, 1))


def test_an_update_sent_before_the_init_is_refused_by_name_and_every_later_reply_is_its_own(
    tmp_path,
):
    # TP 2, an engine whose backend was never initialised (a vllm serve restarted under a
    # running trainer): one rank refuses, so the trainer's next init and every later call get
    # their own replies (vLLM's executor would read a refusal of every rank as the next reply)
    out = run_job(
        tmp_path,
        "uninitialised",
        kind="uninitialised",
        tmp=str(tmp_path),
        dtype="bfloat16",
        lr=1e-3,
        config=CONFIG,
        tp=2,
    )
    refused = out["uninit_error"]
    assert refused is not None and "not initialised" in refused, refused
    assert "call finish_weight_update once" in refused, refused  # what vLLM's API users do
    assert out["uninit_init_error"] is None, out["uninit_init_error"]
    for version in (0, 1):
        assert out[f"uninit_send_error_{version}"] is None, out[f"uninit_send_error_{version}"]
        states = out[f"uninit_states_{version}"]
        assert [s["shard"] for s in states] == ["tp0", "tp1"]  # this call's replies
        for state in states:
            assert state["weight_version"] == version
            split = out[f"uninit_splits_{version}"][state["shard"]]
            assert same_bits(state["tensors"], split) == [], state["shard"]
    assert out["uninit_version_api"] == "1"
    # through vLLM's own API: the refusal says to close the session the other ranks kept
    # (without it their next start is refused first and every reply shifts by one call)
    raw = out["raw_refused"]
    assert "VersionError" in raw and "call finish_weight_update once" in raw, raw
    assert out["raw_next"] is None, out["raw_next"]
    for state in out["raw_states"]:
        assert state["weight_version"] == 2
        assert same_bits(state["tensors"], out["raw_splits"][state["shard"]]) == []


def test_pipeline_parallelism_is_refused_by_name_and_later_calls_get_their_own_replies(
    tmp_path,
):
    # two pipeline stages: one worker refuses, so the next collective_rpc gets its own reply,
    # not the init's refusal
    out = run_job(
        tmp_path,
        "pipeline",
        kind="pipeline",
        tmp=str(tmp_path),
        dtype="bfloat16",
        lr=1e-3,
        config=CONFIG,
        pp=2,
    )
    refused = out["pp_init_error"]
    assert refused.startswith("ConfigError") and "pipeline_parallel_size" in refused, refused
    for call in (1, 2):
        assert out[f"pp_ranks_error_{call}"] is None, out[f"pp_ranks_error_{call}"]
        assert out[f"pp_ranks_{call}"] == [0, 1]
