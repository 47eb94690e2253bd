"""One caller per rank, one process per journal, the model's shapes: what a launcher or an
engine gets wrong is refused by name before anything is sent, written or posted to the group."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from kit import bits, tiny_layouts, told_in_another_process

from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender, RolePlan
from deltasync.cluster.cluster_journal import ClusterJournal
from deltasync.errors import ConfigError, LocalStateError, VersionError
from deltasync.exchange import ExchangeConfig, spawn
from deltasync.receiver import StateDir
from deltasync.trainer import SnapshotTracker

from cluster_testkit import one_process_roles

SPEC, TRAINER, RECEIVERS = tiny_layouts(engine="vllm", tp=2)
MATRIX = "model.layers.0.mlp.gate_proj.weight"  # (128, 64) in the tiny model


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) * 0.05 for n, s in TRAINER.param_shapes().items()}


def _sender(params, version=None, **options) -> ClusterSender:
    plan = RolePlan.contiguous(num_writers=1, shards=[s.id for s in RECEIVERS.shards()])
    tracked = params() if callable(params) else params
    return ClusterSender(
        SnapshotTracker(tracked.items()),
        params,
        plan=plan,
        rank=0,
        trainer_layout=TRAINER,
        receiver_layout=RECEIVERS,
        version=version,
        **options,
    )


@pytest.mark.parametrize("version", [2**64, 10**8, -1, True])
def test_a_writer_built_at_a_version_no_key_can_name_is_refused(version) -> None:
    # 2**64 was taken; its first sync then raised a bare OverflowError building the
    # preflight row on this rank alone, and every other rank waited out its timeout
    params = {n: torch.zeros(s) for n, s in TRAINER.param_shapes().items()}
    with pytest.raises(ConfigError, match=r"ClusterSender version must be None or an int in"):
        _sender(params, version=version)


def test_a_matrix_stored_transposed_is_refused_by_name_before_anything_is_sent() -> None:
    # The same number of elements: it was routed as the layout's rows, committed on every
    # rank and hashed from the same misread rows, so no receiver saw its scrambled copy.
    params = _params()
    assert params[MATRIX].shape == (128, 64)
    params[MATRIX] = params[MATRIX].t().contiguous()
    with pytest.raises(ConfigError, match=rf"{MATRIX}'? is \(64, 128\) here.*\(128, 64\)"):
        _sender(params)

    # given by a callable, it is checked each time it is read: before any payload is built
    right = _params()
    current = {"params": right}
    sender = _sender(lambda: current["params"])
    out = sender.payloads_for_version(0, anchor=True)
    assert out.payloads  # the model's own shapes go out
    current["params"] = params
    with pytest.raises(ConfigError, match=rf"{MATRIX}'? is \(64, 128\) here"):
        sender.payloads_for_version(0, anchor=True)


def test_a_flattened_parameter_is_refused_too() -> None:
    params = _params()
    params[MATRIX] = params[MATRIX].reshape(-1)
    with pytest.raises(ConfigError, match=r"is \(8192,\) here, but writer 0's dim-0 shard"):
        _sender(params)


def test_params_that_leave_out_a_parameter_are_refused_by_name() -> None:
    # An anchor without it cannot restore a shard; a delta would never send its changes.
    params = _params()
    del params["lm_head.weight"]
    with pytest.raises(ConfigError, match=r"params have no \['lm_head.weight'\]"):
        _sender(params)


def _pausing_world():
    """One writer and two receivers in one process; the first receiver's scatter waits for
    ``release`` once ``inside`` is set."""
    inside, release = threading.Event(), threading.Event()

    class Pause:
        def __enter__(self) -> None:
            inside.set()
            assert release.wait(60)

        def __exit__(self, *exc: object) -> None:
            return None

    full = _params()
    plan = RolePlan.contiguous(num_writers=1, shards=[s.id for s in RECEIVERS.shards()])
    senders, receivers = one_process_roles(
        full,
        plan,
        ClusterConfig(),
        trainer_layout=TRAINER,
        receiver_layout=RECEIVERS,
        full_state=True,
    )
    first = receivers[min(receivers)]
    first._pause = Pause  # the engine's "stop reading weights" context
    return full, senders[0], first, inside, release


def test_a_second_threads_call_on_a_receiver_rank_is_refused_while_the_first_applies() -> None:
    full, sender, receiver, inside, release = _pausing_world()
    out = sender.payloads_for_version(0, anchor=True)
    payload = {sender.rank: out.payloads[receiver.rank]}
    done: list[object] = []
    first = threading.Thread(target=lambda: done.append(receiver.apply_payload(payload)))
    first.start()
    assert inside.wait(60)
    before = {n: bits(t).clone() for n, t in receiver.tensors.items()}
    journal = receiver.journal.state
    try:
        for call in (receiver.sync, receiver.receive, lambda: receiver.apply_payload(payload)):
            with pytest.raises(ConfigError, match=r"while another thread's sync.*Nothing was"):
                call()
        # nothing of the refused calls: no write, no journal record
        assert receiver.journal.state == journal
        assert all(torch.equal(bits(t), before[n]) for n, t in receiver.tensors.items())
    finally:
        release.set()
        first.join(60)
    assert len(done) == 1 and done[0].version == 0
    receiver.journal.commit(0)
    bf16 = {n: p.to(torch.bfloat16) for n, p in full.items()}
    truth = RECEIVERS.split(TRAINER.to_canonical(bf16))[receiver.shard]
    assert all(torch.equal(bits(t), bits(truth[n])) for n, t in receiver.tensors.items())
    # the guard is free again: the next call is judged on its own (version 0 is held now)
    with pytest.raises(VersionError, match="committed version 0"):
        receiver.apply_payload(payload)


def _two_callers(rank: int) -> dict:
    """A job of one writer and two receivers in which rank 0 and rank 1 each call ``sync``
    from two threads at once: one call of each is refused, the other commits version 0."""
    import time

    torch.set_num_threads(1)
    from deltasync.exchange import init_from_env

    init_from_env(timeout_s=30)
    _, tl, rl = tiny_layouts()
    plan = RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"])
    config = ClusterConfig(
        exchange=ExchangeConfig(timeout_s=20), wait_for_version_s=30, commit_timeout_s=20
    )
    if rank == 0:
        params = {
            n: torch.randn(s, generator=torch.Generator().manual_seed(0)) * 0.05
            for n, s in tl.param_shapes().items()
        }
        role = ClusterSender(
            SnapshotTracker(params.items()),
            params,
            plan=plan,
            trainer_layout=tl,
            receiver_layout=rl,
            version=None,
            config=config,
        )
        call = lambda: role.sync(0, anchor=True)
    else:
        shard = plan.receiver(rank).shard
        tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in rl.local_specs(shard).items()}
        role = ClusterReceiver(tensors, plan=plan, layout=rl, version=None, config=config)
        call = role.sync
    results: list[str] = []

    def run() -> None:
        try:
            results.append(f"ok {call().version}")
        except ConfigError as exc:
            results.append(f"refused: {exc}")
        except Exception as exc:
            results.append(f"failed: {type(exc).__name__}: {exc}")

    # Each rank's second call comes while its first waits in the preflight for a rank that
    # calls later: the writer's for the receivers (from 2 s), rank 1's for rank 2 (at 3 s).
    torch.distributed.barrier()
    start = {0: 0.0, 1: 2.0, 2: 3.0}[rank]
    time.sleep(start)
    callers = [threading.Thread(target=run) for _ in range(2 if rank < 2 else 1)]
    for t in callers:
        t.start()
        time.sleep(0.5)
    for t in callers:
        t.join(90)
    version = getattr(role, "version", None)
    return {"results": sorted(results), "version": version}


@pytest.mark.timeout(180)
def test_two_threads_syncing_one_rank_of_a_real_group_get_one_refusal_not_an_aborted_peer() -> None:
    # Both threads' collectives went to the group: gloo paired them with the other ranks'
    # rounds of another size and aborted a receiver that had called sync once (SIGABRT).
    results = spawn(_two_callers, 3, timeout_s=150)
    for rank in (0, 1):
        got = results[rank]["results"]
        assert got[0] == "ok 0", got
        assert got[1].startswith("refused: ") and "another thread's sync" in got[1], got
        assert got[1].endswith("Nothing was sent" if rank == 0 else "Nothing was written")
    assert results[2]["results"] == ["ok 0"]
    assert [r["version"] for r in results] == [0, 0, 0]


def _hold_elsewhere(path: Path) -> str:
    """What another process is told when it opens the cluster journal ``path``."""
    return told_in_another_process(
        "from deltasync.cluster.cluster_journal import ClusterJournal",
        "ClusterJournal(version=None, path=path, owner='another rank')",
        path,
    )


def _journal_receiver(path: Path) -> ClusterReceiver:
    plan = RolePlan.contiguous(num_writers=1, shards=[s.id for s in RECEIVERS.shards()])
    role = plan.receiver(1)
    tensors = {
        n: torch.zeros(s.shape, dtype=s.dtype) for n, s in RECEIVERS.local_specs(role.shard).items()
    }
    return ClusterReceiver(
        tensors, plan=plan, rank=1, layout=RECEIVERS, version=None, journal_path=str(path)
    )


@pytest.mark.timeout(120)
def test_a_journal_a_live_process_holds_is_refused_to_another_until_it_is_closed(
    tmp_path: Path,
) -> None:
    # Two receiver ranks given one journal_path wrote one file; after a restart one of them
    # read the other's record and fell back to an anchor. A replacement started beside a hung
    # process had its journal overwritten by the old one.
    path = tmp_path / "journal.json"
    receiver = _journal_receiver(path)
    record = path.read_bytes()
    told = _hold_elsewhere(path)
    assert f"cluster receiver journal {str(path)!r} is in use by another process (pid " in told
    assert f"{os.getpid()})" in told and "another rank cannot share it" in told
    assert "Nothing was written" in told and path.read_bytes() == record

    # the same process shares it (a restart modelled in-process, an engine's reload)
    again = _journal_receiver(path)
    receiver.close()
    assert "in use by another process" in _hold_elsewhere(path)  # `again` still holds it
    again.close()
    assert _hold_elsewhere(path).strip() == "opened"
    # a closed receiver holds no journal to sync over another group
    with pytest.raises(ConfigError, match=r"use_group\(\) after close\(\)"):
        again.use_group(None)


def test_a_journal_path_the_filesystem_refuses_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(LocalStateError, match=r"journal '.*x\\x00.json'.*null byte"):
        ClusterJournal(version=None, path=str(tmp_path / "x\x00.json"))
    with pytest.raises(
        LocalStateError, match=r"cannot open the lock '.*' of cluster receiver journal.*Free space"
    ):
        ClusterJournal(version=None, path=tmp_path / "missing" / "journal.json")


@pytest.mark.timeout(60)
def test_a_fifo_where_a_record_should_be_is_refused_not_waited_on(tmp_path: Path) -> None:
    # opening a FIFO for reading waits for a writer, forever
    fifo = tmp_path / "journal.json"
    os.mkfifo(fifo)
    with pytest.raises(LocalStateError, match="not a regular file"):
        ClusterJournal(version=None, path=fifo)
    state_dir = tmp_path / "rx"
    state_dir.mkdir()
    os.mkfifo(state_dir / "state.json")
    with pytest.raises(LocalStateError, match=r"state.json' is not a regular file"):
        StateDir(state_dir).read_state()
