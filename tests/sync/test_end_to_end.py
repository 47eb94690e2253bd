"""End to end: a transformers Qwen3 trainer with AdamW and the snapshot-free tracker publishes
every step; vLLM-layout TP=2 receivers (two replicas of tp0) and an HF receiver whose live
tensors are a real Qwen3ForCausalLM's parameters pull each version; every version is
bit-identical to a dense split of the trainer's BF16 weights. On a local store and on S3."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import ConfigError
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver, ReceiverConfig
from deltasync.store import LocalStore
from deltasync.trainer import AdamWTracker

from sync_kit import KEY, HFTrainer, assert_same_bits, expected_shards, zero_tensors


def _stores(backend, tmp_path, request):
    if backend == "local":
        return LocalStore(tmp_path / "vllm"), LocalStore(tmp_path / "hf")
    s3 = request.getfixturevalue("s3_store")
    return s3.with_prefix("vllm"), s3.with_prefix("hf")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_every_version_reaches_vllm_and_hf_receivers_bit_exactly(backend, tmp_path, request):
    from transformers import Qwen3ForCausalLM

    vllm_store, hf_store = _stores(backend, tmp_path, request)
    trainer = HFTrainer(seed=0)
    spec = ModelSpec.from_hf_config(trainer.config)
    tl = TrainerLayout(spec)
    rl_vllm = ReceiverLayout.build(spec, "vllm", tp=2)
    rl_hf = ReceiverLayout.build(spec, "hf")
    tracker = AdamWTracker(trainer.opt, trainer.model.named_parameters())
    pubs = [
        Publisher(
            vllm_store,
            receiver_layout=rl_vllm,
            config=PublisherConfig(anchor_every=4, signing_key=KEY),
        ),
        Publisher(hf_store, receiver_layout=rl_hf, config=PublisherConfig(anchor_every=4)),
    ]
    sync = TrainerSync(tracker, pubs, trainer.params)

    def vllm_receiver(rid, shard):
        return Receiver.for_layout(
            vllm_store,
            rl_vllm,
            shard,
            zero_tensors(rl_vllm, shard),
            str(tmp_path / rid),
            ReceiverConfig(receiver_id=rid, signing_key=KEY),
        )

    receivers = {
        "r-tp0-a": vllm_receiver("r-tp0-a", "tp0"),
        "r-tp0-b": vllm_receiver("r-tp0-b", "tp0"),
        "r-tp1": vllm_receiver("r-tp1", "tp1"),
    }
    engine = Qwen3ForCausalLM(trainer.config).to(torch.bfloat16).eval()
    hf_receiver = Receiver.for_layout(
        hf_store,
        rl_hf,
        "tp0",
        {n: p.data for n, p in engine.named_parameters()},
        str(tmp_path / "r-hf"),
        ReceiverConfig(receiver_id="r-hf"),
    )

    kinds = []
    versions = 7 if backend == "local" else 5  # each S3 call costs ~10-50 ms on this machine
    for version in range(versions):
        if version:
            trainer.step()
        reports = sync.step_published(version)
        kinds.append(reports[0].kind)
        want = expected_shards(trainer.params, tl, rl_vllm)
        for rid, rec in receivers.items():
            shard = rec.shard
            report = rec.pull()
            assert report.version == version and report.chain == (version,)
            assert_same_bits(rec.tensors, want[shard], f"{rid} v{version}")
        report = hf_receiver.pull()
        assert report.version == version
        assert_same_bits(hf_receiver.tensors, expected_shards(trainer.params, tl, rl_hf)["tp0"])
        acks = pubs[0].wait_for_acks(version, list(receivers), timeout=5)
        assert all(a is not None and a.version == version for a in acks.values())
    assert kinds == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta"][:versions]
    # The HF engine now computes exactly what the trainer's BF16 weights compute.
    ref = Qwen3ForCausalLM(trainer.config)
    ref.load_state_dict({n: p.detach() for n, p in trainer.model.state_dict().items()})
    ref = ref.to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, trainer.config.vocab_size, (1, 8), generator=gen)
    with torch.no_grad():
        assert torch.equal(engine(ids).logits.view(torch.int16), ref(ids).logits.view(torch.int16))


@pytest.mark.timeout(60)
# upload_threads=1 with 4 shards: the waiting shards' segments queue until a thread is free
@pytest.mark.parametrize("tp, ep, upload_threads", [(2, 2, None), (1, 2, None), (2, 2, 1)])
def test_qwen3_moe_expert_parallel_shards_stay_bit_exact(tp, ep, upload_threads, tmp_path):
    from deltasync.store import MemoryStore

    from sync_kit import TINY, TinyTrainer, rconfig

    cfg = {
        **TINY,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    }
    spec = ModelSpec.from_hf_config(cfg)
    tl, rl = TrainerLayout(spec), ReceiverLayout.build(spec, "vllm", tp=tp, ep=ep)
    store = MemoryStore()
    trainer = TinyTrainer(spec, density=0.1)  # fused expert params, as transformers holds them
    sync = TrainerSync(
        AdamWTracker(trainer.opt, trainer.named_parameters()),
        Publisher(
            store,
            receiver_layout=rl,
            config=PublisherConfig(anchor_every=3, upload_threads=upload_threads),
        ),
        trainer.params,
    )
    receivers = [
        Receiver.for_layout(
            store, rl, s.id, zero_tensors(rl, s.id), str(tmp_path / s.id), rconfig(f"r-{s.id}")
        )
        for s in rl.shards()
    ]
    for version in range(5):
        if version:
            trainer.step()
        sync.step_published(version)
        want = expected_shards(trainer.params, tl, rl)
        for rec in receivers:
            assert rec.pull().version == version
            assert_same_bits(rec.tensors, want[rec.shard], f"{rec.shard} v{version}")


def test_params_that_name_a_tied_tensor_twice_are_refused_before_anything_is_written(tmp_path):
    # named_parameters(remove_duplicate=False) lists the tied lm_head beside the embedding:
    # one canonical tensor from two params would be refused at the first delta, one version
    # late; it is refused at the first publish instead, naming both and the remedy
    trainer = HFTrainer(tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(trainer.hf_config)
    named = list(trainer.model.named_parameters(remove_duplicate=False))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= {n for n, _ in named}
    store = LocalStore(str(tmp_path / "store"))
    pub = Publisher(store, receiver_layout=ReceiverLayout.build(spec, "vllm", tp=2))
    sync = TrainerSync(AdamWTracker(trainer.opt, named), pub, {n: p for n, p in named})
    with pytest.raises(ConfigError, match=r"'lm_head\.weight'.*named_parameters"):
        sync.step_published(0, anchor=True)
    assert store.list("") == []
