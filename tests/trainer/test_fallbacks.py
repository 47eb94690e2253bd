"""Fallbacks are loud and controllable: construction logs which params take the snapshot
path, why and what it holds; strict=True refuses instead; a missing C compiler is logged once
with the remedy, and detection stays exact on the torch path."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deltasync import AdamWTracker
from deltasync.errors import UnsupportedOptimizerError


def _named():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.nn.Parameter(torch.randn(30, 20, generator=g)),
        "h": torch.nn.Parameter(torch.randn(64, generator=g).to(torch.bfloat16)),
    }


def test_construction_logs_and_reports_each_fallback_with_its_reason_and_bytes(caplog):
    ps = _named()
    caplog.set_level(logging.WARNING, logger="deltasync.trainer.adamw_tracker")
    sgd = torch.optim.SGD(ps.values(), lr=0.1)
    t = AdamWTracker(sgd, ps.items())
    assert {n: f.bytes for n, f in t.fallback.items()} == {"w": 600 * 2, "h": 64 * 2}
    assert "optimizer SGD is not torch.optim.Adam/AdamW" in t.fallback["w"].reason
    assert t.memory_bytes() == 1328
    assert "2 parameter(s) take the exact snapshot path, holding 1328 bytes" in caplog.text
    assert "w: optimizer SGD" in caplog.text
    caplog.clear()
    adam = torch.optim.AdamW(ps.values(), lr=1e-3)
    t2 = AdamWTracker(adam, ps.items())
    assert list(t2.fallback) == ["h"] and "bfloat16 is not float32" in str(t2.fallback["h"])
    assert "holding 128 bytes" in caplog.text


def test_strict_raises_unsupported_optimizer_error_naming_the_params():
    ps = _named()
    with pytest.raises(UnsupportedOptimizerError, match=r"2 parameter\(s\).*w: optimizer SGD"):
        AdamWTracker(torch.optim.SGD(ps.values(), lr=0.1), ps.items(), strict=True)
    with pytest.raises(UnsupportedOptimizerError, match=r"h: dtype torch.bfloat16"):
        AdamWTracker(torch.optim.AdamW(ps.values(), lr=1e-3), ps.items(), strict=True)
    outside = torch.nn.Parameter(torch.randn(4))  # trainable but in no param group
    with pytest.raises(UnsupportedOptimizerError, match="x: not in the optimizer"):
        AdamWTracker(
            torch.optim.AdamW([ps["w"]], lr=1e-3), [("w", ps["w"]), ("x", outside)], strict=True
        )
    ok = AdamWTracker(torch.optim.AdamW([ps["w"]], lr=1e-3), [("w", ps["w"])], strict=True)
    assert ok.fallback == {}


_NO_COMPILER = textwrap.dedent(
    """
    import logging, torch
    logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
    from deltasync import AdamWTracker, SnapshotTracker
    from deltasync.native import loader
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5000) * 0.02)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    t, s = AdamWTracker(opt, [("p", p)]), SnapshotTracker([("p", p)])
    for v in range(3):
        p.grad = torch.randn(5000)
        opt.step()
        a, b = t.changed().get("p"), s.changed()["p"]
        assert bool(torch.isin(b, a).all()), "missed"
        t.clear(), s.clear()
    assert loader.load() is None
    print("OK", loader.build_error)
    """
)


@pytest.mark.timeout(60)
def test_without_a_compiler_detection_is_exact_on_the_torch_path_and_says_so_once(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "OK no C compiler" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if "native kernels unavailable" in ln]
    assert len(lines) == 1 and "install a C compiler" in lines[0]


def test_a_step_whose_state_the_kernels_cannot_read_marks_the_param_changed_in_full():
    p = torch.nn.Parameter(torch.randn(50) * 0.02)
    opt = torch.optim.AdamW([p], lr=1e-6)
    tracker = AdamWTracker(opt, [("p", p)], strict=True)
    p.grad = torch.randn(50)
    opt.step()
    # a tiny lr moves few BF16 values (often none: then "p" is not reported at all)
    assert tracker.changed().get("p", torch.empty(0)).numel() < 50
    tracker.clear()
    st = opt.state[p]
    st["exp_avg_sq"] = st["exp_avg_sq"].double()  # e.g. a state kept in another precision
    p.grad = torch.randn(50)
    opt.step()
    assert torch.equal(tracker.changed()["p"], torch.arange(50))  # never a miss: all of it
