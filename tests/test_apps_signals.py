"""The application commands (``demo``, ``rl-demo``, ``bench``) stopped by a signal or failed
by a process of theirs: they clean up, say so in one line, end with their JSON line, and exit
with a status that tells the cases apart (130 SIGINT, 143 SIGTERM, 2 a typed error; 1 stays
"ran, not exact").

The signal tests run the real CLI in a fresh interpreter whose run is replaced, just inside
its run directory (or the bench's temporary directory), by a stand-in that signals its own
process: the command's own handling is what runs, in a second or two, and a SIGTERM that
the command did not handle kills only that interpreter. The harness tests spawn real children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from deltasync_examples.harness import ChildGoneError, serve, spawn

# Runs the CLI (argv after the script) with one function of an application replaced by a
# stand-in that sends SIGNAL to this process and waits WAIT_S for it to land. SIGINT gets
# Python's own handler first, as in a terminal (a background job inherits SIGINT ignored),
# unless SIGINT_HANDLER says otherwise.
STOPPED_RUN = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.{sigint_handler})

def stand_in(*_args, **_kwargs):
    os.kill(os.getpid(), signal.{signal})
    time.sleep({wait_s})  # the signal lands here
    from deltasync.errors import DeltaSyncError  # a typed error: the JSON line says it

    raise DeltaSyncError("the signal did not stop the run")

import {module} as app
app.{name} = stand_in
import deltasync_bench.compare_bench as bench
bench.measure_memory_gbps = lambda: 10.0  # the bench's first measurement, skipped
from deltasync.cli import main
raise SystemExit(main(sys.argv[1:]))
"""

# (command line, module and function replaced, prefix of the temporary directory it makes)
APPS = {
    "demo": (["demo", "--small", "--steps", "3"], "deltasync_examples.demo.run", "_run", "demo"),
    "rl-demo": (["rl-demo", "--steps", "3"], "deltasync_examples.rl.loop", "_run", "rl"),
    "bench": (
        [
            "bench",
            "--model",
            "qwen3-tiny",
            "--steps",
            "1",
            "--no-cluster",
            "--systems",
            "deltasync",
        ],
        "deltasync_bench.compare.run",
        "_Roles",
        "bench",
    ),
    # one rank of a torchrun job, stopped by its launcher (no temporary directory of its own)
    "cluster-worker": (
        ["cluster-worker", "--versions", "1"],
        "deltasync_examples.cluster_job",
        "run_cluster_sync",
        "cluster",
    ),
}


def _stopped(
    tmp_path,
    app: str,
    signum: signal.Signals,
    sigint_handler: str = "default_int_handler",
    wait_s: float = 60,
) -> tuple[subprocess.CompletedProcess, dict]:
    argv, module, name, _ = APPS[app]
    if app == "bench":
        argv = [*argv, "--out", str(tmp_path / "out")]
    script = STOPPED_RUN.format(
        signal=signum.name, module=module, name=name, sigint_handler=sigint_handler, wait_s=wait_s
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    return done, json.loads(lines[-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("app", sorted(APPS))
def test_a_sigterm_stops_the_app_removes_its_temporary_directory_and_exits_143(
    tmp_path, app
) -> None:
    done, out = _stopped(tmp_path, app, signal.SIGTERM)
    assert done.returncode == 143, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr.strip() == f"deltasync {app}: stopped by signal SIGTERM", done.stderr
    assert out["interrupted"] is True and out["signal"] == "SIGTERM"
    assert out["exact" if app != "rl-demo" else "probe_exact"] is False
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("deltasync-")]
    assert not left, f"left behind: {left}"
    if app == "bench":
        assert out["failures"] == ["stopped by signal SIGTERM"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("app", ["demo", "rl-demo"])
def test_a_ctrl_c_prints_one_line_and_a_json_line_and_exits_130(tmp_path, app) -> None:
    done, out = _stopped(tmp_path, app, signal.SIGINT)
    assert done.returncode == 130, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == f"deltasync {app}: stopped by signal SIGINT", done.stderr
    assert out["interrupted"] is True and out["signal"] == "SIGINT" and out["steps"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deltasync-")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("app", ["demo", "rl-demo"])
def test_a_sigint_the_app_was_started_with_ignored_stays_ignored(tmp_path, app) -> None:
    # as a script's background job starts (``deltasync demo &``): the script's Ctrl-C is not its
    done, out = _stopped(tmp_path, app, signal.SIGINT, sigint_handler="SIG_IGN", wait_s=1)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert out["error"] == "DeltaSyncError: the signal did not stop the run"
    assert "interrupted" not in out and "stopped by signal" not in done.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deltasync-")]


def test_a_ctrl_c_in_another_command_is_one_line_and_130(monkeypatch, capsys) -> None:
    import types

    from deltasync import cli

    def interrupted(args) -> int:
        raise KeyboardInterrupt

    def register(sub) -> None:
        sub.add_parser("interrupted").set_defaults(func=interrupted)

    module = types.ModuleType("deltasync.commands.interrupted")
    module.register = register
    monkeypatch.setitem(sys.modules, "deltasync.commands.interrupted", module)
    monkeypatch.setattr(cli, "_COMMAND_MODULES", (*cli._COMMAND_MODULES, "interrupted"))
    try:
        rc = cli.main(["interrupted"])
    except KeyboardInterrupt:  # it would end the whole pytest session
        pytest.fail("the KeyboardInterrupt escaped cli.main")
    assert rc == 130
    assert capsys.readouterr().err == "deltasync interrupted: interrupted\n"


def test_importing_the_package_loads_no_torch() -> None:
    # what lets the command answer a Ctrl-C while it starts: the package root is light
    code = "import sys, deltasync; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    from deltasync import Publisher  # and the flat names still resolve

    assert Publisher.__module__ == "deltasync.publish.publisher"


@pytest.mark.parametrize("command", ["demo", "gc"])
def test_a_ctrl_c_while_the_command_loads_is_one_line_and_130(command, monkeypatch, capsys):
    from deltasync import cli

    def loading() -> None:
        raise KeyboardInterrupt  # as while torch imports

    monkeypatch.setattr(cli, "build_parser", loading)
    try:
        rc = cli.main([command, "--steps", "2"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped cli.main")
    out, err = capsys.readouterr()
    assert rc == 130
    assert err == f"deltasync {command}: stopped by signal SIGINT while starting\n"
    if command == "demo":  # the JSON line the README promises
        assert json.loads(out.splitlines()[-1])["interrupted"] is True
    else:
        assert out == ""


def test_a_real_ctrl_c_half_a_second_after_start_exits_130_with_a_json_line(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync", "demo", "--small", "--steps", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        # a terminal's foreground job gets SIGINT at its default action, whatever this
        # process inherited (a test run in a script's background job has it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_for_python_handler(proc.pid, signal.SIGINT)
    time.sleep(0.3)  # the interpreter is up; the command's imports (torch) are under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert json.loads(out.splitlines()[-1])["interrupted"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("deltasync-")]


@pytest.mark.parametrize("app", ["demo", "rl-demo"])
def test_a_process_of_the_run_gone_ends_with_the_summary_a_typed_error_and_2(
    monkeypatch, capsys, app
) -> None:
    import importlib

    from deltasync import cli

    summary = {"steps": 3, "steps_done": 1, "exact": True, "probe_exact": True}

    def gone(*_args, **_kwargs):
        exc = ChildGoneError("demo receiver tp0 (pid 7) is gone (killed by SIGKILL)")
        exc.summary = summary  # what the run measured before it ended
        raise exc

    _, module, name, _ = APPS[app]
    monkeypatch.setattr(importlib.import_module(module), name, gone)
    assert cli.main(APPS[app][0]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["exact" if app == "demo" else "probe_exact"] is False
    assert out["steps_done"] == 1
    assert out["error"].startswith("ChildGoneError: demo receiver tp0")
    assert captured.err.strip().endswith("is gone (killed by SIGKILL)")
    assert "Traceback" not in captured.err


# A cluster-worker rank whose run fails while a thread that never ends is still up, as the
# gloo group's are after a peer died: the rank still exits at once, with its status.
FAILED_RANK = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: teardown waits

def failed(*_args, **_kwargs):
    if sys.argv[-1] == "typed":
        from deltasync.errors import ExchangeError
        raise ExchangeError("rank 1 sent nothing in 1.0 s (timeout_s)")
    raise RuntimeError("[gloo] Connection closed by peer")

import deltasync_examples.cluster_job as app
app.run_cluster_sync = failed
from deltasync.cli import main
raise SystemExit(main(["cluster-worker", "--versions", "1"]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "status"), [("typed", 2), ("defect", 1)])
def test_a_failed_cluster_worker_rank_exits_with_its_status_while_threads_are_up(
    how, status
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FAILED_RANK, how],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "RANK": "1"},
    )
    assert done.returncode == status, done.stdout[-2000:] + done.stderr[-3000:]
    if how == "typed":
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out == {"rank": 1, "exact": False, "error": out["error"]}
        assert out["error"] == "ExchangeError: rank 1 sent nothing in 1.0 s (timeout_s)"
        assert done.stderr.strip() == f"deltasync: error: {out['error']}"
    else:
        assert "RuntimeError: [gloo] Connection closed by peer" in done.stderr


# --- the harness: children ignore Ctrl-C; a dead child is a typed error naming it -----------


def _child(conn) -> None:
    """A harness child that reports its SIGINT handler and answers pings."""
    serve(
        conn,
        lambda op, *args: {"pid": os.getpid()},
        ready=lambda: {"sigint": repr(signal.getsignal(signal.SIGINT))},
    )


@pytest.mark.timeout(60)
def test_harness_children_ignore_sigint_so_only_the_parent_handles_a_ctrl_c() -> None:
    # The parent's own handler, whatever this process inherited (a background job of a
    # non-interactive shell starts with SIGINT ignored).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        child = spawn(_child, name="test child")
        try:
            assert child.recv(30)["sigint"] == repr(signal.SIG_IGN)
            os.kill(child.pid, signal.SIGINT)  # what a Ctrl-C sends the whole process group
            time.sleep(0.2)
            assert child.call("ping", timeout_s=30)["pid"] == child.pid
        finally:
            child.close()
        # the parent's handler is restored, and SIGINT unblocked
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.timeout(60)
def test_a_dead_harness_child_is_a_typed_error_naming_it_and_how_it_ended() -> None:
    from deltasync.errors import DeltaSyncError

    child = spawn(_child, name="test child")
    try:
        child.recv(30)
        os.kill(child.pid, signal.SIGKILL)
        child.process.join(10)
        with pytest.raises(ChildGoneError, match=r"test child \(pid \d+\) is gone") as exc:
            child.call("ping", timeout_s=10)
        assert isinstance(exc.value, DeltaSyncError)
        assert "killed by SIGKILL" in str(exc.value)
    finally:
        child.close()


@pytest.mark.parametrize(
    ("command", "marks"),
    [
        ("demo", {"exact": False}),
        ("bench", {"exact": False, "failures": ["stopped by signal SIGINT"]}),
        ("rl-demo", {"probe_exact": False}),
        ("cluster-worker", {"exact": False, "rank": 3}),
    ],
)
def test_a_ctrl_c_while_an_app_loads_ends_with_its_json_line_marked_failed_as_a_later_one(
    command, marks, monkeypatch, capsys
) -> None:
    from deltasync import cli

    def loading() -> None:
        raise KeyboardInterrupt  # as while torch imports

    monkeypatch.setattr(cli, "build_parser", loading)
    monkeypatch.setenv("RANK", "3")
    assert cli.main([command]) == 130
    out, err = capsys.readouterr()
    doc = json.loads(out.splitlines()[-1])
    assert doc["interrupted"] is True and doc["signal"] == "SIGINT"
    assert {k: doc.get(k) for k in marks} == marks
    assert err == f"deltasync {command}: stopped by signal SIGINT while starting\n"


def _wait_for_python_handler(pid: int, signum: int, timeout_s: float = 60.0) -> None:
    """Until the process catches ``signum`` (the interpreter installed its handler: before
    that, the signal's default action would end it however deltasync handles a Ctrl-C)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) >> (signum - 1) & 1:
            return
        time.sleep(0.01)
    pytest.fail(f"process {pid} never installed a handler for signal {signum}")
