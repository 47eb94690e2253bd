"""vLLM tier: a store that hangs never holds the deltasync backend's worker RPCs forever.

These cases import vLLM in the test process, so ``test_vllm_backend_hung_store.py`` runs this
file with ``.venv-vllm``'s pytest and reports each case (the tier itself runs in ``.venv``).

The backend class runs here without a whole engine (cheap): vLLM's parallel state is a
one-rank gloo group (TP = 1), the model is a module tree named as vLLM names its parameters
(``tests/engines/engines_helpers.py``), a real trainer publishes to a directory store, and the
store the backend opens is wrapped so that its reads block while a ``threading.Event`` is
clear: a store that accepts the request and never answers. Every call that could hang runs on
a thread of the test with its own bound, so the original code fails here instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# the engine tests' fakes (a job process run as a script has neither folder on its path)
TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "engines")]

from engines_helpers import ENGINE_CONFIG, StoreTrainer, bits_equal, module_tree

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BOUND_S = 30.0  # every call of the backend below returns well within this, or the test fails


class HangingStore:
    """Forwards to ``inner``; ``get``/``get_range``/``list`` block while ``answering`` is
    clear (``entered`` is set when one does), and so does a ``put`` of an ack while
    ``acks_answered`` is clear (the record a receiver writes after its scatter), and one of a
    registration while ``registrations_answered`` is clear."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.answering = threading.Event()
        self.answering.set()
        self.acks_answered = threading.Event()
        self.acks_answered.set()
        self.registrations_answered = threading.Event()
        self.registrations_answered.set()
        self.entered = threading.Event()
        self.manifest_error: BaseException | None = None  # raised by a get of a manifest

    def put(self, key, data):
        if key.startswith("acks/") and not self.acks_answered.is_set():
            self.entered.set()
            self.acks_answered.wait()
        if key.startswith("receivers/") and not self.registrations_answered.is_set():
            self.entered.set()
            self.registrations_answered.wait()
        return self.inner.put(key, data)

    def _wait(self) -> None:
        if not self.answering.is_set():
            self.entered.set()
            self.answering.wait()

    def get(self, key, **kwargs):
        self._wait()
        if key.endswith("MANIFEST.json") and self.manifest_error is not None:
            raise self.manifest_error
        return self.inner.get(key, **kwargs)

    def get_range(self, key, start, length):
        self._wait()
        return self.inner.get_range(key, start, length)

    def list(self, prefix=""):
        self._wait()
        return self.inner.list(prefix)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _within(call, bound: float = BOUND_S):
    """``call()`` on a thread; its result or error, or a failure if it has not returned."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    t = time.monotonic()
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"the call has not returned after {bound} s: it hangs"
    out["elapsed"] = time.monotonic() - t
    return out


def _takes_version_1(engine, trainer) -> None:
    """An update to version 1 returns within the bound, and the worker then holds and names
    it, bit for bit."""
    assert "error" not in _within(lambda: engine.update_weights({"version": 1}))
    engine.finish_weight_update()
    assert engine.weight_version == 1
    split = trainer.split()["tp0"]
    assert all(bits_equal(engine.shard.targets[n], split[n]) for n in split)


def _once_the_store_answers(engine, trainer, answered: threading.Event) -> None:
    """The hung store call answers (``answered`` set) and the left pull ends: the worker still
    reports no version (the weights were written by something else since it verified them),
    and the next update takes version 1 exactly."""
    answered.set()
    for left in engine._still_inside():
        left.thread.join(BOUND_S)
    engine.start_weight_update()
    engine.finish_weight_update()  # the pull has ended: still none held
    assert engine.weight_version is None
    engine.start_weight_update()
    _takes_version_1(engine, trainer)


@pytest.fixture(scope="module")
def tp1_group():
    """vLLM's parallel state for one worker (TP = 1) over gloo, as a CPU worker has."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    _vllm_parallel_state(1, 0, _free_port())
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def _vllm_parallel_state(tp: int, rank: int, port: int) -> None:
    """vLLM's parallel state of worker ``rank`` of ``tp`` over gloo, as a CPU worker has."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tp, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model, store, tmp: Path, stage_timeout_s: float | None, monkeypatch=None):
    """The backend on ``model``, initialised on ``store`` (returned by the store factory)."""
    from deltasync.engines import vllm_backend

    if monkeypatch is not None:
        monkeypatch.setattr(vllm_backend, "open_engine_store", lambda *a, **k: store)
    else:  # a job process of its own
        vllm_backend.open_engine_store = lambda *a, **k: store
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        model_config=SimpleNamespace(hf_config=ENGINE_CONFIG, enforce_eager=True),
    )
    engine = vllm_backend.DeltaSyncWeightTransferEngine(
        None, vllm_config, torch.device("cpu"), model
    )
    fields = {
        "store": str(tmp / "store"),
        "receiver_id": "engine",
        "state_dir": str(tmp / "state"),
        "durable": False,
    }
    if stage_timeout_s is not None:
        fields["stage_timeout_s"] = stage_timeout_s
    engine.init_transfer_engine(engine.parse_init_info(fields))
    return engine


def _backend(tmp_path, monkeypatch, stage_timeout_s: float | None):
    """A trainer at version 0, and a backend initialised on its store (wrapped) at version 0."""
    from deltasync import LocalStore

    inner = LocalStore(tmp_path / "store", durable=False)
    trainer = StoreTrainer(ENGINE_CONFIG, inner)
    trainer.publish(0)
    store = HangingStore(inner)
    model = module_tree(trainer.split()["tp0"])
    engine = _engine(model, store, tmp_path, stage_timeout_s, monkeypatch)
    engine.start_weight_update()
    engine.update_weights({"version": 0})
    engine.finish_weight_update()
    assert engine.weight_version == 0
    return trainer, engine, store


def _snapshot(engine) -> dict:
    return {n: t.clone() for n, t in engine.shard.targets.items()}


def _unchanged(engine, before: dict) -> bool:
    return all(bits_equal(engine.shard.targets[n], t) for n, t in before.items())


def test_an_apply_on_a_hung_store_fails_typed_within_its_timeout_and_nothing_is_ever_written(
    tp1_group, tmp_path, monkeypatch
):
    from deltasync.errors import ApplyError

    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=2.0)
    trainer.step()
    trainer.publish(1)
    before = _snapshot(engine)
    store.answering.clear()  # the store accepts every read from now on and never answers
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    assert store.entered.wait(BOUND_S)
    out = _within(lambda: engine.update_weights({"version": 1}))
    error = out.get("error")
    assert isinstance(error, ApplyError), out
    assert out["elapsed"] < 2.0 + 5.0
    text = str(error)
    assert "version 1" in text and "'tp0'" in text and "stage_timeout_s" in text
    assert "2.0 s" in text and "no rank wrote anything" in text
    assert engine.weight_version == 0 and engine.receiver.version == 0
    # the other RPCs answer, bounded, while the pull is still inside the store
    assert "error" not in _within(engine.finish_weight_update)
    assert "error" not in _within(engine.start_weight_update)
    # the store answers again: the abandoned pull goes on, reaches its gate, and is refused
    store.answering.set()
    left = engine._left[0]
    left.thread.join(BOUND_S)
    assert not left.thread.is_alive() and isinstance(left.error, ApplyError)
    assert _unchanged(engine, before) and engine.weight_version == 0
    # and the next update takes the version, bit for bit
    _takes_version_1(engine, trainer)


def test_a_stage_while_an_abandoned_pull_is_still_inside_the_store_refuses_it_by_name(
    tp1_group, tmp_path, monkeypatch
):
    from deltasync.errors import ApplyError

    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=1.5)
    trainer.step()
    trainer.publish(1)
    before = _snapshot(engine)
    store.answering.clear()
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    assert store.entered.wait(BOUND_S)
    assert isinstance(
        _within(lambda: engine.update_weights({"version": 1})).get("error"), ApplyError
    )
    engine.finish_weight_update()
    # the hung pull still holds the receiver: the next update waits for it (bounded), then
    # fails on every rank naming it, never a second pull on the same receiver
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    out = _within(lambda: engine.update_weights({"version": 1}))
    error = out.get("error")
    assert isinstance(error, ApplyError), out
    assert "pull of version 1" in str(error) and "stage_timeout_s" in str(error)
    engine.finish_weight_update()
    # a restarted trainer's init is refused while it is inside, and keeps the receiver
    receiver = engine.receiver
    init = engine.parse_init_info(
        {
            "store": str(tmp_path / "store"),
            "receiver_id": "engine",
            "state_dir": str(tmp_path / "state"),
            "durable": False,
        }
    )
    out = _within(lambda: engine.init_transfer_engine(init))
    assert isinstance(out.get("error"), ApplyError) and "still inside" in str(out["error"])
    assert engine.receiver is receiver
    assert _unchanged(engine, before) and engine.weight_version == 0
    store.answering.set()
    for left in list(engine._left):
        left.thread.join(BOUND_S)
    engine.start_weight_update()
    assert "error" not in _within(lambda: engine.update_weights({"version": 1}))
    engine.finish_weight_update()
    assert engine.weight_version == 1


def test_a_staged_update_dropped_while_its_pull_is_inside_a_hung_store_never_holds_the_worker(
    tp1_group, tmp_path, monkeypatch
):
    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=None)  # default
    trainer.step()
    trainer.publish(1)
    store.answering.clear()
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    assert store.entered.wait(BOUND_S)
    # finish drops the staged update: bounded, though its thread is inside the store
    out = _within(engine.finish_weight_update)
    from deltasync.engines.vllm_backend import STOP_WAIT_S

    assert "error" not in out and out["elapsed"] < STOP_WAIT_S + 5.0
    assert engine.weight_version == 0
    # a new session's stage returns at once (its thread waits for the one still inside)
    out = _within(engine.start_weight_update)
    assert "error" not in out
    assert "error" not in _within(lambda: engine.update_weights({"version": 1, "phase": "stage"}))
    store.answering.set()  # the store answers: the dropped pull is refused at its gate
    _takes_version_1(engine, trainer)


def test_a_write_whose_records_hang_in_the_store_fails_bounded_as_written_and_names_the_truth(
    tp1_group, tmp_path, monkeypatch
):
    from deltasync.errors import ApplyError

    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=2.0)
    trainer.step()
    trainer.publish(1)
    store.acks_answered.clear()  # the scatter is local; the ack after it never comes back
    engine.start_weight_update()
    out = _within(lambda: engine.update_weights({"version": 1}))
    error = out.get("error")
    assert isinstance(error, ApplyError), out
    assert out["elapsed"] < 2.0 + 2.0 + 5.0  # the staging's bound, then the write's
    assert "wrote part or all of it" in str(error) and "stage_timeout_s" in str(error)
    # it reports what the receiver verified and recorded (the state file is local), no more
    assert engine.weight_version == engine.receiver.version
    store.acks_answered.set()
    for left in engine._still_inside():
        left.thread.join(BOUND_S)
    engine.finish_weight_update()
    engine.start_weight_update()
    _takes_version_1(engine, trainer)


def test_weights_reloaded_while_a_left_pull_holds_the_receiver_are_never_reported_as_held(
    tp1_group, tmp_path, monkeypatch
):
    """vLLM's ``reload_weights`` ran while a pull left by its apply (its ack hung in the store)
    still held the receiver: the receiver refused the reload's invalidate (one call at a
    time), and the finish, the next failed apply (its error: "stays at version 1", and the
    pull it waited for "cancelled", though it wrote), and every call after the pull ended
    named the version from before the reload, which the engine no longer held."""
    from deltasync import LocalStore
    from deltasync.errors import ApplyError

    inner = LocalStore(tmp_path / "store", durable=False)
    trainer = StoreTrainer(ENGINE_CONFIG, inner)
    trainer.publish(0)
    store = HangingStore(inner)
    model = module_tree(trainer.split()["tp0"])

    def load_weights(weights=()):  # a reload: other values than the version held
        for p in model.parameters():
            p.data.add_(1.0)

    model.load_weights = load_weights
    engine = _engine(model, store, tmp_path, 1.5, monkeypatch)
    engine.start_weight_update()
    engine.update_weights({"version": 0})
    engine.finish_weight_update()
    assert engine.weight_version == 0
    trainer.step()
    trainer.publish(1)
    store.acks_answered.clear()  # the scatter is local; the ack after it never comes back
    engine.start_weight_update()
    assert isinstance(
        _within(lambda: engine.update_weights({"version": 1})).get("error"), ApplyError
    )
    assert engine._still_inside()
    model.load_weights()  # while the left pull still holds the receiver
    assert engine.weight_version is None
    engine.finish_weight_update()
    assert engine.weight_version is None  # never the version from before the reload
    engine.start_weight_update()
    out = _within(lambda: engine.update_weights({"version": 1}))
    assert isinstance(out.get("error"), ApplyError), out
    text = str(out["error"])
    assert "written, its records not yet in the store" in text  # not "cancelled": it wrote
    assert "holds no verified version" in text and "stays at version 1" not in text
    assert engine.weight_version is None
    engine.finish_weight_update()
    assert engine.weight_version is None
    _once_the_store_answers(engine, trainer, store.acks_answered)


def test_weights_written_by_something_else_while_the_restage_waits_are_never_reported_as_held(
    tp1_group, tmp_path, monkeypatch
):
    """Something else wrote the engine's weights between stage and apply; the apply's restage
    dropped the staged pull, whose thread, refused at its gate, hung re-registering in the
    store: the restage (and its invalidate, now on its thread) waited for it and ran out of
    time, and the failed update named version 0, which the engine no longer held."""
    from deltasync.errors import ApplyError

    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=1.5)
    trainer.step()
    trainer.publish(1)
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    assert engine._staged.staged.wait(BOUND_S) and engine._staged.error is None
    with torch.no_grad():  # another backend's write: the version counter moves
        next(engine.model.parameters()).add_(1.0)
    store.registrations_answered.clear()
    out = _within(lambda: engine.update_weights({"version": 1}))
    assert isinstance(out.get("error"), ApplyError), out
    assert "stays at version 0" not in str(out["error"])
    assert engine.weight_version is None  # never the version the weights no longer hold
    engine.finish_weight_update()
    assert engine.weight_version is None
    _once_the_store_answers(engine, trainer, store.registrations_answered)


def test_a_manifest_re_read_that_raises_fails_the_update_naming_its_error_not_a_timeout(
    tp1_group, tmp_path, monkeypatch
):
    """The manifest's re-read before the ranks agree raised at once (a custom Store's own
    exception, not a StoreError): the update failed as "not staged within 600.0 s ... has not
    come back", a timeout that never happened, and the store's error was lost."""
    from deltasync.errors import ApplyError

    trainer, engine, store = _backend(tmp_path, monkeypatch, stage_timeout_s=None)  # 600 s
    trainer.step()
    trainer.publish(1)
    before = _snapshot(engine)
    engine.start_weight_update()
    engine.update_weights({"version": 1, "phase": "stage"})
    assert engine._staged.staged.wait(BOUND_S) and engine._staged.error is None
    store.manifest_error = ConnectionResetError("connection reset by peer")
    out = _within(lambda: engine.update_weights({"version": 1}))
    error = out.get("error")
    assert isinstance(error, ApplyError), out
    text = str(error)
    assert "connection reset by peer" in text and "ConnectionResetError" in text, text
    assert "not staged within" not in text and "no rank wrote anything" in text
    assert _unchanged(engine, before) and engine.weight_version == 0
    engine.finish_weight_update()
    store.manifest_error = None
    engine.start_weight_update()
    assert "error" not in _within(lambda: engine.update_weights({"version": 1}))
    engine.finish_weight_update()
    assert engine.weight_version == 1


def test_a_stage_timeout_that_is_not_a_positive_number_of_seconds_is_a_config_error():
    from deltasync.engines.vllm_backend import DeltaSyncInitInfo
    from deltasync.errors import ConfigError

    for bad in (0, -1.0, float("nan"), "60", True):
        with pytest.raises(ConfigError, match="stage_timeout_s"):
            DeltaSyncInitInfo(store="s", receiver_id="r", state_dir="d", stage_timeout_s=bad)


def tp2_rank(spec: dict, rank: int) -> dict:
    """One TP rank of two (a job process of its own: vLLM's parallel state is global). Rank 0's
    store hangs; both ranks apply version 1, then again once it answers."""
    from deltasync import LocalStore

    _vllm_parallel_state(2, rank, spec["port"])
    tmp = Path(spec["tmp"])
    split0, split1 = (torch.load(tmp / f"split{v}.pt")[f"tp{rank}"] for v in (0, 1))
    store = HangingStore(LocalStore(tmp / "store", durable=False))
    engine = _engine(module_tree(split0), store, tmp / f"rank{rank}", spec["stage_timeout_s"])
    if rank == 0:
        store.answering.clear()
    engine.start_weight_update()
    out = _within(lambda: engine.update_weights({"version": 1}))
    error = out.get("error")
    record = {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "elapsed": out["elapsed"],
        "unchanged": all(bits_equal(engine.shard.targets[n], t) for n, t in split0.items()),
        "weight_version": engine.weight_version,
    }
    store.answering.set()
    for left in engine._still_inside():
        left.thread.join(BOUND_S)
    try:
        engine.finish_weight_update()
    except Exception:  # the last rank refuses the finish of its failed update, as in vLLM
        pass
    engine.start_weight_update()
    again = _within(lambda: engine.update_weights({"version": 1}))
    engine.finish_weight_update()
    record["again_error"] = repr(again.get("error"))
    record["again_version"] = engine.weight_version
    record["again_equal"] = all(bits_equal(engine.shard.targets[n], t) for n, t in split1.items())
    return record


def test_a_store_that_hangs_on_one_tp_rank_fails_the_update_on_every_rank_and_none_writes(
    tmp_path,
):
    from deltasync import LocalStore

    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2)
    trainer.publish(0)
    torch.save(trainer.split(), tmp_path / "split0.pt")
    trainer.step()
    trainer.publish(1)
    torch.save(trainer.split(), tmp_path / "split1.pt")
    spec = {"tmp": str(tmp_path), "port": _free_port(), "stage_timeout_s": 3.0}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    jobs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path / "spec.json"), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [job.communicate(timeout=240)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # the last rank raises every rank's failure (vLLM reads it last), the other logs it
    assert first["error"] is None and last["error"].startswith("ApplyError: version 1 ")
    assert "no rank wrote anything" in last["error"] and "shard 'tp0'" in last["error"]
    assert "stage_timeout_s" in last["error"]
    for rank in (first, last):
        assert rank["elapsed"] < 3.0 + 10.0
        assert rank["unchanged"] and rank["weight_version"] is None  # held none before
        assert rank["again_error"] == "None" and rank["again_version"] == 1
        assert rank["again_equal"]


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    job_spec, job_rank = json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2])
    result = tp2_rank(job_spec, job_rank)
    Path(job_spec["tmp"], f"rank{job_rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a thread left in the store must not keep the job alive
