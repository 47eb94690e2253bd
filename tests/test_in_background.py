"""InBackground: a record write on a worker thread, reused across writes, safe across fork."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from deltasync import atomic
from deltasync.atomic import MAX_PARKED, InBackground


def test_runs_the_function_and_hands_back_what_it_raised():
    got = []
    assert InBackground(got.append, 7, name="t-ok").wait() is None
    assert got == [7]

    def boom() -> None:
        raise OSError("disk full")

    error = InBackground(boom, name="t-fail").wait()
    assert isinstance(error, OSError) and str(error) == "disk full"


def test_a_worker_is_reused_for_the_next_job_and_named_for_the_one_it_runs():
    seen = []

    def where() -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))

    for i in range(5):
        assert InBackground(where, name=f"t-job-{i}").wait() is None
    assert len({ident for ident, _ in seen}) == 1  # one thread, parked between the jobs
    assert [name for _, name in seen] == [f"t-job-{i}" for i in range(5)]
    assert all(t.name != "t-job-4" for t in threading.enumerate())  # renamed when parked


def test_jobs_given_at_once_run_at_once_and_only_max_parked_stay():
    n = MAX_PARKED + 3
    barrier = threading.Barrier(n + 1, timeout=10)  # broken (raises) if any job waits on another
    jobs = [InBackground(barrier.wait, name=f"t-at-once-{i}") for i in range(n)]
    barrier.wait()
    assert [job.wait() for job in jobs] == [None] * n
    assert len(atomic._parked) <= MAX_PARKED


def _child_writes(path: str) -> None:
    error = InBackground(Path(path).write_text, "child", name="t-child").wait()
    raise SystemExit(0 if error is None else 1)


def test_a_forked_child_starts_its_own_workers(tmp_path):
    assert InBackground(lambda: None, name="t-before-fork").wait() is None
    assert atomic._parked  # the parent holds a parked worker; the child must not use it
    child = multiprocessing.get_context("fork").Process(
        target=_child_writes, args=(str(tmp_path / "out"),)
    )
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's background write never ran (a parent's worker used)")
    assert child.exitcode == 0
    assert (tmp_path / "out").read_text() == "child"
