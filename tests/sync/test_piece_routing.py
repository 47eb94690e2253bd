"""Row pieces: a vocab-parallel parameter routed piece by piece gives exactly the updates of
routing it whole, written slice by slice it gives exactly the same blob bytes, and a publisher
fed captured positions commits the same state."""

from __future__ import annotations

import pytest
import torch
from kit import (
    assert_same_bits,
    bits_equal,
    build_model,
    expected_shards,
    rconfig,
    tiny_layouts,
    tiny_qwen3,
    zero_tensors,
)

from deltasync import LocalStore, Publisher, PublisherConfig, Receiver
from deltasync.errors import ConfigError
from deltasync.format import encode_blob
from deltasync.layout.digest import state_digests
from deltasync.layout.routing import (
    RowPiece,
    parted_pieces,
    piece_updates,
    routed_pieces,
    row_pieces,
    shard_updates,
)
from deltasync.publish import segments
from deltasync.trainer.positions import Positions

EMBED = "model.embed_tokens.weight"


def test_the_vocab_parallel_embedding_splits_into_one_piece_per_tp_rank() -> None:
    spec, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=1001)
    pieces = row_pieces(EMBED, trainer_layout=tl, receiver_layout=rl)
    assert pieces is not None and len(pieces) == 2
    assert [t[0] for p in pieces for t in p.targets] == ["tp0", "tp1"]
    assert pieces[0].start == 0 and pieces[0].stop == pieces[1].start
    assert pieces[1].stop == spec.canonical_shapes()[EMBED][0] * spec.hidden_size
    # fused, replicated and column-split tensors are routed whole
    for name in (
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    ):
        assert row_pieces(name, trainer_layout=tl, receiver_layout=rl) is None
    assert row_pieces(EMBED, trainer_layout=tl, receiver_layout=rl, world_size=2) is None


def test_routing_piece_by_piece_equals_routing_the_parameter_whole() -> None:
    _, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=1001)
    params = {n: p.detach() for n, p in build_model(tiny_qwen3(vocab_size=1001)).named_parameters()}
    emb = params[EMBED]
    g = torch.Generator().manual_seed(5)
    idx = torch.nonzero(torch.rand(emb.numel(), generator=g) < 0.05).reshape(-1)
    whole = shard_updates({EMBED: idx}, params, trainer_layout=tl, receiver_layout=rl)
    pieces = row_pieces(EMBED, trainer_layout=tl, receiver_layout=rl)
    assert pieces is not None
    pos = Positions.of(idx)
    got: dict[str, list] = {}
    bounds = [p.start for p in pieces] + [pieces[-1].stop]
    for piece, part in zip(pieces, pos.ranges(bounds), strict=True):
        vals = emb.reshape(-1)[part].to(torch.bfloat16)
        for shard, ups in piece_updates(EMBED, piece, part, vals, receiver_layout=rl).items():
            got.setdefault(shard, []).extend(ups)
    for shard, ups in whole.items():
        assert len(got.get(shard, [])) == len(ups)
        for a, b in zip(got.get(shard, []), ups, strict=True):
            assert (a.name, a.shape, a.dtype) == (b.name, b.shape, b.dtype)
            assert torch.equal(a.indices, b.indices)
            assert bits_equal(a.values, b.values)


@pytest.mark.parametrize("size", [1, 97, 1 << 16])
def test_pieces_written_slice_by_slice_give_the_blob_bytes_of_pieces_routed_whole(size) -> None:
    _, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=1001)
    params = {n: p.detach() for n, p in build_model(tiny_qwen3(vocab_size=1001)).named_parameters()}
    emb = params[EMBED]
    pieces = row_pieces(EMBED, trainer_layout=tl, receiver_layout=rl)
    assert pieces is not None
    g = torch.Generator().manual_seed(7)
    # dense rows, sparse rows and an empty stretch: gaps of every width across the slices
    keep = torch.rand(emb.numel(), generator=g) < 0.05
    keep[: emb.shape[1] * 3] = True
    keep[emb.numel() // 2 - 5000 : emb.numel() // 2 + 9000] = False
    pos = Positions.of(torch.nonzero(keep).reshape(-1))

    def blobs(routed) -> list[tuple[str, bytes]]:
        return [
            (shard, encode_blob(ups, version=2, base_version=1, shard=shard, writer="w0"))
            for updates in routed
            for shard, ups in updates.items()
        ]

    whole = blobs(routed_pieces(EMBED, pos, emb, pieces, receiver_layout=rl))
    sliced = blobs(parted_pieces(EMBED, pos, emb, pieces, receiver_layout=rl, size=size))
    assert [s for s, _ in whole] == ["tp0", "tp1"]
    assert sliced == whole
    # detection's values handed over: sliced by ordinal, the parameter itself never read
    given = emb.reshape(-1)[pos.indices()].to(torch.bfloat16)
    unread = torch.full_like(emb, float("nan"))
    handed = parted_pieces(EMBED, pos, unread, pieces, receiver_layout=rl, size=size, values=given)
    assert blobs(handed) == whole
    with pytest.raises(ConfigError, match="values"):
        next(parted_pieces(EMBED, pos, emb, pieces, receiver_layout=rl, values=given[1:]))


def test_a_piece_with_several_targets_gives_each_the_bytes_of_routing_it_whole() -> None:
    # A replicated piece (two shards) and a piece feeding two tensors of one shard: each
    # target's parts walk the piece again, behind the cursor, and still give its whole update.
    _, _, rl = tiny_layouts("vllm", tp=2, vocab_size=1000)
    emb = build_model(tiny_qwen3(vocab_size=1000)).get_parameter(EMBED).detach()
    half = emb.numel() // 2
    shape = (emb.shape[0] // 2, emb.shape[1])
    pieces = (
        RowPiece(start=0, stop=half, targets=(("tp0", "a", 0, shape), ("tp1", "a", 0, shape))),
        RowPiece(
            start=half,
            stop=emb.numel(),
            targets=(("tp0", "b", -half, shape), ("tp0", "c", 7 - half, (shape[0] + 1, shape[1]))),
        ),
    )
    g = torch.Generator().manual_seed(8)
    pos = Positions.of(torch.nonzero(torch.rand(emb.numel(), generator=g) < 0.1).reshape(-1))

    def blobs(routed) -> list[bytes]:
        return [
            encode_blob(ups, version=2, base_version=1, shard=shard, writer="w0")
            for updates in routed
            for shard, ups in updates.items()
        ]

    whole = blobs(routed_pieces(EMBED, pos, emb, pieces, receiver_layout=rl))
    assert len(whole) == 3
    assert blobs(parted_pieces(EMBED, pos, emb, pieces, receiver_layout=rl, size=333)) == whole
    given = emb.reshape(-1)[pos.indices()].to(torch.bfloat16)
    unread = torch.full_like(emb, float("nan"))
    handed = parted_pieces(EMBED, pos, unread, pieces, receiver_layout=rl, size=333, values=given)
    assert blobs(handed) == whole  # walks behind the cursor keep their ordinals


def test_positions_outside_the_parameter_are_refused_before_a_piece_is_written() -> None:
    _, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=1001)
    params = {n: p.detach() for n, p in build_model(tiny_qwen3(vocab_size=1001)).named_parameters()}
    emb = params[EMBED]
    pieces = row_pieces(EMBED, trainer_layout=tl, receiver_layout=rl)
    assert pieces is not None
    pos = Positions.of(torch.tensor([3, 70, emb.numel(), emb.numel() + 5]))
    with pytest.raises(ConfigError, match="2 changed position"):
        next(parted_pieces(EMBED, pos, emb, pieces, receiver_layout=rl))


@pytest.mark.parametrize("pieces_from", [0, None], ids=["pieces", "whole"])
def test_a_publisher_fed_captured_positions_commits_the_exact_state(
    tmp_path, monkeypatch, pieces_from
) -> None:
    """Piece by piece (any changed count: forced here) or whole (a small parameter, under
    PIECES_FROM), the same exact state."""
    _, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=1001)
    if pieces_from is not None:
        monkeypatch.setattr(segments, "PIECES_FROM", pieces_from)
    routed_in_pieces = []
    route_pieces = segments.GroupRouter._route_pieces

    def spied(self, streams, name, *args, **kwargs):
        routed_in_pieces.append(name)
        return route_pieces(self, streams, name, *args, **kwargs)

    monkeypatch.setattr(segments.GroupRouter, "_route_pieces", spied)

    params = {n: p.detach() for n, p in build_model(tiny_qwen3(vocab_size=1001)).named_parameters()}
    pub = Publisher(
        LocalStore(str(tmp_path)),
        receiver_layout=rl,
        trainer_layout=tl,
        config=PublisherConfig(anchor_every=1000, session="t"),
    )
    pub.publish(0, [], params, anchor=True)
    g = torch.Generator().manual_seed(6)
    changes = []
    for name, p in params.items():
        idx = torch.nonzero(torch.rand(p.numel(), generator=g) < 0.1).reshape(-1)
        p.view(-1)[idx] += 0.01  # a new state at exactly these positions
        changes.append((name, Positions.of(idx), None))
    rep = pub.publish(1, changes, params)
    assert rep.kind == "delta"
    # the vocab-parallel embedding and LM head split into row pieces
    assert routed_in_pieces == ([EMBED, "lm_head.weight"] if pieces_from == 0 else [])
    manifest = pub.catalog.manifest(1)
    assert dict(manifest.shard_digests) == state_digests(
        params, trainer_layout=tl, receiver_layout=rl
    )
    pub.close()
    expected = expected_shards(params, tl, rl)
    for info in rl.shards():  # what the blobs carry, applied by a real receiver
        live = zero_tensors(rl, info.id)
        rx = Receiver.for_layout(
            pub.store, rl, info.id, live, str(tmp_path / f"rx-{info.id}"), rconfig(info.id)
        )
        assert rx.pull().version == 1
        assert_same_bits(live, expected[info.id], info.id)
