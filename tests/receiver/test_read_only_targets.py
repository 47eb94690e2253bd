"""Targets in read-only memory (a file mapped ``PROT_READ``, ``mmap`` ``ACCESS_READ``): the
first write into one was a SIGSEGV that killed the whole process, the C scatter and torch's
``index_copy_`` alike. They are refused with a typed error before anything is written, and a
copy-on-write mapping (writable) still receives bit-exactly.

Each refused case runs in a child process, so that the old crash fails the test instead of
killing the test run."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import deltasync

_SRC = str(Path(deltasync.__file__).resolve().parents[1])  # the checkout under test
_TESTS = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve().parent)
_PROT_READ = 1


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bf16_file(path: Path, n: int) -> None:
    path.write_bytes((bytes(range(256)) * (2 * n // 256 + 1))[: 2 * n])


def _mapped(path: Path, access: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``path`` mapped with ``access``, as a flat tensor (torch warns a read-only buffer is
    not writable: that is the case under test)."""
    fd = os.open(path, os.O_RDWR if access != mmap.ACCESS_READ else os.O_RDONLY)
    try:
        m = mmap.mmap(fd, path.stat().st_size, access=access)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=dtype)


def _publisher(tmp: Path):
    from kit import TinyTrainer, tiny_layouts

    from deltasync import LocalStore, Publisher, PublisherConfig, TrainerSync
    from deltasync.trainer import AdamWTracker

    spec, tl, rl = tiny_layouts()
    store = LocalStore(tmp / "store", durable=False)
    model = TinyTrainer(spec, seed=0, density=0.5)
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=100))
    sync = TrainerSync(AdamWTracker(model.opt, model.named_parameters()), pub, model.params)
    return tl, rl, store, model, sync


def _shard_tensors(path: Path, specs, access: int) -> dict[str, torch.Tensor]:
    """The receiver's shard file (``mapped_shard_tensors``' layout) mapped with ``access``."""
    from deltasync.receiver import mapped_shard_tensors
    from deltasync.receiver.mapped import mapped_layout

    mapped_shard_tensors(path, specs)  # created zero-filled
    offsets, _ = mapped_layout(specs)
    raw = _mapped(path, access, torch.uint8)
    return {
        n: raw[o : o + b].view(specs[n].dtype).view(specs[n].shape) for n, (o, b) in offsets.items()
    }


# --- what the child processes run: each prints the typed error it got ---------------------


def _child_scatter16(tmp: Path) -> None:
    from deltasync.native.ops import scatter16

    _bf16_file(tmp / "w.bin", 8192)
    target = _mapped(tmp / "w.bin", mmap.ACCESS_READ)
    idx = torch.tensor([1, 4000, 8191], dtype=torch.int32)
    scatter16(target, idx, torch.ones(3, dtype=torch.bfloat16))


def _child_apply_updates(tmp: Path) -> None:
    from deltasync.format import TensorUpdate, apply_updates

    _bf16_file(tmp / "w.bin", 8192)
    writable = torch.zeros(16, dtype=torch.bfloat16)
    targets = {"a": writable, "w": _mapped(tmp / "w.bin", mmap.ACCESS_READ)}
    ones = torch.ones(2, dtype=torch.bfloat16)
    updates = [
        TensorUpdate("a", (16,), torch.bfloat16, torch.tensor([0, 15]), ones),
        TensorUpdate("w", (8192,), torch.bfloat16, torch.tensor([1, 4000]), ones),
    ]
    try:
        apply_updates(updates, targets)
    finally:
        print("writable target untouched:", int(writable.view(torch.int16).count_nonzero()) == 0)


def _child_apply_pieces_of_an_anchor(tmp: Path) -> None:
    from deltasync.format import TensorUpdate, apply_pieces
    from deltasync.format.merge import TensorPieces

    _bf16_file(tmp / "w.bin", 8192)
    piece = TensorUpdate(
        "w", (8192,), torch.bfloat16, torch.tensor([1, 4000], dtype=torch.int32),
        torch.ones(2, dtype=torch.bfloat16),
    )  # fmt: skip
    chain = TensorPieces("w", (8192,), torch.bfloat16, from_zero=True, pieces=(piece,))
    apply_pieces(chain, {"w": _mapped(tmp / "w.bin", mmap.ACCESS_READ)})  # zero_ first


def _child_receiver_over_read_only_file(tmp: Path) -> None:
    from kit import rconfig

    from deltasync import Receiver

    _, rl, store, _, sync = _publisher(tmp)
    sync.step_published(0)
    tensors = _shard_tensors(tmp / "shard.bin", rl.local_specs("tp0"), mmap.ACCESS_READ)
    Receiver.for_layout(store, rl, "tp0", tensors, str(tmp / "rx"), rconfig("rx")).pull()


def _child_receiver_made_read_only(tmp: Path) -> None:
    from kit import rconfig

    from deltasync import Receiver

    _, rl, store, _, sync = _publisher(tmp)
    sync.step_published(0)
    tensors = _shard_tensors(tmp / "shard.bin", rl.local_specs("tp0"), mmap.ACCESS_WRITE)
    rec = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp / "rx"), rconfig("rx"))
    # built over writable memory, then the mapping is made read-only (mprotect)
    first = next(iter(tensors.values()))
    size = (tmp / "shard.bin").stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(first.data_ptr()), ctypes.c_size_t(size), _PROT_READ):
        raise OSError(ctypes.get_errno(), "mprotect")
    rec.pull()


def _read_only_copy(t: torch.Tensor, path: Path) -> torch.Tensor:
    """A tensor holding ``t``'s bytes in a read-only mapping of ``path``."""
    path.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
    flat = _mapped(path, mmap.ACCESS_READ, torch.uint8)
    return flat.view(t.dtype).view(t.shape)


def _child_cluster_receiver(tmp: Path) -> None:
    from kit import bits
    from test_cluster_single_process import World

    from deltasync.cluster.cluster_journal import JournalState

    world = World()
    world.sync(0, anchor=True)
    world.step(fraction=0.5)
    inbox = world.payloads(1)
    rank, rec = next(iter(world.receivers.items()))
    name = list(rec.tensors)[-1]  # the last: every other tensor would be written before it
    rec.tensors[name] = _read_only_copy(rec.tensors[name], tmp / "w.bin")
    before = {n: t.clone() for n, t in rec.tensors.items()}
    try:
        rec.apply_payload(inbox[rank])
    finally:
        same = all(torch.equal(bits(t), bits(before[n])) for n, t in rec.tensors.items())
        print("every tensor untouched:", same)
        print("journal untouched:", rec.journal.state == JournalState(committed=0))


def _child_engine_dense_load(tmp: Path) -> None:
    from deltasync.engines.adapters import TensorDictEngine, load_dense

    writable = torch.zeros(16, dtype=torch.bfloat16)
    _bf16_file(tmp / "w.bin", 8192)
    engine = TensorDictEngine({"a": writable, "w": _mapped(tmp / "w.bin", mmap.ACCESS_READ)})
    new = {"a": torch.ones(16, dtype=torch.bfloat16), "w": torch.ones(8192, dtype=torch.bfloat16)}
    try:
        load_dense(engine.params(), new)
    finally:
        print("writable target untouched:", int(writable.view(torch.int16).count_nonzero()) == 0)


def _in_child(case: str, tmp: Path) -> subprocess.CompletedProcess:
    """Run ``case`` in a fresh interpreter over files in ``tmp`` (the checkout under test
    first on its path)."""
    code = (
        f"import sys; sys.path[:0] = [{_SRC!r}, {_TESTS!r}, {_HERE!r}, {_TESTS + '/cluster'!r}]\n"
        "from pathlib import Path\n"
        "import test_read_only_targets as t\n"
        "from deltasync.errors import DeltaSyncError\n"
        "try:\n"
        f"    t.{case}(Path({str(tmp)!r}))\n"
        "except DeltaSyncError as exc:\n"
        "    print(f'refused: {type(exc).__name__}: {exc}')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )
    return proc


def _refused(case: str, tmp: Path, error: str) -> str:
    """``case`` run in a child: it must exit normally (not die of SIGSEGV) having been told
    ``error``; returns what it printed (the caller checks its file is unchanged)."""
    proc = _in_child(case, tmp)
    assert proc.returncode == 0, (
        f"the child died of signal {-proc.returncode}"
        if proc.returncode < 0
        else f"the child failed: {proc.stderr[-2000:]}"
    )
    assert f"refused: {error}:" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "read-only memory" in proc.stdout and "Nothing was written" in proc.stdout
    return proc.stdout


@pytest.mark.timeout(240)
def test_the_c_scatter_into_a_read_only_mapping_raises_a_typed_error_and_writes_nothing(
    tmp_path,
):
    _bf16_file(tmp_path / "expected.bin", 8192)
    out = _refused("_child_scatter16", tmp_path, "TensorInputError")
    assert "scatter16: target" in out
    assert _digest(tmp_path / "w.bin") == _digest(tmp_path / "expected.bin")


@pytest.mark.timeout(240)
def test_apply_updates_refuses_a_read_only_target_before_writing_any_target(tmp_path):
    _bf16_file(tmp_path / "expected.bin", 8192)
    out = _refused("_child_apply_updates", tmp_path, "ApplyError")
    assert "tensor 'w'" in out and "writable target untouched: True" in out
    assert _digest(tmp_path / "w.bin") == _digest(tmp_path / "expected.bin")


@pytest.mark.timeout(240)
def test_apply_pieces_refuses_a_read_only_target_before_zeroing_it_for_an_anchor(tmp_path):
    _bf16_file(tmp_path / "expected.bin", 8192)
    out = _refused("_child_apply_pieces_of_an_anchor", tmp_path, "ApplyError")
    assert "tensor 'w'" in out
    assert _digest(tmp_path / "w.bin") == _digest(tmp_path / "expected.bin")


@pytest.mark.timeout(240)
def test_a_receiver_over_a_read_only_mapped_shard_file_is_refused_with_the_file_untouched(
    tmp_path,
):
    out = _refused("_child_receiver_over_read_only_file", tmp_path, "ConfigError")
    assert "receiver shard 'tp0': tensor " in out
    data = (tmp_path / "shard.bin").read_bytes()
    assert data == bytes(len(data))  # zero-filled as created: nothing was written


@pytest.mark.timeout(240)
def test_a_pull_into_a_mapping_made_read_only_after_construction_is_refused_before_any_write(
    tmp_path,
):
    out = _refused("_child_receiver_made_read_only", tmp_path, "ConfigError")
    assert "receiver shard 'tp0': tensor " in out
    data = (tmp_path / "shard.bin").read_bytes()
    assert data == bytes(len(data))


@pytest.mark.timeout(240)
def test_the_in_cluster_receiver_refuses_a_read_only_tensor_before_journaling_or_writing(
    tmp_path,
):
    out = _refused("_child_cluster_receiver", tmp_path, "ConfigError")
    assert "every tensor untouched: True" in out and "journal untouched: True" in out


@pytest.mark.timeout(240)
def test_an_engine_adapters_dense_load_refuses_a_read_only_tensor_before_copying_any(tmp_path):
    _bf16_file(tmp_path / "expected.bin", 8192)
    out = _refused("_child_engine_dense_load", tmp_path, "ApplyError")
    assert "dense load: tensor 'w'" in out and "writable target untouched: True" in out
    assert _digest(tmp_path / "w.bin") == _digest(tmp_path / "expected.bin")


@pytest.mark.timeout(120)
def test_a_copy_on_write_mapping_still_receives_bit_exactly_and_leaves_its_file_alone(tmp_path):
    from kit import expected_shards, rconfig, same_bits

    from deltasync import Receiver

    tl, rl, store, model, sync = _publisher(tmp_path)
    specs = rl.local_specs("tp0")
    tensors = _shard_tensors(tmp_path / "shard.bin", specs, mmap.ACCESS_COPY)  # MAP_PRIVATE
    rec = Receiver.for_layout(store, rl, "tp0", tensors, str(tmp_path / "rx"), rconfig("rx"))
    for version in (0, 1):
        if version:
            model.step()
        sync.step_published(version)
        assert rec.pull().version == version
        assert same_bits(tensors, expected_shards(model.params, tl, rl)["tp0"])
    data = (tmp_path / "shard.bin").read_bytes()
    assert data == bytes(len(data))  # the writes stayed private to this process


def test_the_c_scatter_into_a_copy_on_write_mapping_writes_bit_exactly(tmp_path):
    from deltasync.native.ops import scatter16

    _bf16_file(tmp_path / "w.bin", 8192)
    target = _mapped(tmp_path / "w.bin", mmap.ACCESS_COPY)
    expected = target.clone()
    idx = torch.tensor([0, 4000, 8191], dtype=torch.int32)
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    if not scatter16(target, idx, values):  # no compiler here: the caller's torch path
        target.index_copy_(0, idx.long(), values)
    expected[idx.long()] = values
    assert torch.equal(target.view(torch.int16), expected.view(torch.int16))


def test_a_tensor_loaded_with_torch_load_mmap_is_writable_and_takes_a_scatter(tmp_path):
    from deltasync.format import TensorUpdate, apply_updates

    torch.save({"w": torch.arange(4096).to(torch.bfloat16)}, tmp_path / "w.pt")
    target = torch.load(tmp_path / "w.pt", mmap=True)["w"]  # MAP_PRIVATE: copy-on-write
    expected = target.clone()
    idx = torch.tensor([0, 2047, 4095])
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    apply_updates([TensorUpdate("w", (4096,), torch.bfloat16, idx, values)], {"w": target})
    expected[idx] = values
    assert torch.equal(target.view(torch.int16), expected.view(torch.int16))
