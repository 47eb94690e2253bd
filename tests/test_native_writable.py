"""``native.writable.first_read_only``: the probe that tells a tensor in read-only memory from
a writable one without writing anything different from what is there, and without a crash."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import warnings

import pytest
import torch

from deltasync.native import writable


def _mapped(path, access: int, n: int = 8192) -> torch.Tensor:
    path.write_bytes(bytes(range(256)) * (2 * n // 256))
    fd = os.open(path, os.O_RDONLY if access == mmap.ACCESS_READ else os.O_RDWR)
    try:
        m = mmap.mmap(fd, 2 * n, access=access)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: a read-only buffer
        return torch.frombuffer(m, dtype=torch.bfloat16)


def test_a_read_only_mapping_is_named_and_writable_memory_is_not(tmp_path):
    ro = _mapped(tmp_path / "ro.bin", mmap.ACCESS_READ)
    rw = _mapped(tmp_path / "rw.bin", mmap.ACCESS_WRITE)
    cow = _mapped(tmp_path / "cow.bin", mmap.ACCESS_COPY)
    heap = torch.zeros(8, dtype=torch.bfloat16)
    assert writable.first_read_only([("heap", heap), ("rw", rw), ("cow", cow)]) is None
    assert writable.first_read_only([("rw", rw), ("ro", ro), ("cow", cow)]) == "ro"
    assert writable.first_read_only([("tail", ro[4000:])]) == "tail"  # a view inside it


def test_the_probe_leaves_every_byte_as_it_was(tmp_path):
    rw = _mapped(tmp_path / "rw.bin", mmap.ACCESS_WRITE)
    cow = _mapped(tmp_path / "cow.bin", mmap.ACCESS_COPY)
    before = {n: t.view(torch.int16).clone() for n, t in (("rw", rw), ("cow", cow))}
    assert writable.first_read_only([("rw", rw), ("cow", cow), ("t", rw.view(64, 128).t())]) is None
    assert torch.equal(rw.view(torch.int16), before["rw"])
    assert torch.equal(cow.view(torch.int16), before["cow"])
    assert (tmp_path / "cow.bin").read_bytes() == (tmp_path / "rw.bin").read_bytes()


def test_more_tensors_than_one_system_call_takes_are_all_probed(tmp_path):
    rw = _mapped(tmp_path / "rw.bin", mmap.ACCESS_WRITE)
    ro = _mapped(tmp_path / "ro.bin", mmap.ACCESS_READ)
    named = [(f"t{k}", rw[k : k + 2]) for k in range(3 * writable._BATCH)]
    assert writable.first_read_only(named) is None
    assert writable.first_read_only([*named, ("last", ro)]) == "last"
    assert writable.first_read_only(named) is None  # the pipe is whole again after a refusal


def test_tensors_the_probe_cannot_or_need_not_read_are_skipped():
    skipped = [
        ("meta", torch.empty(4, device="meta")),
        ("sparse", torch.zeros(4).to_sparse()),
        ("empty", torch.frombuffer(bytearray(2), dtype=torch.bfloat16)[:0]),
        ("not a tensor", object()),
    ]
    assert writable.first_read_only(skipped) is None


def test_a_forked_child_probes_through_its_own_pipe(tmp_path):
    ro = _mapped(tmp_path / "ro.bin", mmap.ACCESS_READ)
    rw = _mapped(tmp_path / "rw.bin", mmap.ACCESS_WRITE)
    assert writable.first_read_only([("rw", rw)]) is None  # the parent's pipe stays open
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            ok = writable.first_read_only([("rw", rw)]) is None
            own = writable._pipe is not None and writable._pipe[0] == os.getpid()
            code = 0 if ok and own and writable.first_read_only([("ro", ro)]) == "ro" else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert writable.first_read_only([("ro", ro)]) == "ro"


@pytest.mark.parametrize("refused", ["pipe", "writev"])
def test_a_system_that_refuses_the_probe_skips_it_and_says_so_once(
    tmp_path, monkeypatch, caplog, refused
):
    ro = _mapped(tmp_path / "ro.bin", mmap.ACCESS_READ)

    def refuse(*args):
        raise OSError(errno.EPERM, "Operation not permitted (seccomp)")

    writable._close_pipe()
    monkeypatch.setattr(writable, "_refused", False)
    monkeypatch.setattr(writable.os, refused, refuse)
    with caplog.at_level(logging.WARNING, logger=writable.__name__):
        assert writable.first_read_only([("ro", ro)]) is None
        assert writable.first_read_only([("ro", ro)]) is None
    assert len([r for r in caplog.records if "cannot" in r.getMessage()]) == 1


def _numpy_backed(value: int) -> torch.Tensor:
    """A bf16 tensor over memory torch was handed (probed), every element's bits ``value``."""
    import numpy as np

    return torch.from_numpy(np.full(8, value, np.int16)).view(torch.bfloat16)


def test_an_interrupt_between_the_probes_two_calls_leaves_no_bytes_for_the_next_probe(
    monkeypatch,
):
    a, b = _numpy_backed(0x1111), _numpy_backed(0x2222)
    before_a, before_b = a.view(torch.int16).clone(), b.view(torch.int16).clone()
    real_readv = os.readv

    def interrupted(fd, bufs):  # Ctrl-C lands after the writev, before the bytes come back
        monkeypatch.setattr(os, "readv", real_readv)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "readv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writable.first_read_only([("a", a)])
    assert writable.first_read_only([("b", b)]) is None
    assert torch.equal(b.view(torch.int16), before_b)  # not a's bytes read back into b
    assert torch.equal(a.view(torch.int16), before_a)


def test_a_fork_while_another_thread_probes_leaves_the_child_free_to_probe():
    import threading

    t = _numpy_backed(0x3333)
    inside, release = threading.Event(), threading.Event()
    real_writev = os.writev

    def slow_writev(fd, bufs):
        if threading.current_thread().name == "prober":
            inside.set()
            release.wait()
        return real_writev(fd, bufs)

    prober = threading.Thread(
        target=writable.first_read_only, args=([("t", t)],), name="prober", daemon=True
    )
    os.writev = slow_writev
    try:
        prober.start()
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: a hung probe is killed by the alarm (exit by SIGALRM)
            try:
                import signal

                signal.alarm(5)
                os.writev = real_writev
                ok = writable.first_read_only([("t", t)]) is None
                os._exit(0 if ok else 2)
            finally:
                os._exit(4)
    finally:
        release.set()
        os.writev = real_writev
    prober.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
