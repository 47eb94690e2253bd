"""DigestFeed: receiver tensors hashed from their parameters' BF16 bits as they pass, in chunks
of any size, give exactly the entries the digest pass computes; anything out of order, failed
or missing is left to the pass, never guessed."""

from __future__ import annotations

import pytest
import torch

from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout, digest_feed
from deltasync.layout.digest import combine_entries, state_digests, state_tensor_digests
from deltasync.layout.digest_feed import DigestFeed
from tests.layout.test_layout_digests import CONFIGS

_LAYOUTS = [("hf", 1, 1), ("vllm", 1, 1), ("vllm", 2, 1), ("vllm", 4, 1), ("vllm", 2, 2)]
CASES = [
    (name, *lay)
    for name, cfg in CONFIGS.items()
    for lay in _LAYOUTS
    if lay[2] == 1 or cfg["model_type"] == "qwen3_moe"
]


def _setup(name: str, engine: str, tp: int, ep: int, seed: int = 3):
    spec = ModelSpec.from_hf_config(CONFIGS[name])
    tl = TrainerLayout.build(spec)
    rl = ReceiverLayout.build(spec, engine=engine, tp=tp, ep=ep)
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}
    return tl, rl, params


def _feed_all(feed: DigestFeed, params, chunk: int, order=None) -> None:
    for n in order or params:
        bits = params[n].reshape(-1).to(torch.bfloat16)
        for s in range(0, bits.numel(), chunk):
            feed.feed(n, s, bits[s : s + chunk])


def _truth(tl, rl, params):
    return state_tensor_digests(params, trainer_layout=tl, receiver_layout=rl)


@pytest.mark.parametrize("name,engine,tp,ep", CASES)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 20])
def test_fed_entries_equal_the_digest_pass(name, engine, tp, ep, chunk):
    tl, rl, params = _setup(name, engine, tp, ep)
    feed = DigestFeed(tl, rl)
    _feed_all(feed, params, chunk)
    got = feed.entries()
    want = _truth(tl, rl, params)
    fed = [(s, local) for s, locals_ in got.items() for local in locals_]
    assert fed, "a Qwen3 layout has tensors made of whole row blocks"
    for s, local in fed:
        assert got[s][local] == want[s][local], (s, local)
    # every tensor made only of row blocks of single-span canonical tensors is fed: for these
    # layouts that is all of them (row-parallel column blocks included)
    assert sum(len(v) for v in got.values()) == sum(len(v) for v in want.values())
    # the pass with the fed entries as its keep set gives the state digests unchanged
    keep = state_tensor_digests(params, trainer_layout=tl, receiver_layout=rl, keep=got)
    assert combine_entries(keep) == state_digests(params, trainer_layout=tl, receiver_layout=rl)


@pytest.mark.parametrize("buffer", [3, 64, 1000])
def test_column_blocks_hashed_through_a_small_row_buffer_give_the_same_entries(monkeypatch, buffer):
    # a buffer of a few rows (several pieces a block) and one narrower than a row (each row
    # copied on its own): the entries are the digest pass's either way
    monkeypatch.setattr(digest_feed, "_ROW_BUFFER_ELEMENTS", buffer)
    tl, rl, params = _setup("qwen3_odd_vocab_kv_lt_tp", "vllm", 2, 1)
    feed = DigestFeed(tl, rl)
    _feed_all(feed, params, 1 << 20)
    want = _truth(tl, rl, params)
    assert feed.entries() == want
    assert any("o_proj" in local for locals_ in want.values() for local in locals_)


def test_a_changed_element_changes_the_fed_digest():
    tl, rl, params = _setup("qwen3_odd_vocab_kv_lt_tp", "vllm", 2, 1)
    feed = DigestFeed(tl, rl)
    _feed_all(feed, params, 100)
    before, truth_before = feed.entries(), _truth(tl, rl, params)
    name = next(n for n in params if "o_proj" in n)  # a row-parallel column block
    params[name].view(-1)[40] += 1.0  # row 0, a column of the second shard's half
    feed = DigestFeed(tl, rl)
    _feed_all(feed, params, 100)
    after, truth_after = feed.entries(), _truth(tl, rl, params)

    def changed(a, b):
        return {(s, local) for s in a for local in a[s] if a[s][local] != b[s][local]}

    assert changed(before, after) == changed(truth_before, truth_after) == {("tp1", name)}


def test_parameters_out_of_order_leave_their_fused_tensors_to_the_pass():
    tl, rl, params = _setup("qwen3_odd_vocab_kv_lt_tp", "vllm", 2, 1)
    order = list(params)
    q = next(n for n in order if n.endswith("q_proj.weight"))
    k = next(n for n in order if n.endswith("k_proj.weight"))
    order.remove(k)
    order.insert(order.index(q), k)  # k before q: qkv_proj's rows would come out of order
    feed = DigestFeed(tl, rl)
    _feed_all(feed, params, 50, order)
    got = feed.entries()
    want = _truth(tl, rl, params)
    layer = q.split(".self_attn")[0]
    for s, locals_ in got.items():
        for local, entry in locals_.items():
            assert entry == want[s][local]
            assert not (local.startswith(layer + ".") and "qkv_proj" in local), local
    missing = [(s, loc) for s in want for loc in want[s] if loc not in got.get(s, {})]
    assert missing and all("qkv_proj" in loc for _, loc in missing)


def test_a_failed_or_unfed_parameter_leaves_its_tensors_to_the_pass():
    tl, rl, params = _setup("qwen3_untied", "vllm", 2, 1)
    gate = next(n for n in params if "gate_proj" in n)
    norm = next(n for n in params if n.endswith("input_layernorm.weight"))
    feed = DigestFeed(tl, rl)
    for n in params:
        if n == norm:
            continue  # never fed (a path that does not cast)
        bits = params[n].reshape(-1).to(torch.bfloat16)
        half = bits.numel() // 2
        feed.feed(n, 0, bits[:half])
        if n == gate:
            feed.fail(n)  # e.g. a NaN in its second chunk
        feed.feed(n, half, bits[half:])
    got = feed.entries()
    want = _truth(tl, rl, params)
    held_back = set(rl.holders(tl.resolve(gate))) | set(rl.holders(tl.resolve(norm)))
    for s in want:
        for local in want[s]:
            if (s, local) in held_back:
                assert local not in got.get(s, {})
            else:
                assert got[s][local] == want[s][local]


def test_a_chunk_skipped_is_never_hashed_around():
    tl, rl, params = _setup("qwen3_untied", "vllm", 1, 1)
    name = next(n for n in params if "down_proj" in n)
    feed = DigestFeed(tl, rl)
    for n in params:
        bits = params[n].reshape(-1).to(torch.bfloat16)
        for s in range(0, bits.numel(), 64):
            if n == name and s == 128:
                continue  # one chunk lost
            feed.feed(n, s, bits[s : s + 64])
    assert all(
        name.removesuffix(".weight") not in local
        for loc in feed.entries().values()
        for local in loc
    )


def test_only_the_named_parameters_are_fed():
    tl, rl, params = _setup("qwen3_untied", "vllm", 2, 1)
    first = next(iter(params))
    feed = DigestFeed(tl, rl, params={first})
    assert feed.wants(first) and not any(feed.wants(n) for n in params if n != first)


def test_bad_bits_fail_the_parameter_instead_of_hashing_them():
    tl, rl, params = _setup("qwen3_untied", "vllm", 1, 1)
    feed = DigestFeed(tl, rl)
    for n, p in params.items():
        feed.feed(n, 0, p.reshape(-1) if "up_proj" in n else p.reshape(-1).to(torch.bfloat16))
    got = feed.entries()
    assert got and not any("gate_up" in loc for v in got.values() for loc in v)
