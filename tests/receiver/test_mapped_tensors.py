"""``mapped_shard_tensors``: the shared file a receiver's tensors live in appears whole or not
at all, so a process killed while creating it leaves nothing a restart refuses."""

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
