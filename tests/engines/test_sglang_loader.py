"""The SGLang custom weight loader, against SGLang's Qwen3 conventions (SGLang itself does not
install on this machine: sglang 0.5.23 pins torch==2.14.1 and CUDA-only kernels).

Each TP rank's model is a module tree named as SGLang's Qwen3 names its parameters
(``qkv_proj``, ``gate_up_proj``, 64-padded vocab: vLLM's names and splits). A real trainer
publishes versions with TrainerSync; every rank's model gets the loader call SGLang makes for
``update_weights_from_tensor(load_format=LOADER)``: ``take_version(model, named_tensors)``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from dataclasses import asdict, replace

import pytest
import torch
from kit import same_bits

from deltasync import LocalStore, ModelSpec, Receiver, names
from deltasync.commit.catalog import Catalog
from deltasync.engines.sglang_loader import (
    LOADER,
    REQUEST_NAME,
    SglangRequest,
    check_taken,
    load_deltasync,
    parse_request,
    request_tensors,
    sglang_layout,
    take_version,
)
from deltasync.errors import (
    ApplyError,
    ConfigError,
    DeltaSyncError,
    DigestMismatchError,
    LocalStateError,
    StoreError,
    VersionError,
)
from deltasync.receiver import store_receiver

from engines_helpers import ENGINE_CONFIG, StoreTrainer, corrupt_one_blob, module_tree


class _Cfg(dict):
    """SGLang models carry their HF config as ``model.config`` (attribute access)."""

    __getattr__ = dict.get


def _models(split: dict, tp: int) -> list[torch.nn.Module]:
    models = []
    for r in range(tp):
        model = module_tree(split[f"tp{r}"])
        model.config = _Cfg(ENGINE_CONFIG)
        models.append(model)
    return models


class _TPGroup:
    """An all-gather between ranks that run on threads of this process (SGLang's TP CPU group
    in a real engine): each call returns every rank's item, in rank order."""

    def __init__(self, tp: int) -> None:
        self.slots: list = [None] * tp
        self.barrier = threading.Barrier(tp, timeout=60)

    def gather(self, rank: int):
        def gather(item):
            self.slots[rank] = item
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def _take_all(models: list, named: list, *, per_rank: list | None = None) -> list:
    """Every rank takes ``named`` (or its own of ``per_rank``) at once, as SGLang calls the
    loader on each TP rank: the report (or None) or the exception of each rank."""
    tp = len(models)
    group = _TPGroup(tp)
    results: list = [None] * tp

    def run(r: int) -> None:
        mine = named if per_rank is None else per_rank[r]
        try:
            results[r] = take_version(
                models[r], mine, tp_rank=r, tp=tp, gather=group.gather(r) if tp > 1 else None
            )
        except BaseException as exc:  # an interrupt on one rank too
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _same(model: torch.nn.Module, expected: dict) -> bool:
    return same_bits({n: p.data for n, p in model.named_parameters()}, expected)


def _parsed(tmp_path, version: int, **fields) -> SglangRequest:
    """The request of ``version`` from ``tmp_path/store`` (``fields``: others instead)."""
    base = dict(
        store=str(tmp_path / "store"),
        receiver_id="sgl0",
        state_dir=str(tmp_path / "state"),
        version=version,
        durable=False,
    )
    return SglangRequest(**{**base, **fields})


def _request(tmp_path, version: int, **fields) -> list:
    return request_tensors(_parsed(tmp_path, version, **fields))


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_takes_each_version_in_place_through_the_loader_call(tmp_path, tp):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=tp)
    trainer.publish(0)
    models = _models(trainer.split(), tp)
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in models]
    for version in range(1, 4):
        trainer.step()
        trainer.publish(version)
        for report in _take_all(models, _request(tmp_path, version)):
            assert report is not None and report.version == version
        split = trainer.split()
        for r, model in enumerate(models):
            assert _same(model, split[f"tp{r}"]), (version, r)
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs[r]
    # a repeated call (SGLang retried) is a no-op
    assert _take_all(models, _request(tmp_path, 3)) == [None] * tp


def _one_rank_at_0_then_published(tmp_path):
    """A TP=1 engine's model at version 0, and the trainer one step on, version 1 published."""
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1)
    trainer.step()
    trainer.publish(1)
    return trainer, model


def test_a_corrupted_blob_raises_and_leaves_the_rank_at_its_previous_version(tmp_path):
    _, model = _one_rank_at_0_then_published(tmp_path)
    corrupt_one_blob(tmp_path / "store", 1, "tp0")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(DigestMismatchError):
        take_version(model, _request(tmp_path, 1), tp_rank=0, tp=1)
    assert _same(model, before)
    assert model._deltasync_shard.receiver.version == 0


def test_a_version_that_is_not_the_newest_is_refused_before_anything_is_written(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for version in (1, 2):
        trainer.step()
        trainer.publish(version)
    with pytest.raises(VersionError, match="not the store's newest committed version"):
        take_version(model, _request(tmp_path, 1), tp_rank=0, tp=1)
    with pytest.raises(VersionError, match="not the store's newest committed version"):
        take_version(model, _request(tmp_path, 5), tp_rank=0, tp=1)
    assert _same(model, before)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_version_committed_while_ranks_take_the_previous_one_is_not_what_they_write(
    tmp_path, monkeypatch, tp
):
    # Version 2 commits after the loader checked that 1 is the newest, before (or, at TP=2,
    # between) the ranks' pulls: every rank takes exactly version 1, never 2 or a mix.
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=tp)
    trainer.publish(0)
    models = _models(trainer.split(), tp)
    _take_all(models, _request(tmp_path, 0))
    trainer.step()
    trainer.publish(1)
    expected = trainer.split()
    pull, lock, raced = Receiver.pull, threading.Lock(), []

    def racing(self, version=None):
        with lock:
            if not raced:  # the first rank to pull: the trainer commits 2 now
                raced.append(True)
                trainer.step()
                trainer.publish(2)
        return pull(self, version=version)

    monkeypatch.setattr(Receiver, "pull", racing)
    reports = _take_all(models, _request(tmp_path, 1))
    assert raced and all(r is not None and r.version == 1 for r in reports), reports
    for r, model in enumerate(models):
        assert _same(model, expected[f"tp{r}"]), r
        assert model._deltasync_shard.receiver.version == 1


def test_the_request_travels_as_one_uint8_tensor_and_bad_ones_are_refused():
    req = SglangRequest(store="s3://b/p", receiver_id="x", state_dir="/tmp/x", version=7)
    named = request_tensors(req)
    assert [n for n, _ in named] == [REQUEST_NAME] and named[0][1].dtype == torch.uint8
    assert parse_request(named) == req
    with pytest.raises(ConfigError, match=REQUEST_NAME):
        parse_request([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ConfigError, match="does not hold a deltasync request"):
        parse_request([(REQUEST_NAME, torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8))])
    deep = bytearray(b"[" * 100_000 + b"]" * 100_000)  # nested past the JSON parser's stack
    with pytest.raises(ConfigError, match="does not hold a deltasync request"):
        parse_request([(REQUEST_NAME, torch.frombuffer(deep, dtype=torch.uint8))])
    with pytest.raises(ConfigError, match="version"):
        SglangRequest(store="d", receiver_id="x", state_dir="/s", version=-1)
    assert LOADER == "deltasync.engines.sglang_loader.load_deltasync"


def test_sglangs_wider_vocab_padding_at_a_tp_that_vllm_refuses_is_refused_by_name():
    spec = ModelSpec.from_hf_config(
        {**ENGINE_CONFIG, "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 200}
    )
    with pytest.raises(ConfigError, match="pads a vocabulary of 200 to a multiple of 192"):
        sglang_layout(spec, tp=3)
    assert sglang_layout(ModelSpec.from_hf_config(ENGINE_CONFIG), tp=2).tp == 2


def test_a_model_parameter_no_tensor_of_the_layout_writes_is_refused_naming_it(tmp_path):
    # it was never written: the rank reported each version while computing with it as loaded
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    split = trainer.split()
    extra = "model.layers.0.mlp.shared_expert_gate.weight"
    split["tp0"][extra] = torch.zeros(1, ENGINE_CONFIG["hidden_size"], dtype=torch.bfloat16)
    (model,) = _models(split, 1)
    with pytest.raises(ConfigError, match=rf"SGLang model has parameters \['{extra}'\]"):
        take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1)
    assert not (tmp_path / "state").exists()


def test_a_rank_refuses_a_request_that_would_change_how_it_was_opened(tmp_path):
    # Opened without a key, a rank asked with one must not go on without checking signatures
    # (it did: unsigned manifests were applied); the same for another state dir or store.
    trainer, model = _one_rank_at_0_then_published(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = dict(
        store=str(tmp_path / "store"), receiver_id="sgl0", state_dir=str(tmp_path / "state")
    )
    for change, field in (
        (dict(signing_key_hex="ab" * 32), "signing_key_hex"),
        (dict(state_dir=str(tmp_path / "other")), "state_dir"),
        (dict(durable=True), "durable"),
    ):
        request = SglangRequest(**{**base, "durable": False, **change}, version=1)
        with pytest.raises(ConfigError, match=field):
            take_version(model, request_tensors(request), tp_rank=0, tp=1)
        assert _same(model, before)
    take_version(model, _request(tmp_path, 1), tp_rank=0, tp=1)  # the same fields: taken
    assert _same(model, trainer.split()["tp0"])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(signing_key_hex="zz"), "signing_key_hex"),
        (dict(signing_key_hex="ab"), "signing_key_hex"),
        (dict(s3=[1, 2]), "s3"),
        (dict(durable="no"), "durable"),
        (dict(state_dir="/s/a\x00b"), "state_dir"),
        (dict(store="d\x00"), "store"),
        (dict(request_id="../x"), "request_id"),
        (dict(request_id=""), "request_id"),
    ],
)
def test_bad_request_fields_are_config_errors_naming_them(fields, named):
    with pytest.raises(ConfigError, match=named):
        SglangRequest(
            **{"store": "d", "receiver_id": "x", "state_dir": "/s", "version": 1, **fields}
        )


def test_a_tp_rank_outside_tp_is_a_config_error(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    with pytest.raises(ConfigError, match="tp_rank 3 is not a rank of tp=2"):
        take_version(model, _request(tmp_path, 0), tp_rank=3, tp=2, gather=lambda x: [x, x])


def test_after_a_store_reset_the_same_version_number_is_pulled_not_answered_as_held(tmp_path):
    # A rank at version 2 of one lineage, asked for version 2 after the store was reset and a
    # new run published its own 0..2, answered "already there" (success) holding the old
    # run's weights; it pulls the new run's anchor chain.
    import shutil

    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    for version in (1, 2):
        trainer.step()
        trainer.publish(version)
        take_version(model, _request(tmp_path, version), tp_rank=0, tp=1)
    shutil.rmtree(tmp_path / "store")
    fresh = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), seed=1)
    fresh.publish(0)
    for version in (1, 2):
        fresh.step()
        fresh.publish(version)
    report = take_version(model, _request(tmp_path, 2), tp_rank=0, tp=1)
    assert report is not None and report.version == 2 and report.from_anchor
    assert _same(model, fresh.split()["tp0"])
    assert take_version(model, _request(tmp_path, 2), tp_rank=0, tp=1) is None  # now held


def _at_version_2_then_rank_0_reloads_version_0(tmp_path, tp: int):
    """Every rank takes versions 0-2; then ``update_weights_from_disk`` puts the version-0
    checkpoint back into rank 0's model (the same object, so its shard and receiver live on)."""
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=tp)
    trainer.publish(0)
    v0 = trainer.split()
    models = _models(v0, tp)
    for version in (1, 2):
        trainer.step()
        trainer.publish(version)
        _take_all(models, _request(tmp_path, version))
    with torch.no_grad():
        for n, p in models[0].named_parameters():
            p.copy_(v0["tp0"][n])
    return trainer, models


@pytest.mark.parametrize("tp", [1, 2])
def test_after_update_weights_from_disk_the_held_version_is_restored_not_answered_as_held(
    tmp_path, tp
):
    # SGLang's update_weights_from_disk loads a checkpoint into the same model object, so the
    # shard and its receiver survive it: asked for the version it held before, a rank
    # answered "already there" (success) while serving the checkpoint's weights. Here the
    # version-0 checkpoint goes back into rank 0 only; every rank ends at version 2, exact.
    trainer, models = _at_version_2_then_rank_0_reloads_version_0(tmp_path, tp)
    reports = _take_all(models, _request(tmp_path, 2))
    assert reports[0] is not None and reports[0].version == 2 and reports[0].from_anchor
    assert reports[1:] == [None] * (tp - 1)  # the other ranks still hold it
    split = trainer.split()
    for r, model in enumerate(models):
        assert _same(model, split[f"tp{r}"]), r
    assert _take_all(models, _request(tmp_path, 2)) == [None] * tp  # held now


def _with_load_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a ``load_weights`` as SGLang's models have one (what its
    ``update_weights_from_disk`` calls on the same model): ``(name, tensor)`` pairs copied in."""

    def load_weights(weights) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    model.load_weights = load_weights
    return model


def test_a_reload_through_the_models_load_weights_stops_the_version_held_at_once(tmp_path):
    # update_weights_from_disk left the rank's receiver, its state file and its registration
    # naming version 2 over the checkpoint's weights until a next request came: check_taken
    # of the request that brought version 2 still passed, and so did every reader of the
    # registration (retention, staleness).
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=1)
    trainer.publish(0)
    v0 = trainer.split()
    model = _with_load_weights(_models(v0, 1)[0])
    for version in (1, 2):
        trainer.step()
        trainer.publish(version)
        taken = _parsed(tmp_path, version)
        assert take_version(model, request_tensors(taken), tp_rank=0, tp=1).version == version
    check_taken(taken)
    shard = model._deltasync_shard
    model.load_weights(list(v0["tp0"].items()))  # the version-0 checkpoint, from disk
    assert shard.receiver.version is None and shard.receiver.dirty
    registered = Catalog(LocalStore(tmp_path / "store")).receiver("sgl0-tp0")
    assert registered is not None and registered.version is None
    with pytest.raises(ApplyError, match="shard 'tp0' holds version None"):
        check_taken(taken)
    again = _parsed(tmp_path, 2)  # the next request restores it
    report = take_version(model, request_tensors(again), tp_rank=0, tp=1)
    assert report is not None and report.version == 2 and report.from_anchor
    check_taken(again)
    assert _same(model, trainer.split()["tp0"])


@pytest.mark.parametrize("tp", [1, 2])
def test_check_taken_does_not_answer_a_request_with_a_registration_an_earlier_one_left(
    tmp_path, tp
):
    # After update_weights_from_disk, a request for the version the ranks held that never
    # reached them (or that SGLang never ran) passed check_taken: every registration still
    # named that version, written for the request before, while rank 0 served the checkpoint.
    trainer, models = _at_version_2_then_rank_0_reloads_version_0(tmp_path, tp)
    lost = _parsed(tmp_path, 2)
    with pytest.raises(ApplyError) as failed:
        check_taken(lost)
    for r in range(tp):
        assert f"shard 'tp{r}' registered version 2 without answering this request" in str(
            failed.value
        )
    assert not _same(models[0], trainer.split()["tp0"])
    _take_all(models, request_tensors(lost))  # sent again, it arrives: rank 0 is restored
    check_taken(lost)
    for r, model in enumerate(models):
        assert _same(model, trainer.split()[f"tp{r}"]), r


@pytest.mark.parametrize("outage", ["every read", "one manifest read"])
def test_a_store_outage_never_makes_a_reloaded_rank_answer_a_request_it_did_not_take(
    tmp_path, monkeypatch, outage
):
    # After update_weights_from_disk, a request for the version the rank held met a store
    # outage before the rank re-hashed its tensors. Every read failing: the refusal's
    # registration named the request with that version. One manifest read failing: the pull
    # found the version held and wrote nothing, with success. Either way check_taken passed
    # while the rank served the checkpoint.
    trainer, models = _at_version_2_then_rank_0_reloads_version_0(tmp_path, 1)
    asked = _parsed(tmp_path, 2)
    real_get, failures = LocalStore.get, [1]

    def get(store, key, **kwargs):
        if outage == "every read" or (key.endswith("MANIFEST.json") and failures):
            failures.clear()
            raise StoreError("the connection was reset")
        return real_get(store, key, **kwargs)

    monkeypatch.setattr(LocalStore, "get", get)
    try:
        take_version(models[0], request_tensors(asked), tp_rank=0, tp=1)
    except StoreError:
        pass  # refused: what the registration says is the question
    monkeypatch.setattr(LocalStore, "get", real_get)
    exact = _same(models[0], trainer.split()["tp0"])
    # no registration names version 2 over the checkpoint's weights, for any request (a
    # bounded-staleness trainer counts it), and neither does the receiver
    record = Catalog(LocalStore(tmp_path / "store", durable=False)).receiver("sgl0-tp0")
    assert exact or record.version is None, record
    assert exact or models[0]._deltasync_shard.receiver.version is None
    try:
        check_taken(asked)
    except ApplyError:
        assert not exact or outage == "one manifest read"
    else:
        assert exact, "check_taken passed for a rank serving the checkpoint's weights"
    take_version(models[0], request_tensors(asked), tp_rank=0, tp=1)  # resent
    check_taken(asked)
    assert _same(models[0], trainer.split()["tp0"])


def test_every_registration_of_a_request_names_it_and_a_request_without_an_id_is_taken(
    tmp_path,
):
    _, model = _one_rank_at_0_then_published(tmp_path)
    asked = _parsed(tmp_path, 1)
    take_version(model, request_tensors(asked), tp_rank=0, tp=1)
    catalog = Catalog(LocalStore(tmp_path / "store", durable=False))
    record = catalog.receiver("sgl0-tp0")
    assert (record.version, record.request) == (1, asked.request_id)
    model._deltasync_shard.receiver.heartbeat()  # later registrations keep naming it
    assert catalog.receiver("sgl0-tp0").request == asked.request_id
    # a caller that names no request (an older client's JSON): the same id, None, on every
    # rank, and check_taken by version and lineage alone
    legacy = json.loads(request_tensors(asked)[0][1].numpy().tobytes())
    del legacy["request_id"]
    named = [
        (REQUEST_NAME, torch.frombuffer(bytearray(json.dumps(legacy).encode()), dtype=torch.uint8))
    ]
    assert parse_request(named).request_id is None
    assert take_version(model, named, tp_rank=0, tp=1) is None  # held
    assert catalog.receiver("sgl0-tp0").request is None
    check_taken(replace(asked, request_id=None))
    assert asked.request_id != _parsed(tmp_path, 1).request_id  # fresh for every request
    assert "request_id" not in asked.opening()  # not a field the receiver is opened with
    with pytest.raises(ConfigError, match=r"answering\(\).*'\.\./x' is not a safe name"):
        model._deltasync_shard.receiver.answering("../x")


@pytest.mark.parametrize("tp", [1, 2])
def test_after_update_weights_from_disk_a_new_version_is_taken_by_restoring_the_anchor(
    tmp_path, tp
):
    # Asked for the next version instead, the reloaded rank refused it with an IntegrityError
    # (its delta's base was gone) and every rank raised; only the request after restored it.
    trainer, models = _at_version_2_then_rank_0_reloads_version_0(tmp_path, tp)
    trainer.step()
    trainer.publish(3)
    reports = _take_all(models, _request(tmp_path, 3))
    assert reports[0].version == 3 and reports[0].drifted and reports[0].from_anchor, reports
    assert all(r.version == 3 and not r.drifted for r in reports[1:]), reports
    split = trainer.split()
    for r, model in enumerate(models):
        assert _same(model, split[f"tp{r}"]), r


def test_a_version_one_rank_refuses_is_taken_by_no_rank_and_every_rank_raises(tmp_path):
    # Only tp1's blob is corrupted. Rank 0 took the version and answered success (the answer
    # SGLang returns to the caller, recording the new weight version) while rank 1 stayed at
    # the previous one: the engine served two versions. Now no rank writes and both raise.
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2)
    trainer.publish(0)
    models = _models(trainer.split(), 2)
    assert [r.version for r in _take_all(models, _request(tmp_path, 0))] == [0, 0]
    split0 = trainer.split()
    trainer.step()
    trainer.publish(1)
    corrupt_one_blob(tmp_path / "store", 1, "tp1")
    results = _take_all(models, _request(tmp_path, 1))
    assert isinstance(results[1], DigestMismatchError)
    assert isinstance(results[0], ApplyError) and "tp1" in str(results[0])
    assert "version 1 was not taken" in str(results[0])
    for r, model in enumerate(models):
        assert _same(model, split0[f"tp{r}"]), r
        assert model._deltasync_shard.receiver.version == 0
    # a rank that fails before staging (a request it refuses) is waited for, not hung on
    trainer.step()
    trainer.publish(2)
    results = _take_all(models, _request(tmp_path, 1))  # no longer the newest
    assert all(isinstance(e, (VersionError, ApplyError)) for e in results)
    corrupt_one_blob(tmp_path / "store", 1, "tp1")  # the same byte flipped back: repaired
    for r, report in enumerate(_take_all(models, _request(tmp_path, 2))):
        assert report.version == 2 and _same(models[r], trainer.split()[f"tp{r}"])


def test_a_tp_engine_without_the_ranks_gather_is_refused(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2)
    trainer.publish(0)
    models = _models(trainer.split(), 2)
    with pytest.raises(ConfigError, match="gather"):
        take_version(models[0], _request(tmp_path, 0), tp_rank=0, tp=2)


def _two_ranks_at_0_then_published(tmp_path, version: int):
    """A TP=2 engine's models at version 0, and the trainer one step on, ``version`` published."""
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2)
    trainer.publish(0)
    models = _models(trainer.split(), 2)
    _take_all(models, _request(tmp_path, 0))
    trainer.step()
    trainer.publish(version)
    return trainer, models


def test_a_rank_replaying_a_journal_then_failing_the_request_stops_every_rank_writing(tmp_path):
    # Rank 1's state file failed after its write of version 2 (a journal stays). Asked for 3,
    # whose tp1 blob is corrupt, it agreed "ready" at the replay's write and then failed: rank
    # 0 wrote 3, rank 1 stayed at 2. The replay now comes before the agreement.
    trainer, models = _two_ranks_at_0_then_published(tmp_path, 2)
    state = models[1]._deltasync_shard.receiver.dir

    def full(_state):
        del state.write_state  # once
        raise LocalStateError("cannot write the state file: No space left on device")

    state.write_state = full
    results = _take_all(models, _request(tmp_path, 2))
    assert isinstance(results[1], LocalStateError), results  # rank 0 took it, and says so
    assert isinstance(results[0], ApplyError) and "this rank took it" in str(results[0])
    assert state.read_journal() is not None
    split2 = trainer.split()
    trainer.step()
    trainer.publish(3)
    corrupt_one_blob(tmp_path / "store", 3, "tp1")
    results = _take_all(models, _request(tmp_path, 3))
    assert isinstance(results[1], DigestMismatchError), results
    assert isinstance(results[0], ApplyError) and "version 3 was not taken" in str(results[0])
    for r, model in enumerate(models):
        assert _same(model, split2[f"tp{r}"]), r
        assert model._deltasync_shard.receiver.version == 2, r


def test_an_interrupt_on_one_rank_is_every_ranks_failure_and_the_group_stays_usable(tmp_path):
    # A SystemExit in one rank's verify never reached the agreement: the others waited out the
    # group's timeout, and every later request failed on the broken pairing.
    import deltasync.receiver.store_receiver as store_receiver

    trainer, models = _two_ranks_at_0_then_published(tmp_path, 1)
    real = store_receiver.chain_state_digest
    hit: list[int] = []

    def interrupted(tensors, chain):
        if not hit and tensors is models[1]._deltasync_shard.receiver.tensors:
            hit.append(1)
            raise SystemExit("stopped in verify")
        return real(tensors, chain)

    store_receiver.chain_state_digest = interrupted
    try:
        results = _take_all(models, _request(tmp_path, 1))
    finally:
        store_receiver.chain_state_digest = real
    assert hit and isinstance(results[1], SystemExit), results
    assert isinstance(results[0], ApplyError) and "version 1 was not taken" in str(results[0])
    for r, report in enumerate(_take_all(models, _request(tmp_path, 1))):
        assert report.version == 1 and _same(models[r], trainer.split()[f"tp{r}"]), r


def test_a_mistyped_store_is_refused_uncreated_and_does_not_pin_the_engine(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    with pytest.raises(ConfigError, match=r"stroe.*check the path"):
        take_version(model, _request(tmp_path, 0, store=str(tmp_path / "stroe")), tp_rank=0, tp=1)
    assert not (tmp_path / "stroe").exists()
    assert take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1).version == 0


@pytest.mark.parametrize("receiver_id", ["../outside", "/abs/evil", "a/b"])
def test_a_receiver_id_that_is_not_a_name_is_refused_before_any_directory_is_made(
    tmp_path, receiver_id
):
    fields = dict(store=str(tmp_path / "store"), state_dir=str(tmp_path / "state"), version=0)
    with pytest.raises(ConfigError, match=r"receiver_id.*not a safe name"):
        SglangRequest(receiver_id=receiver_id, **fields)
    assert not (tmp_path / "state").exists() and not (tmp_path / "outside").exists()


def test_ranks_asked_for_different_versions_all_refuse_and_none_writes(tmp_path):
    # Rank 0 held version 1 and was asked for 1, rank 1 was asked for 2: each did what it was
    # asked and both answered success, and the engine served half of each version.
    trainer, models = _two_ranks_at_0_then_published(tmp_path, 1)
    _take_all(models, _request(tmp_path, 1))
    split1 = trainer.split()
    trainer.step()
    trainer.publish(2)
    results = _take_all(models, [], per_rank=[_request(tmp_path, 1), _request(tmp_path, 2)])
    for r, result in enumerate(results):
        assert isinstance(result, ApplyError), results
        assert "asked for different updates" in str(result) and "version 2 of" in str(result)
        assert _same(models[r], split1[f"tp{r}"]), r
        assert models[r]._deltasync_shard.receiver.version == 1, r
    for r, report in enumerate(_take_all(models, _request(tmp_path, 2))):
        assert report.version == 2 and _same(models[r], trainer.split()[f"tp{r}"]), r


def test_the_request_never_shows_its_signing_key_or_s3_credentials():
    request = SglangRequest(
        store="s3://bucket/run",
        receiver_id="sgl0",
        state_dir="/s",
        version=1,
        signing_key_hex="ab" * 32,
        s3={"access_key_id": "AKIA", "secret_access_key": "hidden-secret"},
    )
    shown = repr(request) + request.asked()
    assert "ab" * 32 not in shown and "hidden-secret" not in shown and "AKIA" not in shown
    assert "sgl0" in repr(request) and "version=1" in repr(request)


def test_a_store_path_that_holds_no_store_gets_nothing_written_into_it(tmp_path):
    # /data instead of /data/run: the rank registered into that directory (receivers/...),
    # then said "Nothing was written".
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "data" / "run", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    parent = _parsed(tmp_path, 0, store=str(tmp_path / "data"))
    for _ in range(2):
        with pytest.raises(VersionError, match=r"holds no committed version.*Nothing was written"):
            take_version(model, request_tensors(parent), tp_rank=0, tp=1)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["run"]
    assert not (tmp_path / "state").exists()
    run = SglangRequest(**{**asdict(parent), "store": str(tmp_path / "data" / "run")})
    assert take_version(model, request_tensors(run), tp_rank=0, tp=1).version == 0


def test_a_path_the_filesystem_refuses_is_a_typed_error(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    long_store = _request(tmp_path, 0, store=str(tmp_path / ("s" * 300) / "run"))
    with pytest.raises(ConfigError, match=r"SglangRequest.store .*File name too long"):
        take_version(model, long_store, tp_rank=0, tp=1)
    long_id = _request(tmp_path, 0, receiver_id="r" * 127)
    with pytest.raises(ConfigError, match=r"SglangRequest.receiver_id .* too long for this rank"):
        take_version(model, long_id, tp_rank=0, tp=1)
    assert not (tmp_path / "state").exists()


def test_a_request_one_rank_cannot_read_fails_every_rank_at_once(tmp_path):
    # The rank raised before the agreement, and the others waited in the TP group's gather
    # until it timed out (30 min in SGLang), then "could not agree".
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2)
    trainer.publish(0)
    split0 = trainer.split()
    models = _models(split0, 2)
    _take_all(models, _request(tmp_path, 0))
    trainer.step()
    trainer.publish(1)
    unreadable = [(REQUEST_NAME, torch.frombuffer(bytearray(b"\xff not json"), dtype=torch.uint8))]
    t = time.monotonic()
    results = _take_all(models, [], per_rank=[_request(tmp_path, 1), unreadable])
    assert time.monotonic() - t < 30
    assert isinstance(results[1], ConfigError), results
    assert isinstance(results[0], ApplyError), results
    assert "asked for different updates" in str(results[0])
    assert "could not agree" not in str(results[0])
    for r in range(2):
        assert models[r]._deltasync_shard.receiver.version == 0
        assert _same(models[r], split0[f"tp{r}"]), r
    for r, report in enumerate(_take_all(models, _request(tmp_path, 1))):
        assert report.version == 1 and _same(models[r], trainer.split()[f"tp{r}"]), r


def test_two_callers_on_one_rank_take_their_versions_one_after_the_other(tmp_path, monkeypatch):
    # Thread B replayed thread A's journal as a crash's, wrote and recorded version 2; A
    # then finished writing version 1 over it and recorded 1: the rank reported version 1
    # and held neither.
    trainer, model = _one_rank_at_0_then_published(tmp_path)
    splits = {1: trainer.split()["tp0"]}
    real = store_receiver.apply_pieces
    a_writes, b_started = threading.Event(), threading.Event()

    def apply_pieces(*args, **kwargs):
        if threading.current_thread().name == "A" and not a_writes.is_set():
            a_writes.set()
            b_started.wait(30)
            time.sleep(0.3)  # B is in its call now
        return real(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "apply_pieces", apply_pieces)
    results = {}

    def run(name, version):
        if name == "B":
            b_started.set()
        try:
            results[name] = take_version(model, _request(tmp_path, version), tp_rank=0, tp=1)
        except BaseException as exc:
            results[name] = exc

    a = threading.Thread(target=run, args=("A", 1), name="A")
    a.start()
    assert a_writes.wait(30)
    trainer.step()
    trainer.publish(2)
    splits[2] = trainer.split()["tp0"]
    b = threading.Thread(target=run, args=("B", 2), name="B")
    b.start()
    a.join(60)
    b.join(60)
    assert results["A"].version == 1 and results["B"].version == 2, results
    assert model._deltasync_shard.receiver.version == 2
    assert _same(model, splits[2])


def test_a_receiver_refuses_a_second_threads_pull_while_one_runs(tmp_path, monkeypatch):
    trainer, model = _one_rank_at_0_then_published(tmp_path)
    receiver = model._deltasync_shard.receiver
    real = store_receiver.apply_pieces
    writing, refused = threading.Event(), []

    def apply_pieces(*args, **kwargs):
        if not writing.is_set():
            writing.set()
            for call in (receiver.pull, receiver.scrub, receiver.replay_journal):
                other = threading.Thread(target=lambda c=call: _record(refused, c))
                other.start()
                other.join(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_receiver, "apply_pieces", apply_pieces)
    assert receiver.pull().version == 1
    assert [type(e).__name__ for e in refused] == ["ConfigError"] * 3, refused
    assert "another thread's pull" in str(refused[0])
    assert receiver.version == 1 and _same(model, trainer.split()["tp0"])


def _record(out: list, call) -> None:
    try:
        call()
    except BaseException as exc:
        out.append(exc)
    else:
        out.append(None)


def _as_sglang_rank(monkeypatch, rank: int = 0, tp: int = 1) -> None:
    """What ``load_deltasync`` asks SGLang (its TP rank and size; SGLang cannot be installed
    here): ``sglang.srt.distributed``'s three functions."""
    dist = types.ModuleType("sglang.srt.distributed")
    dist.get_tensor_model_parallel_rank = lambda: rank
    dist.get_tensor_model_parallel_world_size = lambda: tp
    dist.get_tp_group = lambda: None
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", dist)


def test_sglangs_loader_call_never_raises_a_refusal_and_check_taken_tells_the_caller(
    tmp_path, monkeypatch, caplog
):
    # SGLang calls a custom loader without a try and answers success whatever it returns; an
    # exception ends its scheduler and the server. A refused version killed the engine.
    _as_sglang_rank(monkeypatch)
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    request = _parsed(tmp_path, 0)
    load_deltasync(model, request_tensors(request))
    check_taken(request)
    split0 = trainer.split()["tp0"]
    trainer.step()
    trainer.publish(1)
    trainer.step()
    trainer.publish(2)
    stale = SglangRequest(**{**asdict(request), "version": 1})  # not the newest: refused
    with caplog.at_level("ERROR", logger="deltasync.engines.sglang_loader"):
        load_deltasync(model, request_tensors(stale))
    assert "deltasync SGLang TP rank 0: the update was not taken" in caplog.text
    assert "not the store's newest committed version" in caplog.text
    assert _same(model, split0)
    with pytest.raises(
        ApplyError, match=r"'sgl0' did not take version 1: shard 'tp0' holds version 0"
    ):
        check_taken(stale)
    newest = SglangRequest(**{**asdict(request), "version": 2})
    load_deltasync(model, request_tensors(newest))
    check_taken(newest)
    assert _same(model, trainer.split()["tp0"])
    with pytest.raises(VersionError, match="version 3 is not committed"):
        check_taken(SglangRequest(**{**asdict(request), "version": 3}))


def test_check_taken_names_a_rank_that_failed_and_a_lineage_the_store_no_longer_commits(tmp_path):
    import shutil

    _, models = _two_ranks_at_0_then_published(tmp_path, 1)
    corrupt_one_blob(tmp_path / "store", 1, "tp1")
    asked = _parsed(tmp_path, 1)
    results = _take_all(models, request_tensors(asked))
    assert all(isinstance(r, DeltaSyncError) for r in results), results
    with pytest.raises(ApplyError) as failed:
        check_taken(asked)
    # both refused, and both registered what they hold: not for this request, which never
    # had them check it
    held = "holds version 0 (not registered for this request)"
    assert f"shard 'tp0' {held}; shard 'tp1' {held}." in str(failed.value)
    with pytest.raises(ApplyError, match="registered version 0 without answering this request"):
        check_taken(replace(asked, version=0))
    for path in (tmp_path / "store").iterdir():  # a new run: its own version 0
        if path.name != "receivers":  # the ranks' registrations stay
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    fresh = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=2, seed=1)
    fresh.publish(0)
    with pytest.raises(ApplyError, match=r"shard 'tp0' holds version 0 of another lineage"):
        check_taken(replace(asked, version=0))
    asked = _parsed(tmp_path, 0)
    _take_all(models, request_tensors(asked))
    check_taken(asked)


class _FailingPuts:
    """``LocalStore.put`` of keys under ``prefix`` fails (the connection reset) while
    ``armed``; ``failed`` lists the keys refused."""

    def __init__(self, monkeypatch, prefix: str) -> None:
        real, self.armed, self.failed = LocalStore.put, True, []

        def put(store, key, data, *args, **kwargs):
            if key.startswith(prefix) and self.armed:
                self.failed.append(key)
                raise StoreError("the connection was reset")
            return real(store, key, data, *args, **kwargs)

        monkeypatch.setattr(LocalStore, "put", put)


def test_a_rank_whose_registration_names_its_version_and_cannot_be_withdrawn_writes_nothing(
    tmp_path, monkeypatch
):
    # The registration write failed and the rank wrote anyway: the store went on saying it
    # held version 0 (check_taken of 0 passed) over tensors that held 1, or, stopped midway,
    # neither. Now nothing is written until the registration can be withdrawn.
    trainer, model = _one_rank_at_0_then_published(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    puts = _FailingPuts(monkeypatch, "receivers/")
    asked = _parsed(tmp_path, 1)
    with pytest.raises(StoreError, match="could not be withdrawn before the first write"):
        take_version(model, request_tensors(asked), tp_rank=0, tp=1)
    assert puts.failed and _same(model, before)
    assert model._deltasync_shard.receiver.version == 0
    # true: it holds 0, and it could not register since this request came
    with pytest.raises(ApplyError, match=r"holds version 0 \(not registered for this request\)"):
        check_taken(asked)
    puts.armed = False  # the store answers again
    assert take_version(model, request_tensors(asked), tp_rank=0, tp=1).version == 1
    assert _same(model, trainer.split()["tp0"])
    check_taken(asked)


def test_a_retried_request_writes_the_ack_a_failed_write_left_owed(tmp_path, monkeypatch):
    # Asked again for the version it held, the rank rewrote only its registration: the ack a
    # failed write left owed was never written, and a trainer waiting for it timed out
    _, model = _one_rank_at_0_then_published(tmp_path)
    puts = _FailingPuts(monkeypatch, "acks/")
    asked = _parsed(tmp_path, 1)
    assert take_version(model, request_tensors(asked), tp_rank=0, tp=1).version == 1
    acks = LocalStore(tmp_path / "store", durable=False)
    assert puts.failed and not acks.list(names.acks_prefix(1))
    puts.armed = False
    again = _parsed(tmp_path, 1)
    assert take_version(model, request_tensors(again), tp_rank=0, tp=1) is None  # held
    assert acks.list(names.acks_prefix(1))
    check_taken(again)
    with pytest.raises(ApplyError, match="registered version 1 without answering this request"):
        check_taken(asked)  # answered, then superseded by the request after it


def test_arguments_that_are_not_what_sglang_passes_are_config_errors(tmp_path):
    # a ZeroDivisionError, a TypeError and a ManifestError before
    _, model = _one_rank_at_0_then_published(tmp_path)
    with pytest.raises(ConfigError, match=r"take_version.*tp"):
        take_version(model, _request(tmp_path, 1), tp_rank=0, tp=0)
    with pytest.raises(ConfigError, match=r"tp_rank"):
        take_version(model, _request(tmp_path, 1), tp_rank=1, tp=1)
    with pytest.raises(ConfigError, match=r"\(name, tensor\) pairs"):
        parse_request([b"not a pair"])
    with pytest.raises(ConfigError, match=r"too long for shard 'tp0'"):
        check_taken(_parsed(tmp_path, 1, receiver_id="r" * 126))
    assert model._deltasync_shard.receiver.version == 0


def test_check_taken_says_unknown_not_refused_while_a_registration_cannot_be_read(
    tmp_path, monkeypatch
):
    # an outage on the registration read was reported as "shard 'tp0' holds no registration":
    # the caller was told the rank refused a version it had taken
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=1)
    trainer.publish(0)
    model = _models(trainer.split(), 1)[0]
    trainer.step()
    trainer.publish(1)
    taken = _parsed(tmp_path, 1)
    assert take_version(model, request_tensors(taken), tp_rank=0, tp=1).version == 1
    read = LocalStore.get

    def outage(store, key, **kwargs):
        if key.startswith(names.RECEIVERS_PREFIX):
            raise StoreError(f"injected: {key!r} could not be read")
        return read(store, key, **kwargs)

    monkeypatch.setattr(LocalStore, "get", outage)
    with pytest.raises(StoreError, match="whether it took version 1 is unknown"):
        check_taken(taken)
    monkeypatch.undo()
    check_taken(taken)
