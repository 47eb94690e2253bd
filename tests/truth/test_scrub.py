"""Live tensors written by something else while the head does not move: ``Receiver.scrub``
and ``ReceiverConfig.scrub_every`` find it, stop reporting the version, and repair from the
newest anchor."""

from __future__ import annotations

import pytest
import torch
from kit import rconfig
from truth_kit import Rig

from deltasync import LocalStore, Receiver
from deltasync.commit import Catalog
from deltasync.errors import ConfigError, DriftError, IntegrityError


@pytest.fixture
def rig(tmp_path):
    rig = Rig(LocalStore(tmp_path / "store", durable=False), tmp_path)
    for v in range(3):
        rig.publish(v)
    return rig


def _configured(rig, **config) -> Receiver:
    """A receiver of the rig's shard with its own state dir and ``config``."""
    return Receiver.for_layout(
        rig.store,
        rig.rl,
        rig.shard,
        rig.tensors,
        str(rig.tmp / "-".join(["rec", *(f"{k}={v}" for k, v in sorted(config.items()))])),
        rconfig("rec", **config),
    )


def _stray_write(tensors: dict[str, torch.Tensor]) -> None:
    """One element of one tensor, as a stray write in the engine would (a bit flip)."""
    t = next(iter(tensors.values()))
    bits = t.view(-1).view(torch.int16)
    bits[7] ^= 1


@pytest.mark.timeout(60)
def test_scrub_keeps_a_held_state_and_drops_a_drifted_one(rig):
    rig.check(rig.rec.pull())
    assert rig.rec.scrub()  # nothing wrote them: still version 2
    assert rig.rec.version == 2 and not rig.rec.dirty
    _stray_write(rig.rec.tensors)
    assert not rig.rec.scrub()
    assert rig.rec.dirty
    assert Catalog(rig.store).receivers()["rec"].version is None  # no trainer counts it
    report = rig.rec.pull()  # the head has not moved: restored from the newest anchor
    assert report.from_anchor and report.chain == (0, 1, 2)
    rig.check(report)
    assert Catalog(rig.store).receivers()["rec"].version == 2


@pytest.mark.timeout(60)
def test_invalidate_drops_a_version_the_tensors_still_hash_to_and_a_restart_holds_nothing(rig):
    # The caller knows better than the hash (an engine that reloaded the weights it computes
    # with from elsewhere): no record names the version any more, durably.
    rig.check(rig.rec.pull())
    assert rig.rec.scrub()  # the tensors hash to version 2
    rig.rec.invalidate("reloaded by the engine's own loader")
    assert rig.rec.dirty
    assert Catalog(rig.store).receivers()["rec"].version is None
    restarted = rig.receiver()  # the same state dir
    assert restarted.dirty
    report = restarted.pull()  # the head has not moved: restored from the newest anchor
    assert report.from_anchor and report.chain == (0, 1, 2)
    rig.check(report)


@pytest.mark.timeout(60)
def test_scrub_of_a_receiver_holding_nothing_hashes_nothing(rig, monkeypatch):
    from deltasync.receiver import store_receiver

    def refuse(_):
        raise AssertionError("hashed a receiver that holds nothing")

    monkeypatch.setattr(store_receiver, "state_digest", refuse)
    assert not rig.rec.scrub()
    assert rig.rec.version is None


@pytest.mark.timeout(60)
def test_every_nth_idle_pull_scrubs_and_repairs_a_drift_in_the_same_pull(rig):
    rec = _configured(rig, scrub_every=2)
    rig.check(first := rec.pull())
    assert not first.scrubbed  # applied a chain: its verify read the whole state anyway
    assert not rec.pull().scrubbed  # first idle pull
    second = rec.pull()
    assert second.scrubbed and not second.drifted and second.chain == ()
    _stray_write(rec.tensors)
    assert not rec.pull().scrubbed  # between scrubs a drift goes unseen ...
    report = rec.pull()  # ... until the next one, which repairs it at once
    assert report.scrubbed and report.drifted and report.from_anchor
    assert report.previous_version == 2 and report.version == 2
    for name, want in rig.expected(report).items():
        assert torch.equal(rec.tensors[name].view(torch.int16), want.view(torch.int16)), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("every", [-1, 1.5, True, "2"])
def test_scrub_every_must_be_a_non_negative_int(every):
    with pytest.raises(ConfigError, match="scrub_every"):
        rconfig("rec", scrub_every=every)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restore", [False, True])
def test_a_delta_onto_drifted_tensors_is_refused_or_with_restore_drift_restored_at_once(
    rig, restore
):
    # An engine that reloaded its own weights (vLLM's reload_weights, SGLang's
    # update_weights_from_disk) and then asked for the next version was refused; the restore
    # came only with the request after.
    rec = _configured(rig, restore_drift=restore)
    rig.check(rec.pull())
    _stray_write(rec.tensors)
    rig.publish(3)
    if not restore:
        with pytest.raises(IntegrityError, match="no verified version") as refused:
            rec.pull(version=3)
        assert type(refused.value) is DriftError  # a public name (it was the private _Drifted)
        assert rec.dirty and rec.version is None
        return
    report = rec.pull(version=3)
    assert report.drifted and report.from_anchor and report.chain == (0, 1, 2, 3)
    assert report.previous_version == 2 and report.version == 3 and not rec.dirty
    for name, want in rig.expected(report).items():
        assert torch.equal(rec.tensors[name].view(torch.int16), want.view(torch.int16)), name


@pytest.mark.timeout(60)
def test_restore_drift_does_not_repeat_a_refused_anchor(rig, monkeypatch):
    # An anchor whose result is not the manifest's (not a drift: the tensors are overwritten
    # whole) is refused once, not restored into again.
    from deltasync.receiver import store_receiver

    rec = _configured(rig, restore_drift=True)
    calls = []
    real = store_receiver.chain_state_digest

    def wrong(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)
        return "0" * 32

    monkeypatch.setattr(store_receiver, "chain_state_digest", wrong)
    with pytest.raises(IntegrityError):
        rec.pull()
    assert len(calls) == 1 and rec.version is None
