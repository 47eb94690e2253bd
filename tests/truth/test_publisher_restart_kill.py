"""A publisher SIGKILLed in the middle of a version and restarted from its checkpoint: with
the same state it resumes the lineage (a delta on its verified baseline); restarted from a
checkpoint with other data it publishes an anchor of a new lineage. Each trainer is a real
process; receivers follow bitwise either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch
from kit import TinyTrainer, assert_same_bits, expected_shards, tiny_layouts
from truth_kit import rconfig, zero_tensors

from deltasync import LocalStore, Publisher, PublisherConfig, Receiver, TrainerSync, names
from deltasync.trainer import SnapshotTracker

SEED = 3


class Frozen:
    """A store wrapper that freezes the process at the manifest commit of ``version``."""

    def __init__(self, inner, version, flag) -> None:
        self.inner, self.version, self.flag = inner, version, flag

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_if_absent(self, key, data, *args, **kwargs):
        if key == names.manifest_key(self.version):
            open(self.flag, "w").close()
            time.sleep(600)  # SIGKILLed here: blobs and markers stored, nothing committed
        return self.inner.put_if_absent(key, data, *args, **kwargs)


def _trainer(store, seed, steps):
    """The trainer's state after ``steps`` optimizer steps (deterministic: its checkpoint)."""
    spec, _tl, rl = tiny_layouts()
    model = TinyTrainer(spec, seed=seed, density=0.2)
    for _ in range(steps):
        model.step()
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(SnapshotTracker(model.named_parameters()), pub, model.params)
    return model, pub, sync


def _first_run(path, flag):
    store = LocalStore(path, durable=False)
    model, _pub, sync = _trainer(Frozen(store, 4, flag), SEED, 0)
    for v in range(5):
        if v:
            model.step()
        sync.step_published(v)


def _restarted(path, seed, resume_at, expect_resume, result):
    model, _pub, sync = _trainer(LocalStore(path, durable=False), seed, resume_at)
    resumed = sync.resume(resume_at)
    model.step()
    report = sync.step_published(sync.next_version())[0]
    with open(result, "w") as f:
        f.write(f"{resumed} {report.version} {report.kind}\n")
    assert resumed == expect_resume


def _child(fn, *args):
    def main():
        code = 0
        try:
            torch.set_num_threads(1)  # a forked child must not wait on the parent's OpenMP pool
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)

    proc = mp.get_context("fork").Process(target=main, daemon=True)
    proc.start()
    return proc


def _expected(seed, steps):
    spec, tl, rl = tiny_layouts()
    model = TinyTrainer(spec, seed=seed, density=0.2)
    for _ in range(steps):
        model.step()
    return expected_shards(model.params, tl, rl)


@pytest.mark.timeout(300)
def test_a_killed_publisher_resumes_its_lineage_from_a_matching_checkpoint_and_starts_a_new_one_otherwise(
    tmp_path,
):
    path, flag = tmp_path / "store", tmp_path / "frozen"
    _, _, rl = tiny_layouts()
    rec = Receiver.for_layout(
        LocalStore(path, durable=False),
        rl,
        "tp1",
        zero_tensors(rl, "tp1"),
        str(tmp_path / "rec"),
        rconfig("rec"),
    )
    first = _child(_first_run, path, flag)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert first.is_alive() and time.monotonic() < deadline, "the publisher never froze"
        time.sleep(0.02)
    first.kill()
    first.join(10)
    assert first.exitcode == -9
    report = rec.pull()
    assert report.version == 3
    assert_same_bits(rec.tensors, _expected(SEED, 3)["tp1"])
    run = report.run_id

    # restarted from its checkpoint of v3: the same state, so the lineage goes on with a delta
    result = tmp_path / "result"
    child = _child(_restarted, path, SEED, 3, True, result)
    child.join(120)
    assert child.exitcode == 0
    assert result.read_text().split() == ["True", "4", "delta"]
    report = rec.pull()
    assert report.chain == (4,) and report.run_id == run
    assert_same_bits(rec.tensors, _expected(SEED, 4)["tp1"])

    # restarted from a checkpoint with other data: resume refuses, the next version is an anchor
    child = _child(_restarted, path, SEED + 1, 4, False, result)
    child.join(120)
    assert child.exitcode == 0
    assert result.read_text().split() == ["False", "5", "anchor"]
    report = rec.pull()
    assert report.chain == (5,) and report.from_anchor and report.run_id != run
    assert_same_bits(rec.tensors, _expected(SEED + 1, 5)["tp1"])
