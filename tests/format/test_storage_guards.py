"""Tensors that do not hold what their view says: a storage freed or shrunk after the view was
made (FSDP's ``resize_(0)``, offloading), an output buffer over an input, a lazy negation, a
meta target. Every kernel guard refuses them with a typed error and writes nothing; the cases
that crashed the process run in a child, so that a regression fails one test, not the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from kit import anchored_bf16, rconfig, zero_tensors

from deltasync import MemoryStore, Publisher, Receiver
from deltasync.errors import ApplyError, ConfigError, TensorInputError
from deltasync.format import TensorUpdate, apply_updates
from deltasync.native.ops import (
    bf16_at,
    cast_bf16_into,
    column_block,
    patch16,
    patched_digests16,
    scatter16,
)
from deltasync.trainer.detect import bits_to_indices

BF = torch.bfloat16


def _in_a_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its last line of output (a crash fails here)."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    return run.stdout.strip().splitlines()[-1]


_TYPED = """
def typed(call):
    try:
        call()
    except Exception as exc:
        print(type(exc).__name__, str(exc)[:300])
    else:
        print("no error")
"""


def test_a_column_slice_of_a_freed_storage_is_refused_not_read():
    out = _in_a_child(
        _TYPED
        + """
import torch
from deltasync.native.ops import cast_bf16_into
x = torch.randn(64, 64)
view = x[:, :32]  # rows apart by a stride: the row-wise kernel
x.untyped_storage().resize_(0)
typed(lambda: cast_bf16_into(view, torch.empty(64 * 32, dtype=torch.bfloat16)))
"""
    )
    assert out.startswith("TensorInputError") and "does not lie inside its storage" in out, out


def test_a_storage_freed_between_two_chunks_of_detection_is_refused_not_read():
    out = _in_a_child(
        _TYPED
        + """
import torch
from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
from deltasync.trainer.detect import detect_adamw_chunks
k = kernel_scalars(StepHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                             decoupled=True, step=3))
n = 4 << 20
p, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
chunks = detect_adamw_chunks(p, m, v, k, threads=1, values=True)
next(chunks)
for t in (p, m, v):
    t.untyped_storage().resize_(0)
typed(lambda: list(chunks))
"""
    )
    assert out.startswith("TensorInputError") and "while its chunks were detected" in out, out


def test_a_target_whose_storage_shrank_is_refused_before_any_write():
    out = _in_a_child(
        _TYPED
        + """
import torch
from deltasync.format import TensorUpdate, apply_updates
n = 1 << 28
t = torch.zeros(n, dtype=torch.bfloat16)
t.untyped_storage().resize_(16)
u = TensorUpdate(name="a", shape=(n,), dtype=torch.bfloat16, indices=torch.tensor([n - 1]),
                 values=torch.ones(1, dtype=torch.bfloat16))
typed(lambda: apply_updates([u], {"a": t}))
"""
    )
    assert out.startswith("ApplyError") and "'a'" in out and "storage" in out, out


def test_a_receiver_is_refused_a_live_tensor_whose_storage_was_freed(tmp_path):
    # accepted before, and the first pull's scatter wrote through the dangling view (SIGSEGV)
    store = MemoryStore()
    _, rl, _, _ = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, "tp0")
    name = next(iter(tensors))
    tensors[name].untyped_storage().resize_(0)
    with pytest.raises(ConfigError, match=rf"{name!r} does not lie inside its storage"):
        Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "r"), rconfig("r"))


def test_a_live_tensor_freed_after_construction_is_refused_before_any_write(tmp_path):
    # checked only at construction before: the anchor's scatter wrote every tensor before the
    # freed one, then raised ApplyError with the receiver dirty and a journal to replay
    store = MemoryStore()
    _, rl, _, _ = anchored_bf16(store, seed=4)
    tensors = zero_tensors(rl, "tp0")
    rx = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "r"), rconfig("r"))
    victim = list(tensors)[-1]  # the last tensor the scatter writes
    tensors[victim].untyped_storage().resize_(0)
    with pytest.raises(ConfigError, match=rf"{victim!r} does not lie inside its storage"):
        rx.pull()
    assert all(int(t.view(torch.int16).abs().sum()) == 0 for n, t in tensors.items() if n != victim)
    assert rx.version is None and not rx.dirty
    assert not (tmp_path / "r" / "journal.json").exists()
    tensors[victim].untyped_storage().resize_(tensors[victim].numel() * 2)  # back (an anchor)
    assert rx.pull().version == 0


@pytest.mark.parametrize("layout, config", [(None, True), ("vllm", True), (True, None)])
def test_a_receiver_given_something_else_than_a_layout_or_config_is_refused_unwritten(
    tmp_path, layout, config
):
    # untyped AttributeErrors ("... has no attribute 'local_specs' / 'signing_key'") before
    store = MemoryStore()
    _, rl, _, _ = anchored_bf16(store, seed=5)
    layout = rl if layout is True else layout
    config = rconfig("r") if config is True else config
    with pytest.raises(ConfigError, match=r"must be a Receiver(Layout|Config)"):
        Receiver.for_layout(
            store, layout, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), config
        )
    assert not (tmp_path / "r").exists()


def test_a_receiver_given_a_list_of_tensors_or_a_number_for_its_dir_is_refused(tmp_path):
    # a ValueError from dict() and a TypeError from the path functions before
    store = MemoryStore()
    _, rl, _, _ = anchored_bf16(store, seed=7)
    tensors = zero_tensors(rl, "tp0")
    where = str(tmp_path / "r")
    with pytest.raises(ConfigError, match=r"Receiver\.tensors must be a Mapping, got list"):
        Receiver.for_layout(store, rl, "tp0", list(tensors.values()), where, rconfig("r"))
    with pytest.raises(
        ConfigError, match=r"Receiver\.state_dir must be a str or PathLike, got int"
    ):
        Receiver.for_layout(store, rl, "tp0", tensors, 5, rconfig("r"))
    assert not (tmp_path / "r").exists()
    assert (
        Receiver.for_layout(store, rl, "tp0", tensors, tmp_path / "r", rconfig("r")).pull().version
        == 0
    )


def test_a_path_given_in_place_of_the_store_is_refused_with_the_remedy(tmp_path):
    # untyped AttributeErrors ("'str' object has no attribute 'list'") before, and the
    # receiver's state directory made
    _, rl, _, _ = anchored_bf16(MemoryStore(), seed=6)
    where = str(tmp_path / "store")
    with pytest.raises(ConfigError, match=r"Publisher: store must be a Store.*open_store"):
        Publisher(where, receiver_layout=rl)
    with pytest.raises(ConfigError, match=r"Receiver: store must be a Store.*open_store"):
        Receiver.for_layout(
            where, rl, "tp0", zero_tensors(rl, "tp0"), str(tmp_path / "r"), rconfig("r")
        )
    assert not (tmp_path / "r").exists() and not (tmp_path / "store").exists()


def test_the_row_wise_cast_honours_a_lazy_negation():
    # a lazily negated column slice (negation of a view of a complex tensor, or
    # torch._neg_view) holds the values un-negated in memory: the kernel gave every sign wrong
    lazy = torch._neg_view(torch.randn(64, 64)[:, :32])
    assert lazy.is_neg()
    got = cast_bf16_into(lazy, torch.empty(64 * 32, dtype=BF))
    want = lazy.to(BF).reshape(-1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_an_output_buffer_over_an_input_or_expanded_is_refused_on_every_path():
    values = torch.randn(200)
    indices = torch.arange(0, 200, 2)
    over = values.view(torch.int16).view(BF)  # the same bytes as values
    with pytest.raises(TensorInputError, match="out overlaps an input"):
        bf16_at(values, indices, out=over)
    with pytest.raises(TensorInputError, match="share memory"):
        bf16_at(values, indices, out=torch.zeros(1, dtype=BF).expand(200))
    src = torch.randn(100)
    with pytest.raises(TensorInputError, match="out overlaps an input"):
        cast_bf16_into(src, src.view(torch.int16)[:100].view(BF))
    with pytest.raises(TensorInputError, match="share memory"):
        cast_bf16_into(src, torch.zeros(1, dtype=BF).expand(100))


def test_values_over_their_target_or_a_meta_target_are_refused_with_every_target_unchanged():
    b = torch.zeros(10, dtype=BF)
    a = torch.zeros(100, dtype=BF)
    a[:2] = 5
    ups = [
        TensorUpdate(
            name="b",
            shape=(10,),
            dtype=BF,
            indices=torch.tensor([3]),
            values=torch.ones(1, dtype=BF),
        ),
        TensorUpdate(name="a", shape=(100,), dtype=BF, indices=torch.tensor([1, 5]), values=a[:2]),
    ]
    with pytest.raises(ApplyError, match=r"'a'.*share memory with the target"):
        apply_updates(ups, {"b": b, "a": a})
    assert int(b.view(torch.int16).abs().sum()) == 0  # nothing written, b included
    meta = torch.empty(4, dtype=BF, device="meta")
    up = TensorUpdate(
        name="m", shape=(4,), dtype=BF, indices=torch.tensor([1]), values=torch.ones(1, dtype=BF)
    )
    with pytest.raises(ApplyError, match="meta device"):
        apply_updates([up], {"m": meta})


def test_arguments_ctypes_would_take_untyped_are_typed_errors():
    target = torch.zeros(10, dtype=BF)
    with pytest.raises(TensorInputError, match=r"indices must be a torch\.Tensor"):
        scatter16(target, np.arange(3), torch.ones(3, dtype=BF))
    with pytest.raises(TensorInputError, match="numel must be a non-negative int"):
        bits_to_indices(torch.zeros(2, dtype=torch.uint8), 13.0)
    with pytest.raises(TensorInputError, match="chunk must be an int"):
        patched_digests16([(target, None, None)], torch.empty(10, dtype=torch.int16), 50.0)


def test_ints_outside_int64_are_refused_not_wrapped_by_ctypes():
    # ctypes wraps an int outside int64 modulo 2^64: the kernel mapped src_cols=2^64+8 as 8
    idx = torch.arange(40)
    for bad in ({"src_cols": 2**64 + 8}, {"dst_cols": 2**64 + 3}, {"cols": (2, 2**64 + 5)}):
        args = {"src_cols": 8, "cols": (2, 5), "dst_cols": 3, "shift": 1, "pos_base": 0} | bad
        with pytest.raises(TensorInputError, match="outside int64"):
            column_block(idx, **args)


def test_patch16_refuses_a_source_that_is_not_a_tensor():
    target = torch.zeros(4, dtype=BF)
    with pytest.raises(TensorInputError, match=r"source must be a torch\.Tensor"):
        patch16(target, [0.0] * 4, torch.tensor([1]), torch.ones(1, dtype=BF))
    assert int(target.view(torch.int16).abs().sum()) == 0


def test_a_cast_into_a_strided_buffer_gives_nan_the_bits_of_a_plain_cast():
    # a strided out took torch's strided copy, whose NaN is 0x7FC0 where .to() gives 0xFFFF
    src = torch.tensor([float("nan"), 1.0, -float("nan"), 2.5] * 16)
    want = src.to(BF).view(torch.int16)
    for out in (torch.empty(64, dtype=BF), torch.empty(128, dtype=BF)[::2]):
        assert torch.equal(cast_bf16_into(src, out).view(torch.int16), want)
