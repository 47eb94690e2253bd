"""What the optimizer's param groups become after the tracker was built, and steps the version
counter does not see, are never missed: a parameter moved to another group is inverted with
that group's hyperparameters, a deleted group raises nothing, a frozen parameter a fused
optimizer starts stepping and a second (fused) optimizer stepping tracked parameters are sent
in full, and past 2^24 steps (where a float32 step count stops moving) every parameter with a
gradient is. The truth is a SnapshotTracker over the same parameters."""

from __future__ import annotations

import logging

import pytest
import torch

from deltasync import AdamWTracker, SnapshotTracker


def _missed(tracked: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> int:
    empty = torch.empty(0, dtype=torch.int64)
    return sum(int((~torch.isin(idx, tracked.get(n, empty))).sum()) for n, idx in truth.items())


def _params(*names: str, n: int = 4096) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(n, generator=g) * 0.05) for name in names}


def _grads(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3


def _check(tracker: AdamWTracker, truth: SnapshotTracker) -> dict[str, torch.Tensor]:
    changed = tracker.changed()
    real = truth.changed()
    assert any(i.numel() for i in real.values()), (
        "the step changed nothing: a test that cannot fail"
    )
    assert _missed(changed, real) == 0
    tracker.clear()
    truth.clear()
    return changed


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(foreach=True), dict(fused=True)])
def test_a_parameter_moved_to_another_group_is_inverted_with_that_groups_settings(impl):
    # It was inverted with its first group's tiny lr: 3 of ~4000 changed elements reported.
    params = _params("a", "b")
    opt = torch.optim.AdamW(
        [{"params": [params["a"]], "lr": 1e-6}, {"params": [params["b"]], "lr": 1e-3}], **impl
    )
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    _grads(params, 1)
    opt.step()
    _check(tracker, truth)
    opt.param_groups[0]["params"].remove(params["a"])
    opt.add_param_group({"params": [params["a"]], "lr": 1e-2})
    for seed in (2, 3):
        _grads(params, seed)
        opt.step()
        changed = _check(tracker, truth)
    assert tracker.out_of_band == ()  # sparse, not in full: its new group is still AdamW's
    assert 0 < changed["a"].numel() < params["a"].numel()


def test_a_deleted_param_group_raises_nothing_and_its_parameters_are_not_stepped():
    # The tracker indexed the group list it was built with: IndexError out of opt.step().
    params = _params("a", "b")
    opt = torch.optim.AdamW([{"params": [params["a"]]}, {"params": [params["b"]], "lr": 1e-2}])
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    del opt.param_groups[0]
    _grads(params, 1)
    opt.step()
    changed = _check(tracker, truth)
    assert "a" not in changed and changed["b"].numel() > 0


def test_a_frozen_parameter_a_fused_optimizer_starts_stepping_is_sent_in_full(caplog):
    # A fused step leaves the version counter alone, so the constant's counter never moved
    # and every element it changed was missed.
    params = _params("body", "head")
    params["head"].requires_grad_(False)
    opt = torch.optim.AdamW([params["body"]], lr=1e-3, fused=True)
    tracker = AdamWTracker(opt, params.items(), strict=True)
    assert tracker.constant == ("head",)
    truth = SnapshotTracker(params.items())
    params["head"].requires_grad_(True)
    opt.add_param_group({"params": [params["head"]], "lr": 1e-3})
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        for seed in (1, 2):
            _grads(params, seed)
            opt.step()
            changed = _check(tracker, truth)
            assert changed["head"].numel() == params["head"].numel()
    assert "added to the optimizer after the tracker was built" in caplog.text
    assert tracker.constant == ()


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True)])
def test_a_second_optimizer_stepping_tracked_parameters_is_seen_fused_or_not(impl):
    params = _params("w", "other")
    opt = torch.optim.AdamW([params["w"], params["other"]], lr=1e-3)
    second = torch.optim.AdamW([params["w"]], lr=1e-3, **impl)
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    _grads(params, 1)
    second.step()
    changed = _check(tracker, truth)
    assert tracker.out_of_band == () and changed["w"].numel() == params["w"].numel()
    assert "other" not in changed
    if impl.get("fused"):  # a step whose counter does not move: seen through the hook alone
        tracker.close()  # its hooks go, the one on every optimizer too
        second.step()
        assert tracker.changed() == {}


@pytest.mark.parametrize("impl", [dict(foreach=False), dict(fused=True)])
def test_past_2_pow_24_steps_a_frozen_parameter_added_later_is_still_sent_in_full(impl, caplog):
    # an adopted constant was reported only when its step count moved: at 2^24 it does not,
    # and a fused step moves no version counter either, so every element it changed was missed
    params = _params("body", "head")
    params["head"].requires_grad_(False)
    opt = torch.optim.AdamW([params["body"]], lr=1e-3, **impl)
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    params["head"].requires_grad_(True)
    opt.add_param_group({"params": [params["head"]]})
    _grads(params, 1)
    opt.step()
    _check(tracker, truth)
    opt.state[params["head"]]["step"].fill_(2.0**24)  # a state resumed from a long run
    _grads(params, 2)
    opt.step()  # (the count jumped: sent in full as a step not seen)
    _check(tracker, truth)
    _grads(params, 3)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        opt.step()
        changed = _check(tracker, truth)
    assert float(opt.state[params["head"]]["step"]) == 2.0**24  # it really did not move
    assert changed["head"].numel() == params["head"].numel()
    assert "reached 2^24" in caplog.text


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True)])
def test_past_2_pow_24_steps_a_step_is_not_taken_for_a_skipped_one(impl, caplog):
    # float32: 2^24 + 1 == 2^24, so the count did not move and the step was taken as skipped
    # (fused: every changed element missed; foreach: sent as "modified outside").
    params = _params("w")
    opt = torch.optim.AdamW(params.values(), lr=1e-3, **impl)
    _grads(params, 1)
    opt.step()
    opt.state[params["w"]]["step"].fill_(2.0**24)
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    _grads(params, 2)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        opt.step()
        changed = _check(tracker, truth)
    assert float(opt.state[params["w"]]["step"]) == 2.0**24  # it really did not move
    assert changed["w"].numel() == params["w"].numel() and tracker.out_of_band == ()
    assert "reached 2^24" in caplog.text and "modified outside" not in caplog.text


def test_groups_changed_by_a_pre_step_hook_registered_after_the_tracker_are_read_as_the_update_read_them():
    # The tracker read the groups in its own pre-step hook; a later hook moved a parameter to
    # a group with 10x the lr (inverted with the old lr: elements missed) and added a frozen
    # one under fused=True (its first step missed whole).
    params = _params("a", "b", "frozen")
    params["frozen"].requires_grad_(False)
    opt = torch.optim.AdamW(
        [{"params": [params["a"]], "lr": 1e-4}, {"params": [params["b"]], "lr": 1e-3}],
        fused=True,
    )
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    _grads(params, 1)
    opt.step()
    _check(tracker, truth)

    def regroup(optimizer, args, kwargs):
        optimizer.param_groups[0]["params"].remove(params["a"])
        optimizer.add_param_group({"params": [params["a"]], "lr": 1e-2})
        params["frozen"].requires_grad_(True)
        optimizer.add_param_group({"params": [params["frozen"]], "lr": 1e-3})

    handle = opt.register_step_pre_hook(regroup)
    _grads(params, 2)
    params["frozen"].grad = torch.full_like(params["frozen"], 1e-3)  # for the step it joins
    opt.step()
    handle.remove()
    changed = _check(tracker, truth)
    assert changed["frozen"].numel() == params["frozen"].numel()
    assert 0 < changed["a"].numel() < params["a"].numel()


def test_a_parameter_listed_in_two_groups_is_stepped_twice_and_sent_in_full():
    # torch steps it once per group it is listed in; the inversion of one step missed some
    params = _params("a", "b")
    opt = torch.optim.AdamW([{"params": [params["a"]]}, {"params": [params["b"]]}], lr=1e-5)
    tracker = AdamWTracker(opt, params.items(), strict=True)
    truth = SnapshotTracker(params.items())
    opt.param_groups[1]["params"].append(params["a"])
    _grads(params, 1)
    opt.step()
    assert float(opt.state[params["a"]]["step"]) == 2.0  # two updates in one step()
    changed = _check(tracker, truth)
    assert changed["a"].numel() == params["a"].numel()
    assert changed["b"].numel() < params["b"].numel()
