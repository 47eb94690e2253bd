"""Apply deltasync updates inside a vLLM worker, in place, through vLLM's worker extension.

vLLM's documented route for touching an engine's weights from outside is a *worker extension*:
``LLM(..., worker_extension_cls="deltasync.engines.vllm_ext.VllmWorkerExtension")`` mixes this
class into every worker, and ``llm.collective_rpc("deltasync_apply", args=(...))`` runs the
method on each TP rank. Each rank decodes *its own* blob (``tp{rank}``) against the vLLM
receiver layout of the served model, validates all of it, then scatters the values into the
live parameters.

Where a write lands (``VllmShardAdapter.mode``):

- ``inplace`` -- GPU, and CPU builds whose linear kernels read ``layer.weight`` on every call
  (vLLM's ``torch.nn.functional.linear`` fallback, e.g. BF16 on an AVX2-only CPU): the
  parameters are the weights; a scatter is the whole apply.
- ``repack`` (CPU default where kernels prepack) -- vLLM's CPU backend hands each linear
  layer to oneDNN or the SGL kernels after loading (``dispatch_cpu_unquantized_gemm``), which
  reorder the weight into their own blocked buffer and replace ``layer.weight`` with an empty
  tensor, so a write to the parameter never reaches the kernel. Here each packed layer gets a
  plain BF16 *master* tensor (its receiver-shard tensor), updates are scattered into the master,
  and vLLM's own dispatch is re-run for the layers that changed, repacking from the master.
  The kernel is vLLM's own, so outputs are bit-identical to a fresh engine loaded with the same
  weights. Cost: one extra copy of the linear weights (master + packed) and a repack of each
  touched layer per sync (a reorder, O(layer size), no I/O).
- ``unpacked`` (CPU, opt-in) -- the packed layers are switched to
  ``torch.nn.functional.linear`` over the master: one copy of the weights and a pure scatter
  per sync, but a different (usually slower) GEMM than vLLM's packed one, so outputs match an
  engine run the same way, not a packed engine.

Which layers are packed is *measured*, not assumed: a layer whose kernel ignores the weight
argument it is called with is packed (``_kernel_reads_weight``). On CPU the engine must run with
``enforce_eager=True``: a compiled graph would keep the kernel it captured.

Packed layers lost their values when vLLM packed them, so a ``repack``/``unpacked`` shard starts
at version -1 and needs one dense load (``deltasync_load``, e.g. from an anchor) before deltas.

This module imports vLLM only inside the worker; it knows nothing about stores or manifests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltasync.engines.base import UNLOADED
from deltasync.errors import ApplyError, ConfigError
from deltasync.format import TensorUpdate, apply_updates, decode_blob
from deltasync.layout import ModelSpec, ReceiverLayout
from deltasync.names import shard_id

MODES = ("auto", "inplace", "repack", "unpacked")


def _kernel_reads_weight(layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """True if ``layer.cpu_linear`` computes with the weight it is called with (so in-place
    writes reach it); False if it uses a packed copy of its own.

    Probe: call it with a random weight and with its negation. A kernel that reads the argument
    returns different outputs; a packed kernel computes with its own copy both times and returns
    the same bits (whatever the served values are, zeros included).
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.ones((1, weight.shape[1]), dtype=weight.dtype)
    probe = torch.randn(weight.shape, generator=gen).to(weight.dtype)
    with torch.no_grad():
        a = layer.cpu_linear(x, probe, None)
        b = layer.cpu_linear(x, -probe, None)
    return not torch.equal(a, b)


class VllmShardAdapter:
    """The engine adapter of one vLLM worker's shard (lives inside the worker)."""

    def __init__(
        self, model: torch.nn.Module, hf_config, tp_rank: int, tp: int, mode: str, version: int
    ):
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.layout = ReceiverLayout.build(self.spec, engine="vllm", tp=tp)
        self.shard = shard_id(tp_rank)
        self.specs = self.layout.local_specs(self.shard)
        self.model = model
        self.version = UNLOADED
        live = dict(model.named_parameters())
        missing = [n for n in self.specs if n not in live]
        if missing:
            raise ConfigError(
                f"vLLM model has no parameters {missing[:4]} of receiver shard {self.shard!r}"
            )
        self._params: dict[str, torch.Tensor] = {}
        self._packed: dict[str, torch.nn.Module] = {}  # local name -> layer with a packed kernel
        for name, spec in self.specs.items():
            layer = model.get_submodule(name.rpartition(".")[0])
            p = live[name]
            packed = hasattr(layer, "cpu_linear") and (
                p.numel() == 0 or not _kernel_reads_weight(layer, p.data)
            )
            if not packed:
                self._check(name, p.data)
                self._params[name] = p.data
                continue
            # The packed kernel owns the values; the parameter is empty or stale. Give the
            # layer a real tensor of the receiver-shard shape: the master to write into.
            master = p.data if p.numel() else torch.zeros(spec.shape, dtype=p.dtype)
            self._check(name, master)
            if p.numel() == 0:
                layer.weight = torch.nn.Parameter(master, requires_grad=False)
            self._params[name] = master
            self._packed[name] = layer
        if mode == "auto":
            mode = "repack" if self._packed else "inplace"
        if mode == "inplace" and self._packed:
            raise ConfigError(
                f"mode 'inplace' cannot reach the packed CPU kernels of {list(self._packed)[:3]}; "
                "use 'repack' (exact, 2x linear-weight memory) or 'unpacked' (1x, torch GEMM)"
            )
        self.mode = mode
        if mode == "unpacked":
            for layer in set(self._packed.values()):
                layer.cpu_linear = _plain_linear
        # Until a dense load, packed layers' masters hold zeros, not the served weights.
        self.version = UNLOADED if self._packed else version

    def _check(self, name: str, t: torch.Tensor) -> None:
        spec = self.specs[name]
        if tuple(t.shape) != spec.shape or t.dtype not in (spec.dtype, torch.float32):
            raise ConfigError(
                f"vLLM parameter {name!r} is {tuple(t.shape)} {t.dtype}; the receiver layout says "
                f"{spec.shape} {spec.dtype} (or float32 holding BF16 values)"
            )

    def params(self) -> Mapping[str, torch.Tensor]:
        return self._params

    def apply(self, updates: Sequence[TensorUpdate]) -> int:
        written = apply_updates([self._widen(u) for u in updates], self._params)
        self._refresh({u.name for u in updates})
        return written

    def load(self, tensors: Mapping[str, torch.Tensor], *, version: int) -> None:
        if set(tensors) != set(self._params):
            raise ApplyError(
                f"dense load of shard {self.shard!r}: names differ from the layout's; nothing "
                "was written"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise ApplyError(
                    f"dense load: {name!r} has shape {tuple(t.shape)}; nothing written"
                )
        with torch.no_grad():
            for name, t in tensors.items():
                self._params[name].copy_(t)  # bf16 -> fp32 widening is exact
        self._refresh(set(tensors))
        self.version = version

    def _widen(self, u: TensorUpdate) -> TensorUpdate:
        """An fp32 engine holds BF16 values widened; widening is exact, so convert the update."""
        target = self._params.get(u.name)
        if target is None or target.dtype == u.dtype:
            return u
        return TensorUpdate(
            name=u.name, shape=u.shape, dtype=target.dtype, indices=u.indices,
            values=u.values.to(target.dtype),
        )  # fmt: skip

    def _refresh(self, names: set[str]) -> None:
        if self.mode != "repack":
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for layer in {id(lay): lay for n, lay in self._packed.items() if n in names}.values():
            # Re-run vLLM's own dispatch on the updated master: same kernel choice, fresh pack.
            # remove_weight=False keeps the master as layer.weight for the next sync.
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def _plain_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


class VllmWorkerExtension:
    """Mixed into vLLM's worker; every method is meant for ``llm.collective_rpc``.

    Names carry a ``deltasync_`` prefix: vLLM refuses an extension whose attributes collide
    with the worker's.
    """

    def _deltasync_adapter(self) -> VllmShardAdapter:
        adapter = getattr(self, "_deltasync", None)
        if adapter is None:
            raise ConfigError("call collective_rpc('deltasync_prepare') first")
        return adapter

    def deltasync_prepare(self, mode: str = "auto", version: int = UNLOADED) -> dict:
        """Find the live tensors of this rank's shard. ``version``: what the engine was loaded
        with (kept only if every tensor is live; packed shards need a dense load first).
        Returns the shard id, mode, version and the packed tensors' names."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        runner = self.model_runner
        self._deltasync = VllmShardAdapter(
            runner.get_model(),
            runner.model_config.hf_config,
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
            mode,
            version,
        )
        a = self._deltasync
        return {"shard": a.shard, "mode": a.mode, "version": a.version, "packed": sorted(a._packed)}

    def deltasync_load(self, shards: Mapping[str, Mapping[str, torch.Tensor]], version: int) -> str:
        """Dense load of this rank's shard from ``{shard_id: {local_name: tensor}}``."""
        a = self._deltasync_adapter()
        if a.shard not in shards:
            raise ApplyError(f"dense load has no tensors for shard {a.shard!r}")
        a.load(shards[a.shard], version=version)
        return a.shard

    def deltasync_apply(self, blobs: Mapping[str, bytes], version: int, base_version: int) -> int:
        """Decode and apply this rank's blob; the shard must be at ``base_version``."""
        a = self._deltasync_adapter()
        if a.version != base_version:
            raise ApplyError(
                f"shard {a.shard!r} is at version {a.version}, the delta to {version} needs "
                f"{base_version}; load an anchor or replay the missing deltas. Nothing was written"
            )
        blob = blobs.get(a.shard)
        if blob is None:
            raise ApplyError(f"no blob for shard {a.shard!r} in version {version}")
        decoded = decode_blob(
            blob, expected=a.specs, version=version, base_version=base_version, shard=a.shard
        )
        written = a.apply(decoded.updates)
        a.version = version
        return written

    def deltasync_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, copies of this rank's live tensors) -- for tests and digests."""
        a = self._deltasync_adapter()
        return a.version, {n: t.detach().clone() for n, t in a.params().items()}
