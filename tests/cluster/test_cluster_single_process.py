"""The sender's payloads applied by receivers in one process, with no process group: the data
path (detect, route, encode, frame; unwrap, verify, decode, merge, journal, apply, digest) and
every refusal that must leave the live tensors bitwise untouched."""

from __future__ import annotations

import pytest
import torch
from kit import bits, tiny_layouts

from deltasync.cluster import (
    AnchorRequiredError,
    ClusterConfig,
    ClusterReceiver,
    EnvelopeError,
    RolePlan,
    cluster_receiver,
)
from deltasync.cluster.cluster_journal import ClusterJournal, JournalState
from deltasync.cluster.envelope import flatten, pack_envelope
from deltasync.errors import (
    BaseVersionMismatchError,
    DigestMismatchError,
    FormatError,
    IntegrityError,
    VersionError,
)
from deltasync.layout import ReceiverLayout, TrainerLayout
from deltasync.receiver import MissingBlobError

from cluster_testkit import one_process_roles

SPEC, TRAINER, RECEIVERS = tiny_layouts(engine="vllm", tp=2)


class World:
    """Writers (FSDP dim-0 halves of one fp32 model, exact snapshot trackers) and receivers
    (two TP shards x ``replicas``), exchanging payloads by hand."""

    def __init__(
        self,
        *,
        writers: int = 1,
        replicas: int = 1,
        mode: str = "direct",
        digest_every: int = 0,
        full_state: bool = True,
        layouts: tuple[TrainerLayout, ReceiverLayout] = (TRAINER, RECEIVERS),
    ) -> None:
        self.trainer_layout, self.receiver_layout = layouts
        g = torch.Generator().manual_seed(0)
        self.full = {
            n: torch.randn(s, generator=g) * 0.05
            for n, s in self.trainer_layout.param_shapes().items()
        }
        self.gen = torch.Generator().manual_seed(1)
        self.plan = RolePlan.contiguous(
            num_writers=writers,
            shards=[s.id for s in self.receiver_layout.shards()],
            replicas=replicas,
            dp_mode=mode,
        )
        config = ClusterConfig(digest_every=digest_every)
        self.senders, self.receivers = one_process_roles(
            self.full,
            self.plan,
            config,
            trainer_layout=self.trainer_layout,
            receiver_layout=self.receiver_layout,
            full_state=full_state,
        )

    def step(self, fraction: float = 0.02) -> None:
        """Move a random ``fraction`` of every param by a BF16-visible amount."""
        for p in self.full.values():
            mask = torch.rand(p.shape, generator=self.gen) < fraction
            p.add_(mask * 0.01)

    def payloads(self, version: int, *, anchor: bool = False) -> dict[int, dict[int, bytes]]:
        """``{receiver rank: {source rank: payload}}`` as the exchange(s) would deliver them."""
        inbox: dict[int, dict[int, bytes]] = {r: {} for r in self.receivers}
        for s in self.senders:
            out = s.payloads_for_version(version, anchor=anchor)
            s.mark_sent(out)  # as sync() does once the preflight passed
            for dst, payload in out.payloads.items():
                inbox[dst][s.rank] = payload
        for rank in self.receivers:  # the forward exchange, as ClusterReceiver.receive builds it
            for target in self.plan.forward_targets(rank):
                got = inbox[rank]
                inbox[target] = {rank: pack_envelope([got[s] for s in sorted(got)], nested=True)}
        return inbox

    def commit(self, version: int, applied: dict[int, object]) -> None:
        """What a positive joint commit does on every rank."""
        for s in self.senders:
            s.tracker.clear()
            s.version = version
            s._pending, s._pending_anchor = {}, False  # what a positive joint commit drops
        for rank in applied:
            self.receivers[rank].journal.commit(version)

    def sync(self, version: int, *, anchor: bool = False) -> None:
        inbox = self.payloads(version, anchor=anchor)
        reports = {r: self.receivers[r].apply_payload(inbox[r]) for r in self.receivers}
        self.commit(version, reports)

    def mismatches(self) -> list[tuple[int, str]]:
        bf16 = {n: p.to(torch.bfloat16) for n, p in self.full.items()}
        truth = self.receiver_layout.split(self.trainer_layout.to_canonical(bf16))
        out = []
        for rank, rec in self.receivers.items():
            for n, t in rec.tensors.items():
                if not torch.equal(bits(t), bits(truth[rec.shard][n])):
                    out.append((rank, n))
        return out

    def snapshot(self) -> dict[int, dict[str, torch.Tensor]]:
        return {
            r: {n: t.clone() for n, t in rec.tensors.items()} for r, rec in self.receivers.items()
        }

    def unchanged_since(self, snap: dict[int, dict[str, torch.Tensor]]) -> bool:
        return all(
            torch.equal(bits(t), bits(snap[r][n]))
            for r, rec in self.receivers.items()
            for n, t in rec.tensors.items()
        )


@pytest.mark.parametrize("writers", [1, 2])
def test_a_shard_holding_only_vocabulary_padding_takes_the_anchor_as_zeros(writers: int) -> None:
    # vLLM pads 65 tokens to 128 rows: at TP=4, tp3's 32 rows are all padding. The sender's
    # anchor is routed from the trainer's elements, none of which lands there: tp3 still gets
    # a record for the tensor (empty: zeros), or it would refuse every anchor as incomplete.
    _spec, tl, rl = tiny_layouts(engine="vllm", tp=4, vocab_size=65)
    assert "model.embed_tokens.weight" in rl.table.uncovered("tp3")
    world = World(writers=writers, layouts=(tl, rl))
    for rec in world.receivers.values():
        for t in rec.tensors.values():
            t.fill_(1.0)  # stale bits: the anchor defines every element, padding included
    world.sync(0, anchor=True)
    assert world.mismatches() == []
    world.step()
    world.sync(1)
    assert world.mismatches() == []


@pytest.mark.parametrize(
    ("writers", "replicas", "mode"),
    [(1, 1, "direct"), (2, 1, "direct"), (2, 2, "forward"), (1, 3, "direct")],
)
def test_an_anchor_then_deltas_leave_every_receiver_bit_identical_to_a_dense_split(
    writers: int, replicas: int, mode: str
) -> None:
    world = World(writers=writers, replicas=replicas, mode=mode, digest_every=2)
    world.sync(0, anchor=True)
    assert world.mismatches() == []
    for v in range(1, 5):
        world.step()
        world.sync(v)
        assert world.mismatches() == [], v
    assert {r.version for r in world.receivers.values()} == {4}


def test_two_fsdp_writers_send_disjoint_halves_that_merge_into_one_writers_state() -> None:
    one, two = World(writers=1), World(writers=2)
    for world in (one, two):
        world.sync(0, anchor=True)
        world.step()
        world.sync(1)
    by_shard = {r.shard: r.tensors for r in two.receivers.values()}
    for rec in one.receivers.values():
        a, b = rec.tensors, by_shard[rec.shard]
        assert all(torch.equal(bits(a[n]), bits(b[n])) for n in a)
    sizes = [s.payloads_for_version(2).shard_bytes["tp0"] for s in two.senders]
    assert all(n > 0 for n in sizes)


def test_a_delta_on_the_wrong_base_is_refused_before_any_write() -> None:
    world = World()
    world.sync(0, anchor=True)
    world.step()
    world.sync(1)
    world.step()
    stale = world.payloads(2)
    world.senders[0].version = 0  # a trainer that lost track: base 0 while receivers hold 1
    wrong = world.payloads(2)
    before = world.snapshot()
    for rank, rec in world.receivers.items():
        with pytest.raises(BaseVersionMismatchError, match="holds version 1"):
            rec.apply_payload(wrong[rank])
        assert rec.journal.state == JournalState(committed=1)
    assert world.unchanged_since(before)
    for rank, rec in world.receivers.items():  # the right payload still applies afterwards
        rec.apply_payload(stale[rank])


def test_a_delta_to_a_receiver_holding_nothing_asks_for_an_anchor() -> None:
    world = World()
    world.senders[0].version = 0  # pretends receivers hold version 0
    inbox = world.payloads(1)
    rec = world.receivers[1]
    with pytest.raises(AnchorRequiredError, match="anchor"):
        rec.apply_payload(inbox[1])
    assert all(int(t.abs().sum()) == 0 for t in rec.tensors.values())


def test_the_first_sync_of_a_sender_must_be_an_anchor_and_versions_must_grow() -> None:
    world = World()
    with pytest.raises(AnchorRequiredError):
        world.senders[0].payloads_for_version(0)
    world.sync(0, anchor=True)
    with pytest.raises(VersionError, match="not after the committed version 0"):
        world.senders[0].payloads_for_version(0)


def test_a_corrupted_payload_raises_the_storage_paths_error_and_writes_nothing() -> None:
    world = World(writers=2)
    world.sync(0, anchor=True)
    world.step()
    inbox = world.payloads(1)
    damaged = bytearray(inbox[2][1])
    damaged[-40] ^= 0x01  # inside writer 1's blob for tp1
    before = world.snapshot()
    with pytest.raises(DigestMismatchError):
        world.receivers[2].apply_payload({0: inbox[2][0], 1: bytes(damaged)})
    assert world.unchanged_since(before)
    assert world.receivers[2].journal.state == JournalState(committed=0)


def test_a_missing_writer_or_an_unexpected_source_is_refused() -> None:
    world = World(writers=2)
    world.sync(0, anchor=True)
    inbox = world.payloads(1, anchor=True)
    with pytest.raises(MissingBlobError, match=r"no payload from ranks \[1\]"):
        world.receivers[2].apply_payload({0: inbox[2][0]})
    with pytest.raises(EnvelopeError, match="does not name"):
        world.receivers[2].apply_payload({**inbox[2], 3: inbox[3][0]})


def test_a_state_that_does_not_match_the_trainers_digest_goes_dirty_until_an_anchor() -> None:
    world = World(digest_every=1)
    world.sync(0, anchor=True)
    world.step()
    inbox = world.payloads(1)
    rec = world.receivers[1]
    name = next(iter(rec.tensors))
    rec.tensors[name].view(-1)[-1] += 1  # drift outside what any delta rewrites
    before = world.snapshot()
    with pytest.raises(IntegrityError, match=r"Refused before any write.*only an anchor"):
        rec.apply_payload(inbox[1])
    assert world.unchanged_since(before)  # verified before the first live write
    assert rec.journal.state.dirty and rec.journal.state.applying is None
    with pytest.raises(AnchorRequiredError, match="dirty"):
        rec.apply_payload(inbox[1])
    anchor = world.payloads(1, anchor=True)
    for rank, r in world.receivers.items():
        r.apply_payload(anchor[rank])
    world.commit(1, world.receivers)
    assert world.mismatches() == [] and not rec.journal.state.dirty


def _journal_on_disk(path) -> tuple[World, ClusterReceiver, dict[int, dict[int, bytes]]]:
    """A world at version 0 whose receiver 1 records its journal in the file ``path``, that
    receiver, and version 1's payloads."""
    world = World(digest_every=1)
    world.sync(0, anchor=True)
    rec = world.receivers[1]
    rec.journal = ClusterJournal(version=0, path=path)
    world.step()
    return world, rec, world.payloads(1)


def test_a_verify_that_raises_puts_back_the_journal_recorded_meanwhile(
    tmp_path, monkeypatch
) -> None:
    # The apply's record is written while verify runs (its fsyncs overlap the hashing); a
    # verify that raises (here a record refused by its own check) leaves the file as it was.
    world, rec, inbox = _journal_on_disk(tmp_path / "journal.json")

    def refused(*_args, **_kwargs):
        raise FormatError("a record refused on purpose")

    monkeypatch.setattr(cluster_receiver, "state_digest_after", refused)
    before = world.snapshot()
    with pytest.raises(FormatError, match="on purpose"):
        rec.apply_payload(inbox[1])
    assert world.unchanged_since(before)
    assert rec.journal.state == JournalState(committed=0)
    assert ClusterJournal(version=None, path=tmp_path / "journal.json").state == rec.journal.state
    monkeypatch.undo()
    report = rec.apply_payload(inbox[1])  # the same payload applies afterwards
    assert report.version == 1 and rec.journal.state.applying == (1, 0)


def test_a_diverged_state_is_marked_dirty_on_disk_after_the_apply_recorded_meanwhile(
    tmp_path,
) -> None:
    world, rec, inbox = _journal_on_disk(tmp_path / "journal.json")
    name = next(iter(rec.tensors))
    rec.tensors[name].view(-1)[-1] += 1  # drift outside what any delta rewrites
    before = world.snapshot()
    with pytest.raises(IntegrityError, match="only an anchor"):
        rec.apply_payload(inbox[1])
    assert world.unchanged_since(before)
    on_disk = ClusterJournal(version=None, path=tmp_path / "journal.json").state
    assert on_disk == rec.journal.state and on_disk.dirty and on_disk.applying is None


def test_several_writers_without_the_full_state_send_part_digests_that_catch_drift() -> None:
    world = World(writers=2, digest_every=1, full_state=False)
    world.sync(0, anchor=True)
    world.step()
    world.sync(1)
    assert world.mismatches() == []
    world.step()
    inbox = world.payloads(2)
    rec = world.receivers[2]
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: rows split by the writers
    rec.tensors[name].view(torch.int16)[-1, 0] ^= 1  # drift in the last rows: writer 1's part
    before = world.snapshot()
    with pytest.raises(IntegrityError, match=r"writers \['w00001'\]"):
        rec.apply_payload(inbox[2])
    assert world.unchanged_since(before)  # verified before the first live write
    assert rec.journal.state.dirty and rec.version is None


def test_a_writer_that_sends_no_part_digest_beside_one_that_does_is_refused_unwritten() -> None:
    # Its part went unchecked: a drift there was written and committed unseen.
    world = World(writers=2, digest_every=1, full_state=False)
    world.sync(0, anchor=True)
    world.step()
    inbox = world.payloads(1)
    rec = world.receivers[2]
    ((blob, digest, part),) = flatten(inbox[2][1], where="test")
    assert digest is not None and part  # writer 1's part digest, dropped below
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: rows split by the writers
    rec.tensors[name].view(torch.int16)[-1, 0] ^= 1  # drift in writer 1's part
    before = world.snapshot()
    with pytest.raises(EnvelopeError, match=r"writers \['w00001'\] did not") as info:
        rec.apply_payload({0: inbox[2][0], 1: pack_envelope([blob])})
    assert "version 1" in str(info.value) and "digest_every" in str(info.value)
    assert world.unchanged_since(before)
    state = rec.journal.state
    assert (state.committed, state.applying, state.dirty) == (0, None, False)


@pytest.mark.parametrize("writers", [1, 2])
def test_a_retry_resends_what_an_aborted_attempt_sent_even_where_it_went_back_to_base(
    writers: int,
) -> None:
    world = World(writers=writers)
    world.sync(0, anchor=True)
    world.step()
    world.sync(1)
    base = {n: p.clone() for n, p in world.full.items()}
    world.step()
    attempt = world.payloads(2)
    applied = world.receivers[writers]  # tp0 applies the attempt; tp1 fails: nothing commits
    applied.apply_payload(attempt[applied.rank])
    world.step()  # training goes on before the retry
    reverted = 0
    for n, p in world.full.items():  # and some elements the attempt moved go back to base
        moved = torch.nonzero(p.to(torch.bfloat16) != base[n].to(torch.bfloat16)).reshape(-1)
        flat = p.view(-1)
        flat[moved[::3]] = base[n].view(-1)[moved[::3]]
        reverted += int(moved[::3].numel())
    assert reverted > 0
    assert applied.version is None  # it holds the attempt, not version 1
    world.sync(2)  # the retry
    assert world.mismatches() == []
    assert sum(s.pending_elements for s in world.senders) == 0  # dropped at the commit


def test_an_uncommitted_anchor_attempt_makes_the_retry_an_anchor() -> None:
    world = World()
    world.sync(0, anchor=True)
    world.step()
    sender = world.senders[0]
    sender.mark_sent(sender.payloads_for_version(1, anchor=True))
    assert sender._pending_anchor


def test_a_version_without_changes_still_sends_one_empty_blob_per_writer_and_commits() -> None:
    world = World(writers=2, replicas=2, mode="forward")
    world.sync(0, anchor=True)
    inbox = world.payloads(1)  # nothing trained since the anchor
    reports = {r: rec.apply_payload(inbox[r]) for r, rec in world.receivers.items()}
    assert {rep.elements for rep in reports.values()} == {0}
    assert all(rep.payload_bytes > 0 for rep in reports.values())  # the writers did report
    world.commit(1, reports)
    assert world.mismatches() == []


def test_close_ends_the_digest_thread_of_a_blocking_sender() -> None:
    import threading

    world = World(digest_every=1, full_state=False)
    world.sync(0, anchor=True)
    world.step()
    world.sync(1)
    assert not world.mismatches()
    digest_threads = [t for t in threading.enumerate() if t.name.startswith("ds-cluster-digest")]
    assert digest_threads, "the delta's digest pass ran on no thread of its own"
    for sender in world.senders:
        sender.close()
    for t in digest_threads:
        t.join(timeout=10)
        assert not t.is_alive(), f"{t.name} outlived close()"
