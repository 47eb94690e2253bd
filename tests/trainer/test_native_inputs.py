"""Every entry into the C kernels takes whatever it is handed without crashing: a seeded fuzz
of DTensors, strided/offset/transposed/expanded views, wrong dtypes, mismatched shapes, meta
and zero-size tensors. Each call either raises TensorInputError naming the tensor or returns
exactly what the torch path returns on a contiguous copy of the same values."""

from __future__ import annotations

import random

import pytest
import torch
from kit import bits_equal, one_rank_mesh

from deltasync.errors import TensorInputError
from deltasync.native import loader as native
from deltasync.native.ops import bf16_at, first_not_increasing
from deltasync.trainer.adamw_bound import StepHyper, kernel_scalars
from deltasync.trainer.detect import (
    bits_to_indices,
    bitset_bytes,
    detect_adamw_,
    detect_adamw_changes,
    detect_adamw_indices,
)

K = kernel_scalars(
    StepHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, step=3)
)


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo group, so real DTensors can be built in this process."""
    with one_rank_mesh() as m:
        yield m


def _reference(p, m, v):
    """The torch path on contiguous copies: (bitset, indices, values)."""
    pc, mc, vc = (t.detach().contiguous().clone() for t in (p, m, v))
    bits = torch.zeros(bitset_bytes(pc.numel()), dtype=torch.uint8)
    detect_adamw_(pc, mc, vc, K, bits, force_torch=True)
    idx = torch.nonzero(
        ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[: pc.numel()]
    ).reshape(-1)
    vals = pc.reshape(-1)[idx].to(torch.bfloat16)
    return bits, idx, vals


def _views(
    rng: random.Random, gen: torch.Generator, n_rows: int, n_cols: int, scale: float, positive: bool
):
    """A base tensor (with a sprinkle of special values) and one kind of view of it."""
    base = torch.randn(n_rows + 3, n_cols + 5, generator=gen) * scale
    if positive:
        base = base.abs()
    base.view(-1)[:: max(1, rng.randint(5, 40))] = torch.tensor(
        [0.0, -0.0, 1e-40, float("inf"), float("nan"), 3e38, 1.0]
    )[rng.randint(0, 6)]
    kind = rng.choice(
        ["plain", "offset", "strided", "transpose", "expand", "zero", "scalar", "flat"]
    )
    if kind == "plain":
        t = base[:n_rows, :n_cols].contiguous()
    elif kind == "offset":
        off = rng.randint(1, 7)
        t = base.view(-1)[off : off + n_rows * n_cols].view(n_rows, n_cols)
    elif kind == "strided":
        t = base[:n_rows, : n_cols + 4 : 2]
    elif kind == "transpose":
        t = base[:n_cols, :n_rows].t() if n_cols <= n_rows + 3 else base[:n_rows, :n_cols]
    elif kind == "expand":
        t = base[:1, :n_cols].expand(n_rows, n_cols)
    elif kind == "zero":
        t = base[:0, :n_cols]
    elif kind == "scalar":
        t = base[0, 0].clone()
    else:
        t = base.view(-1)[3 : 3 + n_rows]
    return kind, t


@pytest.mark.parametrize("seed", range(6))
def test_detection_entry_points_match_the_torch_path_on_every_kind_of_view(seed):
    assert native.load() is not None, native.build_error
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        rows, cols = rng.randint(1, 40), rng.randint(1, 70)
        made = [
            _views(rng, gen, rows, cols, sc, pos)
            for sc, pos in ((0.02, False), (1e-3, False), (1e-6, True))
        ]
        kinds, (p, m, v) = zip(*made, strict=True)
        if rng.random() < 0.5:  # states of the param's shape, so the paths are compared more often
            m = torch.randn(p.shape, generator=gen) * 1e-3
            v = torch.rand(p.shape, generator=gen) * 1e-6
        if tuple(p.shape) != tuple(m.shape) or tuple(p.shape) != tuple(v.shape):
            with pytest.raises(TensorInputError, match="shape"):
                detect_adamw_changes(p, m, v, K)
            continue
        ref_bits, ref_idx, ref_vals = _reference(p, m, v)
        idx, vals = detect_adamw_changes(p, m, v, K, threads=2)
        assert torch.equal(idx, ref_idx), kinds
        assert bits_equal(vals, ref_vals), kinds
        assert torch.equal(detect_adamw_indices(p, m, v, K), ref_idx), kinds
        nbytes = bitset_bytes(p.numel()) + rng.randint(0, 3)
        if rng.random() < 0.3:  # a strided bitset view: the torch path writes through it
            bits = torch.zeros(2 * nbytes + 1, dtype=torch.uint8)[1::2]
        else:
            bits = torch.zeros(nbytes, dtype=torch.uint8)
        detect_adamw_(p, m, v, K, bits)
        assert torch.equal(bits[: ref_bits.numel()], ref_bits), kinds
        assert torch.equal(bits_to_indices(bits, p.numel()), ref_idx), kinds
        if p.numel():
            assert bits_equal(bf16_at(p, ref_idx), ref_vals), kinds


def test_wrong_dtypes_meta_sparse_and_bad_bitsets_raise_typed_errors_naming_the_tensor():
    p = torch.randn(10, 8)
    m, v = torch.zeros_like(p), torch.ones_like(p)
    cases = [
        ((p.double(), m, v), "param has dtype torch.float64"),
        ((p, m.bfloat16(), v), "exp_avg has dtype torch.bfloat16"),
        ((p, m, v.half()), "exp_avg_sq has dtype torch.float16"),
        ((p.to("meta"), m, v), "param is on the meta device"),
        ((p.to_sparse(), m, v), "param has layout"),
        ((p, m[:5], v), "exp_avg has shape"),
        ((p, m, v.reshape(8, 10)), "exp_avg_sq has shape"),
        ((p, m, "v"), "exp_avg_sq must be a torch.Tensor"),
    ]
    for args, match in cases:
        with pytest.raises(TensorInputError, match=match):
            detect_adamw_changes(*args, K)
        with pytest.raises(TensorInputError, match=match):
            detect_adamw_(*args, K, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(TensorInputError, match="bits holds 3 bytes; 80 elements need 10"):
        detect_adamw_(p, m, v, K, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TensorInputError, match=r"bits has dtype torch.int32"):
        detect_adamw_(p, m, v, K, torch.zeros(10, dtype=torch.int32))
    with pytest.raises(TensorInputError, match="expanded view"):
        detect_adamw_(p, m, v, K, torch.zeros(1, dtype=torch.uint8).expand(10))
    with pytest.raises(TensorInputError, match="overlaps"):
        detect_adamw_(p, m, v, K, p.view(torch.uint8).reshape(-1))
    with pytest.raises(TensorInputError, match=r"indices has dtype torch.float32"):
        first_not_increasing(torch.tensor([1.0, 2.0]))
    with pytest.raises(TensorInputError, match="must be 1-D"):
        first_not_increasing(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TensorInputError, match=r"values has dtype torch.int64"):
        bf16_at(torch.arange(5), torch.tensor([1]))
    with pytest.raises(TensorInputError, match="meta"):
        bf16_at(torch.zeros(5, device="meta"), torch.tensor([1]))


def test_order_check_and_gather_take_the_torch_path_on_views_and_narrow_ints():
    x = torch.arange(0, 200, 3)
    for idx in (
        x,
        x[::2],
        x[5:],
        x.to(torch.int32),
        torch.stack([x, x])[:, 1:][0],
        x.expand(1, -1)[0],
    ):
        assert first_not_increasing(idx) == -1
    bad = x.clone()
    bad[7] = bad[6]
    assert first_not_increasing(bad) == 7 == first_not_increasing(bad.to(torch.int32))
    assert first_not_increasing(bad[::1]) == 7
    vals = torch.randn(300)
    want = vals[x].to(torch.bfloat16)
    for idx in (x, x.to(torch.int32), x[::1]):
        assert bits_equal(bf16_at(vals, idx), want)
    assert bits_equal(bf16_at(vals.expand(2, -1)[1], x), want)


def test_dtensors_are_refused_by_every_entry_point_with_the_remedy(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    p = distribute_tensor(torch.randn(16, 4), mesh, [Shard(0)])
    m, v = torch.zeros(16, 4), torch.ones(16, 4)
    with pytest.raises(TensorInputError, match=r"param is a tensor subclass DTensor.*to_local"):
        detect_adamw_changes(p, m, v, K)
    with pytest.raises(TensorInputError, match="exp_avg is a tensor subclass DTensor"):
        detect_adamw_(
            p.to_local(),
            distribute_tensor(m, mesh, [Shard(0)]),
            v,
            K,
            torch.zeros(8, dtype=torch.uint8),
        )
    with pytest.raises(TensorInputError, match="DTensor"):
        bf16_at(p, torch.tensor([0, 3]))
    with pytest.raises(TensorInputError, match="DTensor"):
        first_not_increasing(distribute_tensor(torch.arange(4), mesh, [Shard(0)]))
    # the local shard is a plain tensor: the kernel takes it
    idx, vals = detect_adamw_changes(p.to_local(), m, v, K)
    _ref_bits, ref_idx, ref_vals = _reference(p.to_local(), m, v)
    assert torch.equal(idx, ref_idx) and bits_equal(vals, ref_vals)
