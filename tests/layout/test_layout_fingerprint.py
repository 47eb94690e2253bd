"""The layout a manifest records covers placements, not only tensor names and shapes.

Two receiver layouts can name the same local tensors with the same shapes and still put
canonical elements in different places (a probed table of another engine version that swaps
k and v inside a fused ``qkv_proj``, a hand table with a bug). A receiver built for such a
layout must refuse a version before it fetches or writes anything; a receiver of a shard whose
placements agree takes it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deltasync import (
    MemoryStore,
    ModelSpec,
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    ReceiverLayout,
    TrainerLayout,
    names,
)
from deltasync.commit import Manifest
from deltasync.commit.model import placements_fingerprint
from deltasync.errors import LayoutMismatchError
from deltasync.layout import LayoutTable

pytestmark = pytest.mark.timeout(120)

CONFIG = dict(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    tie_word_embeddings=False,
)
KV = ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight")


def _swapped_kv(layout: ReceiverLayout, shard: str) -> ReceiverLayout:
    """The same layout but for ``shard``, where layer 0's k and v heads trade places inside
    ``qkv_proj``: every local name and shape is unchanged."""
    t = layout.table
    placements = {n: list(pls) for n, pls in t.placements.items()}
    k, v = (
        [i for i, p in enumerate(placements[n]) if p.shard == shard and "qkv_proj" in p.local]
        for n in KV
    )
    (ik,), (iv,) = k, v
    pk, pv = placements[KV[0]][ik], placements[KV[1]][iv]
    placements[KV[0]][ik] = dataclasses.replace(
        pk, block=dataclasses.replace(pk.block, dst_row=pv.block.dst_row)
    )
    placements[KV[1]][iv] = dataclasses.replace(
        pv, block=dataclasses.replace(pv.block, dst_row=pk.block.dst_row)
    )
    table = LayoutTable(
        src_shapes=t.src_shapes, dst_shapes=t.dst_shapes, placements=placements, aliases=t.aliases
    )
    return ReceiverLayout(
        spec=layout.spec,
        engine=layout.engine,
        tp=layout.tp,
        ep=layout.ep,
        table=table,
        shards=layout.shards(),
    )


@pytest.fixture
def published():
    spec = ModelSpec.from_hf_config(CONFIG)
    layout = ReceiverLayout.build(spec, engine="vllm", tp=2)
    gen = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(s, generator=gen).to(torch.bfloat16)
        for n, s in TrainerLayout(spec).param_shapes().items()
    }
    store = MemoryStore()
    publisher = Publisher(store, receiver_layout=layout, config=PublisherConfig(anchor_every=10))
    publisher.publish(0, [], params, anchor=True)
    canonical = TrainerLayout(spec).to_canonical(params)
    return store, layout, layout.split(canonical)


def _receiver(store, layout, shard, tmp_path, rid):
    tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in layout.local_specs(shard).items()}
    rec = Receiver.for_layout(
        store,
        layout,
        shard,
        tensors,
        str(tmp_path / rid),
        ReceiverConfig(receiver_id=rid, durable=False),
    )
    return rec, tensors


def _same_bits(a, b) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


def test_a_receiver_whose_shard_places_elements_differently_is_refused_before_any_write(
    published, tmp_path
):
    store, layout, _ = published
    other = _swapped_kv(layout, "tp0")
    assert other.local_specs("tp0") == layout.local_specs("tp0")  # names and shapes agree
    rec, tensors = _receiver(store, other, "tp0", tmp_path, "swapped")
    with pytest.raises(LayoutMismatchError, match="places canonical elements differently"):
        rec.pull()
    assert all(int(t.view(torch.int16).abs().sum()) == 0 for t in tensors.values())
    assert rec.version is None and not rec.dirty
    assert not rec.dir.journal_path.exists()


def test_receivers_whose_placements_agree_take_the_version_bit_exact(published, tmp_path):
    store, layout, split = published
    other = _swapped_kv(layout, "tp0")  # tp1's placements are untouched
    for shard, rl in (("tp0", layout), ("tp1", layout), ("tp1", other)):
        rec, tensors = _receiver(store, rl, shard, tmp_path, f"{shard}-{id(rl)}")
        assert rec.pull().version == 0
        assert _same_bits(tensors, split[shard]), shard


def test_the_manifest_records_every_shards_placements_fingerprint(published):
    store, layout, _ = published
    manifest = Manifest.from_json(store.get(names.manifest_key(0)))
    recorded = {s: r.placements for s, r in manifest.layout.shards.items()}
    assert recorded == {s: placements_fingerprint(layout.table, s) for s in ("tp0", "tp1")}
    assert recorded["tp0"] != recorded["tp1"]
    swapped = _swapped_kv(layout, "tp0").table
    assert placements_fingerprint(swapped, "tp0") != recorded["tp0"]
    assert placements_fingerprint(swapped, "tp1") == recorded["tp1"]


def test_a_manifest_written_without_placements_still_reads_and_is_checked_by_specs(
    published, tmp_path
):
    store, layout, split = published
    key = names.manifest_key(0)
    doc = json.loads(store.get(key))
    for rec in doc["layout"]["shards"].values():
        del rec["placements"]
    old = Manifest.from_json(json.dumps(doc).encode())
    assert all(r.placements is None for r in old.layout.shards.values())
    store.put(key, old.to_json())
    rec, tensors = _receiver(store, _swapped_kv(layout, "tp0"), "tp0", tmp_path, "old")
    rec.pull()  # nothing to compare placements with: the specs check alone, as before
    assert rec.version == 0
    # the blob's local indices are the publisher's: what the record now exists to refuse
    assert _same_bits(tensors, split["tp0"])
