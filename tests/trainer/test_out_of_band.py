"""Edits outside the optimizer are never missed: the version counter of every parameter is
recorded after each step and at clear(), and a parameter whose counter moved is reported in
full for that version. The truth is a SnapshotTracker over the same parameters."""

from __future__ import annotations

import logging

import pytest
import torch

from deltasync import AdamWTracker, SnapshotTracker
from deltasync.errors import ParamsEditedError, UnsupportedOptimizerError
from deltasync.native.loader import touching
from deltasync.trainer.params import ReadWindow


def _missed(tracked: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> int:
    empty = torch.empty(0, dtype=torch.int64)
    return sum(int((~torch.isin(idx, tracked.get(n, empty))).sum()) for n, idx in truth.items())


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(32, 48)
        self.b = torch.nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _setup(**kw):
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
    tracker = AdamWTracker(opt, model.named_parameters())
    truth = SnapshotTracker(model.named_parameters())
    return model, opt, tracker, truth


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
    opt.step()


def _check(tracker, truth, expect_oob: set[str]) -> dict[str, torch.Tensor]:
    changed = tracker.changed()
    assert _missed(changed, truth.changed()) == 0
    assert set(tracker.out_of_band) == expect_oob
    for name in expect_oob:  # reported in full, values included
        full = dict(tracker.local_params())[name].numel()
        assert changed[name].numel() == full
    return changed


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_an_in_place_edit_between_versions_is_reported_in_full(impl, caplog):
    model, opt, tracker, truth = _setup(**impl)
    _step(model, opt, 1)
    _check(tracker, truth, set())
    tracker.clear(), truth.clear()
    with torch.no_grad():
        model.a.weight[7:11].mul_(1.5)
    caplog.set_level(logging.WARNING, logger="deltasync.trainer.adamw_tracker")
    _check(tracker, truth, {"a.weight"})
    assert "'a.weight' was modified outside the optimizer" in caplog.text
    tracker.clear(), truth.clear()
    _step(model, opt, 2)
    _check(tracker, truth, set())  # clear() took the edit as the new baseline


def test_an_edit_between_steps_of_a_multi_step_version_is_caught_before_the_next_step():
    model, opt, tracker, truth = _setup()
    _step(model, opt, 1)
    with torch.no_grad():
        model.b.bias.clamp_(-0.01, 0.01)
    _step(model, opt, 2)
    _step(model, opt, 3)
    _check(tracker, truth, {"b.bias"})


def test_a_param_edited_then_stepped_is_still_reported():
    model, opt, tracker, truth = _setup()
    with torch.no_grad():
        model.a.bias.add_(0.25)  # the step right after moves the counter again
    _step(model, opt, 1)
    _check(tracker, truth, {"a.bias"})


def test_an_edit_through_a_view_bumps_the_shared_counter():
    model, _opt, tracker, truth = _setup()
    row = model.b.weight.detach()[3]  # a view: shares the parameter's version counter
    row.zero_()
    _check(tracker, truth, {"b.weight"})


def test_load_state_dict_reports_every_loaded_param():
    model, _opt, tracker, truth = _setup()
    other = Model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.load_state_dict(other.state_dict())
    _check(tracker, truth, {"a.weight", "a.bias", "b.weight", "b.bias"})


def test_a_lora_style_merge_into_a_base_weight_is_reported():
    model, opt, tracker, truth = _setup()
    _step(model, opt, 1)
    tracker.clear(), truth.clear()
    g = torch.Generator().manual_seed(5)
    lora_a, lora_b = torch.randn(4, 32, generator=g), torch.randn(48, 4, generator=g) * 1e-2
    with torch.no_grad():
        model.a.weight.addmm_(lora_b, lora_a, alpha=2.0)  # W += scale * B @ A
    _step(model, opt, 2)
    _check(tracker, truth, {"a.weight"})


def test_writes_through_data_bypass_the_counter_and_mark_changed_is_the_remedy():
    model, _opt, tracker, truth = _setup()
    model.a.bias.data[0] += 1.0  # .data has its own version counter: invisible
    assert tracker.out_of_band == ()
    assert _missed(tracker.changed(), truth.changed()) == 1  # the documented blind spot
    tracker.mark_changed("a.bias")
    _check(tracker, truth, {"a.bias"})
    with pytest.raises(KeyError, match="'nope' is not a tracked parameter"):
        tracker.mark_changed("nope")


def test_a_frozen_param_outside_the_optimizer_is_a_constant_until_edited(caplog):
    model = Model()
    model.a.requires_grad_(False)
    opt = torch.optim.AdamW(model.b.parameters(), lr=1e-3)
    caplog.set_level(logging.INFO, logger="deltasync.trainer.adamw_tracker")
    tracker = AdamWTracker(opt, model.named_parameters(), strict=True)
    truth = SnapshotTracker(model.named_parameters())
    assert tracker.constant == ("a.weight", "a.bias") and tracker.fallback == {}
    assert tracker.memory_bytes() == 0  # no snapshot of the frozen params
    assert "2 frozen parameter(s)" in caplog.text
    _step(model, opt, 1)
    assert "a.weight" not in tracker.changed()
    with torch.no_grad():
        model.a.weight[0, 0] = 3.0
    _check(tracker, truth, {"a.weight"})


def test_frozen_params_are_snapshotted_when_asked():
    model = Model()
    model.a.requires_grad_(False)
    opt = torch.optim.AdamW(model.b.parameters(), lr=1e-3)
    tracker = AdamWTracker(opt, model.named_parameters(), track_frozen=True)
    assert set(tracker.fallback) == {"a.weight", "a.bias"} and tracker.constant == ()
    assert tracker.memory_bytes() == (32 * 48 + 48) * 2
    model.a.bias.data[1] = 7.0  # even through .data: the snapshot compares bits
    assert tracker.changed()["a.bias"].tolist() == [1]


def _reset_moments(opt) -> None:
    for state in opt.state.values():
        state["exp_avg"].zero_()


def _halve_denominators(opt) -> None:
    for state in opt.state.values():
        state["exp_avg_sq"].mul_(4.0)


def _forget_state(opt) -> None:
    opt.state.clear()


@pytest.mark.parametrize(
    "edit", [_reset_moments, _halve_denominators, _forget_state, "load_state_dict"]
)
@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_optimizer_state_changed_after_the_step_reports_the_step_in_full(edit, impl, caplog):
    # The inversion reads the state the step left; detected from any other state it could
    # miss elements. Each edit below made the detection miss thousands of them before.
    model, opt, tracker, truth = _setup(**impl)
    _step(model, opt, 1)
    tracker.clear(), truth.clear()
    saved = {k: v for k, v in opt.state_dict().items()}
    saved["state"] = {i: {k: t.clone() for k, t in s.items()} for i, s in saved["state"].items()}
    _step(model, opt, 2)
    caplog.set_level(logging.WARNING, logger="deltasync.trainer.adamw_tracker")
    if edit == "load_state_dict":
        opt.load_state_dict(saved)  # e.g. a resume that loads an older optimizer checkpoint
    else:
        edit(opt)
    changed = _check(tracker, truth, set())
    params = dict(tracker.local_params())
    assert {n: changed[n].numel() for n in changed} == {n: p.numel() for n, p in params.items()}
    assert "optimizer state was replaced or written after the step" in caplog.text
    tracker.clear(), truth.clear()
    _step(model, opt, 3)  # a step from the edited state is detected as any other
    _check(tracker, truth, set())


def test_a_state_written_between_two_steps_of_one_version_is_caught_before_the_next_step():
    model, opt, tracker, truth = _setup()
    _step(model, opt, 1)
    _step(model, opt, 2)  # step 1 inverted here, before step 2 changes the state
    _reset_moments(opt)
    _step(model, opt, 3)  # step 2's state was reset: it is reported in full
    changed = _check(tracker, truth, set())
    assert all(changed[n].numel() == p.numel() for n, p in dict(tracker.local_params()).items())


def test_a_frozen_param_added_to_the_optimizer_later_is_reported_in_full(caplog):
    # Progressive unfreezing: a constant at construction, stepped from then on. The step's
    # writes to it are not the tracker's own: it is reported in full, with a warning.
    model, opt, tracker, truth = (None, None, None, None)
    model = Model()
    model.b.weight.requires_grad_(False)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01
    )
    tracker = AdamWTracker(opt, model.named_parameters())
    truth = SnapshotTracker(model.named_parameters())
    assert tracker.constant == ("b.weight",)
    _step(model, opt, 1)
    _check(tracker, truth, set())
    tracker.clear(), truth.clear()
    model.b.weight.requires_grad_(True)
    opt.add_param_group({"params": [model.b.weight]})
    caplog.set_level(logging.WARNING, logger="deltasync.trainer.adamw_tracker")
    for seed in (2, 3):
        _step(model, opt, seed)
        _check(tracker, truth, {"b.weight"})
        tracker.clear(), truth.clear()
    assert "were added to the optimizer after the tracker was built ('b.weight')" in caplog.text
    assert tracker.constant == ()


def test_a_step_hook_that_edits_a_param_the_step_does_not_move_is_seen():
    model, opt, tracker, truth = _setup()

    def edit(_opt, _args, _kwargs):  # registered after the tracker: runs inside its window
        with torch.no_grad():
            model.b.bias.add_(0.125)

    opt.register_step_pre_hook(edit)
    model.b.bias.requires_grad_(False)  # no gradient: the step itself does not move it
    _step(model, opt, 1)
    _check(tracker, truth, {"b.bias"})


IMPLS = [dict(foreach=False), dict(foreach=True), dict(fused=True)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positional", [False, True])
def test_a_closure_that_writes_a_param_the_step_moves_is_seen(impl, positional):
    # Adam calls the closure inside step(), after every pre-step hook: its write lands
    # between the tracker's hooks, where the update's own writes are, yet is not the update.
    model, opt, tracker, truth = _setup(**impl)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 32, generator=g)

    def closure():
        with torch.no_grad():
            model.a.weight.clamp_(-0.05, 0.05)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure) if positional else opt.step(closure=closure)
    assert isinstance(loss, torch.Tensor)  # the closure's loss comes back as before
    _check(tracker, truth, {"a.weight"})
    tracker.clear(), truth.clear()
    _step(model, opt, 5)  # a plain step after it: nothing out of band
    _check(tracker, truth, set())


@pytest.mark.parametrize("impl", IMPLS)
def test_a_pre_hook_registered_after_the_tracker_that_writes_a_stepped_param_is_seen(impl):
    model, opt, tracker, truth = _setup(**impl)

    def edit(_opt, _args, _kwargs):
        with torch.no_grad():
            model.a.bias.mul_(1.5)

    opt.register_step_pre_hook(edit)
    _step(model, opt, 1)
    _check(tracker, truth, {"a.bias"})


@pytest.mark.parametrize("impl", IMPLS)
def test_post_hooks_registered_before_the_tracker_act_after_the_recorded_step(impl):
    # One writes a stepped param, one decays the learning rate: both run after the
    # tracker's own post-step hook, so the write is seen and the step is inverted with the
    # learning rate it used.
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **impl)

    def renorm(_opt, _args, _kwargs):
        with torch.no_grad():
            model.b.weight.mul_(0.5)

    def decay(o, _args, _kwargs):
        for group in o.param_groups:
            group["lr"] *= 1e-4

    opt.register_step_post_hook(renorm)
    opt.register_step_post_hook(decay)
    tracker = AdamWTracker(opt, model.named_parameters())
    truth = SnapshotTracker(model.named_parameters())
    _step(model, opt, 1)
    _check(tracker, truth, {"b.weight"})


def test_params_that_share_memory_take_the_snapshot_path_and_are_never_missed():
    # Two parameters over one storage, in groups with very different learning rates: the
    # update of either writes into the other, which no inversion of one step can see.
    torch.manual_seed(0)
    base = torch.nn.Parameter(torch.randn(16, 16))
    head = torch.nn.Parameter(base.detach()[:4])
    lone = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.AdamW([{"params": [base, lone], "lr": 1e-7}, {"params": [head], "lr": 1e-2}])
    named = [("base", base), ("head", head), ("lone", lone)]
    tracker = AdamWTracker(opt, named)
    assert set(tracker.fallback) == {"base", "head"}
    assert "shares memory with parameter 'head'" in tracker.fallback["base"].reason
    truth = SnapshotTracker(named)
    for p in (base, head, lone):
        p.grad = torch.randn_like(p)
    opt.step()
    assert _missed(tracker.changed(), truth.changed()) == 0
    with pytest.raises(UnsupportedOptimizerError, match="shares memory"):
        AdamWTracker(opt, named, strict=True)


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
@pytest.mark.parametrize("stepper", ["this", "another", "this, added later"])
def test_a_frozen_view_of_a_stepped_param_takes_the_snapshot_path_and_is_never_missed(
    impl, stepper
):
    # a constant (frozen, in no group) is checked by its version counter alone, which a fused
    # step writing the memory it shares does not move: all its changes were missed, whether
    # the tracked optimizer, another one, or the tracked one after add_param_group stepped it
    torch.manual_seed(0)
    stepped = torch.nn.Parameter(torch.randn(64) * 0.02)
    frozen = torch.nn.Parameter(stepped.detach()[:16], requires_grad=False)
    alone = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    other = torch.nn.Parameter(torch.randn(8))
    tracked = [stepped] if stepper == "this" else [other]
    opt = torch.optim.AdamW(tracked, lr=1e-2, **impl)
    named = [("stepped", stepped), ("frozen", frozen), ("alone", alone), ("other", other)]
    tracker = AdamWTracker(opt, named)
    assert tracker.constant == ("alone",) and "frozen" in tracker.fallback
    assert "shares memory with parameter 'stepped'" in tracker.fallback["frozen"].reason
    truth = SnapshotTracker(named)
    if stepper == "another":
        stepper_opt = torch.optim.AdamW([stepped], lr=1e-2, **impl)
    else:
        stepper_opt = opt
        if stepper == "this, added later":
            opt.add_param_group({"params": [stepped]})
    stepped.grad = torch.randn_like(stepped)
    stepper_opt.step()
    seen = truth.changed()
    assert seen["frozen"].numel() > 0 and _missed(tracker.changed(), seen) == 0
    with pytest.raises(UnsupportedOptimizerError, match="frozen, but shares memory"):
        AdamWTracker(torch.optim.AdamW([stepped], lr=1e-2), named[:3], strict=True)


def test_memory_spans_touching_others_are_found_beside_spans_of_their_own_owner():
    # an item inside a wider span of its own owner that overlaps a third tensor: the third
    # is found, the item itself never is
    base = torch.zeros(100)
    wide, inner, other = base[0:100], base[10:20], base[15:18]
    far = torch.zeros(4)
    everything = [("wide", wide, "w"), ("inner", inner, "i"), ("other", other, "o")]
    found = touching([("wide", wide, "w"), ("inner", inner, "i"), ("far", far, "f")], everything)
    assert found["inner"] in ("wide", "other") and found["wide"] in ("inner", "other")
    mine = [("wide", wide, "w"), ("inner", inner, "w"), ("other", other, "o")]
    assert touching([("inner", inner, "w")], mine) == {"inner": "other"}
    assert touching([("inner", inner, "w")], [("wide", wide, "w")]) == {}  # one tensor, two names
    assert touching([("edge", base[10:20], "e")], [("before", base[0:10], "b")]) == {}


def test_tied_weights_under_two_names_stay_on_the_bound():
    # one tensor, two names (an embedding tied to the LM head): not two tensors sharing memory
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = torch.optim.AdamW([w], lr=1e-3)
    tracker = AdamWTracker(opt, [("embed", w), ("lm_head", w)], strict=True)
    assert tracker.fallback == {}


class _Renormed(torch.optim.AdamW):
    """An AdamW whose step also rescales every row: not the update the bound inverts."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 2:
                    p.div_(p.norm(dim=1, keepdim=True).clamp(min=1.0))
        return loss


class _Named(torch.optim.AdamW):
    """A subclass that keeps AdamW's step."""


def test_a_subclass_that_overrides_step_takes_the_snapshot_path():
    torch.manual_seed(0)
    model = Model()
    opt = _Renormed(model.parameters(), lr=1e-1)
    with pytest.raises(UnsupportedOptimizerError, match="_Renormed overrides step"):
        AdamWTracker(opt, model.named_parameters(), strict=True)
    tracker = AdamWTracker(opt, model.named_parameters())
    truth = SnapshotTracker(model.named_parameters())
    _step(model, opt, 1)
    assert _missed(tracker.changed(), truth.changed()) == 0
    kept = AdamWTracker(_Named(model.parameters(), lr=1e-3), model.named_parameters(), strict=True)
    assert kept.fallback == {}


class _NoClosure(torch.optim.Optimizer):
    """An optimizer whose step() takes no closure (plain SGD on ``.data``)."""

    def __init__(self, params) -> None:
        super().__init__(params, {})

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-0.1)


def test_an_optimizer_whose_step_takes_no_closure_steps_unchanged_on_the_snapshot_path():
    model = Model()
    opt = _NoClosure(model.parameters())
    tracker = AdamWTracker(opt, model.named_parameters())
    truth = SnapshotTracker(model.named_parameters())
    _step(model, opt, 1)  # the tracker hands it no closure: it would raise a TypeError
    assert _missed(tracker.changed(), truth.changed()) == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drop", ["positional", "keyword"])
def test_a_pre_hook_that_drops_the_trackers_closure_has_its_writes_seen(impl, drop):
    # A hook after the tracker's writes a param, then returns the step's arguments without
    # the closure the tracker handed step(): the check right before the update never runs,
    # so the tracker cannot tell that write from the update's and sends the param in full.
    model, opt, tracker, truth = _setup(**impl)

    def edit_and_rebuild(o, args, kwargs):
        with torch.no_grad():
            model.a.weight.view(-1)[:10].add_(0.25)
        return ((args[0],), {}) if drop == "positional" else (args, {})

    opt.register_step_pre_hook(edit_and_rebuild)
    _step(model, opt, 1)
    changed = tracker.changed()
    assert _missed(changed, truth.changed()) == 0
    assert "a.weight" in tracker.out_of_band


def test_a_mark_on_a_snapshot_path_param_is_counted_and_sends_it_in_full():
    # An Adam subclass overriding step() puts every param on the snapshot path. A .data write
    # then marked, made while an overlapped version reads the params, must refuse that
    # version (the read window counts the mark) and go out in full after the tracker's
    # clear(), whose fresh snapshot already holds the write.
    model = Model()
    opt = _Renormed(model.parameters(), lr=1e-3)
    tracker = AdamWTracker(opt, model.named_parameters())
    assert set(tracker.fallback) == {n for n, _ in model.named_parameters()}
    params = dict(model.named_parameters())
    window = ReadWindow(params, 1, window="test", tracker=tracker)
    before = tracker.marks()
    params["a.bias"].data.add_(0.5)
    tracker.mark_changed("a.bias")
    assert tracker.marks() == before + 1 and tracker.marked_since(before) == {"a.bias"}
    with pytest.raises(ParamsEditedError, match=r"a\.bias"):
        window.refuse_if_written(params)
    tracker.clear()  # the end of that version's detection: the snapshot takes the write in
    window.settle(params, tracker)  # re-marked for the next version
    assert tracker.out_of_band == ("a.bias",)
    assert tracker.changed()["a.bias"].numel() == params["a.bias"].numel()


def test_the_snapshot_tracker_takes_marks_too():
    # A write through .data after a detection read the param and before the clear() that
    # follows it is in the new snapshot: only the mark can send it, and a read window counts
    # it as a write there.
    model = Model()
    tracker = SnapshotTracker(model.named_parameters())
    params = dict(model.named_parameters())
    window = ReadWindow(params, 3, window="test", tracker=tracker)
    params["b.bias"].data.add_(0.5)
    tracker.mark_changed("b.bias")
    assert tracker.marked == {"b.bias"} and tracker.marked_since(0) == {"b.bias"}
    with pytest.raises(ParamsEditedError, match=r"version 3 .*b\.bias"):
        window.refuse_if_written(params)
    tracker.clear()
    assert tracker.changed() == {} and tracker.marked == frozenset()
    window.settle(params, tracker)
    assert tracker.changed()["b.bias"].numel() == params["b.bias"].numel()
    with pytest.raises(KeyError):
        tracker.mark_changed("nope")


def test_a_swap_tensors_load_whose_counters_match_is_reported_in_full():
    # load_state_dict(assign=True) under swap-tensors loading swaps each parameter's whole
    # tensor, version counter included: a freshly initialised parameter and a loaded tensor
    # are both at version 1, so the counter alone does not move.
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    named = list(model.named_parameters())
    tracker, truth = AdamWTracker(opt, named, strict=True), SnapshotTracker(named)
    loaded = {k: (v * 1.5).clone() for k, v in model.state_dict().items()}
    for t in loaded.values():
        t.add_(0)  # a loaded tensor's counter, as torch.load leaves it: 1
    assert {p._version for p in model.parameters()} == {t._version for t in loaded.values()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(loaded, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    changed = tracker.changed()
    assert set(changed) == {n for n, _ in named} and _missed(changed, truth.changed()) == 0
    tracker.close()


def test_parameters_the_tracker_is_not_given_can_still_be_swap_loaded():
    # the tracker looks at the memory of every optimizer's parameters it was not given (a
    # critic's, or its own optimizer's extras): holding even a weak reference to one makes
    # torch.utils.swap_tensors refuse it, and with it every swap-tensors load of that model
    model, critic = Model(), torch.nn.Linear(8, 8)
    extra = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW([*model.parameters(), *extra.parameters()], lr=1e-4)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-4, fused=True)
    tracker = AdamWTracker(opt, model.named_parameters(), strict=True)
    for p in (*model.parameters(), *extra.parameters(), *critic.parameters()):
        p.grad = torch.randn_like(p)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})
    opt.step()
    critic_opt.step()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for module in (critic, extra):
            module.load_state_dict({k: v * 2 for k, v in module.state_dict().items()}, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    tracker.close()


def _interrupted_after_the_update(opt, model, seed: int) -> None:
    """A step whose fused update ran and whose post-step hooks did not: a KeyboardInterrupt
    (Ctrl-C, a preemption handler raising) delivered as the kernel returns."""
    real = torch._fused_adamw_

    def update_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    torch._fused_adamw_ = update_then_interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            _step(model, opt, seed)
    finally:
        torch._fused_adamw_ = real


@pytest.mark.parametrize("first", [True, False])
def test_a_fused_step_interrupted_after_its_update_is_reported_in_full(first, caplog):
    # The update was in the params and the step counts had moved, but no post-step hook
    # recorded the step and a fused update moves no version counter: every element missed,
    # in this version and the next.
    model, opt, tracker, truth = _setup(fused=True)
    if not first:  # the first step creates the moments; a later one steps existing ones
        _step(model, opt, 0)
        _check(tracker, truth, set())
        tracker.clear(), truth.clear()
    _interrupted_after_the_update(opt, model, 1)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        _check(tracker, truth, {n for n, _ in model.named_parameters()})
    assert "without the tracker seeing the step" in caplog.text
    _step(model, opt, 2)  # the loop goes on: still in full, then the next step sparsely
    _check(tracker, truth, {n for n, _ in model.named_parameters()})
    tracker.clear(), truth.clear()
    _step(model, opt, 3)
    _check(tracker, truth, set())


def test_a_fused_step_interrupted_then_its_optimizer_state_cleared_misses_nothing():
    # The count gone (optimizer.state.clear()) was taken for no update: every element missed.
    model, opt, tracker, truth = _setup(fused=True)
    _step(model, opt, 0)
    tracker.changed(), tracker.clear(), truth.clear()
    _interrupted_after_the_update(opt, model, 1)
    opt.state.clear()
    _check(tracker, truth, {n for n, _ in model.named_parameters()})


def test_a_fused_step_interrupted_then_stepped_again_before_detection_misses_nothing():
    model, opt, tracker, truth = _setup(fused=True)
    _step(model, opt, 0)
    tracker.changed(), tracker.clear(), truth.clear()
    _interrupted_after_the_update(opt, model, 1)
    _step(model, opt, 2)  # the pre-step hook finds the step it never saw
    _check(tracker, truth, {n for n, _ in model.named_parameters()})


def test_an_interrupt_inside_the_trackers_own_post_step_hook_misses_nothing(monkeypatch):
    # Stopped between recording a parameter's step count and its pending step, the tracker
    # took that step as seen and never detected it.
    import deltasync.trainer.adamw_tracker as adamw_tracker

    model, opt, tracker, truth = _setup(fused=True)
    _step(model, opt, 0)
    tracker.changed(), tracker.clear(), truth.clear()
    real, calls = adamw_tracker._state_usable, []

    def second_interrupts(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(adamw_tracker, "_state_usable", second_interrupts)
    with pytest.raises(KeyboardInterrupt):
        _step(model, opt, 1)
    monkeypatch.setattr(adamw_tracker, "_state_usable", real)
    changed = tracker.changed()
    assert _missed(changed, truth.changed()) == 0


def test_an_interrupt_while_detection_flags_an_unseen_step_misses_nothing(monkeypatch):
    # The count was taken as seen before the flag: a second Ctrl-C between the two lost the
    # interrupted step for good.
    from deltasync.trainer.params import OutOfBandWatch

    model, opt, tracker, truth = _setup(fused=True)
    _step(model, opt, 0)
    tracker.changed(), tracker.clear(), truth.clear()
    _interrupted_after_the_update(opt, model, 1)
    real, calls = OutOfBandWatch.flag, []

    def first_interrupts(self, name, why):
        calls.append(name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, name, why)

    monkeypatch.setattr(OutOfBandWatch, "flag", first_interrupts)
    with pytest.raises(KeyboardInterrupt):
        tracker.changed()
    monkeypatch.setattr(OutOfBandWatch, "flag", real)
    _check(tracker, truth, {n for n, _ in model.named_parameters()})


def _checkpoint_after_steps(steps: int):
    model, opt, _tracker, _truth = _setup(fused=True)
    _tracker.close()
    for seed in range(steps):
        _step(model, opt, seed)
    return {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()


@pytest.mark.parametrize("interrupted", [False, True])
def test_optimizer_state_loaded_after_the_tracker_is_built_is_no_step(interrupted):
    # Resuming (tracker built, then the optimizer's state loaded) moved every step count: each
    # parameter was sent in full. An interrupted step before a load is still seen.
    import copy

    weights, state = _checkpoint_after_steps(3)
    model, opt, tracker, truth = _setup(fused=True)
    model.load_state_dict(weights)
    tracker.changed(), tracker.clear(), truth.clear()
    if interrupted:  # a step seen, then one interrupted: moments exist, then are replaced
        _step(model, opt, 6)
        tracker.changed(), tracker.clear(), truth.clear()
        _interrupted_after_the_update(opt, model, 7)
    opt.load_state_dict(copy.deepcopy(state))
    _step(model, opt, 3)
    _check(tracker, truth, {n for n, _ in model.named_parameters()} if interrupted else set())


def test_another_optimizers_fused_step_interrupted_after_its_update_is_reported_in_full():
    # Seen only by a hook after every optimizer's step: cut short before it (Ctrl-C as the
    # kernel returned), the update of a second optimizer (a layer unfrozen with an optimizer
    # of its own) moved no counter and no tracked step count, and every element was missed.
    model, opt, tracker, truth = _setup(fused=True)
    _step(model, opt, 0)
    tracker.changed(), tracker.clear(), truth.clear()
    head = torch.optim.AdamW(model.b.parameters(), lr=1e-3, fused=True)
    _interrupted_after_the_update(head, model, 1)
    _check(tracker, truth, {"b.weight", "b.bias"})
    _step(model, head, 2)  # finished: marked by the hook after it, as before
    tracker.clear(), truth.clear()
    _step(model, opt, 3)
    _check(tracker, truth, set())


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_a_param_sharing_memory_with_one_another_optimizer_steps_takes_the_snapshot_path(impl):
    # the critic's parameter is a view of the actor's trunk: a fused step of the critic's
    # optimizer writes the trunk without moving its counter, and its hook names the critic's
    # parameter only
    torch.manual_seed(0)
    trunk = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    critic = torch.nn.Parameter(trunk.detach()[:16])
    actor_opt = torch.optim.AdamW([trunk], lr=1e-3, **impl)
    critic_opt = torch.optim.AdamW([critic], lr=1e-3, **impl)
    named = [("trunk", trunk), ("critic", critic)]
    tracker = AdamWTracker(actor_opt, named)
    assert "shares memory with parameter 'critic'" in tracker.fallback["trunk"].reason
    truth = SnapshotTracker(named)
    for _ in range(2):
        trunk.grad = torch.randn_like(trunk)
        actor_opt.step()
        critic.grad = torch.randn_like(critic)
        critic_opt.step()
        seen = truth.changed()
        assert seen["trunk"].numel() > 0 and _missed(tracker.changed(), seen) == 0
        tracker.clear()
        truth.clear()
    tracker.close()


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_a_view_another_optimizer_steps_that_the_tracker_is_not_given_is_never_missed(impl):
    # the critic's parameter is a view of the actor's trunk, and only the actor's parameters
    # are tracked: the critic's fused step wrote the trunk without moving its counter, and
    # the critic's hook named no tracked parameter, so every element it changed was missed
    torch.manual_seed(0)
    trunk = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    head = torch.nn.Parameter(torch.randn(8) * 0.02)
    critic = torch.nn.Parameter(trunk.detach()[:16])
    actor_opt = torch.optim.AdamW([trunk, head], lr=1e-3, **impl)
    critic_opt = torch.optim.AdamW([critic], lr=1e-2, **impl)
    named = [("trunk", trunk), ("head", head)]
    tracker = AdamWTracker(actor_opt, named, strict=True)
    truth = SnapshotTracker(named)
    for _ in range(2):
        trunk.grad, head.grad = torch.randn_like(trunk), torch.randn_like(head)
        actor_opt.step()
        critic.grad = torch.randn_like(critic)
        critic_opt.step()
        seen = truth.changed()
        changed = tracker.changed()
        assert seen["trunk"].numel() > 0 and _missed(changed, seen) == 0
        assert changed["trunk"].numel() == trunk.numel()  # the critic's step: in full
        tracker.clear()
        truth.clear()
    tracker.close()


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_a_view_the_tracked_optimizer_steps_that_the_tracker_is_not_given_takes_the_snapshot_path(
    impl,
):
    # the view's update writes the tracked parameter inside the same step: the counter it
    # moves was taken as the step's own (a fused update moves none), and the inversion of the
    # tracked parameter's own step missed elements the view's update changed
    torch.manual_seed(0)
    base = torch.nn.Parameter(torch.randn(8, 8) * 0.02)
    frozen = torch.nn.Parameter(torch.randn(8, 8) * 0.02, requires_grad=False)
    views = [torch.nn.Parameter(base.detach()[:4]), torch.nn.Parameter(frozen.detach()[4:])]
    opt = torch.optim.AdamW([base, *views], lr=1e-3, **impl)
    named = [("base", base), ("frozen", frozen)]
    tracker = AdamWTracker(opt, named)
    assert set(tracker.fallback) == {"base", "frozen"} and tracker.constant == ()
    assert "not given to the tracker" in tracker.fallback["base"].reason
    truth = SnapshotTracker(named)
    for _ in range(3):
        base.grad = torch.randn_like(base)
        for v in views:
            v.grad = torch.randn_like(v) * 100
        opt.step()
        assert _missed(tracker.changed(), truth.changed()) == 0
        tracker.clear()
        truth.clear()
    with pytest.raises(UnsupportedOptimizerError, match="not given to the tracker"):
        AdamWTracker(opt, named, strict=True)


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_a_view_added_to_the_tracked_optimizer_later_sends_what_it_writes_in_full(impl, caplog):
    torch.manual_seed(0)
    base = torch.nn.Parameter(torch.randn(8, 8) * 0.02)
    frozen = torch.nn.Parameter(torch.randn(8, 8) * 0.02, requires_grad=False)
    alone = torch.nn.Parameter(torch.randn(64) * 0.02)
    opt = torch.optim.AdamW([base, alone], lr=1e-3, **impl)
    named = [("base", base), ("frozen", frozen), ("alone", alone)]
    tracker = AdamWTracker(opt, named, strict=True)
    truth = SnapshotTracker(named)
    views = [torch.nn.Parameter(base.detach()[:4]), torch.nn.Parameter(frozen.detach()[4:])]
    opt.add_param_group({"params": views})
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        for _ in range(3):
            base.grad, alone.grad = torch.randn_like(base), torch.randn_like(alone) * 1e-3
            for v in views:
                v.grad = torch.randn_like(v) * 100
            opt.step()
            seen, changed = truth.changed(), tracker.changed()
            assert seen["frozen"].numel() > 0 and _missed(changed, seen) == 0
            assert changed["base"].numel() == base.numel()
            assert changed["frozen"].numel() == frozen.numel()
            tracker.clear()
            truth.clear()
    assert "share memory with a parameter added to the optimizer" in caplog.text


# (foreach=True updates every moment before any parameter: both steps use the final moments,
# and nothing is missed there)
@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_moments_shared_between_params_send_both_in_full(impl):
    # model surgery: a shallow copy of one parameter's state for another, its own step count;
    # the second update rewrites the moments after the first one used them
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    b = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    opt = torch.optim.AdamW([a, b], lr=1e-3, **impl)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    opt.state[b] = {**opt.state[a], "step": opt.state[a]["step"].clone()}

    def grads():
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b) * 100

    assert _misses_over_steps(opt, [("a", a), ("b", b)], grads) == 0


def _misses_over_steps(opt, named, grads, steps: int = 3) -> int:
    """Elements whose BF16 bits changed and the tracker did not report, over ``steps`` steps
    with gradients from ``grads()``."""
    tracker = AdamWTracker(opt, named)
    truth = SnapshotTracker(named)
    missed = 0
    for _ in range(steps):
        grads()
        opt.step()
        seen = truth.changed()
        assert any(t.numel() for t in seen.values())
        missed += _missed(tracker.changed(), seen)
        tracker.clear()
        truth.clear()
    tracker.close()
    return missed


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_moments_shared_through_views_at_other_offsets_send_both_in_full(impl):
    # b's state sliced from a's rows 16..48 without a copy: the two overlap without starting at
    # the same address
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    b = torch.nn.Parameter(torch.randn(32, 32) * 0.02)
    opt = torch.optim.AdamW([a, b], lr=1e-3, **impl)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    state = opt.state[a]
    opt.state[b] = {
        "step": state["step"].clone(),
        "exp_avg": state["exp_avg"][16:48],
        "exp_avg_sq": state["exp_avg_sq"][16:48],
    }

    def grads():
        a.grad, b.grad = torch.randn_like(a), torch.randn_like(b) * 100

    assert _misses_over_steps(opt, [("a", a), ("b", b)], grads) == 0


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_moments_shared_with_a_parameter_the_tracker_is_not_given_send_the_tracked_one_whole(
    impl,
):
    # a value head beside the policy, stepped by the same optimizer over the same moments
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    head = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    opt = torch.optim.AdamW([a, head], lr=1e-3, **impl)
    a.grad, head.grad = torch.randn_like(a), torch.randn_like(head)
    opt.step()
    opt.state[head] = {**opt.state[a], "step": opt.state[a]["step"].clone()}

    def grads():
        a.grad, head.grad = torch.randn_like(a), torch.randn_like(head) * 100

    assert _misses_over_steps(opt, [("a", a)], grads) == 0


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True), dict(foreach=False)])
def test_tied_weights_under_two_names_are_not_taken_for_shared_moments(impl):
    # one parameter, one state: named twice (named_parameters(remove_duplicate=False)) it was
    # sent whole at every step
    torch.manual_seed(0)
    embed = torch.nn.Embedding(512, 64)
    head = torch.nn.Linear(64, 512, bias=False)
    head.weight = embed.weight
    opt = torch.optim.AdamW(embed.parameters(), lr=1e-5, **impl)
    named = [("embed.weight", embed.weight), ("head.weight", head.weight)]
    tracker = AdamWTracker(opt, named)
    assert not tracker.fallback
    for _ in range(3):
        x = torch.randint(0, 512, (4, 8))
        head(torch.tanh(embed(x))).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        sent = tracker.changed()
        assert 0 < sent["embed.weight"].numel() < embed.weight.numel()
        tracker.clear()
    tracker.close()


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_shared_moments_of_scalar_parameters_send_both_in_full(impl):
    # learnable scalars (a logit scale): their moments are 0-dim like the step count, and were
    # left out of the check
    torch.manual_seed(0)
    a = [torch.nn.Parameter(1.0 + torch.randn(()) * 0.02) for _ in range(50)]
    b = [torch.nn.Parameter(1.0 + torch.randn(()) * 0.02) for _ in range(50)]
    opt = torch.optim.AdamW([*a, *b], lr=1e-3, **impl)
    for p in (*a, *b):
        p.grad = torch.randn_like(p)
    opt.step()
    for x, y in zip(a, b, strict=True):
        opt.state[y] = {**opt.state[x], "step": opt.state[x]["step"].clone()}

    def grads():
        for x, y in zip(a, b, strict=True):
            x.grad, y.grad = torch.randn_like(x), torch.randn_like(y) * 100

    named = [(f"a{i}", x) for i, x in enumerate(a)] + [(f"b{i}", y) for i, y in enumerate(b)]
    assert _misses_over_steps(opt, named, grads) == 0


def test_moments_shared_with_another_optimizers_state_send_the_tracked_one_whole():
    # a value head's optimizer handed a shallow copy of a policy parameter's state: its fused
    # step after the tracked one rewrites the moments without moving their version counters
    # (a single-tensor step moves them, and the seal sees it)
    impl = dict(fused=True)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    head = torch.nn.Parameter(torch.randn(64, 32) * 0.02)
    opt = torch.optim.AdamW([a], lr=1e-3, **impl)
    head_opt = torch.optim.AdamW([head], lr=1e-3, **impl)
    a.grad = torch.randn_like(a)
    opt.step()
    head_opt.state[head] = {**opt.state[a], "step": opt.state[a]["step"].clone()}
    tracker = AdamWTracker(opt, [("a", a)])
    truth = SnapshotTracker([("a", a)])
    for _ in range(3):
        a.grad, head.grad = torch.randn_like(a), torch.randn_like(head) * 100
        opt.step()
        head_opt.step()
        seen = truth.changed()
        assert seen["a"].numel() > 0 and _missed(tracker.changed(), seen) == 0
        tracker.clear()
        truth.clear()
    tracker.close()


def test_an_optimizer_whose_state_has_no_storage_still_steps():
    # sparse momentum (or a wrapper subclass, as quantized optimizer states are): the shared
    # state check read every state tensor's storage, and every step after the first raised
    w = torch.nn.Parameter(torch.randn(16, 16))

    class SparseMomentumSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=1e-3))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["momentum"] = p.grad.to_sparse()
                    p.add_(p.grad, alpha=-group["lr"])

    opt = SparseMomentumSGD([w])
    tracker = AdamWTracker(opt, [("w", w)])  # not Adam: the snapshot path
    for _ in range(2):
        w.grad = torch.randn_like(w)
        opt.step()
    assert tracker.changed()["w"].numel() > 0
    tracker.close()
