"""AdamWTracker against the bitwise truth (SnapshotTracker): never a missed element."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltasync import AdamWTracker, SnapshotTracker
from deltasync.errors import UnsupportedOptimizerError

IMPLS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def _compare(
    tracked: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]
) -> tuple[int, int, int]:
    """(missed, extra, true) element counts; also checks the output contract."""
    missed = extra = true = 0
    for name, idx in tracked.items():
        assert idx.dtype == torch.int64 and idx.dim() == 1 and idx.numel() > 0
        assert bool((idx[1:] > idx[:-1]).all()), f"{name}: indices not strictly increasing"
    for name in set(tracked) | set(truth):
        a = tracked.get(name, torch.empty(0, dtype=torch.int64))
        b = truth.get(name, torch.empty(0, dtype=torch.int64))
        inter = torch.isin(b, a).sum().item()
        missed += b.numel() - inter
        extra += a.numel() - inter
        true += b.numel()
    return missed, extra, true


def _check_values(tracker, named) -> dict[str, torch.Tensor]:
    """``changed_values()`` gives the indices of ``changed()`` and, bit for bit, torch's BF16
    cast of the current params at them (the values a delta carries)."""
    params = dict(named)
    pairs = tracker.changed_values()
    changed = tracker.changed()  # asking twice gives the same answer
    assert set(pairs) == set(changed)
    for name, (idx, vals) in pairs.items():
        assert torch.equal(idx, changed[name])
        want = params[name].detach().reshape(-1)[idx].to(torch.bfloat16)
        assert vals.dtype == torch.bfloat16 and torch.equal(
            vals.view(torch.int16), want.view(torch.int16)
        )
    return changed


def _params(shapes, scale=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * scale) for s in shapes]


def _run(ps, opt, steps_per_version=1, versions=3, grad_scale=1.0, seed=0, sched=None, skip=()):
    named = [(f"p{i}", p) for i, p in enumerate(ps)]
    tracker = AdamWTracker(opt, named)
    truth = SnapshotTracker(named)
    g = torch.Generator().manual_seed(seed)
    totals = [0, 0, 0]
    for v in range(versions):
        for s in range(steps_per_version):
            for i, p in enumerate(ps):
                p.grad = (
                    None if (v, s, i) in skip else torch.randn(p.shape, generator=g) * grad_scale
                )
            opt.step()
            if sched is not None:
                sched.step()
        missed, extra, true = _compare(_check_values(tracker, named), truth.changed())
        assert missed == 0, f"version {v}: {missed} changed elements missed"
        totals = [totals[0] + missed, totals[1] + extra, totals[2] + true]
        tracker.clear()
        truth.clear()
    tracker.close()
    return totals


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("lr", [1e-7, 3e-6, 1e-4, 1e-3])
@pytest.mark.parametrize("wd", [0.0, 1e-2, 1e-1])
def test_tracker_never_misses_an_element_for_any_adamw_implementation(impl, lr, wd):
    ps = _params([(64, 96), (1000,)], seed=int(lr * 1e7) + int(wd * 100))
    opt = torch.optim.AdamW(ps, lr=lr, weight_decay=wd, **IMPLS[impl])
    _missed, extra, true = _run(ps, opt)
    assert true > 0
    assert extra <= 0.05 * true + 20, f"too loose: {extra} extra for {true} true"


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize(
    "betas,eps", [((0.9, 0.999), 1e-8), ((0.8, 0.95), 1e-6), ((0.0, 0.9999), 1e-12)]
)
def test_betas_and_eps_variants_are_covered(impl, betas, eps):
    ps = _params([(50, 70)], seed=3)
    opt = torch.optim.AdamW(ps, lr=1e-5, betas=betas, eps=eps, weight_decay=0.01, **IMPLS[impl])
    _run(ps, opt, versions=2)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_late_steps_with_converged_bias_correction_are_covered(impl):
    ps = _params([(40, 40)], seed=4)
    opt = torch.optim.AdamW(ps, lr=3e-6, weight_decay=0.1, **IMPLS[impl])
    ps[0].grad = torch.randn_like(ps[0])
    opt.step()
    st = opt.state[ps[0]]
    st["step"] = torch.tensor(1500.0) if isinstance(st["step"], torch.Tensor) else 1500
    _run(ps, opt, versions=2)
    assert float(opt.state[ps[0]]["step"]) == 1502


@pytest.mark.parametrize("impl", list(IMPLS))
def test_several_steps_per_version_with_a_scheduler_changing_lr_after_each_step(impl):
    ps = _params([(32, 64), (500,)], seed=5)
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.05, **IMPLS[impl])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 3 * s))
    _run(ps, opt, steps_per_version=4, versions=3, sched=sched)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_params_without_gradients_are_reported_unchanged(impl):
    ps = _params([(30, 30), (30, 30)], seed=6)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **IMPLS[impl])
    named = [("a", ps[0]), ("b", ps[1])]
    tracker = AdamWTracker(opt, named)
    ps[0].grad = torch.randn_like(ps[0])
    opt.step()
    changed = tracker.changed()
    assert "a" in changed and "b" not in changed
    # b without grad again, a too: nothing moves, nothing is reported after clear
    tracker.clear()
    ps[0].grad = None
    opt.step()
    assert tracker.changed() == {}
    _run(ps, opt, skip={(0, 0, 1), (1, 0, 0)})


@pytest.mark.parametrize("impl", list(IMPLS))
def test_steps_skipped_by_grad_scaler_report_nothing(impl):
    ps = _params([(20, 20)], seed=7)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **IMPLS[impl])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    named = [("w", ps[0])]
    tracker, truth = AdamWTracker(opt, named), SnapshotTracker(named)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        scaler.scale((ps[0] * x).sum()).backward()
        scaler.step(opt)
        scaler.update()

    step(torch.randn(20, 20))  # a finite step moves weights
    m, _, t = _compare(tracker.changed(), truth.changed())
    assert m == 0 and t > 0
    tracker.clear(), truth.clear()
    before = ps[0].detach().clone()
    step(torch.full((20, 20), float("inf")))  # inf gradients: the scaler skips the step
    assert torch.equal(before.view(torch.int32), ps[0].detach().view(torch.int32))
    assert tracker.changed() == {} and truth.changed() == {}
    step(torch.randn(20, 20))  # and the next finite step is tracked again
    m, _, t = _compare(tracker.changed(), truth.changed())
    assert m == 0 and t > 0


def _adversarial_values(n_each: int, seed: int) -> torch.Tensor:
    """fp32 values exactly at and a few ulps around BF16 rounding midpoints, ±0, subnormals,
    huge magnitudes."""
    g = torch.Generator().manual_seed(seed)
    b = (
        (torch.randn(n_each, generator=g) * 0.05)
        .to(torch.bfloat16)
        .view(torch.int16)
        .to(torch.int32)
    )
    mid = (b << 16) | 0x8000  # fp32 bit pattern halfway between two BF16 values
    parts = [mid + k for k in range(-3, 4)]
    parts.append(torch.tensor([0, -(2**31)], dtype=torch.int32))  # +0, -0
    parts.append(
        torch.randint(1, 0x7FFFFF, (n_each,), generator=g, dtype=torch.int32)
    )  # +subnormal
    parts.append(torch.randint(1, 0x7FFFFF, (n_each,), generator=g, dtype=torch.int32) | -(2**31))
    parts.append(torch.randint(0x7E000000, 0x7F000000, (n_each,), generator=g, dtype=torch.int32))
    parts.append(torch.randint(0x00800000, 0x01800000, (n_each,), generator=g, dtype=torch.int32))
    return torch.cat(parts).view(torch.float32).clone()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("lr,wd", [(1e-7, 0.0), (3e-6, 0.1), (1e-3, 1e-2)])
def test_adversarial_values_at_bf16_midpoints_zeros_subnormals_and_large_exponents(impl, lr, wd):
    for seed in range(3):
        p = torch.nn.Parameter(_adversarial_values(400, seed))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, **IMPLS[impl])
        g = torch.Generator().manual_seed(100 + seed)
        # tiny and sign-mixed gradients so updates land on both sides of the midpoints
        grads = [
            torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-12, 1, p.shape, generator=g)
            for _ in range(3)
        ]
        named = [("x", p)]
        tracker, truth = AdamWTracker(opt, named), SnapshotTracker(named)
        for gr in grads:
            p.grad = gr
            opt.step()
            missed, _, _ = _compare(_check_values(tracker, named), truth.changed())
            assert missed == 0
            tracker.clear(), truth.clear()


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_amsgrad_and_maximize_are_covered_by_the_bound(flag):
    ps = _params([(40, 50)], seed=8)
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **{flag: True})
    tracker = AdamWTracker(opt, [("p0", ps[0])])
    assert tracker.fallback == {}
    _run(ps, opt, versions=3)


def test_plain_adam_with_l2_weight_decay_is_covered():
    ps = _params([(40, 50)], seed=9)
    opt = torch.optim.Adam(ps, lr=1e-4, weight_decay=0.01)
    _run(ps, opt, versions=3)


def test_uncovered_configurations_fall_back_to_an_exact_snapshot():
    p_sgd = torch.nn.Parameter(torch.randn(100))
    sgd = torch.optim.SGD([p_sgd], lr=0.1)
    t = AdamWTracker(sgd, [("w", p_sgd)])
    assert "SGD" in t.fallback["w"].reason
    before = p_sgd.detach().to(torch.bfloat16).view(torch.int16).clone()
    p_sgd.grad = torch.randn(100)
    sgd.step()
    after = p_sgd.detach().to(torch.bfloat16).view(torch.int16)
    truth = torch.nonzero(before != after).reshape(-1)
    assert truth.numel() > 0 and torch.equal(t.changed()["w"], truth)

    p16 = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    p32 = torch.nn.Parameter(torch.randn(64))
    outside = torch.nn.Parameter(torch.randn(64))
    # capturable=True cannot step on CPU; the classification is what matters here
    cap = AdamWTracker(torch.optim.AdamW([p32], lr=1e-3, capturable=True), [("cap", p32)])
    assert "capturable" in cap.fallback["cap"].reason
    cap.close()
    opt = torch.optim.AdamW([p32, p16], lr=1e-3)
    named = [("fp32", p32), ("bf16", p16), ("outside", outside)]
    t2, oracle = AdamWTracker(opt, named), SnapshotTracker(named)
    assert set(t2.fallback) == {"bf16", "outside"}
    with torch.no_grad():
        outside[5] += 1.0  # modified outside the optimizer: only a snapshot can see this
    p32.grad, p16.grad = torch.randn(64), torch.randn(64).to(torch.bfloat16)
    opt.step()
    ch = _check_values(t2, named)
    assert 5 in ch["outside"].tolist()
    missed, _extra, true = _compare(ch, oracle.changed())
    assert missed == 0 and true > 0
    for name in ("bf16", "outside"):  # the snapshot fallback is exact, not just a superset
        assert torch.equal(ch[name], oracle.changed()[name])


def test_native_kernel_and_torch_fallback_produce_the_same_mask():
    from deltasync.native import loader as native
    from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
    from deltasync.trainer.detect import (
        bits_to_indices,
        bitset_bytes,
        detect_adamw_,
        detect_adamw_changes,
    )

    if native.load() is None:
        pytest.fail(f"C kernel did not build: {native.build_error}")
    g = torch.Generator().manual_seed(11)
    n = (1 << 20) + 77  # crosses a chunk boundary and ends mid-byte
    p = torch.cat([_adversarial_values(1000, 1), torch.randn(n, generator=g) * 0.02])
    m = torch.randn(p.shape, generator=g) * 1e-3
    v = torch.rand(p.shape, generator=g) * 1e-6
    for step, wd in itertools.product([1, 7, 5000], [0.0, 0.1]):
        k = kernel_scalars(
            StepHyper(
                lr=3e-6,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=wd,
                decoupled=True,
                step=step,
            )
        )
        a = torch.zeros(bitset_bytes(p.numel()), dtype=torch.uint8)
        b = torch.zeros_like(a)
        detect_adamw_(p, m, v, k, a, threads=2)
        detect_adamw_(p, m, v, k, b, force_torch=True)
        assert torch.equal(a, b)
        idx, _values = detect_adamw_changes(p, m, v, k, threads=2)  # the list kernel
        assert torch.equal(idx, bits_to_indices(b, p.numel()))


def test_changed_values_cover_a_chunk_boundary_and_values_the_kernel_declines():
    # > 1 M elements crosses a detection chunk; NaN-free subnormals and huge values among the
    # flagged ones make the C gather decline a chunk, which torch then casts.
    n = (1 << 20) + 300
    g = torch.Generator().manual_seed(21)
    base = torch.randn(n, generator=g) * 0.02
    base[:4000] = _adversarial_values(500, 3)[:4000]
    p = torch.nn.Parameter(base)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    named = [("w", p)]
    tracker, truth = AdamWTracker(opt, named), SnapshotTracker(named)
    for _ in range(2):
        p.grad = torch.randn(n, generator=g)
        opt.step()
        missed, _, _ = _compare(_check_values(tracker, named), truth.changed())
        assert missed == 0
        pairs = truth.changed_values()  # the oracle's values are the same cast
        for _name, (idx, vals) in pairs.items():
            want = p.detach().reshape(-1)[idx].to(torch.bfloat16)
            assert torch.equal(vals.view(torch.int16), want.view(torch.int16))
        tracker.clear(), truth.clear()


def _stepped_tracker(shapes, *, threads=None, seed=3, steps=1):
    ps = _params(shapes, seed=seed)
    opt = torch.optim.AdamW(ps, lr=1e-3)
    named = [(f"p{i}", p) for i, p in enumerate(ps)]
    tracker = AdamWTracker(opt, named, threads=threads)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return tracker, dict(named)


def _same_stream(a, b) -> None:
    assert [n for n, *_ in a] == [n for n, *_ in b]
    for (name, ia, va), (_, ib, vb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib), name
        assert (va is None) == (vb is None), name
        if va is not None:
            assert torch.equal(va.view(torch.int16), vb.view(torch.int16)), name


# many small tensors (detected ahead on the threads), one above a work item (chunked)
SHAPES = [(64, 48)] * 9 + [(3, 5), (1100, 1000), (257,)]


def _count_taken(monkeypatch, method: str) -> list[str]:
    """The names whose results ``Lookahead.<method>`` handed over from the threads."""
    from deltasync.trainer import detect

    taken: list[str] = []
    original = getattr(detect.Lookahead, method)

    def counting(self, name):
        got = original(self, name)
        if got is not None:
            taken.append(name)
        return got

    monkeypatch.setattr(detect.Lookahead, method, counting)
    return taken


def test_small_params_detected_ahead_on_threads_equal_one_at_a_time_bit_for_bit(monkeypatch):
    taken = _count_taken(monkeypatch, "take")
    tracker, _ = _stepped_tracker(SHAPES, threads=2)
    ahead = list(tracker.iter_changes())
    several, _ = _stepped_tracker(SHAPES, threads=2, steps=2)  # a bitset per param: in order
    _same_stream(
        list(several.iter_changes()),
        list(_stepped_tracker(SHAPES, threads=1, steps=2)[0].iter_changes()),
    )
    # the small ones came from the detection threads, the first ten as one group
    assert taken[0] == tuple(f"p{i}" for i in range(10)) and "p11" in taken
    ahead_idx = list(tracker.iter_changed())
    one_at_a_time, _ = _stepped_tracker(SHAPES, threads=1)
    _same_stream(ahead, list(one_at_a_time.iter_changes()))
    _same_stream(
        [(n, i, None) for n, i in ahead_idx],
        [(n, i, None) for n, i in one_at_a_time.iter_changed()],
    )
    assert len(ahead) == len(SHAPES)


# chunked parameters (above one work item) between small ones: their chunks run ahead
# across the parameter boundaries
MIXED = [(1100, 1000), (64, 48), (2100, 1000), (3, 5), (1500, 900), (257,)]


def test_large_params_chunks_run_ahead_across_parameters_equal_one_at_a_time(monkeypatch):
    taken = _count_taken(monkeypatch, "take_items")
    ahead, _ = _stepped_tracker(MIXED, threads=2)
    alone, _ = _stepped_tracker(MIXED, threads=1)
    truth = list(alone.iter_changes())
    got = list(ahead.iter_positions())
    assert sorted(taken) == ["p0", "p2", "p4"]  # every chunked one came from the threads
    assert [n for n, _ in got] == [n for n, *_ in truth]
    for (name, pos), (_, idx, _) in zip(got, truth, strict=True):
        assert torch.equal(pos.indices(), idx), name
    taken.clear()
    _same_stream(list(ahead.iter_changes()), truth)  # with values, from the threads too
    assert sorted(taken) == ["p0", "p2", "p4"]
    captured = list(ahead.iter_capture(1 << 40))
    for (name, pos, vals), (_, idx, want) in zip(captured, truth, strict=True):
        got_idx = pos if isinstance(pos, torch.Tensor) else pos.indices()
        assert torch.equal(got_idx, idx), name
        assert vals is None or torch.equal(vals.view(torch.int16), want.view(torch.int16)), name
    stream = ahead.iter_positions()  # abandoned after one parameter, the next ones in flight
    next(stream)
    stream.close()
    again = list(ahead.iter_positions())
    for (name, pos), (_, idx, _) in zip(again, truth, strict=True):
        assert torch.equal(pos.indices(), idx), name


def test_a_group_of_small_params_is_one_kernel_call_equal_to_each_alone_bit_for_bit(monkeypatch):
    from deltasync.trainer import detect
    from deltasync.trainer.adamw_bound import KernelScalars

    g = torch.Generator().manual_seed(5)
    k = KernelScalars(
        bc2s=0.03, eps=1e-8, step_size=1e-3, inv_c=1.0, rel_s=2e-7, rel_u=2e-7, abs_e=1e-30
    )

    def state(n):
        return (
            torch.randn(n, generator=g) * 0.02,
            torch.randn(n, generator=g) * 1e-3,
            torch.rand(n, generator=g) * 1e-6,
            k,
        )

    alone = detect.detect_adamw_changes
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return alone(*args, **kwargs)

    monkeypatch.setattr(detect, "detect_adamw_changes", counted)
    group = [state(n) for n in (64, 0, 3000, 1, 70_000)]
    buffers = detect.CastBuffers()
    for cast in (None, buffers):
        got = detect.detect_adamw_group(group, cast=cast)
        assert len(got.found) == len(group) and not calls  # one kernel call for all five
        assert (got.shared is None) == (cast is None)
        for (p, m, v, kk), (idx, vals, bits) in zip(group, got.found, strict=True):
            want_idx, want_vals = detect.detect_adamw_changes(p, m, v, kk, threads=1)
            calls.clear()
            assert want_idx.numel() > 0 or p.numel() <= 1
            assert torch.equal(idx, want_idx)
            assert torch.equal(vals.view(torch.int16), want_vals.view(torch.int16))
            if cast is None:
                assert bits is None
            else:  # every element's BF16 bits, a view of the group's one buffer
                assert torch.equal(bits.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
    # what the kernel declines (a strided view; a flagged subnormal) is detected one by one
    p, m, v, _ = state(4000)
    strided = (p[::2], m[::2], v[::2], k)
    odd = state(500)
    odd[0][7] = 1e-40  # an fp32 subnormal among the flagged values
    for members in ([group[0], strided], [group[0], odd]):
        for cast in (None, detect.CastBuffers()):
            calls.clear()
            got = detect.detect_adamw_group(members, cast=cast)
            assert calls == [64, members[1][0].numel()]  # each on its own, without bits
            assert got.shared is None and all(bits is None for *_, bits in got.found)
            if cast is not None:  # a buffer it took (the kernel ran, then declined) is back
                assert len(cast._free) == len(cast._made) == (members[1] is odd)
            for (pp, mm, vv, kk), (idx, vals, _) in zip(members, got.found, strict=True):
                want_idx, want_vals = alone(pp, mm, vv, kk, threads=1)
                assert torch.equal(idx, want_idx)
                assert torch.equal(vals.view(torch.int16), want_vals.view(torch.int16))
    with pytest.raises(ValueError, match="at most"):
        detect.detect_adamw_group([state(1 << 19), state((1 << 19) + 1)])


def test_small_params_go_to_the_threads_in_groups_bounded_by_size_and_order(monkeypatch):
    from deltasync.trainer import adamw_tracker, detect

    # 300 K elements each: above GROUP_NUMEL, alone; 100 K: grouped, up to GROUP_ELEMENTS
    shapes = [(100, 1000)] * 12 + [(300, 1000), (16,), (100, 1000), (1100, 1000), (8,)]
    tracker, params = _stepped_tracker(shapes, threads=2)
    pending = {e[0]: e for e in tracker._pending}
    chunked = {n for n in tracker._order if tracker._chunked_step(n, pending)}
    keys, group_of = tracker._work_keys(pending, chunked, lambda _: False)
    flat = [n for key in keys for n in (key if isinstance(key, tuple) else (key,))]
    assert flat == [f"p{i}" for i in range(len(shapes))]  # every one, in order
    for key in keys:
        if isinstance(key, tuple):
            assert len(key) > 1
            assert sum(params[n].numel() for n in key) <= detect.GROUP_ELEMENTS
            assert all(params[n].numel() <= detect.GROUP_NUMEL for n in key)
            assert all(group_of[n] == key for n in key)
    assert keys[:2] == [tuple(f"p{i}" for i in range(10)), ("p10", "p11")]
    assert keys[2:] == ["p12", ("p13", "p14"), "p15", "p16"]
    # a group's members are all cast for a sink, or none
    keys, _ = tracker._work_keys(pending, chunked, lambda n: n == "p1")
    assert keys[:3] == ["p0", "p1", tuple(f"p{i}" for i in range(2, 12))]
    keys, _ = tracker._work_keys(pending, chunked, lambda n: n in ("p1", "p2"))
    assert keys[:3] == ["p0", ("p1", "p2"), tuple(f"p{i}" for i in range(3, 12))]
    # against each parameter detected alone (no groups), with one and with two threads
    alone, _ = _stepped_tracker(shapes, threads=1)
    with monkeypatch.context() as m:
        m.setattr(adamw_tracker, "GROUP_NUMEL", 0)
        truth = list(alone.iter_changes())
        budget = sum(i.numel() for _, i, _ in truth[:5])  # values for the first few only
        ungrouped = list(alone.iter_capture(budget))
    groups: list[int] = []
    real = adamw_tracker.detect_adamw_group
    monkeypatch.setattr(
        adamw_tracker,
        "detect_adamw_group",
        lambda states, **kw: groups.append(len(states)) or real(states, **kw),
    )
    single, _ = _stepped_tracker(shapes, threads=1)
    for got in (tracker, single):
        groups.clear()
        _same_stream(list(got.iter_changes()), truth)
        assert groups == [10, 2, 2]  # on the threads, or on the caller's one
        a, b = list(got.iter_capture(budget)), ungrouped
        assert [n for n, *_ in a] == [n for n, *_ in b]
        for (name, pa, va), (_, pb, vb) in zip(a, b, strict=True):
            assert type(pa) is type(pb), name
            ia = pa if isinstance(pa, torch.Tensor) else pa.indices()
            ib = pb if isinstance(pb, torch.Tensor) else pb.indices()
            assert torch.equal(ia, ib), name
            assert (va is None) == (vb is None), name
            if va is not None:
                assert torch.equal(va.view(torch.int16), vb.view(torch.int16)), name


def test_an_abandoned_stream_leaves_the_tracker_answering_the_same():
    tracker, _ = _stepped_tracker(SHAPES, threads=2)
    first = list(tracker.iter_changes())
    stream = tracker.iter_positions()
    next(stream)  # the rest are in flight on the detection threads
    stream.close()
    _same_stream(first, list(tracker.iter_changes()))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_stream_abandoned_before_a_multi_step_version_was_read_loses_no_step(threads):
    # Two optimizer steps in the version: each parameter's second step is folded into its
    # bitset when the stream reaches it. A consumer that gives up after the first parameter
    # (its send failed) must leave the others' second steps for the retry.
    def two_steps():  # a first step that moves almost nothing, then one that moves most
        ps = _params(SHAPES, seed=5)
        opt = torch.optim.AdamW(ps, lr=1e-7)
        tracker = AdamWTracker(opt, [(f"p{i}", p) for i, p in enumerate(ps)], threads=threads)
        g = torch.Generator().manual_seed(5)
        for lr in (1e-7, 1e-2):
            opt.param_groups[0]["lr"] = lr
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return tracker

    abandoned = two_steps()
    stream = abandoned.iter_changes()
    next(stream)
    stream.close()
    _same_stream(list(two_steps().iter_changes()), list(abandoned.iter_changes()))


def test_capture_gives_values_within_the_budget_and_positions_beyond_it():
    tracker, params = _stepped_tracker(SHAPES)
    truth = list(tracker.iter_changes())
    counts = [i.numel() for _, i, _ in truth]
    budget = counts[0] + counts[1]  # the third parameter starts beyond it
    got = list(tracker.iter_capture(budget))
    assert [n for n, *_ in got] == [n for n, *_ in truth]
    seen = 0
    for (name, pos, vals), (_, idx, want) in zip(got, truth, strict=True):
        small = params[name].numel() <= (1 << 20)
        if seen < budget and small:
            assert isinstance(pos, torch.Tensor) and torch.equal(pos, idx), name
            assert torch.equal(vals.view(torch.int16), want.view(torch.int16)), name
        else:  # positions only: the values are read where they are routed
            assert vals is None and torch.equal(pos.indices(), idx), name
        seen += idx.numel()
    nothing = list(tracker.iter_capture(0))
    assert all(vals is None for *_, vals in nothing)
    with pytest.raises(ValueError, match="values_below"):
        list(tracker.iter_capture(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_capture_hands_over_a_chunked_parameters_values_up_to_values_max(threads):
    tracker, params = _stepped_tracker(MIXED, threads=threads)
    truth = {n: (i, v) for n, i, v in tracker.iter_changes()}
    chunked = sorted(n for n, p in params.items() if p.numel() > 1 << 20)
    counts = {n: truth[n][0].numel() for n in chunked}
    assert len(set(counts.values())) == len(chunked)  # distinct: one limit splits them
    limit = sorted(counts.values())[1]  # the fewest two come with values, the largest not
    got = list(tracker.iter_capture(0, values_max=limit))
    assert [n for n, *_ in got] == list(truth)
    for name, pos, vals in got:
        idx, want = truth[name]
        if name not in chunked:  # small: int64 indices and values, as within values_below
            assert isinstance(pos, torch.Tensor) and torch.equal(pos, idx), name
        else:
            assert torch.equal(pos.indices(), idx), name
        if name not in chunked or counts[name] <= limit:
            assert torch.equal(vals.view(torch.int16), want.view(torch.int16)), name
        else:  # too many to hold: the consumer reads them
            assert vals is None, name
    assert all(v is None for *_, v in tracker.iter_capture(0))  # positions only by default
    with pytest.raises(ValueError, match="values_max"):
        list(tracker.iter_capture(0, values_max=-1))


def test_a_compiled_step_with_fp32_bias_corrections_misses_nothing():
    # Compiled, Adam evaluates 1 - beta**t in fp32 tensors: for beta2 = 0.999999 that is off
    # by ~1e-2 at small t, far beyond the bound's 2^-10 margin on the update term.
    ps = _params([(20000,)], scale=0.05, seed=11)
    opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.999999), weight_decay=0.01)
    step = torch.compile(opt.step)
    opt.step = step  # what _run calls
    _run(ps, opt, versions=8)


def test_the_update_term_grows_only_where_fp32_bias_corrections_need_it():
    from deltasync.trainer.adamw_bound import REL_U, StepHyper, invertible, kernel_scalars

    def rel_u(beta2: float, step: int) -> float:
        h = StepHyper(
            lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0, decoupled=True, step=step
        )
        return kernel_scalars(h).rel_u if invertible(h) else float("inf")

    assert rel_u(0.999, 1) == REL_U and rel_u(0.95, 1) == REL_U and rel_u(0.999, 7) == REL_U
    assert rel_u(0.999999, 1) > 0.01  # beta2 = 0.999999 rounds to fp32 at ~6e-8 of 1e-6
    assert rel_u(0.999999, 100_000) > 0.01  # t * (beta rounded) still moves beta**t by 3%
    assert rel_u(0.999999, 50_000_000) == REL_U  # converged: beta**t is ~0 either way
    assert rel_u(1.0 - 2.0**-30, 1) == float("inf")  # 1 - beta rounds to 0 in fp32: no bound


def test_a_non_contiguous_parameter_under_fused_adam_takes_the_snapshot_path():
    # torch's fused kernel steps a column slice by its storage: other elements than the
    # parameter's change, so the step is not the update the bound inverts.
    g = torch.Generator().manual_seed(12)
    buf = torch.randn(64, 128, generator=g) * 0.05
    sliced = torch.nn.Parameter(buf[:, :64])
    whole = torch.nn.Parameter(torch.randn(64, 64, generator=g) * 0.05)
    assert not sliced.is_contiguous()
    opt = torch.optim.AdamW([sliced, whole], lr=1e-3, weight_decay=0.01, fused=True)
    with pytest.raises(UnsupportedOptimizerError, match="p0: fused=True steps a non-contiguous"):
        AdamWTracker(opt, [("p0", sliced), ("p1", whole)], strict=True)
    tracker = AdamWTracker(opt, [("p0", sliced), ("p1", whole)])
    assert set(tracker.fallback) == {"p0"} and "non-contiguous" in tracker.fallback["p0"].reason
    tracker.close()
    _run([sliced, whole], opt, versions=3)


def test_fused_set_on_a_group_after_construction_sends_a_non_contiguous_parameter_whole():
    g = torch.Generator().manual_seed(13)
    buf = torch.randn(64, 128, generator=g) * 0.05
    sliced = torch.nn.Parameter(buf[:, :64])
    opt = torch.optim.AdamW([sliced], lr=1e-4, weight_decay=0.01)
    tracker = AdamWTracker(opt, [("p", sliced)])
    assert tracker.fallback == {}
    opt.param_groups[0]["fused"] = True  # e.g. an optimizer state dict saved with it
    truth = SnapshotTracker([("p", sliced)])
    for _ in range(3):
        sliced.grad = torch.randn(64, 64, generator=g)
        opt.step()
        assert truth.changed()["p"].numel() > 0
        assert torch.equal(tracker.changed()["p"], torch.arange(64 * 64))  # whole: no bound
        tracker.clear()
        truth.clear()
    tracker.close()


def test_fused_adam_over_a_non_contiguous_optimizer_state_sends_the_parameter_whole():
    # A checkpoint of a channels_last model resumed into a contiguous one: the loaded
    # exp_avg / exp_avg_sq keep their channels_last strides, and torch's fused kernel walks
    # them by storage, pairing each element with another one's moments.
    g = torch.Generator().manual_seed(14)
    p = torch.nn.Parameter(torch.randn(16, 8, 3, 3, generator=g) * 0.05)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        opt.state[p][key] = opt.state[p][key].contiguous(memory_format=torch.channels_last)
    tracker = AdamWTracker(opt, [("p", p)])
    truth = SnapshotTracker([("p", p)])
    for _ in range(3):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        missed, _, true = _compare(_check_values(tracker, [("p", p)]), truth.changed())
        assert true > 0 and missed == 0
        tracker.clear()
        truth.clear()
    tracker.close()


def test_a_negative_lr_set_by_hand_keeps_the_subnormal_allowance_positive():
    # torch's constructor refuses lr < 0; an edit of param_groups (gradient ascent) is not
    # checked. A negative allowance dropped the slack for subnormal rounding: misses.
    from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars

    for lr in (-5e-9, -1e-8, -1e-3):
        h = StepHyper(
            lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=False, step=3
        )
        assert kernel_scalars(h).abs_e > 0


def _whole_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "reported changed in full for" in r.message]


def test_a_step_sent_whole_says_why_once_per_cause_naming_the_parameter(caplog):
    # fused set on a group after the tracker was built (a state dict saved with it): the
    # sliced parameter goes in full every step, and the operator learns why, once
    g = torch.Generator().manual_seed(15)
    buf = torch.randn(64, 128, generator=g) * 0.05
    sliced = torch.nn.Parameter(buf[:, :64])
    plain = torch.nn.Parameter(torch.randn(32, 32, generator=g) * 0.05)
    opt = torch.optim.AdamW([sliced, plain], lr=1e-4, weight_decay=0.01)
    tracker = AdamWTracker(opt, [("sliced", sliced), ("plain", plain)])
    opt.param_groups[0]["fused"] = True
    caplog.set_level("WARNING", logger="deltasync.trainer.adamw_tracker")
    for _ in range(3):
        sliced.grad = torch.randn(64, 64, generator=g)
        plain.grad = torch.randn(32, 32, generator=g)
        opt.step()
        tracker.changed()
        tracker.clear()
    tracker.close()
    (message,) = _whole_warnings(caplog)
    assert "1 parameter(s)" in message and "'sliced'" in message and "'plain'" not in message
    assert "non-contiguous parameter" in message


def test_shared_moments_are_named_once_as_the_cause_of_a_whole_send(caplog):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    b = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    c = torch.nn.Parameter(torch.randn(8, 8) * 0.02)
    opt = torch.optim.AdamW([a, b, c], lr=1e-6, foreach=False)
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[b] = {**opt.state[a], "step": opt.state[a]["step"].clone()}  # model surgery
    tracker = AdamWTracker(opt, [("a", a), ("b", b), ("c", c)])
    caplog.set_level("WARNING", logger="deltasync.trainer.adamw_tracker")
    for _ in range(2):
        for p in (a, b, c):
            p.grad = torch.randn_like(p)
        opt.step()
        changed = tracker.changed()
        assert changed["a"].numel() == a.numel() and changed["b"].numel() == b.numel()
        assert changed["c"].numel() < c.numel()
        tracker.clear()
    tracker.close()
    (shared,) = _whole_warnings(caplog)
    assert "2 parameter(s)" in shared and "('a', 'b')" in shared and "share memory" in shared


def test_steps_the_bound_inverts_log_nothing(caplog):
    caplog.set_level("WARNING", logger="deltasync.trainer.adamw_tracker")
    for impl in IMPLS.values():
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.randn(32, 16) * 0.02)
        opt = torch.optim.AdamW([p], lr=1e-6, weight_decay=0.01, **impl)
        tracker = AdamWTracker(opt, [("p", p)])
        for _ in range(3):
            p.grad = torch.randn_like(p)
            opt.step()
            assert tracker.changed()["p"].numel() < p.numel()
            tracker.clear()
        tracker.close()
    assert _whole_warnings(caplog) == []


def test_a_cause_whose_text_carries_a_changing_value_is_still_logged_once(caplog):
    # a checkpoint with a fractional step count: every step goes whole (exact), and the
    # warning that says so names the count, which moves each step; it is one cause
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(32, 16) * 0.02)
    opt = torch.optim.AdamW([p], lr=1e-6, weight_decay=0.01)
    tracker = AdamWTracker(opt, [("p", p)])
    p.grad = torch.randn_like(p)
    opt.step()
    tracker.changed()
    tracker.clear()
    opt.state[p]["step"] = torch.tensor(1.5)
    caplog.set_level("WARNING", logger="deltasync.trainer.adamw_tracker")
    for _ in range(4):
        p.grad = torch.randn_like(p)
        opt.step()
        assert tracker.changed()["p"].numel() == p.numel()
        tracker.clear()
    tracker.close()
    (message,) = _whole_warnings(caplog)
    assert "is not whole" in message and "'p'" in message
