"""``deltasync demo`` (what ``make demo`` runs) end to end, and the CLI without its applications.

The demo runs as a user runs it: the installed ``deltasync`` script in a fresh process, real
receiver processes, a real local store; the tiny model and two steps keep it short. Its own
check (every receiver's digest against a dense split of the trainer, and the dense refit
loaded next to the live shard) must say exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DELTASYNC = str(Path(sys.executable).with_name("deltasync"))

# Runs the CLI with the application packages made unimportable, as in an install without them.
WITHOUT_APPS = """
import sys
class _Gone:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("deltasync_examples", "deltasync_bench"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Gone())
from deltasync.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(240)
def test_the_demo_syncs_every_step_bit_exactly(tmp_path) -> None:
    done = subprocess.run(
        [DELTASYNC, "demo", "--steps", "2", "--small", "--store", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["exact"] is True and out["steps"] == 2
    assert 0 < out["medians"]["bytes"] < out["medians"]["dense_bytes"]
    assert (tmp_path / "store").is_dir(), "the demo did not use the store it was given"


@pytest.mark.timeout(240)
def test_the_demo_removes_the_temporary_store_it_made(tmp_path) -> None:
    done = subprocess.run(
        [DELTASYNC, "demo", "--steps", "1", "--small"],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "removed at exit" in " ".join(done.stdout.split())  # the console wraps lines
    assert not list(tmp_path.glob("deltasync-demo-*")), "the temporary store was left behind"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("argv", "package"),
    [
        (["demo", "--steps", "1"], "deltasync_examples"),
        (["cluster-worker", "--versions", "1"], "deltasync_examples"),
        (["bench", "--preset", "small"], "deltasync_bench"),
    ],
)
def test_a_command_whose_application_is_missing_names_the_remedy(argv, package) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_APPS, *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ApplicationMissingError" in done.stderr and package in done.stderr
    assert "pip install -e ." in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("bad", [-1.0, True, "1"])
def test_the_demos_link_rate_must_be_a_non_negative_number(bad) -> None:
    from deltasync.errors import ConfigError
    from deltasync_examples.demo.run import DemoConfig

    with pytest.raises(ConfigError, match="link_gbps must be a number >= 0"):
        DemoConfig(link_gbps=bad)
    assert DemoConfig(link_gbps=0).link_gbps == 0  # no emulated link: the local disk


def test_the_demo_store_is_throttled_only_when_a_link_is_asked_for(tmp_path) -> None:
    from deltasync import LocalStore
    from deltasync.store import ThrottledStore
    from deltasync_examples.demo.receiver_proc import open_demo_store

    assert isinstance(open_demo_store(str(tmp_path), 0), LocalStore)
    linked = open_demo_store(str(tmp_path), 1.0)
    assert isinstance(linked, ThrottledStore) and linked.config.gbps == 1.0


@pytest.mark.parametrize("store", ["s3://my-bucket/run", "file:///tmp/run", "memory://x", ""])
@pytest.mark.parametrize("config", ["demo", "rl"])
def test_the_demos_store_must_be_a_local_directory(store, config) -> None:
    from deltasync.errors import ConfigError
    from deltasync_examples.demo.run import DemoConfig
    from deltasync_examples.rl import RLConfig

    make = DemoConfig if config == "demo" else RLConfig
    with pytest.raises(ConfigError, match=r"store \(--store\) takes a local directory"):
        make(store=store)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["demo", "rl-demo"])
@pytest.mark.parametrize("store", ["s3://my-bucket/run", ""])
def test_the_demos_refuse_a_store_url_or_an_empty_store_and_create_nothing(
    tmp_path, command, store
) -> None:
    work, tmp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    done = subprocess.run(
        [DELTASYNC, command, "--steps", "1", "--store", store],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        cwd=work,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ConfigError" in done.stderr and "takes a local directory" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(work.iterdir()) and not list(tmp.iterdir()), "the demo created something"


@pytest.mark.timeout(120)
def test_rl_demo_refuses_a_used_store_up_front_as_demo_does(tmp_path) -> None:
    import time

    from deltasync.errors import ConfigError
    from deltasync_examples.rl import RLConfig, run_rl

    used = tmp_path / "run"
    (used / "store").mkdir(parents=True)
    (used / "store" / "LATEST").write_text('{"version": 1}')  # an earlier run's
    cfg = RLConfig(
        steps=1, workers=1, prompts_per_step=2, group_size=2, timeout_s=20.0, store=str(used)
    )
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"is not empty \(it holds an earlier demo run\)"):
        run_rl(cfg, log=lambda _line: None)
    assert time.monotonic() - t0 < 5, "it did not refuse up front"
    assert [p.name for p in used.rglob("*")] == ["store", "LATEST"], "it wrote into the store"


def test_a_store_holding_something_else_is_refused_naming_what_it_holds(tmp_path) -> None:
    from deltasync.errors import ConfigError
    from deltasync_examples.demo.run_dir import run_dir

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    with (
        pytest.raises(ConfigError, match=r"not empty \(it holds 2 entries, 'data' first\)"),
        run_dir(str(tmp_path), prefix="deltasync-demo-"),
    ):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


@pytest.mark.timeout(120)
def test_rl_demo_removes_the_temporary_run_directory_it_made(tmp_path, monkeypatch) -> None:
    import tempfile

    from deltasync_examples.rl import RLConfig, run_rl

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = RLConfig(steps=1, workers=1, prompts_per_step=2, group_size=2, timeout_s=60.0)
    assert run_rl(cfg, log=lambda _line: None)["probe_exact"] is True
    assert not list(tmp_path.glob("deltasync-rl-*")), "the temporary run directory was left behind"
