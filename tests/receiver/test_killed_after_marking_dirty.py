"""A receiver that finds its tensors no longer hold its version withdraws its registration
before it writes the dirty state file: SIGKILLed between the two, its registration (heartbeat
fresh, over tensors that outlive it) named the version they were found not to hold."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from kit import TinyTrainer, rconfig, tiny_layouts

from deltasync import LocalStore, Publisher, PublisherConfig, Receiver, TrainerSync
from deltasync.commit import Catalog
from deltasync.receiver import mapped_shard_tensors
from deltasync.receiver.journal import StateDir
from deltasync.trainer import AdamWTracker


@pytest.mark.timeout(120)
def test_a_scrub_killed_after_its_dirty_state_file_leaves_no_version_registered(tmp_path):
    spec, _, rl = tiny_layouts()
    store = LocalStore(tmp_path / "store", durable=False)
    model = TinyTrainer(spec, seed=0, density=0.5)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(AdamWTracker(model.opt, model.named_parameters()), pub, model.params)
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
