"""The SGLang custom weight loader, against SGLang's Qwen3 conventions (SGLang itself does not
install on this machine: sglang 0.5.23 pins torch==2.14.1 and CUDA-only kernels).

Each TP rank's model is a module tree named as SGLang's Qwen3 names its parameters
(``qkv_proj``, ``gate_up_proj``, 64-padded vocab: vLLM's names and splits). A real trainer
publishes versions with TrainerSync; every rank's model gets the loader call SGLang makes for
``update_weights_from_tensor(load_format=LOADER)``: ``take_version(model, named_tensors)``.
"""

from __future__ import annotations

import pytest
import torch
from kit import same_bits

from deltasync import LocalStore, ModelSpec
from deltasync.engines.sglang_loader import (
    LOADER,
    REQUEST_NAME,
    SglangRequest,
    parse_request,
    request_tensors,
    sglang_layout,
    take_version,
)
from deltasync.errors import ConfigError, DigestMismatchError, VersionError

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


def _same(model: torch.nn.Module, expected: dict) -> bool:
    return same_bits({n: p.data for n, p in model.named_parameters()}, expected)


def _request(tmp_path, version: int) -> list:
    req = SglangRequest(
        store=str(tmp_path / "store"),
        receiver_id="sgl0",
        state_dir=str(tmp_path / "state"),
        version=version,
        durable=False,
    )
    return request_tensors(req)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_takes_each_version_in_place_through_the_loader_call(tmp_path, tp):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False), tp=tp)
    trainer.publish(0)
    models = _models(trainer.split(), tp)
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in models]
    for version in range(1, 4):
        trainer.step()
        trainer.publish(version)
        named = _request(tmp_path, version)
        for r, model in enumerate(models):
            report = take_version(model, named, tp_rank=r, tp=tp)
            assert report is not None and report.version == version
        split = trainer.split()
        for r, model in enumerate(models):
            assert _same(model, split[f"tp{r}"]), (version, r)
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs[r]
    # a repeated call (SGLang retried) is a no-op
    assert take_version(models[0], _request(tmp_path, 3), tp_rank=0, tp=tp) is None


def test_a_corrupted_blob_raises_and_leaves_the_rank_at_its_previous_version(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1)
    trainer.step()
    trainer.publish(1)
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


def test_the_request_travels_as_one_uint8_tensor_and_bad_ones_are_refused():
    req = SglangRequest(store="s3://b/p", receiver_id="x", state_dir="/tmp/x", version=7)
    named = request_tensors(req)
    assert [n for n, _ in named] == [REQUEST_NAME] and named[0][1].dtype == torch.uint8
    assert parse_request(named) == req
    with pytest.raises(ConfigError, match=REQUEST_NAME):
        parse_request([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ConfigError, match="does not hold a deltasync request"):
        parse_request([(REQUEST_NAME, torch.frombuffer(bytearray(b"{}"), dtype=torch.uint8))])
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


def test_a_rank_refuses_a_request_that_would_change_how_it_was_opened(tmp_path):
    # Opened without a key, a rank asked with one must not go on without checking signatures
    # (it did: unsigned manifests were applied); the same for another state dir or store.
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    take_version(model, _request(tmp_path, 0), tp_rank=0, tp=1)
    trainer.step()
    trainer.publish(1)
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
    ],
)
def test_bad_request_fields_are_config_errors_naming_them(fields, named):
    with pytest.raises(ConfigError, match=named):
        SglangRequest(store="d", receiver_id="x", state_dir="/s", version=1, **fields)


def test_a_tp_rank_outside_tp_is_a_config_error(tmp_path):
    trainer = StoreTrainer(ENGINE_CONFIG, LocalStore(tmp_path / "store", durable=False))
    trainer.publish(0)
    (model,) = _models(trainer.split(), 1)
    with pytest.raises(ConfigError, match="tp_rank 3 is not a rank of tp=2"):
        take_version(model, _request(tmp_path, 0), tp_rank=3, tp=2)


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
