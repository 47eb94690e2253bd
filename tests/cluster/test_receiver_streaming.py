"""The in-cluster receiver reads a version one tensor at a time, streamed from the received
bytes or decoded and held within its budget, and both accept and refuse exactly the same
things: overlapping writers, incomplete anchors, digests that do not match, each refused with
every live element untouched; an anchor's unlisted elements are zero; a writer that lists its
tensors in another order still verifies against its part digest.

Payloads are built by hand with the real encoder (``encode_blob``) and envelope, so each test
controls exactly what every writer sends."""

from __future__ import annotations

import pytest
import torch
from kit import assert_same_bits, random_tensors, random_update, tiny_layouts

from deltasync import ClusterReceiver
from deltasync.cluster import RolePlan
from deltasync.cluster.cluster_journal import JournalState
from deltasync.cluster.envelope import pack_envelope
from deltasync.errors import BlobMismatchError, ConfigError, IntegrityError
from deltasync.format import TensorUpdate, apply_updates, encode_blob, merge_writers
from deltasync.layout.digest import state_digest
from deltasync.layout.part_digests import receiver_part_digests

SPEC, TRAINER, RECEIVERS = tiny_layouts(engine="vllm", tp=2)
PLAN = RolePlan.contiguous(num_writers=2, shards=["tp0", "tp1"])
ROLE = PLAN.receivers[0]
SPECS = RECEIVERS.local_specs(ROLE.shard)
BUDGETS = pytest.mark.parametrize("budget", [0, 1 << 30], ids=["streamed", "held"])


def _receiver(budget: int, *, version: int | None = 0, seed: int = 0) -> ClusterReceiver:
    tensors = random_tensors(SPECS, torch.Generator().manual_seed(seed))
    return ClusterReceiver(
        tensors,
        plan=PLAN,
        layout=RECEIVERS,
        rank=ROLE.rank,
        version=version,
        max_staged_bytes=budget,
    )


def _payload(
    per_writer: list[list[TensorUpdate]],
    *,
    version: int = 1,
    base: int = 0,
    digest: str | None = None,
    parts: dict[int, str] | None = None,
) -> dict[int, bytes]:
    out = {}
    for k, w in enumerate(PLAN.writers):
        blob = encode_blob(
            per_writer[k], version=version, base_version=base, shard=ROLE.shard, writer=w.writer_id
        )
        expected = parts[k] if parts is not None else digest
        out[w.rank] = pack_envelope([blob], state_digest=expected, part_digest=parts is not None)
    return out


def _split(gen: torch.Generator, density: float) -> list[list[TensorUpdate]]:
    """Two writers' disjoint updates of every tensor (even / odd listed positions)."""
    per_writer: list[list[TensorUpdate]] = [[], []]
    for name in SPECS:
        u = random_update(SPECS, name, gen, density)
        for k in range(2):
            idx, vals = u.indices[k::2], u.values[k::2]  # type: ignore[index]
            per_writer[k].append(
                TensorUpdate(name=name, shape=u.shape, dtype=u.dtype, indices=idx, values=vals)
            )
    return per_writer


def _after(tensors: dict[str, torch.Tensor], per_writer: list[list[TensorUpdate]]):
    out = {n: t.clone() for n, t in tensors.items()}
    apply_updates(merge_writers(1, per_writer), out)
    return out


def _refused_untouched(rec: ClusterReceiver, payload: dict[int, bytes], match: str) -> None:
    before = {n: t.clone() for n, t in rec.tensors.items()}
    state = rec.journal.state
    with pytest.raises(BlobMismatchError, match=match):
        rec.apply_payload(payload)
    assert_same_bits(rec.tensors, before, "after a refused version")
    assert rec.journal.state == state  # no apply was journaled


@BUDGETS
def test_both_ways_of_reading_a_delta_write_the_same_bits_and_report_the_same_elements(
    budget: int,
) -> None:
    rec = _receiver(budget)
    per_writer = _split(torch.Generator().manual_seed(1), 0.1)
    want = _after(rec.tensors, per_writer)
    report = rec.apply_payload(_payload(per_writer, digest=state_digest(want)))
    assert report.state_digest == state_digest(want)
    assert report.elements == sum(u.nnz for ups in per_writer for u in ups)
    assert_same_bits(rec.tensors, want, "after the delta")
    assert rec.journal.state == JournalState(committed=0, applying=(1, 0))


@BUDGETS
def test_two_writers_that_send_the_same_element_are_refused_before_any_write(budget: int) -> None:
    rec = _receiver(budget)
    per_writer = _split(torch.Generator().manual_seed(2), 0.1)
    last = per_writer[1][-1]  # writer 1 also sends writer 0's first element of that tensor
    first = next(u for u in per_writer[0] if u.name == last.name)
    idx = torch.cat([first.indices[:1], last.indices])  # type: ignore[index]
    vals = torch.cat([first.values[:1], last.values])
    idx, order = torch.sort(idx)
    per_writer[1][-1] = TensorUpdate(
        name=last.name, shape=last.shape, dtype=last.dtype, indices=idx, values=vals[order]
    )
    _refused_untouched(rec, _payload(per_writer), "two writers sent the same element")


@BUDGETS
def test_a_dense_update_next_to_another_writers_update_is_refused(budget: int) -> None:
    rec = _receiver(budget)
    per_writer = _split(torch.Generator().manual_seed(3), 0.1)
    name = per_writer[0][0].name
    spec = SPECS[name]
    per_writer[0][0] = TensorUpdate(
        name=name,
        shape=spec.shape,
        dtype=spec.dtype,
        indices=None,
        values=torch.randn(spec.shape).to(spec.dtype).reshape(-1),
    )
    _refused_untouched(rec, _payload(per_writer), "dense update and another update")


@BUDGETS
def test_an_anchor_leaving_a_tensor_out_is_refused_before_any_write(budget: int) -> None:
    rec = _receiver(budget, version=None)
    per_writer = _split(torch.Generator().manual_seed(4), 0.5)
    missing = per_writer[0][-1].name
    per_writer = [[u for u in ups if u.name != missing] for ups in per_writer]
    _refused_untouched(rec, _payload(per_writer, base=-1), f"no values for tensors.*{missing}")


@BUDGETS
def test_an_anchor_defines_the_whole_state_its_unlisted_elements_are_zero(budget: int) -> None:
    rec = _receiver(budget, version=None)  # random live values: none of them may survive
    per_writer = _split(torch.Generator().manual_seed(5), 0.3)
    want = _after({n: torch.zeros_like(t) for n, t in rec.tensors.items()}, per_writer)
    report = rec.apply_payload(_payload(per_writer, base=-1, digest=state_digest(want)))
    assert report.base == -1 and report.state_digest == state_digest(want)
    assert report.elements == sum(t.numel() for t in rec.tensors.values())
    assert_same_bits(rec.tensors, want, "after the anchor")


@BUDGETS
@pytest.mark.parametrize("reverse", [False, True], ids=["shard-order", "reverse-order"])
def test_part_digests_verify_whatever_order_the_writers_list_their_tensors_in(
    budget: int, reverse: bool
) -> None:
    rec = _receiver(budget)
    per_writer = _split(torch.Generator().manual_seed(6), 0.1)
    del per_writer[1][len(per_writer[1]) // 2]  # a tensor only one writer touches
    want = _after(rec.tensors, per_writer)
    parts = receiver_part_digests(want, layout=RECEIVERS, shard=ROLE.shard, count=2)
    sent = [list(reversed(ups)) for ups in per_writer] if reverse else per_writer
    rec.apply_payload(_payload(sent, parts=parts))
    assert_same_bits(rec.tensors, want, "after the delta")


@BUDGETS
def test_a_part_digest_that_does_not_match_refuses_the_version_with_nothing_written(
    budget: int,
) -> None:
    rec = _receiver(budget)
    per_writer = _split(torch.Generator().manual_seed(7), 0.1)
    want = _after(rec.tensors, per_writer)
    parts = receiver_part_digests(want, layout=RECEIVERS, shard=ROLE.shard, count=2)
    parts[0] = "0" * 32
    before = {n: t.clone() for n, t in rec.tensors.items()}
    with pytest.raises(IntegrityError, match=r"writers \['w00000'\]"):
        rec.apply_payload(_payload(per_writer, parts=parts))
    assert_same_bits(rec.tensors, before, "after a refused version")
    assert rec.journal.state.dirty and rec.journal.state.applying is None


@pytest.mark.parametrize("budget", [-1, 1.5, "4MiB"])
def test_a_staging_budget_that_is_not_a_byte_count_is_refused_naming_the_field(
    budget: object,
) -> None:
    with pytest.raises(ConfigError, match="max_staged_bytes"):
        _receiver(budget)  # type: ignore[arg-type]


def test_a_target_whose_elements_share_memory_is_refused_before_any_sync() -> None:
    tensors = random_tensors(SPECS, torch.Generator().manual_seed(8))
    name, spec = next((n, s) for n, s in SPECS.items() if len(s.shape) == 2)
    tensors[name] = torch.zeros(spec.shape[1], dtype=spec.dtype).expand(spec.shape)
    with pytest.raises(ConfigError, match=rf"{name}.*share memory"):
        ClusterReceiver(tensors, plan=PLAN, layout=RECEIVERS, rank=ROLE.rank, version=0)


@BUDGETS
def test_a_live_tensor_freed_after_construction_is_refused_before_any_write(budget: int) -> None:
    # checked only at construction before: an anchor's scatter wrote every tensor before the
    # freed one, then failed on it
    rec = _receiver(budget, version=None)
    per_writer = _split(torch.Generator().manual_seed(6), 0.3)
    want = _after({n: torch.zeros_like(t) for n, t in rec.tensors.items()}, per_writer)
    victim = list(SPECS)[-1]  # the last tensor the scatter writes
    rec.tensors[victim].untyped_storage().resize_(0)
    before = {n: t.clone() for n, t in rec.tensors.items() if n != victim}
    state = rec.journal.state
    with pytest.raises(ConfigError, match=rf"{victim!r} does not lie inside its storage"):
        rec.apply_payload(_payload(per_writer, base=-1, digest=state_digest(want)))
    assert_same_bits({n: rec.tensors[n] for n in before}, before, "after a refused version")
    assert rec.journal.state == state  # no apply was journaled


def test_a_list_of_tensors_or_a_number_for_the_journal_is_refused_naming_it(tmp_path) -> None:
    # a ValueError from dict() and a TypeError from Path() before
    tensors = random_tensors(SPECS, torch.Generator().manual_seed(0))
    args = {"plan": PLAN, "layout": RECEIVERS, "rank": ROLE.rank, "version": 0}
    with pytest.raises(ConfigError, match=r"ClusterReceiver\.tensors must be a Mapping, got list"):
        ClusterReceiver(list(tensors.values()), **args)
    with pytest.raises(ConfigError, match=r"journal_path must be a str or PathLike, got int"):
        ClusterReceiver(tensors, journal_path=5, **args)
    ClusterReceiver(tensors, journal_path=tmp_path / "journal.json", **args)
