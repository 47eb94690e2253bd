"""rl-demo end to end on a tiny model: real processes, real store, real SIGKILL.

Every run checks, at every version a worker generates from (and at the end), that its probe
logits are bit-identical to the trainer's dense BF16 reference; the summary says so.
"""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from deltasync_examples.rl import ProbeMismatchError, RLConfig, run_rl

SMALL = {"prompts_per_step": 4, "group_size": 4, "timeout_s": 60.0}


def _strictly_increasing(xs: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(xs))


@pytest.mark.timeout(150)
def test_short_run_with_a_killed_worker_is_exact_monotone_and_within_staleness(tmp_path):
    cfg = RLConfig(
        steps=6,
        workers=2,
        max_staleness=1,
        kill_worker_at=2,
        restart_after=1,
        store=str(tmp_path),
        **SMALL,
    )
    out = run_rl(cfg, log=lambda _line: None)

    assert out["probe_exact"] is True
    assert out["versions"] == list(range(7))
    # Every trajectory trained a policy at most max_staleness versions newer than its own.
    for step, sampled in enumerate(out["sampled_versions"], start=1):
        assert sampled and all(0 <= (step - 1) - v <= 1 for v in sampled), (step, sampled)
    assert out["max_staleness"] <= 1
    # Each worker process saw versions only move forward, and proved each one it used.
    procs = out["probe_versions"]
    assert set(procs) == {"0.0", "0.1", "1.0"}
    for versions in procs.values():
        assert _strictly_increasing(versions), procs
    # The killed worker's new incarnation caught up from the store (anchor + deltas), proved
    # the version it reached, and proved the final one too.
    assert out["killed_at"] == 2 and out["restarts"] == 1
    assert out["rejoined_at"] >= 3
    assert procs["0.1"][0] == out["rejoined_at"] and procs["0.1"][-1] == 6
    assert procs["1.0"][-1] == 6


@pytest.mark.timeout(90)
def test_a_reference_that_differs_by_one_bit_fails_the_run_loudly(tmp_path, monkeypatch):
    from deltasync_examples.rl import loop

    original = loop._Trainer.publish

    def publish_with_a_flipped_bit(self, version):
        original(self, version)
        if version == 1:
            self.refs[1] = self.refs[1].copy()
            self.refs[1].reshape(-1)[0] ^= 1

    monkeypatch.setattr(loop._Trainer, "publish", publish_with_a_flipped_bit)
    cfg = RLConfig(steps=3, workers=1, max_staleness=0, store=str(tmp_path), **SMALL)
    with pytest.raises(ProbeMismatchError, match="version 1") as exc:
        run_rl(cfg, log=lambda _line: None)
    assert exc.value.summary["probe_exact"] is False


@pytest.mark.timeout(90)
def test_a_run_stopped_early_lists_only_the_versions_it_published(tmp_path, monkeypatch):
    from deltasync_examples.rl import loop

    original = loop._Trainer.publish

    def publish_then_ctrl_c(self, version):
        original(self, version)
        if version == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop._Trainer, "publish", publish_then_ctrl_c)
    cfg = RLConfig(steps=6, workers=1, max_staleness=0, store=str(tmp_path), **SMALL)
    with pytest.raises(KeyboardInterrupt) as exc:
        run_rl(cfg, log=lambda _line: None)
    assert exc.value.summary["versions"] == [0, 1, 2]
    assert exc.value.summary["steps"] == 6


@pytest.mark.timeout(90)
def test_cli_with_the_hf_engine_ends_with_one_json_line(tmp_path, capsys):
    from deltasync.commands import apps

    parser = argparse.ArgumentParser()
    apps.register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "rl-demo",
            "--steps",
            "2",
            "--workers",
            "1",
            "--engine",
            "hf",
            "--max-staleness",
            "0",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--store",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert {
        "steps",
        "versions",
        "reward_first",
        "reward_last",
        "probe_exact",
        "max_staleness",
    } <= set(out)
    assert out["steps"] == 2 and out["versions"] == [0, 1, 2] and out["engine"] == "hf"
    assert out["probe_exact"] is True and out["max_staleness"] == 0
    assert len(lines) == 3  # one line per step, then the JSON line


@pytest.mark.timeout(120)
def test_a_worker_restarted_at_the_last_step_proves_it_again_and_the_run_ends(tmp_path):
    # The restart (kill at 1, restart 2 later: past the end) happens at the last step; the
    # final "every worker proves the final version" asks the restarted worker for the version
    # it just proved, and it must answer (it stayed silent: the run waited out its timeout).
    cfg = RLConfig(
        steps=2,
        workers=2,
        kill_worker_at=1,
        restart_after=2,
        store=str(tmp_path),
        **{**SMALL, "timeout_s": 30.0},
    )
    out = run_rl(cfg, log=lambda _line: None)
    assert out["probe_exact"] is True and out["rejoined_at"] == 2
    assert out["probe_versions"]["0.1"] == [2, 2]  # after the restart, and at the end


@pytest.mark.parametrize("field", ["lr", "temperature", "clip"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_rl_config_refuses_a_non_finite_rate(field, value):
    from deltasync.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"RLConfig\.{field} must be a finite number > 0"):
        RLConfig(**{field: value})
    assert RLConfig(timeout_s=float("inf")).timeout_s == float("inf")  # wait forever: allowed


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_run_ends_the_cli_with_the_summary_and_a_typed_error(
    tmp_path, monkeypatch, capsys
):
    import os
    import signal

    from deltasync import cli
    from deltasync_examples.rl import fleet

    broadcast = fleet.Fleet.broadcast_ref

    def broadcast_then_kill(self, version, bits):
        broadcast(self, version, bits)
        if version == 1:  # from outside, as the OOM killer would
            os.kill(self._children[1].pid, signal.SIGKILL)

    monkeypatch.setattr(fleet.Fleet, "broadcast_ref", broadcast_then_kill)
    argv = ["rl-demo", "--steps", "4", "--workers", "2", "--prompts-per-step", "4"]
    argv += ["--group-size", "2", "--timeout", "30", "--store", str(tmp_path), "--quiet"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["probe_exact"] is False and out["steps"] == 4
    assert "rollout worker 1" in out["error"] and "killed by SIGKILL" in out["error"]
    assert captured.err.startswith("deltasync: error: ")
    assert "rollout worker 1" in captured.err and "Traceback" not in captured.err
