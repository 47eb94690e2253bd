"""Verify before write: the state a pull leads to is checked against the manifest while the
engine still serves, in bounded memory, and a refused pull leaves every live element bitwise
at the last verified version (an edited shard digest in an unsigned store, a receiver built
from a config with one layer more than the trainer's, an incomplete anchor)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from truth_kit import CountingStore, Rig, assert_same_bits, rconfig, snapshot, tiny_layouts

from deltasync import LocalStore, names
from deltasync.commit import Manifest, blob_digest
from deltasync.errors import (
    BlobMismatchError,
    ConfigError,
    DigestMismatchError,
    IntegrityError,
    LayoutMismatchError,
)
from deltasync.format import TensorUpdate, apply_updates, encode_blob
from deltasync.format.merge import TensorPieces
from deltasync.layout.digest import state_digest, tensor_digest
from deltasync.layout.verify import (
    chain_state_digest,
    patched_tensor_digest,
    updated_state_digest,
)
from deltasync.receiver import Receiver


@pytest.fixture
def rig(tmp_path):
    r = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    r.publish(0)
    r.check(r.rec.pull())
    r.publish(1)
    return r


def _edit_manifest(store, version, **changes) -> bytes:
    key = names.manifest_key(version)
    original = store.get(key)
    m = Manifest.from_json(original)
    store.put(key, dataclasses.replace(m, **changes).to_json())
    return original


@pytest.mark.timeout(60)
def test_a_blob_that_matches_its_manifest_entry_yet_fails_its_own_checks_is_named(rig):
    # Rewritten with its manifest entry (an unsigned store): refetching gives the same bytes,
    # so the error names the blob and its version, and does not say to fetch it again.
    m = Manifest.from_json(rig.store.get(names.manifest_key(1)))
    entry = m.blobs_for("tp0")[0]
    data = bytearray(rig.store.get(entry.key))
    data[-1] ^= 1  # its own xxh3 trailer no longer matches
    rig.store.put(entry.key, bytes(data))
    blobs = tuple(
        dataclasses.replace(b, digest=blob_digest(bytes(data))) if b.key == entry.key else b
        for b in m.blobs
    )
    _edit_manifest(rig.store, 1, blobs=blobs)
    before = snapshot(rig.tensors)
    with pytest.raises(DigestMismatchError) as err:
        rig.rec.pull()
    message = str(err.value)
    assert message.startswith(f"version 1 blob {entry.key!r}: blob digest"), message
    assert "fetch it again" not in message and "match the manifest's digest" in message
    assert_same_bits(rig.tensors, before, "refused pull")


@pytest.mark.timeout(60)
def test_an_edited_shard_digest_is_refused_with_the_tensors_untouched_and_heals_when_repaired(rig):
    m = Manifest.from_json(rig.store.get(names.manifest_key(1)))
    original = _edit_manifest(rig.store, 1, shard_digests={**m.shard_digests, "tp0": "0" * 32})
    before = snapshot(rig.tensors)
    with pytest.raises(IntegrityError, match="Refused before any write"):
        rig.rec.pull()
    assert_same_bits(rig.tensors, before, "refused pull")
    assert rig.rec.version == 0 and not rig.rec.dirty
    assert not rig.rec.dir.journal_path.exists()
    assert not rig.store.list(names.acks_prefix(1))
    rig.store.put(names.manifest_key(1), original)  # repaired: heals on the next pull
    rig.check(rig.rec.pull())


@pytest.mark.timeout(60)
def test_a_receiver_built_for_one_layer_more_is_refused_before_any_fetch(rig, tmp_path):
    _, _, bigger = tiny_layouts(num_hidden_layers=3)
    counting = CountingStore(rig.store)
    tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in bigger.local_specs("tp0").items()}
    rec = Receiver.for_layout(
        counting, bigger, "tp0", tensors, str(tmp_path / "big"), rconfig("big")
    )
    before = snapshot(tensors)
    with pytest.raises(LayoutMismatchError) as err:
        rec.pull()
    message = str(err.value)
    assert (
        "engine vllm tp=2" in message and "elements" in message and "Nothing was fetched" in message
    )
    assert not [k for k in counting.reads if k.endswith(".blob")]
    assert_same_bits(tensors, before, "refused receiver")
    assert rec.version is None


def _bad_inputs(specs):
    """Live tensors a verify cannot vouch for once written: each entry names the tensor."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    norm = "model.norm.weight"

    def fresh():
        return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}

    alias = fresh()
    alias[head] = alias[embed]  # one storage under two layout names (an engine's tie)
    halves = fresh()  # two names over overlapping halves of one buffer
    rows = specs[embed].shape[0]
    buffer = torch.zeros(rows + 1, specs[embed].shape[1], dtype=specs[embed].dtype)
    halves[embed], halves[head] = buffer[:rows], buffer[1:]
    meta = fresh()
    meta[norm] = torch.empty(specs[norm].shape, dtype=specs[norm].dtype, device="meta")
    expanded = fresh()
    expanded[norm] = torch.zeros(1, dtype=specs[norm].dtype).expand(specs[norm].shape)
    missing = fresh()
    missing[norm] = None
    listed = fresh()
    listed[norm] = [0.0] * specs[norm].shape[0]
    return {
        "alias": (alias, "share memory"),
        "overlapping views": (halves, "share memory"),
        "meta": (meta, "meta device and holds no values"),
        "expanded": (expanded, "an expanded view"),
        "None": (missing, f"{norm!r} is a NoneType, not a torch.Tensor"),
        "list": (listed, f"{norm!r} is a list, not a torch.Tensor"),
    }


@pytest.mark.parametrize("case", ["alias", "overlapping views", "meta", "expanded", "None", "list"])
def test_live_tensors_a_verify_cannot_vouch_for_are_refused_at_construction(rig, tmp_path, case):
    # Accepted before, each one let a pull report a version the tensors did not hold (two
    # names over one storage, a meta tensor), tore the engine's weights mid-scatter (an
    # expanded view) or raised a raw error.
    tensors, message = _bad_inputs(rig.rl.local_specs("tp1"))[case]
    with pytest.raises(ConfigError, match=message) as err:
        Receiver.for_layout(rig.store, rig.rl, "tp1", tensors, str(tmp_path / "x"), rconfig("x"))
    assert "receiver shard 'tp1'" in str(err.value)


@pytest.mark.timeout(60)
def test_an_incomplete_anchor_is_refused_before_any_write(tmp_path):
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    rig.publish(0)
    m = Manifest.from_json(rig.store.get(names.manifest_key(0)))
    (entry,) = m.blobs_for("tp0")
    specs = rig.rl.local_specs("tp0")
    first = next(iter(specs))
    partial = [  # every tensor but the first: a blob consistent with its manifest entry
        TensorUpdate(
            name=n,
            shape=s.shape,
            dtype=s.dtype,
            indices=None,
            values=torch.zeros(s.shape, dtype=s.dtype).reshape(-1),
        )
        for n, s in specs.items()
        if n != first
    ]
    blob = encode_blob(partial, version=0, base_version=-1, shard="tp0", writer=entry.writer)
    from deltasync.commit import blob_digest

    rig.store.put(entry.key, blob)
    fixed = dataclasses.replace(entry, size=len(blob), digest=blob_digest(blob), elements=None)
    others = [b for b in m.blobs if b.key != entry.key]
    rig.store.put(names.manifest_key(0), dataclasses.replace(m, blobs=(*others, fixed)).to_json())
    before = snapshot(rig.tensors)
    with pytest.raises(BlobMismatchError, match="incomplete anchor"):
        rig.rec.pull()
    assert_same_bits(rig.tensors, before, "incomplete anchor")


def _random_updates(tensors, rng):
    out = []
    for name, t in tensors.items():
        n = t.numel()
        pick = rng.random()
        if pick < 0.2:
            continue
        if pick < 0.3:
            values = torch.randn(n).to(t.dtype)
            out.append(
                TensorUpdate(
                    name=name, shape=tuple(t.shape), dtype=t.dtype, indices=None, values=values
                )
            )
            continue
        k = rng.randrange(1, n + 1)
        idx = torch.tensor(sorted(rng.sample(range(n), k)), dtype=torch.int64)
        values = torch.randn(k).to(t.dtype)
        out.append(
            TensorUpdate(name=name, shape=tuple(t.shape), dtype=t.dtype, indices=idx, values=values)
        )
    return out


@pytest.mark.timeout(60)
def test_the_digest_before_the_write_equals_the_digest_after_it_bitwise():
    rng = random.Random(1234)
    for trial in range(30):
        tensors = {
            f"t{i}": torch.randn(rng.randrange(1, 9), rng.randrange(1, 300)).to(torch.bfloat16)
            for i in range(4)
        }
        updates = _random_updates(tensors, rng)
        predicted = updated_state_digest(tensors, updates)
        apply_updates(updates, tensors)
        assert predicted == state_digest(tensors), f"trial {trial}"


@pytest.mark.timeout(60)
def test_the_patched_digest_works_chunk_by_chunk_across_every_boundary():
    rng = random.Random(99)
    t = torch.randn(1000).to(torch.bfloat16)
    for chunk in (1, 7, 64, 999, 1000, 4096):
        idx = torch.tensor([*sorted(rng.sample(range(1000), 50)), 999], dtype=torch.int64).unique()
        vals = torch.randn(idx.numel()).to(torch.bfloat16)
        want = t.clone()
        want.index_copy_(0, idx, vals)
        got = patched_tensor_digest(t, idx, vals, chunk=chunk)
        assert got == tensor_digest(want), f"chunk {chunk}"
    strided = t.view(10, 100).t()  # a transposed view: hashed in its row-major order
    want = strided.contiguous().reshape(-1).clone()
    want.index_copy_(0, idx, vals)
    assert patched_tensor_digest(strided, idx, vals, chunk=64) == tensor_digest(want)


@pytest.mark.timeout(60)
def test_one_scratch_buffer_serves_tensors_of_every_size_and_dtype_in_a_verify():
    """The chain's tensors share one chunk buffer per dtype: a short tensor after a long one,
    an fp16 tensor between BF16 ones and a tensor above the chunk size each hash as if alone."""
    rng = random.Random(7)
    sizes = [(700,), (3, 5), (2000,), (1,), (40, 30), (64,)]
    dtypes = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.bfloat16]
    for chunk in (64, 500, 1 << 20):
        tensors = {
            f"t{i}": torch.randn(shape).to(dtypes[i % len(dtypes)]) for i, shape in enumerate(sizes)
        }
        updates = _random_updates(tensors, rng)
        predicted = chain_state_digest(
            tensors,
            (
                TensorPieces(
                    name=u.name, shape=u.shape, dtype=u.dtype, from_zero=False, pieces=(u,)
                )
                for u in updates
            ),
            chunk=chunk,
        )
        apply_updates(updates, tensors)
        assert predicted == state_digest(tensors), f"chunk {chunk}"
