"""The one test kit: the tiny Qwen3, bitwise equality, the dense-refit oracle and the trainers.

Imported by bare name (``from kit import ...``): ``tests/`` is on ``sys.path`` through the
root conftest. Everything model- or oracle-shaped comes from the applications' own modules
(``deltasync_examples.models`` / ``.oracle``), so tests, examples and benchmarks share one
tiny config, one synthetic trainer and one oracle.

- ``TINY_QWEN3`` / ``tiny_qwen3(**overrides)`` / ``tiny_spec`` / ``tiny_layouts``: the tiny
  Qwen3 (hidden 64, 2 layers, GQA 4/2, head_dim 16, vocab 251) and its layouts;
- ``bits``, ``bits_equal``, ``same_bits``, ``assert_same_bits``: equality on integer views
  (float ``==`` treats -0.0 == +0.0 and NaN != NaN), for one tensor or a dict of tensors;
- ``expected_shards``: the oracle, a dense split of the trainer's canonical BF16 weights;
- ``random_update``: a seeded sparse ``TensorUpdate`` of one tensor of a spec dict, and
  ``random_tensors``: seeded live tensors for such a dict;
- ``zero_tensors``: a receiver shard's live tensors, all zeros; ``rconfig``: a
  ``ReceiverConfig`` without fsyncs (tests kill processes, not power);
- ``SyntheticTrainer`` (seeded Gaussian gradients, any FSDP split), ``TinyTrainer`` (a masked
  quadratic loss: a chosen fraction of elements gets a gradient each step), ``HFTrainer``
  (transformers' Qwen3ForCausalLM on random tokens);
- ``one_torch_thread``: an autouse-able fixture running a test module's torch single-threaded
  (tiny tensors; forked children must not inherit a busy OpenMP pool: on a shared 2-core
  machine it made small AdamW steps ~10x slower);
- ``one_rank_mesh()``: a one-rank gloo group and its CPU device mesh in this process, so real
  DTensors can be built without spawning;
- ``mounted_tmpfs(path)``: a small tmpfs mounted at ``path`` (skips where mounting is not
  permitted), unmounted on exit; ``fill_up(path)`` fills it to its last page, so the next
  write there meets a real ENOSPC;
- ``unlinked_fds_under(path)``: the unlinked files under ``path`` this process holds open.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from deltasync import ModelSpec, ReceiverConfig, ReceiverLayout, TrainerLayout
from deltasync.format import TensorSpec, TensorUpdate
from deltasync_examples.models import TINY_QWEN3, SyntheticTrainer, build_model, tiny_qwen3

__all__ = [
    "TINY_QWEN3",
    "HFTrainer",
    "SyntheticTrainer",
    "TinyTrainer",
    "assert_same_bits",
    "bits",
    "bits_equal",
    "build_model",
    "expected_shards",
    "fill_up",
    "mounted_tmpfs",
    "one_rank_mesh",
    "one_torch_thread",
    "rconfig",
    "same_bits",
    "tiny_layouts",
    "tiny_qwen3",
    "tiny_spec",
    "zero_tensors",
]


def tiny_spec(**overrides: object) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_qwen3(**overrides))


def tiny_layouts(engine: str = "vllm", tp: int = 2, **overrides: object):
    """``(spec, TrainerLayout, ReceiverLayout)`` of the tiny Qwen3 (with ``overrides``)."""
    spec = tiny_spec(**overrides)
    return spec, TrainerLayout(spec), ReceiverLayout.build(spec, engine, tp)


# ---------------------------------------------------------------------- bitwise equality


# An integer dtype of each element size: a view as it needs no contiguity (any strides, also
# the stride-0 elements of an expanded tensor) and compares bit patterns, not float values.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a 16-bit tensor as int16 (BF16 / FP16 weights); any strides."""
    return t.view(torch.int16)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (integer views: ±0 and NaN payloads count), on any
    devices (both are compared on the CPU)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.element_size() in _INT_OF_SIZE:
        as_int = _INT_OF_SIZE[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_bits(a: dict, b: dict) -> bool:
    """Same names and every tensor :func:`bits_equal`."""
    return a.keys() == b.keys() and all(bits_equal(a[n], b[n]) for n in a)


def assert_same_bits(actual: dict, expected: dict, what: str = "") -> None:
    assert actual.keys() == expected.keys(), f"{what}: names differ"
    bad = [n for n in expected if not bits_equal(actual[n], expected[n])]
    assert not bad, f"{what}: tensors differ bitwise: {bad[:5]}"


def expected_shards(params, trainer_layout: TrainerLayout, receiver_layout: ReceiverLayout):
    """Oracle: dense split of the canonical BF16 weights (what a full refit would write)."""
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    return receiver_layout.split(trainer_layout.to_canonical(bf16))


def random_update(
    specs: dict[str, TensorSpec],
    name: str,
    gen: torch.Generator,
    density: float,
    keep: torch.Tensor | None = None,
) -> TensorUpdate:
    """A sparse update of ``specs[name]``: each element listed with probability ``density``
    (only where ``keep`` is true, when given), random values in the tensor's dtype."""
    spec = specs[name]
    mask = torch.rand(math.prod(spec.shape), generator=gen) < density
    if keep is not None:
        mask &= keep
    idx = torch.nonzero(mask).view(-1)
    vals = torch.randn(idx.numel(), generator=gen).to(spec.dtype)
    return TensorUpdate(name=name, shape=spec.shape, dtype=spec.dtype, indices=idx, values=vals)


def random_tensors(specs: dict[str, TensorSpec], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Live tensors for ``specs``, random values in each tensor's dtype."""
    return {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in specs.items()}


def zero_tensors(receiver_layout: ReceiverLayout, shard: str) -> dict[str, torch.Tensor]:
    """A receiver shard's live tensors before its first pull: zeros of every local spec."""
    specs = receiver_layout.local_specs(shard)
    return {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}


def rconfig(receiver_id: str, **kwargs: object) -> ReceiverConfig:
    """A ReceiverConfig without fsyncs of the journal and state files: the tests kill
    processes, not power, and the page cache survives SIGKILL."""
    return ReceiverConfig(receiver_id=receiver_id, durable=False, **kwargs)


# ---------------------------------------------------------------------- trainers


def anchored_bf16(store, *, seed: int):
    """Random BF16 params of the tiny model, published to ``store`` as anchor 0 by a publisher
    that sends deltas after it: (trainer layout, receiver layout, params, publisher)."""
    from deltasync import Publisher, PublisherConfig

    _, tl, rl = tiny_layouts()
    gen = torch.Generator().manual_seed(seed)
    params = {
        n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
        for n, s in tl.param_shapes().items()
    }
    pub = Publisher(store, receiver_layout=rl, config=PublisherConfig(anchor_every=1000))
    pub.publish(0, [], params, anchor=True)
    return tl, rl, params, pub


def publish_edit(pub, params: dict[str, torch.Tensor], version: int, count: int) -> None:
    """Add 1 to the first ``count`` elements of the first param and publish them as
    ``version``."""
    name = next(iter(params))
    params[name].view(-1)[:count] += 1
    idx = torch.arange(count, dtype=torch.int64)
    pub.publish(version, [(name, idx, params[name].view(-1)[:count].clone())], params)


class TinyTrainer:
    """fp32 master params with TrainerLayout names, AdamW(lr) on a masked quadratic loss.
    ``device`` holds params and optimizer state; the random draws are made on the CPU, so the
    same seed gives the same trajectory on any device."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        seed: int = 0,
        lr: float = 1e-3,
        density: float = 0.05,
        device: str | torch.device = "cpu",
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        shapes = TrainerLayout(spec).param_shapes()
        self.params = {
            n: torch.nn.Parameter(
                (
                    torch.ones(s)
                    if n.endswith("norm.weight")
                    else torch.randn(s, generator=self.gen) * 0.02
                ).to(device)
            )
            for n, s in shapes.items()
        }
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, foreach=False)
        self.density = density
        self.steps = 0

    def step(self) -> None:
        self.opt.zero_grad()
        for p in self.params.values():
            mask = (torch.rand(p.shape, generator=self.gen) < self.density).to(p.device)
            target = (torch.randn(p.shape, generator=self.gen) * 0.02).to(p.device)
            p.grad = torch.where(mask, p.detach() - target, 0.0)
        self.opt.step()
        self.steps += 1

    def named_parameters(self):
        return list(self.params.items())


class HFTrainer:
    """transformers' Qwen3ForCausalLM (the tiny config with ``overrides``, or ``hf_config``),
    AdamW on next-token loss over random tokens; the same seeds give the same trajectory in
    every process."""

    def __init__(
        self,
        *,
        seed: int = 0,
        lr: float = 1e-3,
        hf_config: dict | None = None,
        batch: tuple[int, int] = (2, 12),
        data_seed: int | None = None,
        **overrides: object,
    ) -> None:
        cfg = tiny_qwen3(**overrides) if hf_config is None else {**hf_config, **overrides}
        self.hf_config = cfg
        self.vocab_size = cfg["vocab_size"]
        self.batch = batch
        self.model = build_model(cfg, seed=seed)
        self.config = self.model.config
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1 if data_seed is None else data_seed)

    def step(self) -> None:
        ids = torch.randint(0, self.vocab_size, self.batch, generator=self.gen)
        self.opt.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()


# ---------------------------------------------------------------------- process groups


@contextmanager
def one_rank_mesh() -> Iterator[object]:
    """A one-rank gloo group (an in-memory store, no ports) and its 1-D CPU device mesh,
    destroyed on exit. Fails if this process already has a group: two tests must not share one
    by accident."""
    if dist.is_initialized():
        raise AssertionError("a process group is already initialized in this test process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``: Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def settled_rss() -> int:
    """Collect garbage, hand the heap's free pages back, reset the RSS high-water mark to the
    current RSS and return it in bytes: the baseline of a peak measured with
    ``status_kib("VmHWM")``."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    return status_kib("VmRSS") * 1024


def _in_child(target, args: tuple, results) -> None:
    try:
        results.put(target(*args))
    except BaseException as exc:  # reported by the test, not lost with the child
        results.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


def in_fresh_process(target, *args: object, timeout_s: float = 240.0):
    """``target(*args)`` in a fresh (spawned) interpreter, its return value back here (its
    error raised here). Memory tests measure there: in a process that ran a thousand tests
    first, heap the allocator keeps and the arenas of finished threads move the high-water
    mark by megabytes either way."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_in_child, args=(target, args, results))
    proc.start()
    got = results.get(timeout=timeout_s)
    proc.join(60)
    if isinstance(got, RuntimeError):
        raise got
    return got


def told_in_another_process(imports: str, opens: str, path) -> str:
    """What another process is told when it runs ``opens`` (an expression of ``path``, bound
    to the name ``path`` there, after ``imports``): the text of the LocalStateError it
    raised, or ``"opened"``."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from deltasync.errors import LocalStateError\n"
        f"{imports}\n"
        "path = sys.argv[1]\n"
        "try:\n"
        f"    {opens}\n"
        "except LocalStateError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('opened')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def spy_digest_pass(monkeypatch, module) -> list[int]:
    """Wrap ``module.state_tensor_digests`` (the digest pass a sender calls); returns the list
    that receives, per call, how many receiver tensors' entries the pass was given (``keep``:
    hashed by the detection pass, not read again)."""
    given: list[int] = []
    pass_ = module.state_tensor_digests

    def spying(params, *, trainer_layout, receiver_layout, keep=None):
        given.append(sum(len(v) for v in (keep or {}).values()))
        return pass_(
            params, trainer_layout=trainer_layout, receiver_layout=receiver_layout, keep=keep
        )

    monkeypatch.setattr(module, "state_tensor_digests", spying)
    return given


# ---------------------------------------------------------------------- a full filesystem


@contextmanager
def mounted_tmpfs(path, size: str = "1m") -> Iterator[object]:
    """A tmpfs of ``size`` mounted at ``path`` (created); skips the test where mounting is not
    permitted (not root, a container without CAP_SYS_ADMIN); always unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path, leave: int = 0) -> None:
    """Write ``path/FILLER`` until the filesystem is full (a real ENOSPC), then give ``leave``
    bytes back (a tmpfs counts whole pages: pass multiples of 4096); remove the file to free
    the space again."""
    fd = os.open(path / "FILLER", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28, exc  # ENOSPC
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


def unlinked_fds_under(path) -> list[str]:
    """Targets of this process's fds to unlinked files under ``path`` (a pull's spill and stash
    files: each shows as its dir's path plus a ``(deleted)`` or an O_TMPFILE ``#inode`` name;
    the state dir's lock does not)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)) and ("(deleted)" in target or "/#" in target):
            out.append(target)
    return out
