"""Pure planning: tracker output -> shard updates, folding chains, checking chains, retention,
manifests built from markers, config validation. No store, no processes."""

from __future__ import annotations

import pytest
import torch

from deltasync import names
from deltasync.commit import BlobEntry, Manifest, WriterMarker, plan_deletions
from deltasync.commit.committer import build_manifest
from deltasync.errors import BaseVersionMismatchError, ConfigError, ManifestError
from deltasync.format import merge_writers
from deltasync.layout import fsdp_dim0_rows
from deltasync.layout.routing import shard_updates
from deltasync.publish import PublisherConfig
from deltasync.receiver.staging import check_chain

from sync_kit import TinyTrainer, expected_shards, layouts

BF = torch.bfloat16


def _dense(updates):
    return {u.name: u for u in updates}


def test_q_k_v_changes_land_in_one_sorted_qkv_update_with_current_values():
    spec, tl, rl = layouts()
    tr = TinyTrainer(spec)
    p = "model.layers.0.self_attn."
    changed = {
        p + "q_proj.weight": torch.tensor([5, 40 * 64], dtype=torch.int64),  # heads 0 and 2
        p + "k_proj.weight": torch.tensor([3, 16 * 64 + 3], dtype=torch.int64),  # kv heads 0, 1
        p + "v_proj.weight": torch.tensor([1000], dtype=torch.int64),
    }
    ups = shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl)
    expected = expected_shards(tr.params, tl, rl)
    for shard in ("tp0", "tp1"):
        by_name = _dense(ups[shard])
        qkv = by_name.get("model.layers.0.self_attn.qkv_proj.weight")
        assert qkv is not None
        idx = qkv.indices
        assert bool((idx[1:] > idx[:-1]).all()), "indices must come out sorted"
        want = expected[shard][qkv.name].reshape(-1)[idx]
        assert torch.equal(qkv.values.view(torch.int16), want.view(torch.int16))
    # TP=2: q heads 0-1, kv head 0 on tp0; q heads 2-3, kv head 1 on tp1
    assert {s: sum(u.nnz for u in ups[s]) for s in ups} == {"tp0": 3, "tp1": 2}


def test_values_are_the_round_to_nearest_even_bf16_of_the_fp32_master_never_differences():
    spec, tl, rl = layouts(engine="hf", tp=1)
    tr = TinyTrainer(spec)
    name = "model.norm.weight"
    with torch.no_grad():
        # 1 + 2^-8 is a BF16 tie: RNE rounds it to 1.0; 1 + 3*2^-9 rounds up to 1 + 2^-7
        tr.params[name][0] = 1.0 + 2.0**-8
        tr.params[name][1] = 1.0 + 3 * 2.0**-9
    changed = {name: torch.tensor([0, 1])}
    ups = shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl)
    (u,) = ups["tp0"]
    assert u.values.tolist() == [1.0, 1.0 + 2.0**-7]


def test_fsdp_writer_shards_merged_equal_one_writer_holding_everything():
    spec, tl, rl = layouts()
    tr = TinyTrainer(spec, density=0.3)
    tr.step()
    gen = torch.Generator().manual_seed(1)
    changed = {
        n: torch.nonzero(torch.rand(p.numel(), generator=gen) < 0.1).reshape(-1)
        for n, p in tr.params.items()
    }
    whole = shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl)
    world = 3
    per_writer = []
    for rank in range(world):
        local_params, local_changed = {}, {}
        for n, p in tr.params.items():
            start, stop = fsdp_dim0_rows(p.shape[0], rank, world)
            local_params[n] = p.detach()[start:stop]
            row = p[0].numel() if p.dim() > 1 else 1
            idx = changed[n]
            keep = (idx >= start * row) & (idx < stop * row)
            local_changed[n] = idx[keep] - start * row
        per_writer.append(
            shard_updates(
                local_changed,
                local_params,
                trainer_layout=tl,
                receiver_layout=rl,
                rank=rank,
                world_size=world,
            )
        )
    for shard in whole:
        merged = _dense(merge_writers(1, [w[shard] for w in per_writer]))
        single = _dense(whole[shard])
        assert merged.keys() == single.keys()
        for n, u in single.items():
            assert torch.equal(merged[n].indices, u.indices), n
            assert torch.equal(merged[n].values.view(torch.int16), u.values.view(torch.int16)), n


def _manifest(version, kind="delta", base=None, shards=("tp0",)):
    return Manifest(
        version=version,
        base_version=base if kind == "delta" else None,
        kind=kind,
        format_version=1,
        created_at=1.0,
        writers=("w00000",),
        blobs=(),
        shard_digests={s: "0" * 32 for s in shards},
        run_id="run0",
        base_digests={s: "0" * 32 for s in shards} if kind == "delta" else {},
    )


def test_a_chain_must_start_at_the_local_version_or_an_anchor_and_be_contiguous():
    check_chain([_manifest(4, base=3), _manifest(5, base=4)], 3, "tp0")
    check_chain([_manifest(4, kind="anchor"), _manifest(5, base=4)], None, "tp0")
    with pytest.raises(BaseVersionMismatchError, match="hold version 2"):
        check_chain([_manifest(4, base=3)], 2, "tp0")
    with pytest.raises(BaseVersionMismatchError, match="no verified version"):
        check_chain([_manifest(4, base=3)], None, "tp0")
    with pytest.raises(BaseVersionMismatchError, match="hold version 4"):
        check_chain([_manifest(4, base=3), _manifest(6, base=5)], 3, "tp0")
    with pytest.raises(ManifestError, match="another layout"):
        check_chain([_manifest(4, base=3, shards=("tp1",))], 3, "tp0")


def _entry(v, shard="tp0", writer="w00000"):
    return BlobEntry(
        shard=shard, writer=writer, key=names.blob_key(v, shard, writer), size=10, digest="1" * 64
    )


def test_the_manifest_lists_every_writers_blobs_and_needs_every_marker():
    markers = [
        WriterMarker(
            version=7, writer="w00000-s", blobs=(_entry(7, "tp1", "w00000-s"),), created_at=1.0
        ),
        WriterMarker(version=7, writer="w00001-s", blobs=(), created_at=1.0),
    ]
    m = build_manifest(
        version=7,
        kind="delta",
        base_version=6,
        writers=["w00000-s", "w00001-s"],
        markers=markers,
        shard_digests={"tp0": "a" * 32, "tp1": "b" * 32},
        created_at=2.0,
        run_id="run0",
        base_digests={"tp0": "c" * 32, "tp1": "d" * 32},
    )
    assert [b.key for b in m.blobs] == ["v00000007/tp1/w00000-s.blob"]
    assert m.writers == ("w00000-s", "w00001-s")
    with pytest.raises(ManifestError, match="markers from"):
        build_manifest(
            version=7,
            kind="delta",
            base_version=6,
            writers=["w00000-s", "w00001-s"],
            markers=markers[:1],
            shard_digests={"tp0": "a" * 32, "tp1": "b" * 32},
            created_at=2.0,
            run_id="run0",
        )


def test_retention_keeps_what_live_receivers_need_and_deletes_manifests_first():
    ms = {v: _manifest(v, base=v - 1) for v in range(1, 9)}
    ms[0] = _manifest(0, kind="anchor")
    ms[5] = _manifest(5, kind="anchor")
    keys = {v: [names.manifest_key(v), names.blob_key(v, "tp0", "w00000")] for v in ms}
    keys[3].append(names.blob_key(3, "tp0", "w00000-lost"))  # orphan of a losing attempt
    keys[9] = [names.blob_key(9, "tp0", "w00000")]  # in flight: newer than committed, no manifest
    keys[2].append(names.writer_marker_key(2, "w00000"))
    keys[2].append(names.writer_claim_key(2, "w00000"))
    # a kept version: its writers' claims stay (one deleted let a second process running as
    # that writer claim the version and overwrite its committed blobs); a claim of a writer
    # its manifest does not name is a losing attempt's
    keys[7] += [names.writer_claim_key(7, "w00000"), names.writer_claim_key(7, "w00009")]
    keys[9].append(names.writer_claim_key(9, "w00000"))
    plan = plan_deletions(
        version_keys=keys,
        manifests=ms,
        ack_keys={1: ["acks/v00000001/r.json"]},
        committed=8,
        live_versions=[6],
        keep_versions=1,
    )
    assert plan.versions == (0, 1, 2, 3, 4)
    assert names.writer_claim_key(2, "w00000") in plan.keys
    assert names.writer_claim_key(7, "w00009") in plan.keys
    assert names.writer_claim_key(7, "w00000") not in plan.keys
    assert names.manifest_key(7) not in plan.keys
    manifest_keys = [k for k in plan.keys if k.endswith("MANIFEST.json")]
    assert plan.keys[: len(manifest_keys)] == tuple(manifest_keys), "manifests go first"
    assert "acks/v00000001/r.json" in plan.keys
    assert not any(k.startswith("v00000009/") for k in plan.keys)
    # a live receiver holding 2 needs 3..8 (the chain through deltas): only 0..2 may go
    plan = plan_deletions(
        version_keys=keys,
        manifests=ms,
        ack_keys={},
        committed=8,
        live_versions=[2],
        keep_versions=1,
    )
    assert plan.versions == (0, 1, 2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_writers=0), "num_writers"),
        (dict(writer_rank=2, num_writers=2, session="s"), "writer_rank"),
        (dict(num_writers=2), "session"),
        (dict(anchor_every=0), "anchor_every"),
        (dict(signing_key=b"short"), "signing_key"),
        (dict(marker_timeout_s=float("nan")), "marker_timeout_s"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(prefetch=-1), "prefetch"),
        (dict(orphan_grace_s=-1.0), "orphan_grace_s"),
        (dict(orphan_grace_s=float("inf")), "orphan_grace_s"),
        (dict(session="run/42"), r"PublisherConfig.session 'run/42'"),  # was a ManifestError
        (dict(session="a" * 122), r"at most 121 characters"),
    ],
)
def test_publisher_config_rejects_bad_fields_naming_them(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        PublisherConfig(**kwargs)
    assert PublisherConfig(session="a" * 121).session == "a" * 121


@pytest.mark.parametrize("engine, tp", [("vllm", 2), ("hf", 1)])
def test_digests_hashed_from_canonical_tensors_equal_digests_of_the_split_shards(engine, tp):
    from deltasync.layout.digest import shard_digests, state_digests
    from deltasync.layout.routing import full_shard_tensors

    spec, tl, rl = layouts(engine=engine, tp=tp)
    tr = TinyTrainer(spec)
    tr.step()
    kw = dict(trainer_layout=tl, receiver_layout=rl)
    assert state_digests(tr.params, **kw) == shard_digests(full_shard_tensors(tr.params, **kw))


def test_values_captured_by_the_tracker_give_the_same_updates_and_bad_ones_are_refused():
    spec, tl, rl = layouts()
    tr = TinyTrainer(spec)
    g = torch.Generator().manual_seed(5)
    changed = {
        n: torch.nonzero(torch.rand(p.numel(), generator=g) < 0.05).reshape(-1)
        for n, p in tr.params.items()
    }
    values = {n: tr.params[n].reshape(-1)[i].to(BF) for n, i in changed.items()}
    plain = shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl)
    given = shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl, values=values)
    assert plain.keys() == given.keys()
    for shard in plain:
        assert [u.name for u in plain[shard]] == [u.name for u in given[shard]]
        for a, b in zip(plain[shard], given[shard], strict=False):
            assert torch.equal(a.indices, b.indices)
            assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
    name = next(iter(changed))
    short = dict(values, **{name: values[name][:-1]})
    with pytest.raises(ConfigError, match=f"values\\[{name!r}\\] holds"):
        shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl, values=short)
    fp32 = dict(values, **{name: values[name].float()})
    with pytest.raises(ConfigError, match="must be a BF16 tensor"):
        shard_updates(changed, tr.params, trainer_layout=tl, receiver_layout=rl, values=fp32)
    unsorted = dict(changed, **{name: changed[name].flip(0)})
    with pytest.raises(ConfigError, match="not strictly increasing"):
        shard_updates(unsorted, tr.params, trainer_layout=tl, receiver_layout=rl)


def test_cluster_config_rejects_zero_encode_threads():
    from deltasync.cluster.roles import ClusterConfig

    with pytest.raises(ConfigError, match="encode_threads"):
        ClusterConfig(encode_threads=0)
