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
