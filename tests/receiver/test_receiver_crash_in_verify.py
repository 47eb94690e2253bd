"""The journal is written while verify runs (its fsyncs overlap the hashing); these prove the
crash cases of that overlap with real SIGKILLs: killed in verify after the journal is durable,
the next receiver on the same state dir replays the chain to the exact target; a refused
chain leaves no journal behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from kit import assert_same_bits, rconfig, tiny_layouts

from deltasync import MemoryStore, Publisher, PublisherConfig, Receiver, names
from deltasync.errors import IntegrityError, StoreError
from deltasync.receiver import mapped_shard_tensors

SHARD = "tp0"


class Trainer:
    """Publishes an anchor, then deltas of ~5% of every parameter; keeps each shard state."""

    def __init__(self, store, tl, rl) -> None:
        self.gen = torch.Generator().manual_seed(1)
        self.tl, self.rl = tl, rl
        self.params = {
            n: (torch.randn(s, generator=self.gen) * 0.02).to(torch.bfloat16)
            for n, s in tl.param_shapes().items()
        }
        self.pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=1000))
        self.pub.publish(0, [], self.params, anchor=True)
        self.states = {0: self._state()}

    def _state(self):
        return {
            n: t.clone() for n, t in self.rl.split(self.tl.to_canonical(self.params))[SHARD].items()
        }

    def publish(self, v: int) -> None:
        changes = []
        for name, p in self.params.items():
            flat = p.view(-1)
            idx = torch.nonzero(torch.rand(flat.numel(), generator=self.gen) < 0.05).view(-1)
            flat[idx] = (flat[idx].float() + 2.0**-4).to(torch.bfloat16)
            changes.append((name, idx, flat[idx].clone()))
        self.pub.publish(v, changes, self.params)
        self.states[v] = self._state()


def _receiver(store, rl, tmp_path, staged=None):
    tensors = mapped_shard_tensors(tmp_path / "shard.bin", rl.local_specs(SHARD))
    config = rconfig("rx", max_staged_bytes=staged)
    return Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "state"), config)


def _killed_in_verify(store, rl, tmp_path, staged) -> None:
    """Child: pull, and SIGKILL itself inside verify once the journal is on disk."""
    import deltasync.receiver.store_receiver as sr

    real = sr.chain_state_digest
    journal = tmp_path / "state" / names.JOURNAL_FILE

    def dying(tensors, chain):
        deadline = time.monotonic() + 20
        while not journal.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
        return real(tensors, chain)

    sr.chain_state_digest = dying
    _receiver(store, rl, tmp_path, staged).pull()


def _killed_applying_two_versions(tmp_path, staged):
    """A receiver at version 0 killed in its pull of versions 1 and 2 after the journal:
    (store, layout, trainer)."""
    _, tl, rl = tiny_layouts()
    store = MemoryStore()
    trainer = Trainer(store, tl, rl)
    assert _receiver(store, rl, tmp_path).pull().version == 0
    trainer.publish(1)
    trainer.publish(2)
    child = mp.get_context("fork").Process(
        target=_killed_in_verify, args=(store, rl, tmp_path, staged)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    return store, rl, trainer


# None: the tiny chain is decoded once and held; 0: it is streamed (decoded on a thread)
@pytest.mark.parametrize("staged", [None, 0])
@pytest.mark.timeout(120)
def test_killed_in_verify_after_the_journal_the_next_receiver_replays_to_the_exact_target(
    tmp_path, staged
):
    store, rl, trainer = _killed_applying_two_versions(tmp_path, staged)
    assert (tmp_path / "state" / names.JOURNAL_FILE).exists()  # durable before the kill
    again = _receiver(store, rl, tmp_path, staged)
    assert again.last_repair is not None and again.last_repair.repaired
    assert again.last_repair.chain == (1, 2) and not again.last_repair.from_anchor
    assert again.version == 2 and not again.dirty
    assert not (tmp_path / "state" / names.JOURNAL_FILE).exists()
    assert_same_bits(again.tensors, trainer.states[2], "after the replayed chain")


@pytest.mark.parametrize("staged", [None, 0])
@pytest.mark.timeout(120)
def test_a_refused_chain_leaves_no_journal_and_the_tensors_untouched(tmp_path, monkeypatch, staged):
    _, tl, rl = tiny_layouts()
    store = MemoryStore()
    trainer = Trainer(store, tl, rl)
    trainer.publish(1)
    trainer.publish(2)
    rx = _receiver(store, rl, tmp_path, staged)
    before = {n: t.clone() for n, t in rx.tensors.items()}
    import deltasync.receiver.store_receiver as sr

    monkeypatch.setattr(sr, "chain_state_digest", lambda tensors, chain: "0" * 32)
    with pytest.raises(IntegrityError, match="Refused before any write"):
        rx.pull()
    assert not (tmp_path / "state" / names.JOURNAL_FILE).exists()
    assert rx.version is None
    assert_same_bits(rx.tensors, before, "after the refused pull")
    monkeypatch.undo()
    assert rx.pull().version == 2
    assert_same_bits(rx.tensors, trainer.states[2], "after the healed pull")


class Outage:
    """The store refuses every call while ``down`` (a network outage)."""

    def __init__(self, inner) -> None:
        self.inner, self.down = inner, False

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down:
                raise StoreError("connection refused")
            return attr(*args, **kwargs)

        return call


@pytest.mark.timeout(120)
def test_a_receiver_restarted_with_a_journal_during_an_outage_starts_and_repairs_later(tmp_path):
    # Killed mid-apply, restarted while the store is unreachable: it starts (the engine may
    # serve on), holds no version, and its first pull once the store is back replays the chain.
    store, rl, trainer = _killed_applying_two_versions(tmp_path, None)
    outage = Outage(store)
    outage.down = True
    again = _receiver(outage, rl, tmp_path)
    assert again.last_repair is None and again.dirty  # reports no version
    assert (tmp_path / "state" / names.JOURNAL_FILE).exists()
    with pytest.raises(StoreError):
        again.pull()
    outage.down = False
    report = again.pull()
    assert report.repaired and report.version == 2 and not again.dirty
    assert_same_bits(again.tensors, trainer.states[2], "after the deferred replay")
