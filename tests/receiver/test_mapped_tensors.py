"""``mapped_shard_tensors``: the shared file a receiver's tensors live in appears whole or not
at all, so a process killed while creating it leaves nothing a restart refuses; and a receiver
killed over it (mid-scatter, or right after it found a drift) leaves no registration naming a
version the file does not hold."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from kit import tiny_layouts

from deltasync.errors import ConfigError
from deltasync.receiver import mapped, mapped_shard_tensors


def _killed_while_sizing(path: Path, specs) -> int:
    """A child process that creates ``path`` and is SIGKILLed right as it sizes the file (as
    a random kill landing there would); returns the signal it died of."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        real_open = open

        class Dying:
            def __init__(self, f) -> None:
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.f.close()

            def truncate(self, size: int) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

        mapped.open = lambda p, mode="r", *a, **k: Dying(real_open(p, mode, *a, **k))
        try:
            mapped_shard_tensors(path, specs)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status)


@pytest.mark.timeout(60)
def test_a_process_killed_while_creating_its_shard_file_leaves_none_a_restart_refuses(tmp_path):
    # The file was created, then sized: killed in between, it stayed empty, and every restart
    # on that path refused it as "made for another layout".
    _, _, rl = tiny_layouts()
    specs = rl.local_specs("tp0")
    path = tmp_path / "shard.bin"
    assert _killed_while_sizing(path, specs) == signal.SIGKILL
    assert not path.exists()
    tensors = mapped_shard_tensors(path, specs)  # the restart, same path, same specs
    assert set(tensors) == set(specs)
    assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in tensors.values())
    tensors[next(iter(tensors))].view(-1)[0] = 1.0  # written through to the file ...
    again = mapped_shard_tensors(path, specs)  # ... which a second open maps, not recreates
    assert float(again[next(iter(again))].view(-1)[0]) == 1.0


def test_a_shard_file_of_another_size_is_refused_and_left_alone(tmp_path):
    _, _, rl = tiny_layouts()
    path = tmp_path / "shard.bin"
    path.write_bytes(b"x" * 10)
    with pytest.raises(ConfigError, match="made for another layout"):
        mapped_shard_tensors(path, rl.local_specs("tp0"))
    assert path.read_bytes() == b"x" * 10
    with pytest.raises(ConfigError, match="does not exist"):
        mapped_shard_tensors(tmp_path / "missing.bin", rl.local_specs("tp0"), create=False)


def _tiny_publisher(tmp_path):
    """A tiny model under AdamW publishing to a local store: the layouts, the store, the
    model and its sync."""
    from kit import TinyTrainer

    from deltasync import LocalStore, Publisher, PublisherConfig, TrainerSync
    from deltasync.trainer import AdamWTracker

    spec, tl, rl = tiny_layouts()
    store = LocalStore(tmp_path / "store", durable=False)
    model = TinyTrainer(spec, seed=0, density=0.5)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(AdamWTracker(model.opt, model.named_parameters()), pub, model.params)
    return tl, rl, store, model, sync


@pytest.mark.timeout(120)
def test_a_receiver_killed_mid_scatter_leaves_a_registration_naming_no_version(tmp_path):
    # Its registration still named the version before, heartbeat fresh, while the shared
    # tensors (which outlive it, and an engine serves from) held neither version, until a
    # successor started or the heartbeat aged past the TTL.
    from kit import expected_shards, rconfig

    from deltasync import Receiver
    from deltasync.commit import Catalog
    from deltasync.layout.digest import state_digest

    tl, rl, store, model, sync = _tiny_publisher(tmp_path)
    specs = rl.local_specs("tp0")
    held = {}

    def agent(kill_after: int | None = None) -> Receiver:
        written: list[str] = []

        def on_tensor(name: str) -> None:
            written.append(name)
            if len(written) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        tensors = mapped_shard_tensors(tmp_path / "shard.bin", specs)
        state = str(tmp_path / "rx")
        return Receiver.for_layout(
            store, rl, "tp0", tensors, state, rconfig("rx"), on_tensor_written=on_tensor
        )

    for version in (0, 1):
        if version:
            model.step()
        sync.step_published(version)
        held[version] = state_digest(expected_shards(model.params, tl, rl)["tp0"])
    assert agent().pull(version=0).version == 0
    assert Catalog(store).receiver("rx").version == 0
    pid = os.fork()
    if pid == 0:
        try:
            agent(kill_after=2).pull()  # SIGKILLed after two of its tensors were written
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WTERMSIG(status) == signal.SIGKILL
    live = state_digest(mapped_shard_tensors(tmp_path / "shard.bin", specs, create=False))
    assert live not in held.values()  # torn: neither version
    assert Catalog(store).receiver("rx").version is None
    restarted = agent()  # replays the journal, then on to the newest
    assert restarted.pull().version == 1 and restarted.state_digest == held[1]
    assert Catalog(store).receiver("rx").version == 1


@pytest.mark.timeout(120)
def test_a_scrub_killed_after_its_dirty_state_file_leaves_no_version_registered(tmp_path):
    # It wrote the dirty state file before withdrawing its registration: SIGKILLed between
    # the two, the registration (heartbeat fresh, over tensors that outlive it) named the
    # version they were found not to hold.
    from kit import rconfig

    from deltasync import Receiver
    from deltasync.commit import Catalog
    from deltasync.receiver.journal import StateDir

    _, rl, store, _, sync = _tiny_publisher(tmp_path)
    sync.step_published(0)
    specs = rl.local_specs("tp0")

    def agent() -> Receiver:
        tensors = mapped_shard_tensors(tmp_path / "shard.bin", specs)
        return Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "rx"), rconfig("rx"))

    rec = agent()
    assert rec.pull().version == 0
    rec.close()
    assert Catalog(store).receiver("rx").version == 0
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            child = agent()
            name = next(iter(child.tensors))
            child.tensors[name].view(torch.int16).view(-1)[0] ^= 0x5555  # a stray write
            real = StateDir.write_state

            def write_state(self, state):
                real(self, state)
                if state.dirty:
                    os.kill(os.getpid(), signal.SIGKILL)

            StateDir.write_state = write_state
            child.scrub()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert StateDir(tmp_path / "rx").read_state().dirty  # it had found the drift
    assert Catalog(store).receiver("rx").version is None
    restarted = agent()  # the next pull restores the anchor
    assert restarted.version is None
    assert restarted.pull().version == 0
    assert Catalog(store).receiver("rx").version == 0
