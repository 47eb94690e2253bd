"""The benchmarks' own checks catch what they claim to: each test feeds a benchmark one wrong
element (a fake tracker that misses a change, a wrong anchor, a wrong routed value, a system on
other versions, a refused version) and expects ``exact`` false and a non-zero exit, not a
clean report. Small inputs: each runs in seconds."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deltasync import AdamWTracker
from deltasync.trainer.positions import Positions


class _MissingTracker(AdamWTracker):
    """A tracker with a bug: it misses the last changed element of the first parameter with
    more than one (both in what it publishes and in what it reports)."""

    def _miss_one(self, items):
        missed = False
        for name, x, *rest in items:
            if not missed and len(x) > 1:
                missed = True
                x = Positions.of(x.indices()[:-1]) if isinstance(x, Positions) else x[:-1]
                rest = [v if v is None else v[:-1] for v in rest]
            yield (name, x, *rest)

    def iter_capture(self, values_below, *, values_max=0, sink=None):
        return self._miss_one(super().iter_capture(values_below, values_max=values_max, sink=sink))

    def iter_changes(self, *, sink=None):
        return self._miss_one(super().iter_changes(sink=sink))


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_publish_probe_reports_versions_its_receivers_refuse_as_not_exact(
    monkeypatch, capsys
) -> None:
    from deltasync_bench import publish_probe

    threads = torch.get_num_threads()
    monkeypatch.setattr(publish_probe, "AdamWTracker", _MissingTracker)
    argv = ["publish_probe", "--model", "qwen3-small", "--layers", "1", "--versions", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--pre-steps", "1", "--threads", "1"])
    try:
        rc = publish_probe.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 1 and "exact: NO" in out
    assert _last_json(out)["exact"] is False


@pytest.mark.timeout(120)
def test_detect_dtensor_fails_when_detection_misses_a_changed_element() -> None:
    """The plain and DTensor runs share the tracker's bug, so only the bitwise truth sees it."""
    head = textwrap.dedent(
        """
        import sys
        sys.argv = ["detect_dtensor", "--params", "2", "--rows", "64", "--cols", "64",
                    "--repeat", "1"]
        from deltasync_bench import detect_dtensor
        from deltasync import AdamWTracker
        from deltasync.trainer.positions import Positions
        """
    )
    tail = (
        "detect_dtensor.AdamWTracker = _MissingTracker\nraise SystemExit(detect_dtensor.main())\n"
    )
    code = head + inspect.getsource(_MissingTracker) + tail
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    out = _last_json(done.stdout)
    assert out["exact"] is False and out["plain_missed"] == 1 and out["dtensor_missed"] == 1


def test_format_bench_dense_fails_on_a_wrong_anchor(monkeypatch, capsys) -> None:
    from deltasync_bench import format_bench

    real = format_bench.apply_updates

    def apply_with_a_wrong_anchor(updates, live):
        written = real(updates, live)
        if all(u.indices is None for u in updates):  # the anchor: one bit of one value wrong
            next(iter(live.values())).view(-1).view(torch.int16)[0] ^= 1
        return written

    monkeypatch.setattr(format_bench, "apply_updates", apply_with_a_wrong_anchor)
    argv = ["format_bench", "--elements", "200000", "--tensors", "2", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--dense"])
    with pytest.raises(SystemExit) as failed:
        format_bench.main()
    assert failed.value.code not in (0, None)
    out = capsys.readouterr().out
    assert "exact: NO" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["exact"] is False and result["anchor_exact"] is False


def _routed_small_model():
    from deltasync.layout import ModelSpec, ReceiverLayout
    from deltasync_bench import route_bench

    cfg = dict(route_bench.QWEN3_06B, vocab_size=1000, hidden_size=256, intermediate_size=512)
    spec = ModelSpec.from_hf_config(dict(cfg, num_hidden_layers=1))
    layout = ReceiverLayout.build(spec, "vllm", 2)
    changes = route_bench.change_sets(spec, 0.05, seed=0)
    routed = route_bench.run_route(layout, changes)
    valued = route_bench.run_route_values(layout, changes)
    merged = layout.route_changes(changes)
    return cfg, routed, merged, changes, valued


def _flip_one_value(per_shard: dict) -> None:
    shard = next(iter(per_shard))
    local, (idx, vals) = next((k, v) for k, v in per_shard[shard].items() if v[1].numel())
    vals = vals.clone()
    vals.view(torch.int16)[-1] ^= 1
    per_shard[shard][local] = (idx, vals)


def test_route_bench_verify_checks_the_routed_values_against_a_dense_split() -> None:
    from deltasync_bench import route_bench

    cfg, routed, merged, changes, valued = _routed_small_model()
    assert route_bench.verify(cfg, 2, routed, merged, changes, valued) > 0
    _flip_one_value(merged)  # route_changes gives one wrong value
    with pytest.raises(SystemExit, match="route_changes"):
        route_bench.verify(cfg, 2, routed, merged, changes, valued)
    cfg, routed, merged, changes, valued = _routed_small_model()
    _flip_one_value(valued["model.embed_tokens.weight"])  # route_values gives one wrong value
    with pytest.raises(SystemExit, match="route_values"):
        route_bench.verify(cfg, 2, routed, merged, changes, valued)


def test_snapshot_reports_its_busiest_shards_changed_elements_for_the_floor() -> None:
    """Without deltasync in --systems the floor's scatter is still the busiest shard's count."""
    from deltasync import ModelSpec, ReceiverLayout, TrainerLayout
    from deltasync.store import MemoryStore
    from deltasync_bench.compare.systems.base import canonical_bf16
    from deltasync_bench.compare.systems.snapshot import SnapshotTrainer
    from deltasync_bench.compare.workload import Workload, build_trainer

    w = Workload(model="qwen3-tiny", lr=1e-4, pre_steps=1)
    trainer = build_trainer(w)
    trainer.step(-1)
    spec = ModelSpec.from_hf_config(w.hf_config())
    tlayout, rlayout = TrainerLayout.build(spec), ReceiverLayout.build(spec, engine="vllm", tp=2)
    side = SnapshotTrainer(params=trainer.params(), tlayout=tlayout, rlayout=rlayout, timeout_s=9)
    store = MemoryStore()
    side.bootstrap(store)
    before = canonical_bf16(trainer.params(), tlayout)
    trainer.step(1)
    side.store_sync(1, store)
    after = canonical_bf16(trainer.params(), tlayout)
    changes = {}
    for name, t in after.items():  # the bitwise truth, routed to the shards
        new, old = t.reshape(-1).view(torch.int16), before[name].reshape(-1).view(torch.int16)
        idx = torch.nonzero(new != old).reshape(-1)
        changes[name] = (idx, t.reshape(-1)[idx])
    busiest = max(
        sum(int(i.numel()) for i, _ in per.values())
        for per in rlayout.route_changes(changes).values()
    )
    assert side.last_shard_elements == busiest
    assert 0 < busiest < side.last_changed_elements  # TP=2: a shard holds part of the change


# --- deltasync bench (compare): the orchestrator and main, with fake roles and runs ---------


def _tr(version: int) -> dict:
    t = float(version)
    return dict(
        t0=t,
        t_exchange=t + 0.01,
        t1=t + 0.01,
        t_commit=t + 0.02,
        t_fb=t + 0.03,
        stall_s=0.01,
        detect_s=0.001,
        fwd_bwd_cpu_s=0.01,
        sync_cpu_s=0.01,
        fwd_bwd_with_s=0.01,
        barrier_s=0.0,
        overhead_s=0.01,
        bytes=1000,
        peak_rss=10,
        overhead_bytes=1,
        kept_bytes=0,
    )


def _rx(version: int, shard: str) -> dict:
    return dict(
        t_recv=version + 0.01,
        t_done=version + 0.05,
        transfer_s=0.01,
        pause_s=0.001,
        cpu_s=0.01,
        shard=shard,
        shard_bytes=100,
        rss_base=1,
        peak_rss=2,
    )


class _FakeRoles:
    """Roles that answer like the real ones: receiver tp0 holds a wrong element at version
    ``wrong``, and refuses version ``refused`` (the receiver's IntegrityError)."""

    wrong, refused = 1, 3

    def __init__(self, *_a, **_k) -> None:
        self.version = 0

    def _truth(self, version: int) -> dict[str, str]:
        return {"tp0": f"a{version}", "tp1": f"b{version}"}

    def call(self, rank: int, op: str, *args) -> dict:
        if op == "bootstrap":
            if rank == 0:
                return {"model_bf16_bytes": 400, "expected": self._truth(0)}
            shard = f"tp{rank - 1}"
            # receiver tp1's first pull peaks higher: the run keeps the largest
            over = 300 if shard == "tp0" else 500
            return {
                "digest": self._truth(0)[shard],
                "shard": shard,
                "overhead_bytes": over,
                "shard_bytes": 200,
            }
        truth = self._truth(self.version)
        if op == "check":  # a receiver's own digest, asked for after the timed part
            shard = f"tp{rank - 1}"
            wrong = shard == "tp0" and self.version == self.wrong
            return {"digest": "wrong" if wrong else truth[shard]}
        assert op == "expected"
        return {"expected": truth}

    def send(self, rank: int, op: str, version: int, *args) -> None:
        self.version = version

    def recv_all(self, ranks) -> list[dict]:
        from deltasync_examples.harness import ChildFailedError

        v = self.version
        if v == self.refused:
            raise ChildFailedError("bench deltasync receiver rank 1 failed: IntegrityError: x")
        return [_tr(v), _rx(v, "tp0"), _rx(v, "tp1")]

    def close(self, join_s: float = 10.0) -> None:
        pass


def test_run_system_records_a_wrong_warm_up_and_a_refused_version_as_not_exact(
    monkeypatch,
) -> None:
    from deltasync_bench.compare import run
    from deltasync_bench.compare.workload import Workload

    monkeypatch.setattr(run, "_Roles", _FakeRoles)
    cfg = run.RunConfig(
        workload=Workload(model="qwen3-tiny"),
        paths=(run.PathSpec(kind="store"), run.PathSpec(kind="store", gbps=1.0)),
        warmup=1,
        steps=1,
    )
    lines: list[str] = []
    got = run.run_system(cfg, "deltasync", 2, log=lines.append)  # no exception: a report
    assert got.exact is False
    assert [r.version for r in got.records] == [2]  # v3 was refused: the run ended there
    assert any("v1" in f and "warm-up" in f for f in got.failures), got.failures
    assert any("v3" in f and "IntegrityError" in f for f in got.failures), got.failures
    assert any("v1" in line and "exact=False" in line for line in lines), lines
    assert sorted(got.expected) == [0, 1, 2]
    assert got.bootstrap_rx_mem == 2.5  # 500 bytes above the interpreter, a 200-byte shard


def _system_run(system: str, *, exact: bool = True, differ_at: int | None = None):
    from deltasync_bench.compare.run import SyncRecord, SystemRun

    one = SystemRun(system=system, model_bf16_bytes=400, exact=exact)
    one.expected = {v: {"tp0": f"a{v}" + ("x" if v == differ_at else "")} for v in range(3)}
    for v, path in ((1, "store @ 1 Gbit/s"),):
        one.records.append(
            SyncRecord(
                system=system,
                path=path,
                version=v,
                total_s=0.1,
                trainer_stall_s=0.01,
                transfer_s=0.01,
                receiver_pause_s=0.01,
                bytes=1000,
                trainer_peak_rss_bytes=1,
                trainer_overhead_bytes=1,
                receiver_peak_rss_bytes=1,
                receiver_overhead_bytes=1,
                shard_bytes=200,
                exact=True,
                changed_elements=10,
                max_shard_elements=6 if system != "dense" else None,
            )
        )
    if not exact:
        one.failures.append(f"{system} v1 (store (unthrottled), warm-up): differs")
    return one


def _compare_main(
    monkeypatch, tmp_path, capsys, runs: dict, *, unthrottled: bool = False
) -> tuple[int, dict, str]:
    import argparse

    from deltasync_bench import compare_bench

    monkeypatch.setattr(compare_bench, "measure_memory_gbps", lambda: 10.0)
    monkeypatch.setattr(compare_bench, "run_system", lambda cfg, s, n: runs[s])
    p = argparse.ArgumentParser()
    compare_bench.add_arguments(p)
    args = p.parse_args(
        [
            *("--model", "qwen3-tiny", "--steps", "1", "--link-gbps", "1"),
            *(() if unthrottled else ("--no-unthrottled",)),
            *("--no-cluster", "--systems", ",".join(runs), "--out", str(tmp_path)),
        ]
    )
    rc = compare_bench.main(args)
    out = capsys.readouterr().out
    return rc, _last_json(out), out


def test_compare_marks_a_system_with_a_wrong_warm_up_not_exact_in_its_rows(
    monkeypatch, tmp_path, capsys
) -> None:
    runs = {"dense": _system_run("dense", exact=False), "snapshot": _system_run("snapshot")}
    runs["snapshot"].bootstrap_rx_mem = 2.25
    rc, out, text = _compare_main(monkeypatch, tmp_path, capsys, runs)
    assert rc == 1 and out["exact"] is False
    assert out["results"]["snapshot"]["bootstrap_rx_mem_over_shard"] == 2.25
    assert out["results"]["dense"]["bootstrap_rx_mem_over_shard"] is None
    assert "rx first pull" in text and "2.25x" in text
    assert out["results"]["dense"]["exact"] is False  # its measured versions were all exact
    assert out["results"]["snapshot"]["exact"] is True
    assert any("dense v1" in f for f in out["failures"])
    # the floor's scatter: the busiest shard's changed elements, without deltasync too
    assert out["floor"]["scatter_elements"] == 6


def test_compare_fails_when_systems_ran_on_different_versions(
    monkeypatch, tmp_path, capsys
) -> None:
    runs = {"dense": _system_run("dense"), "snapshot": _system_run("snapshot", differ_at=2)}
    rc, out, text = _compare_main(monkeypatch, tmp_path, capsys, runs)
    assert rc == 1 and out["exact"] is False
    assert out["results"]["snapshot"]["exact"] is False
    assert any("snapshot v2" in f and "same versions" in f for f in out["failures"])
    assert "NOT EXACT: snapshot v2" in text


def test_the_bench_oracle_fills_vllm_shards_apart_from_the_layout_tables() -> None:
    # The oracle split the checkpoint with the very layout under test: a table with k and v
    # swapped inside qkv_proj made receivers and oracle agree on the wrong weights ("exact").
    from dataclasses import replace

    from deltasync import ModelSpec, ReceiverLayout, TrainerLayout
    from deltasync.layout.table import LayoutTable
    from deltasync_bench.compare.workload import Workload, build_trainer
    from deltasync_examples.oracle import dense_shards, reference_shards, same_bits

    w = Workload(model="qwen3-small")
    params = build_trainer(w).params()
    spec = ModelSpec.from_hf_config(w.hf_config())
    tl, rl = TrainerLayout.build(spec), ReceiverLayout.build(spec, engine="vllm", tp=2)
    good = reference_shards(params, tl, rl)
    assert all(same_bits(good[s], t) for s, t in dense_shards(params, tl, rl).items())

    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    placements = dict(rl.table.placements)
    rows = {n: [p.block.dst_row for p in placements[n]] for n in (k, v)}
    for name, other in ((k, v), (v, k)):
        placements[name] = [
            replace(p, block=replace(p.block, dst_row=row))
            for p, row in zip(placements[name], rows[other], strict=True)
        ]
    table = LayoutTable(
        src_shapes=rl.table.src_shapes,
        dst_shapes=rl.table.dst_shapes,
        placements=placements,
        aliases=rl.table.aliases,
    )
    swapped = ReceiverLayout(spec=spec, engine="vllm", tp=2, ep=1, table=table, shards=rl.shards())
    wrong = dense_shards(params, tl, swapped)  # what receivers on that table would hold
    assert not all(same_bits(wrong[s], t) for s, t in reference_shards(params, tl, swapped).items())


def test_each_paths_changed_fraction_is_that_paths_own(monkeypatch, tmp_path, capsys) -> None:
    # it was the median over every path's versions, the same number on each path
    from dataclasses import replace

    runs = {"snapshot": _system_run("snapshot")}
    (rec,) = runs["snapshot"].records
    runs["snapshot"].records.append(
        replace(rec, path="store (unthrottled)", version=2, changed_elements=30)
    )
    _, out, _ = _compare_main(monkeypatch, tmp_path, capsys, runs, unthrottled=True)
    got = {r["path"]: r["results"]["snapshot"]["changed_fraction"] for r in out["runs"]}
    assert got == {"store (unthrottled)": 30 / 200, "store @ 1 Gbit/s": 10 / 200}, got


# --- deltasync bench: every flag checked before anything is written or measured ---------------


def _bench_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, str]:
    """``deltasync bench ARGV`` in this process, with the memory measurement and the runs
    replaced by ones that fail the test: a refused flag must reach neither."""
    from deltasync import cli
    from deltasync_bench import compare_bench

    def measured(*_a, **_k):
        raise AssertionError("the benchmark measured something before refusing a flag")

    monkeypatch.setattr(compare_bench, "measure_memory_gbps", measured)
    monkeypatch.setattr(compare_bench, "run_system", measured)
    rc = cli.main(["bench", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--steps", "-1"], "--steps must be an int >= 1"),
        (["--steps", "0"], "--steps must be an int >= 1"),
        (["--warmup", "-1"], "--warmup must be an int >= 0"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--link-gbps", "-1"], "--link-gbps must be a finite number > 0"),
        (["--link-gbps", "nan"], "--link-gbps must be a finite number > 0"),
        (["--fwd-bwd-s", "-5"], "--fwd-bwd-s must be a finite number >= 0"),
        (["--tp", "0"], "--tp must be an int >= 1"),
        (["--threads", "0"], "--threads must be an int >= 1"),
        (["--rounds", "0"], "--rounds must be an int >= 1"),
        (["--systems", "foo"], "unknown system"),
        (["--out", "FILE"], "exists and is not a directory"),
    ],
)
def test_a_bad_bench_flag_is_a_config_error_before_anything_is_written(
    monkeypatch, tmp_path, capsys, flags, says
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    out = tmp_path / "out"
    flags = [str(afile) if f == "FILE" else f for f in flags]
    argv = ["--model", "qwen3-tiny", "--no-cluster", "--out", str(out), *flags]
    rc, stdout, stderr = _bench_cli(monkeypatch, capsys, argv)
    assert rc == 2, stdout[-2000:] + stderr[-2000:]
    assert stderr.startswith("deltasync: error: ConfigError: ") and says in stderr, stderr
    assert not out.exists(), "--out was created for a run that could not start"
    assert stdout == ""  # nothing ran: no table, no JSON line


def test_bench_link_gbps_0_is_refused_and_points_at_the_unthrottled_path(
    monkeypatch, tmp_path, capsys
) -> None:
    from deltasync.errors import ConfigError
    from deltasync_bench.compare.run import PathSpec

    argv = ["--model", "qwen3-tiny", "--link-gbps", "0", "--out", str(tmp_path / "out")]
    rc, _, stderr = _bench_cli(monkeypatch, capsys, argv)
    assert rc == 2 and "--link-gbps must be a finite number > 0, got 0.0" in stderr
    assert "the unthrottled store path runs by default" in stderr
    with pytest.raises(ConfigError, match=r"PathSpec\.gbps"):
        PathSpec(kind="store", gbps=0)  # it was labelled "store (unthrottled)", a second time
    assert PathSpec(kind="store").label == "store (unthrottled)"


def test_bench_runs_a_link_rate_given_twice_once(monkeypatch, tmp_path, capsys) -> None:
    import argparse

    from deltasync_bench import compare_bench

    monkeypatch.setattr(compare_bench, "measure_memory_gbps", lambda: 10.0)
    paths = []

    def run_system(cfg, system, n):
        paths.append([p.label for p in cfg.paths])
        return _system_run(system)

    monkeypatch.setattr(compare_bench, "run_system", run_system)
    p = argparse.ArgumentParser()
    compare_bench.add_arguments(p)
    argv = ["--model", "qwen3-tiny", "--steps", "1", "--link-gbps", "1", "--link-gbps", "1"]
    argv += ["--no-unthrottled", "--no-cluster", "--systems", "snapshot", "--out", str(tmp_path)]
    assert compare_bench.main(p.parse_args(argv)) == 0
    assert paths == [["store @ 1 Gbit/s"]]
    assert [r["path"] for r in _last_json(capsys.readouterr().out)["runs"]] == ["store @ 1 Gbit/s"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--lr", "-1"], "DetectBenchConfig.lr must be a finite number > 0"),
        (["--lr", "inf"], "DetectBenchConfig.lr must be a finite number > 0"),
        (["--weight-decay", "nan"], "DetectBenchConfig.weight_decay must be a finite number >= 0"),
        (["--tensors", "0"], "--tensors"),
    ],
)
def test_a_bad_detect_bench_flag_is_a_config_error(capsys, flags, says) -> None:
    from deltasync import cli

    rc = cli.main(["bench", "detect", "--elements", "200000", "--tensors", "4", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.startswith("deltasync: error: ConfigError: ") and says in captured.err


def test_the_bench_removes_every_roles_state_with_its_temporary_directory(
    monkeypatch, tmp_path
) -> None:
    # The deltasync receivers kept their state in <tmp>/deltasync-bench-...-rx-tpN, beside the
    # run's temporary directory instead of inside it: two directories left by every run.
    import tempfile

    from deltasync import ModelSpec, ReceiverLayout
    from deltasync_bench.compare import run
    from deltasync_bench.compare.systems.deltasync_system import DeltasyncReceiver
    from deltasync_bench.compare.workload import Workload

    w = Workload(model="qwen3-tiny")
    rlayout = ReceiverLayout.build(ModelSpec.from_hf_config(w.hf_config()), engine="vllm", tp=2)

    class RolesThatKeepState(_FakeRoles):
        def __init__(self, cfg, system, store_root, n) -> None:
            super().__init__()
            os.makedirs(store_root, exist_ok=True)  # what the trainer's store does
            for shard in ("tp0", "tp1"):  # what each receiver's Receiver does
                rx = DeltasyncReceiver(
                    rlayout=rlayout, shard=shard, store_root=store_root, timeout_s=1.0
                )
                os.makedirs(rx.state_dir)

    monkeypatch.setattr(run, "_Roles", RolesThatKeepState)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = run.RunConfig(workload=w, paths=(run.PathSpec(kind="store"),), warmup=0, steps=1)
    run.run_system(cfg, "deltasync", 2, log=lambda _line: None)
    assert not list(tmp_path.iterdir()), "the run left something in the temp dir"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ranks", "1"], "--ranks must be an int in [2, 16]"),
        (["--hidden", "192"], "--hidden must be a multiple of 128"),
        (["--versions", "1"], "--versions must be an int in [2, 1000]"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
    ],
)
def test_a_bad_fsdp_bench_flag_is_a_config_error_before_any_rank_starts(capsys, flags, says):
    from deltasync import cli

    rc = cli.main(["bench", "fsdp", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.startswith("deltasync: error: ConfigError: ") and says in captured.err


def test_the_fsdp_bench_check_compares_each_receiver_shard_bit_for_bit() -> None:
    from types import SimpleNamespace

    from kit import tiny_layouts

    from deltasync_bench import fsdp_bench

    _, tl, rl = tiny_layouts()
    gen = torch.Generator().manual_seed(3)
    full = {n: torch.randn(s, generator=gen) for n, s in tl.param_shapes().items()}
    want = rl.split(tl.to_canonical({n: t.to(torch.bfloat16) for n, t in full.items()}))

    def receivers(flip: bool) -> dict:
        out = {}
        for shard, tensors in want.items():
            tensors = {n: t.clone() for n, t in tensors.items()}
            if flip and shard == "tp1":
                t = next(iter(tensors.values()))
                t.view(-1).view(torch.int16)[-1] ^= 1  # one bit of one element
            out[shard] = SimpleNamespace(tensors=tensors, pull=lambda: None)
        return out

    assert fsdp_bench._pulled_exactly(receivers(False), tl, rl, full)
    assert not fsdp_bench._pulled_exactly(receivers(True), tl, rl, full)


def test_the_fsdp_bench_reports_a_version_that_is_not_exact_and_exits_1(capsys) -> None:
    from deltasync_bench import fsdp_bench

    def version(v: int, exact: bool) -> dict:
        times = dict(blocked_s=0.2, gather_s=0.15, detect_s=0.05, commit_s=0.3)
        return dict(version=v, **times, mem_bytes=100, mem_rank0_bytes=100, exact=exact)

    out = {
        "ranks": 2,
        "model_bf16_bytes": 1000,
        "phases": {"fp32": [version(1, True)], "bf16": [version(1, False), version(2, True)]},
    }
    assert fsdp_bench._report(out) == 1
    got = _last_json(capsys.readouterr().out)
    assert got["exact"] is False and got["medians"]["fp32"]["exact"] is True
    assert got["medians"]["bf16"]["blocked_over_detect"] == pytest.approx(4.0)


@pytest.mark.timeout(240)
def test_the_fsdp_bench_runs_two_gloo_ranks_exactly_and_ends_with_its_json_line() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "deltasync", "bench", "fsdp"),
            *("--layers", "1", "--hidden", "128", "--vocab", "256", "--versions", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = _last_json(done.stdout)
    assert got["exact"] is True and got["ranks"] == 2
    for phase in ("fp32", "bf16"):
        (one,) = got["versions"][phase]  # version 1: the anchor is not measured
        assert one["version"] == 1 and one["exact"] is True
        assert 0 < one["gather_s"] <= one["blocked_s"] <= one["commit_s"], one
    (one,) = got["versions"]["parts"]  # no full_state: parts digests, nothing gathered
    assert one["version"] == 1 and one["exact"] is True and one["gather_s"] == 0, one


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--hidden", "192"], "--hidden must be a multiple of 128"),
        (["--tp", "3"], "--tp 3 does not divide"),
        (["--changed", "1.5"], "--changed is a fraction in (0, 1]"),
        (["--repeat", "0"], "--repeat must be an int in [1, 100]"),
        (["--writers", "0"], "--writers must be an int in [1, 8]"),
        (["--writers", "9"], "--writers must be an int in [1, 8]"),
    ],
)
def test_a_bad_first_pull_bench_flag_is_a_config_error_before_anything_runs(capsys, flags, says):
    from deltasync import cli

    rc = cli.main(["bench", "first-pull", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.startswith("deltasync: error: ConfigError: ") and says in captured.err


def test_the_first_pull_bench_compares_bit_for_bit_and_exits_1_on_a_difference(capsys) -> None:
    from deltasync_bench import first_pull_bench

    gen = torch.Generator().manual_seed(5)
    want = {n: torch.randn(64, generator=gen).to(torch.bfloat16) for n in ("a", "b")}
    got = {n: t.clone() for n, t in want.items()}
    assert first_pull_bench._same_bits(got, want)
    got["b"].view(torch.int16)[7] ^= 1  # one bit of one element
    assert not first_pull_bench._same_bits(got, want)
    assert not first_pull_bench._same_bits({"a": want["a"]}, want)  # a tensor missing

    def run(case: str, exact: bool, peak: float) -> dict:
        times = dict(wall_s=1.0, stage_s=0.3, verify_s=0.4, pause_s=0.2)
        return dict(
            case=case,
            exact=exact,
            chain=[0],
            shard_bytes=1 << 20,
            **times,
            bytes_fetched=1 << 19,
            peak_bytes=int(peak * (1 << 20)),
            peak_over_shard=peak,
        )

    runs = {"anchor": [run("anchor", True, 1.05)], "catch-up": [run("catch-up", False, 1.2)]}
    assert first_pull_bench._report(runs) == 1
    out = _last_json(capsys.readouterr().out)
    assert out["exact"] is False and out["failures"] == ["catch-up: the receiver's tensors differ"]
    assert out["first_pull_peak_over_shard"] == pytest.approx(1.2) and out["met"] is False


@pytest.mark.timeout(240)
def test_the_first_pull_bench_pulls_exactly_and_ends_with_its_json_line() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "deltasync", "bench", "first-pull", "--layers", "1"),
            *("--hidden", "128", "--vocab", "512", "--deltas", "2", "--repeat", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = _last_json(done.stdout)
    assert got["exact"] is True and got["failures"] == []
    anchor, catch_up = got["cases"]
    assert (anchor["case"], anchor["versions"]) == ("anchor", 1), anchor
    assert (catch_up["case"], catch_up["versions"]) == ("catch-up", 3), catch_up
    for case in (anchor, catch_up):
        # the shard itself is counted: a pull that wrote every element peaks above it
        assert case["exact"] is True and case["peak_over_shard"] >= 1.0, case
    assert got["first_pull_peak_over_shard"] == max(c["peak_over_shard"] for c in got["cases"])


@pytest.mark.timeout(240)
def test_the_first_pull_bench_publishes_from_several_writers_with_parts_digests() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "deltasync", "bench", "first-pull", "--layers", "1"),
            *("--hidden", "128", "--vocab", "500", "--deltas", "1", "--repeat", "1"),
            *("--writers", "3"),  # uneven rows, and vocabulary padding no writer owns
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = _last_json(done.stdout)
    assert got["exact"] is True and got["writers"] == 3, got
    assert [(c["case"], c["versions"]) for c in got["cases"]] == [("anchor", 1), ("catch-up", 2)]
