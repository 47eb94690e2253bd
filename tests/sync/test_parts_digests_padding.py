"""Elements no writer owns (vLLM's vocabulary padding) are in no part digest; a receiver's parts
check also proves them zero in the state it checks. The rectangles no piece covers are the exact
complement of the pieces; a nonzero (or -0.0) padding element makes the live check fail
(scrub, verify_on_open: dirty), the check before a write refuse the chain, and a chain that
writes padding be refused before any write; zero padding passes all of them."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_parts_digests import SHARDS, _published, _ranks, _receivers

from deltasync.errors import DeltaSyncError
from deltasync.format import TensorPieces, TensorUpdate
from deltasync.layout import ReceiverLayout
from deltasync.layout.part_digests import (
    chain_part_digests,
    iter_pieces,
    receiver_part_digests,
)
from deltasync.receiver import Receiver

from sync_kit import (
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    same_bits,
    scratch_store,
    tiny_spec,
)

PADDED = "tp1"  # the tiny Qwen3's vocabulary 251 -> 256 under vLLM TP 2: 5 rows in tp1
EMBED = "model.embed_tokens.weight"


def _mark(layout, hits, shard, name, r, c, n, w):
    shape = layout.local_specs(shard)[name].shape
    view = hits[(shard, name)].view(-1, shape[-1] if len(shape) > 1 else 1)
    view[r : r + n, c : c + w] += 1


@pytest.mark.parametrize(("tp", "writers"), [(2, 2), (2, 3), (4, 2), (1, 4)])
def test_the_unowned_rectangles_and_the_pieces_tile_every_tensor_exactly_once(tp, writers):
    from deltasync.layout.part_digests import unowned_rects  # new with the padding check

    for spec in (tiny_spec(), tiny_spec(vocab_size=77), tiny_spec(tie_word_embeddings=True)):
        layout = ReceiverLayout.build(spec, "vllm", tp=tp)
        hits = {
            (s.id, n): torch.zeros(sp.shape, dtype=torch.int32).reshape(-1)
            for s in layout.shards()
            for n, sp in layout.local_specs(s.id).items()
        }
        for p in iter_pieces(layout, writers):
            _mark(layout, hits, p.shard, p.local, p.local_row, p.local_col, p.rows, p.cols)
        padded = 0
        for s in layout.shards():
            for name, rects in unowned_rects(layout, s.id, writers).items():
                assert "embed" in name or "lm_head" in name, name  # only the vocabulary's
                for rect in rects:
                    _mark(layout, hits, s.id, name, *rect)
                    padded += rect[2] * rect[3]
        for key, t in hits.items():
            assert int(t.min()) == 1 and int(t.max()) == 1, key
        assert padded or tp == 1  # vLLM pads the vocabulary to 64 rows per TP rank


@pytest.mark.parametrize("seed", range(3))
def test_the_complement_of_random_disjoint_rectangles_covers_the_rest_exactly_once(seed):
    from deltasync.layout.part_digests import _complement  # new with the padding check

    rng = random.Random(seed)
    for _ in range(500):
        rows, cols = rng.randint(0, 12), rng.randint(1, 9)
        grid = torch.zeros(rows, cols, dtype=torch.int32)
        rects = []
        for _ in range(rng.randint(0, 8) if rows else 0):
            r, c = rng.randrange(rows), rng.randrange(cols)
            n, w = rng.randint(1, rows - r), rng.randint(1, cols - c)
            if not grid[r : r + n, c : c + w].any():
                grid[r : r + n, c : c + w] += 1
                rects.append((r, c, n, w))
        for r, c, n, w in _complement(rects, rows, cols):
            assert n > 0 and w > 0
            grid[r : r + n, c : c + w] += 1
        assert not rows or (int(grid.min()) == 1 and int(grid.max()) == 1), rects


def _exact_shard(seed: int = 0):
    _spec, tl, rl = layouts()
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) for n, s in tl.param_shapes().items()}
    return rl, rl.split(tl.to_canonical({n: p.to(torch.bfloat16) for n, p in full.items()}))


@pytest.mark.parametrize("value", [1.0, -0.0, float("nan")])
def test_a_nonzero_padding_element_makes_every_live_part_digest_one_that_cannot_match(
    value, caplog
):
    rl, shards = _exact_shard()
    tensors = shards[PADDED]
    assert not tensors[EMBED][123:].view(torch.int16).any()  # split writes padding zero
    exact = receiver_part_digests(tensors, layout=rl, shard=PADDED, count=2)
    tensors[EMBED][125, 7] = value
    with caplog.at_level(logging.WARNING, logger="deltasync.layout.part_digests"):
        bad = receiver_part_digests(tensors, layout=rl, shard=PADDED, count=2)
    assert all(bad[k] != exact[k] for k in range(2)), (bad, exact)
    assert EMBED in caplog.text and "vocabulary padding" in caplog.text
    tensors[EMBED][125, 7] = 0.0
    assert receiver_part_digests(tensors, layout=rl, shard=PADDED, count=2) == exact


def _pieces(name, shape, idx, vals, *, from_zero=False):
    u = TensorUpdate(name=name, shape=shape, dtype=torch.bfloat16, indices=idx, values=vals)
    return TensorPieces(
        name=name, shape=shape, dtype=torch.bfloat16, from_zero=from_zero, pieces=(u,)
    )


def test_a_chain_that_writes_padding_or_leaves_it_nonzero_gives_digests_that_cannot_match():
    rl, shards = _exact_shard()
    live = {n: t.clone() for n, t in shards[PADDED].items()}
    exact = receiver_part_digests(live, layout=rl, shard=PADDED, count=2)
    shape = tuple(live[EMBED].shape)
    width = shape[1]

    def after(chain, tensors):
        return chain_part_digests(tensors, chain, listed={EMBED}, layout=rl, shard=PADDED, count=2)

    owned = torch.tensor([3 * width + 1])
    same = live[EMBED].view(-1)[owned]
    assert after([_pieces(EMBED, shape, owned, same)], live) == exact  # owned: unchanged
    padding = torch.tensor([124 * width + 5])
    one = torch.ones(1, dtype=torch.bfloat16)
    assert after([_pieces(EMBED, shape, padding, one)], live) != exact  # writes padding
    assert after([_pieces(EMBED, shape, padding, one * 0)], live) == exact  # writes it zero
    scribbled = {n: t.clone() for n, t in live.items()}
    scribbled[EMBED][127, 63] = 2.0
    assert after([_pieces(EMBED, shape, owned, same)], scribbled) != exact  # garbage stays
    # an anchor (from zero) of the owned elements clears the garbage: exact again
    flat = live[EMBED].reshape(-1)
    idx = torch.arange(123 * width)
    anchor = [_pieces(EMBED, shape, idx, flat[idx], from_zero=True)]
    assert after(anchor, scribbled) == exact
    assert scribbled[EMBED][127, 63] == 2.0  # the tensors are never written


def _pulled(tmp_path, **config):  # 2 writers, no full state: anchor 0 held by each shard
    _, tl, rl = layouts()
    store = scratch_store(tmp_path / "store")
    syncs, trainers = _ranks([store] * 2, 2)
    _published(syncs, 0)
    recs = _receivers(store, rl, tmp_path, **config)
    for rec in recs.values():
        assert rec.pull().version == 0
    return store, rl, tl, syncs, trainers, recs


@pytest.mark.timeout(90)
def test_nonzero_padding_fails_scrub_and_verify_on_open_and_zero_padding_passes(tmp_path, caplog):
    store, rl, tl, _syncs, trainers, recs = _pulled(tmp_path)
    rec = recs[PADDED]
    assert rec.scrub()  # zero padding: verified
    rec.tensors["lm_head.weight"][126, 0] = 3.0  # a scribbled engine buffer, padding row
    with caplog.at_level(logging.WARNING, logger="deltasync.layout.part_digests"):
        assert not rec.scrub()
    assert "'lm_head.weight'" in caplog.text and "vocabulary padding" in caplog.text
    assert rec.version is None and rec.dirty
    assert rec.pull().version == 0  # the newest anchor restored: padding zero again
    assert not rec.tensors["lm_head.weight"][123:].view(torch.int16).any()
    assert rec.scrub()

    # restarted on its state dir with garbage padding (a corrupted restore): dirty on open
    tensors = rec.tensors
    tensors[EMBED][123, 1] = -0.0
    rec.close()
    again = Receiver.for_layout(
        store, rl, PADDED, tensors, str(tmp_path / f"r-{PADDED}"), rconfig(f"r{PADDED}")
    )
    assert again.dirty and again.state_digest is None
    assert again.pull().version == 0
    assert_same_bits(again.tensors, expected_shards(trainers[0].params, tl, rl)[PADDED])
    again.close()
    tensors = again.tensors  # zero padding: verified on open
    clean = Receiver.for_layout(
        store, rl, PADDED, tensors, str(tmp_path / f"r-{PADDED}"), rconfig(f"r{PADDED}")
    )
    assert not clean.dirty and clean.version == 0


@pytest.mark.timeout(90)
def test_nonzero_padding_refuses_a_delta_before_any_write(tmp_path):
    _store, rl, tl, syncs, trainers, recs = _pulled(tmp_path)
    rec = recs[PADDED]
    rec.tensors[EMBED][124, 9] = 1.0
    held = {n: t.clone() for n, t in rec.tensors.items()}
    for t in trainers:
        t.step()
    _published(syncs, 1)
    with pytest.raises(DeltaSyncError, match=r"versions \[1\].*Refused before any write"):
        rec.pull()
    assert same_bits(rec.tensors, held)  # nothing written
    assert rec.version is None and rec.dirty  # the live tensors no longer hold version 0
    other = next(s for s in SHARDS if s != PADDED)
    assert recs[other].pull().version == 1  # a shard with zero padding takes it
    rep = rec.pull()  # the newest anchor and the delta: exact, padding zero
    assert rep.version == 1
    assert_same_bits(rec.tensors, expected_shards(trainers[0].params, tl, rl)[PADDED])


@pytest.mark.timeout(90)
def test_nonzero_padding_written_during_the_pause_fails_the_check_after_the_write(tmp_path):
    store, rl, _tl, syncs, trainers, recs = _pulled(tmp_path, verify_after_write=True)
    rec = recs[PADDED]
    rec.close()

    def scribble(name):  # the engine writes a padding row while the scatter runs
        if name == EMBED:
            tensors[EMBED][127, 3] = 5.0

    tensors = rec.tensors
    rec = Receiver.for_layout(
        store,
        rl,
        PADDED,
        tensors,
        str(tmp_path / f"r-{PADDED}"),
        rconfig(f"r{PADDED}", verify_after_write=True),
        on_tensor_written=scribble,
    )
    for t in trainers:
        t.step()
    _published(syncs, 1)
    with pytest.raises(DeltaSyncError, match="did not survive"):
        rec.pull()
    assert rec.dirty and rec.version is None
