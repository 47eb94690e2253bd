"""``deltasync.native.loader.disable()`` forces the torch path in a process, and changes nothing
but speed: the tracker finds the same elements with and without the kernels."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    import torch
    from deltasync import AdamWTracker
    from deltasync.native import loader

    def changed(seed):
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(20000) * 0.02)
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1)
        tracker = AdamWTracker(opt, [("p", p)])
        for _ in range(3):
            p.grad = torch.randn(20000)
            opt.step()
        return tracker.changed()["p"]

    assert loader.load() is not None, loader.build_error
    native = changed(0)
    loader.disable()
    assert loader.load() is None
    assert not loader.usable(torch.zeros(8))
    torch_path = changed(0)
    loader.enable()
    assert loader.load() is not None
    print("native", native.numel(), "torch", torch_path.numel(), torch.equal(native, torch_path))
    """
)


@pytest.mark.timeout(120)
def test_disable_forces_the_torch_path_and_the_changed_elements_stay_the_same() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=110, check=False
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[0] == "native" and int(words[1]) > 0, out.stdout
    assert words[-1] == "True", out.stdout


_HASHED_AFTER_ENABLE = textwrap.dedent(
    """
    import torch
    from deltasync.native import loader, ops

    live = torch.arange(4096).to(torch.bfloat16)
    items = [(live, torch.tensor([3, 4000], dtype=torch.int32), torch.tensor([-1.0, -2.0],
              dtype=torch.bfloat16))]
    scratch = torch.empty(1024, dtype=torch.bfloat16)
    loader.disable()
    assert ops.patched_digests16(items, scratch, 1024) is None  # the caller hashes in Python
    loader.enable()
    got = ops.patched_digests16(items, scratch, 1024)
    print("kernel" if got is not None and got[0] is not None else "python")
    """
)


@pytest.mark.timeout(120)
def test_the_verify_kernel_runs_again_once_the_kernels_are_enabled() -> None:
    # The verify kernel's one-time check of xxhash's C API ran while the kernels were off, and
    # its "unavailable" stayed for the life of the process: every verify after enable()
    # hashed in Python.
    out = subprocess.run(
        [sys.executable, "-c", _HASHED_AFTER_ENABLE],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kernel"], out.stdout
