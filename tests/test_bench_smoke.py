"""The benchmark programs run end to end on tiny inputs and report their self-checks.

Not timed tests: they only guard the programs against bit-rot and check that the last stdout
line is the documented JSON with ``exact`` / ``missed`` filled in by the benchmark's own
verification (receiver state digests against the trainer's; the tracker against a snapshot)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

DELTASYNC = [str(Path(sys.executable).with_name("deltasync"))]


def _last_json(args: list[str], timeout: float) -> dict:
    done = subprocess.run(
        DELTASYNC + args, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    return json.loads(last)


@pytest.mark.timeout(240)
def test_compare_bench_on_a_tiny_moe_is_exact_and_reports_every_field(tmp_path) -> None:
    out = _last_json(
        [
            "bench",
            "--model",
            "qwen3-moe-tiny",
            "--lr",
            "1e-4",
            "--steps",
            "1",
            "--link-gbps",
            "1",
            "--systems",
            "snapshot,deltasync",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
        ],
        timeout=220,
    )
    assert out["exact"] is True and out["link_gbps"] == 1.0
    assert set(out["results"]) == {"snapshot", "deltasync"}
    for res in out["results"].values():
        for key in (
            "total_s",
            "trainer_stall_s",
            "transfer_s",
            "receiver_pause_s",
            "bytes",
            "trainer_peak_rss_bytes",
            "receiver_peak_rss_bytes",
            "changed_fraction",
        ):
            assert isinstance(res[key], (int, float)) and res[key] >= 0, key
        assert 0 < res["changed_fraction"] <= 1 and res["bytes"] > 0
        timeline = res["timeline"]  # where the latency went, and the CPU it cost
        for key in ("rx_cpu_s", "fwd_bwd_cpu_s", "visible_s"):
            assert isinstance(timeline[key], (int, float)) and timeline[key] >= 0, key
        # a paired difference (the trainer's CPU in the window less its forward/backward's
        # alone): a sync cheaper than that forward/backward's variation can read below zero
        for key in ("sync_cpu_s", "cpu_bound_s"):
            assert isinstance(timeline[key], (int, float)) and math.isfinite(timeline[key]), key
        assert timeline["rx_cpu_s"] > 0 and timeline["visible_s"] <= res["total_s"]
    mine = out["results"]["deltasync"]["timeline"]
    assert {"stage_s", "verify_s"} <= set(mine)
    # deltasync's sync routes, encodes and uploads ~40% of the model here: well above the noise
    assert mine["sync_cpu_s"] > 0 and mine["cpu_bound_s"] > 0
    assert {r["path"] for r in out["runs"]} >= {"store (unthrottled)", "store @ 1 Gbit/s"}
    for run in out["runs"]:  # two rounds: each system's median latency in each, pooled above
        rounds = run["round_latency_s"]
        assert set(rounds) == {"snapshot", "deltasync"}, run["path"]
        assert all(len(v) == 2 and all(x > 0 for x in v) for v in rounds.values()), rounds
        pooled = run["results"]["deltasync"]["total_s"]
        assert min(rounds["deltasync"]) <= pooled <= max(rounds["deltasync"]), run["path"]
    assert list(tmp_path.glob("*.png")), "the plot was not written"


@pytest.mark.timeout(120)
def test_detect_bench_on_a_small_set_misses_nothing() -> None:
    out = _last_json(["bench", "detect", "--elements", "3000000", "--tensors", "3"], timeout=110)
    assert out["missed"] == 0
    assert out["detect_elements_per_s"] > 0 and out["memory_read_gbps"] > 0
    assert 0 <= out["extra_over_true"] <= 0.05


def _module_json(module: str, *args: str, timeout: float) -> dict:
    """Run ``python -m module args``; its last stdout line, parsed."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_publish_probe_on_a_small_model_is_exact() -> None:
    """The one-process store-path probe (TrainerSync(overlap=True) + Publisher, as users run it)
    checks what it published itself: a Receiver per shard pulls every version, bit for bit
    against a dense split of the trainer's BF16 params."""
    out = _module_json(
        "deltasync_bench.publish_probe",
        *("--model", "qwen3-small", "--layers", "1", "--versions", "2", "--pre-steps", "1"),
        timeout=220,
    )
    assert out["bench"] == "publish_probe"
    assert out["exact"] is True


@pytest.mark.timeout(240)
def test_gpu_sync_bench_dry_runs_both_modes_on_the_cpu_and_checks_every_version() -> None:
    """The device tier's sync benchmark (scripts/gpu_tier.sh) on the CPU: the same program,
    blocking and overlapped, each version checked bit for bit by the benchmark itself."""
    out = _module_json(
        "deltasync_bench.gpu_sync_bench",
        *("--model", "qwen3-tiny", "--versions", "2", "--pre-steps", "1"),
        *("--modes", "blocking,overlap"),
        timeout=220,
    )
    assert out["bench"] == "gpu_sync" and out["exact"] is True
    assert set(out["modes"]) == {"blocking", "overlap"}
    for mode in out["modes"].values():
        assert len(mode["versions"]) == 2
        for row in mode["versions"]:
            assert row["elements"] > 0 and 0 < row["stall_s"] <= row["commit_s"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "module",
    [
        "publish_probe",
        "route_bench",
        "exchange_bench",
        "format_bench",
        "dp_replicas_bench",
        "detect_dtensor",
        "probe_bench",
    ],
)
def test_every_benchmark_program_docs_list_answers_help_with_its_usage(module) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"deltasync_bench.{module}", "--help"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and "Traceback" not in done.stderr
