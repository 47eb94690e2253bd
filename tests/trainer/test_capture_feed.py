"""The capture's detection pass also hashes the receivers' tensors (``iter_capture(sink=)``):
on a real ``transformers`` Qwen3 under real AdamW steps, the kernel's casts fed to a DigestFeed
give exactly the digest pass's entries, for chunked, single-item and grouped small parameters,
on one and two detection threads; a NaN in a chunk leaves that parameter's tensors to the pass; the capture
itself is unchanged."""

from __future__ import annotations

import pytest
import torch
from kit import build_model, tiny_layouts, tiny_qwen3

from deltasync import AdamWTracker
from deltasync.layout.digest import state_tensor_digests
from deltasync.layout.digest_feed import DigestFeed
from deltasync.trainer.positions import Positions

# gate/up/down and the embedding above the kernel's 2^20-element chunk: several chunks each,
# detected ahead on the kernel threads; attention and norms one item each
BIG = dict(
    hidden_size=256,
    intermediate_size=4608,
    vocab_size=4500,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=1,
)


def _trained(threads: int, seed: int = 0):
    cfg = tiny_qwen3(**BIG)
    model = build_model(cfg, seed=seed)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=3e-6, weight_decay=0.01)
    tracker = AdamWTracker(opt, named, threads=threads)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
        tracker.clear()
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()
    return model, named, tracker


def _capture(tracker, sink=None):
    out = {}
    for name, pos, vals in tracker.iter_capture(1 << 12, values_max=1 << 16, sink=sink):
        idx = pos.indices() if isinstance(pos, Positions) else pos
        out[name] = (idx, vals)
    return out


def _changes(tracker, stream: str, sink=None) -> dict:
    """``{name: (int64 indices, values or None)}`` from one of the two streams a sender reads:
    the capture (an overlapped sender) or the whole indices and values (a sender without
    overlap, the in-cluster inline path: each parameter's chunks joined, their casts fed on
    the way)."""
    if stream == "iter_capture":
        return _capture(tracker, sink)
    changes = tracker.iter_changes() if sink is None else tracker.iter_changes(sink=sink)
    return {n: (i, v) for n, i, v in changes}


@pytest.mark.parametrize("stream", ["iter_capture", "iter_changes"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_detection_hashes_the_receivers_tensors_as_the_pass_does(stream, threads, tp, monkeypatch):
    from deltasync.trainer import adamw_tracker

    _, tl, rl = tiny_layouts("vllm", tp=tp, **BIG)
    _, named, tracker = _trained(threads)
    params = {n: p.detach() for n, p in named}
    plain = _changes(tracker, stream)  # a pending step: asking again gives the same answer
    feed = DigestFeed(tl, rl)
    cast_groups: list[int] = []
    real = adamw_tracker.detect_adamw_group

    def spy(states, *, cast=None):
        if cast is not None:
            cast_groups.append(len(states))
        return real(states, cast=cast)

    monkeypatch.setattr(adamw_tracker, "detect_adamw_group", spy)
    fed = _changes(tracker, stream, feed)
    assert cast_groups and max(cast_groups) > 1  # small parameters cast in groups
    assert plain.keys() == fed.keys()
    for name, (idx, vals) in plain.items():
        assert torch.equal(idx, fed[name][0])
        assert (vals is None) == (fed[name][1] is None)
        if vals is not None:
            assert torch.equal(vals.view(torch.int16), fed[name][1].view(torch.int16))
    got = feed.entries()
    want = state_tensor_digests(params, trainer_layout=tl, receiver_layout=rl)
    assert got == want  # every tensor: each is whole row blocks of one parameter's rows
    assert feed.covered() == sum(
        torch.Size(e[1]).numel() for locals_ in want.values() for e in locals_.values()
    )


def test_a_nan_chunk_leaves_its_parameter_to_the_pass():
    _, tl, rl = tiny_layouts("vllm", tp=2, **BIG)
    _, named, tracker = _trained(threads=2, seed=4)
    params = {n: p.detach() for n, p in named}
    gate = next(n for n in params if "gate_proj" in n)
    params[gate].view(-1)[(1 << 20) + 3] = float("nan")  # its second chunk
    feed = DigestFeed(tl, rl)
    _capture(tracker, feed)
    got = feed.entries()
    want = state_tensor_digests(params, trainer_layout=tl, receiver_layout=rl)
    held_back = set(rl.holders(tl.resolve(gate)))
    assert held_back
    for shard, locals_ in want.items():
        for local, entry in locals_.items():
            if (shard, local) in held_back:
                assert local not in got.get(shard, {})
            else:
                assert got[shard][local] == entry


def test_a_sharded_or_unwanted_parameter_is_not_cast():
    _, tl, rl = tiny_layouts("vllm", tp=2, **BIG)
    _, named, tracker = _trained(threads=1, seed=5)
    down = next(n for n, _ in named if "down_proj" in n)
    feed = DigestFeed(tl, rl, params={n for n, _ in named} - {down})
    _capture(tracker, feed)
    got = feed.entries()
    assert got and not any("down_proj" in local for v in got.values() for local in v)


def test_the_kernels_cast_is_torchs_bit_for_bit_and_refuses_nan_and_subnormals():
    from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
    from deltasync.trainer.detect import CastBuffers, chunk_items

    g = torch.Generator().manual_seed(9)
    n = (1 << 20) + 4097  # two chunks, the second short
    p = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    p[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.0e38, -1.1754944e-38])
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    k = kernel_scalars(
        StepHyper(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, step=3
        )
    )
    buffers = CastBuffers()
    plain = [item() for item in chunk_items(p, m, v, k, values=True)]
    cast = [item() for item in chunk_items(p, m, v, k, values=True, cast=buffers)]
    start = 0
    for (idx, vals), (idx_c, vals_c, bits) in zip(plain, cast, strict=True):
        assert torch.equal(idx, idx_c) and torch.equal(
            vals.view(torch.int16), vals_c.view(torch.int16)
        )
        want = p[start : start + bits.numel()].to(torch.bfloat16)
        assert torch.equal(bits.view(torch.int16), want.view(torch.int16))
        start += bits.numel()
        buffers.give(bits)
    assert start == n
    for bad in (float("nan"), 1e-40):  # a NaN, an fp32 subnormal: torch decides those
        q = p.clone()
        q[(1 << 20) + 5] = bad
        first, second = (item() for item in chunk_items(q, m, v, k, values=True, cast=buffers))
        assert first[2] is not None and second[2] is None


def test_after_a_two_step_version_a_one_step_version_is_the_kernels_again():
    # two optimizer steps in one version fold into a bitset; clear() keeps it zeroed, and a
    # later one-step version is detected straight from its step again (values and casts),
    # with the same answer the bitset would give
    _, tl, rl = tiny_layouts("vllm", tp=2, **BIG)
    _, named, tracker = _trained(threads=2, seed=8)
    g = torch.Generator().manual_seed(99)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    tracker._opt.step()  # a second step in this version: folded into bitsets
    two = _capture(tracker)
    assert tracker._bits and all(tracker._folded(n) for n in tracker._bits)
    tracker.clear()
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    tracker._opt.step()
    assert not any(tracker._folded(n) for n in tracker._bits)
    feed = DigestFeed(tl, rl)
    one = _capture(tracker, feed)
    params = {n: p.detach() for n, p in named}
    assert feed.entries() == state_tensor_digests(params, trainer_layout=tl, receiver_layout=rl)
    assert one.keys() and two.keys()
    # the bitset's answer for the same step: fold it (a step on top would) and ask again
    tracker._finalize()
    again = _capture(tracker)
    for name, (idx, _) in one.items():
        assert torch.equal(idx, again[name][0]), name
