"""A receiver's first pull that catches up an anchor and several deltas in one chain, its blobs
spilled to files: bit-exact (deltas that rewrite the same elements: the last one wins), its
large sparse pieces stashed in an unlinked file of the state dir during the verify and gone
after, and each tensor reported written once (not once per version), holding its last
version's values.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from kit import (
    assert_same_bits,
    rconfig,
    tiny_layouts,
    unlinked_fds_under,
    zero_tensors,
)

from deltasync import LocalStore, Publisher, PublisherConfig, Receiver
from deltasync.errors import LocalStateError
from deltasync.format import stash as stash_module
from deltasync.receiver import store_receiver


def _publish(store, versions: int, *, last_only: str | None = None, **shape):
    """Anchor 0 and ``versions`` deltas of random BF16 params: each rewrites 1% of every
    tensor (the last one of parameter ``last_only`` alone, when given), half of it elements
    the delta before rewrote too. (receiver layout, the shard's tensors as the last version
    leaves them)."""
    _, tl, rl = tiny_layouts(tp=1, **shape)
    gen = torch.Generator().manual_seed(0)
    params = {
        n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
        for n, s in tl.param_shapes().items()
    }
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=1000))
    pub.publish(0, [], params, anchor=True)
    before = {n: torch.zeros(0, dtype=torch.int64) for n in params}
    for v in range(1, versions + 1):
        changes = []
        for n, p in params.items():
            if v == versions and last_only not in (None, n):
                continue
            flat = p.view(-1)
            k = max(2, flat.numel() // 100)
            fresh = torch.randperm(flat.numel(), generator=gen)[: k - k // 2]
            again = before[n][: k // 2]  # rewritten by the version before too
            idx = torch.unique(torch.cat([fresh, again]))
            flat[idx] = (torch.randn(idx.numel(), generator=gen) * 0.02).to(torch.bfloat16)
            changes.append((n, idx, flat[idx].clone()))
            before[n] = idx[torch.randperm(idx.numel(), generator=gen)]
        pub.publish(v, changes, params)
    return rl, rl.split(tl.to_canonical(params))["tp0"]


class Stashes:
    """Records every piece a pull's verify stashes (a spy: the real Stash runs)."""

    def __init__(self, monkeypatch) -> None:
        self.pieces: list = []
        self.stashes: list = []
        seen = self

        class Spy(stash_module.Stash):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                seen.stashes.append(self)

            def keep(self, record):
                got = super().keep(record)
                if isinstance(got, stash_module.StashedPiece):
                    seen.pieces.append(got)
                return got

        monkeypatch.setattr(store_receiver, "Stash", Spy)


def test_a_spilled_catch_up_is_bit_exact_stashes_its_large_pieces_and_leaves_no_file(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(stash_module, "STASH_MIN", 64)  # the tiny model's pieces too
    store = LocalStore(str(tmp_path / "store"), durable=False)
    rl, expected = _publish(store, 5)
    stashes = Stashes(monkeypatch)
    tensors = zero_tensors(rl, "tp0")
    written: list[str] = []
    rx = Receiver.for_layout(
        store,
        rl,
        "tp0",
        tensors,
        str(tmp_path / "rx"),
        rconfig("rx", max_staged_bytes=0),  # every blob of the chain is spilled
        on_tensor_written=written.append,
    )
    assert rx.pull().version == 5
    assert_same_bits(tensors, expected)
    assert len(stashes.stashes) == 1 and stashes.pieces  # the verify parked its pieces
    assert {p.name for p in stashes.pieces} <= set(tensors)
    assert sorted(written) == sorted(tensors)  # each tensor reported once, not per version
    assert unlinked_fds_under(tmp_path / "rx") == []
    rx.close()


def test_each_tensor_is_reported_written_once_it_holds_the_last_version(
    tmp_path, monkeypatch
) -> None:
    # A chain is written version by version: a tensor the last version does not list is
    # final after an earlier one, one it lists only after the last. Reported at its first
    # write, a tensor the later versions rewrite did not yet hold what the pull installs.
    monkeypatch.setattr(stash_module, "STASH_MIN", 64)
    store = LocalStore(str(tmp_path / "store"), durable=False)
    rl, expected = _publish(store, 3, last_only="model.norm.weight")
    tensors = zero_tensors(rl, "tp0")
    seen: dict[str, torch.Tensor] = {}

    def written(name: str) -> None:
        assert name not in seen, f"{name} reported twice"
        seen[name] = tensors[name].clone()

    rx = Receiver.for_layout(
        store,
        rl,
        "tp0",
        tensors,
        str(tmp_path / "rx"),
        rconfig("rx", max_staged_bytes=0),
        on_tensor_written=written,
    )
    assert rx.pull().version == 3
    assert_same_bits(tensors, expected)
    assert sorted(seen) == sorted(tensors)
    assert_same_bits(seen, expected, "each tensor as it was reported written")
    rx.close()


def test_a_catch_up_within_its_budget_stashes_nothing(tmp_path, monkeypatch) -> None:
    store = LocalStore(str(tmp_path / "store"), durable=False)
    rl, expected = _publish(store, 3)
    stashes = Stashes(monkeypatch)
    tensors = zero_tensors(rl, "tp0")
    rx = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "rx"), rconfig("rx"))
    assert rx.pull().version == 3
    assert_same_bits(tensors, expected)
    assert stashes.stashes == []
    rx.close()


def test_a_stash_that_cannot_be_read_back_fails_the_pull_before_any_write(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(stash_module, "STASH_MIN", 64)
    store = LocalStore(str(tmp_path / "store"), durable=False)
    rl, expected = _publish(store, 3)
    broken: list = []

    class Unreadable(stash_module.Stash):
        """Hands back its first stashed piece on a write-only file (a real EBADF on read)."""

        def keep(self, record):
            got = super().keep(record)
            if isinstance(got, stash_module.StashedPiece) and not broken:
                broken.append(open(os.devnull, "wb"))  # noqa: SIM115 (closed below)
                got = dataclasses.replace(got, file=broken[0])
            return got

    monkeypatch.setattr(store_receiver, "Stash", Unreadable)
    tensors = zero_tensors(rl, "tp0")
    before = {n: t.clone() for n, t in tensors.items()}
    rx = Receiver.for_layout(
        store, rl, "tp0", tensors, str(tmp_path / "rx"), rconfig("rx", max_staged_bytes=0)
    )
    with pytest.raises(LocalStateError, match=r"cannot read them back.*Nothing was written"):
        rx.pull()
    broken[0].close()
    assert rx.version is None
    assert_same_bits(tensors, before, "untouched by the refused pull")
    monkeypatch.setattr(store_receiver, "Stash", stash_module.Stash)
    assert rx.pull().version == 3  # the next pull takes the chain
    assert_same_bits(tensors, expected)
    assert unlinked_fds_under(tmp_path / "rx") == []
    rx.close()
