"""The live tensors of one vLLM worker's receiver shard, and how writes reach its kernels.

:class:`VllmShard` is built inside a vLLM worker from the worker's own model and configs: the
TP/EP rank and sizes come from vLLM's parallel state, the model family from its HF config, and
the receiver layout (``ReceiverLayout.build(spec, engine="vllm", tp=..., ep=...)``) says which
local tensors the shard holds. ``targets`` are what a :class:`~deltasync.Receiver` writes into.

Where a write lands (:attr:`VllmShard.path`):

- ``inplace`` (GPU workers, and CPU builds whose linear kernels read ``layer.weight`` on every
  call): every target *is* the parameter the engine computes with. An update is a scatter of
  the changed elements, O(changed); nothing else runs.
- ``repack`` (vLLM's CPU backend where linear kernels prepack): after loading, vLLM's
  post-load processing (``quant_method.process_weights_after_loading`` ->
  ``dispatch_cpu_unquantized_gemm``) reorders each linear weight into a oneDNN / SGL-kernel
  buffer of its own and replaces ``layer.weight`` with an empty tensor (``lm_head`` keeps its
  tensor but computes with the packed copy). Writes into the parameter never reach such a
  kernel. Here each packed layer gets a plain BF16 *master* of its receiver-shard shape, the
  receiver scatters into the master, and :meth:`refresh` re-runs vLLM's own post-load
  processing for the layers whose masters changed, from the master. Same kernel choice, same
  packing code, so outputs equal a fresh engine loaded with the same weights bit for bit.
  Costs: one extra copy of the packed layers' weights (master + packed), and each touched
  layer is repacked, O(layer size), per update. The packed layers' values are gone after
  load, so the masters start unknown and the first update restores the newest anchor.

  vLLM's CPU MoE experts are packed differently: ``cpu_prepack_moe_weight`` reorders
  ``w13_weight``/``w2_weight`` *inside* the parameter (same shape and dtype). Their masters
  are prepacked into the parameter again with vLLM's own op (``prepack_moe_weight``).

Which linear layers are packed is measured, not assumed (:func:`kernel_reads_weight`). A packed CPU
engine must run with ``enforce_eager=True``: a compiled graph keeps the kernel it captured.

The masters are the receiver's record of what the engine computes with, so anything else that
writes the engine's weights (vLLM's own ``reload_weights``, which re-runs the post-load
processing of every layer) makes them stale while they still hash to the version held.
:meth:`VllmShard.drifted` finds that before an update or a re-init trusts them: a packed layer
whose kernel is not the one the shard last built, an engine tensor whose values differ from
its master, an expert parameter whose bytes differ from those the shard last prepacked.

This module imports vLLM only inside functions that run in a worker. It knows the model's
modules and the receiver layout; nothing about stores, versions or the weight-transfer API.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deltasync import ModelSpec, ReceiverLayout
from deltasync.engines.adapters import check_every_parameter_written
from deltasync.errors import ConfigError
from deltasync.layout.digest import tensor_digest

log = logging.getLogger(__name__)

PATHS = ("inplace", "repack")


# The engine dtypes a BF16 value converts to and back exactly: the receiver's masters are BF16.
_HOLDS_BF16 = (torch.bfloat16, torch.float32, torch.float64)


def kernel_reads_weight(layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """True if ``layer.cpu_linear`` computes with the weight it is called with (so in-place
    writes reach it); False if it computes with a packed copy of its own.

    Probe: call it with a random weight and with its negation. A kernel that reads the argument
    returns different outputs; a packed kernel returns the same bits both times."""
    gen = torch.Generator().manual_seed(0)
    x = torch.ones((1, weight.shape[1]), dtype=weight.dtype)
    probe = torch.randn(tuple(weight.shape), generator=gen).to(weight.dtype)
    with torch.no_grad():
        a = layer.cpu_linear(x, probe, None)
        b = layer.cpu_linear(x, -probe, None)
    return not torch.equal(a, b)


@dataclass(frozen=True)
class ShardPlace:
    """Where a vLLM worker sits: its TP rank/size and EP rank/size (EP = 1 when off)."""

    tp_rank: int
    tp: int
    ep_rank: int = 0
    ep: int = 1

    @classmethod
    def from_vllm(cls, parallel_config: Any) -> ShardPlace:
        """Read this worker's place from vLLM's parallel state and config (in a worker)."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        tp_rank = get_tensor_model_parallel_rank()
        tp = get_tensor_model_parallel_world_size()
        if getattr(parallel_config, "pipeline_parallel_size", 1) != 1:
            raise ConfigError(
                "deltasync's vLLM layouts cover TP and EP; pipeline_parallel_size must be 1"
            )
        if not getattr(parallel_config, "enable_expert_parallel", False):
            return cls(tp_rank=tp_rank, tp=tp)
        # vLLM's expert-parallel group spans TP x DP: EP rank = dp_rank * tp + tp_rank.
        dp = int(getattr(parallel_config, "data_parallel_size", 1))
        dp_rank = int(getattr(parallel_config, "data_parallel_rank", 0))
        return cls(tp_rank=tp_rank, tp=tp, ep_rank=dp_rank * tp + tp_rank, ep=tp * dp)


class VllmShard:
    """One worker's receiver shard: layout, shard id, write targets, packed layers.

    ``model`` is the worker's live model (``model_runner.get_model()``), ``hf_config`` its
    ``model_config.hf_config``. ``layout``: the receiver layout to hold (one probed from this
    engine's own loader, :mod:`.vllm_probe`); None builds the ``vllm`` convention's
    (``ReceiverLayout.build``). ``path`` is ``"auto"`` (measure), ``"inplace"`` (refuse a
    packed kernel) or ``"repack"``. ``eager``: whether the engine runs without a compiled
    graph (required for ``repack``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: Any,
        place: ShardPlace,
        *,
        layout: ReceiverLayout | None = None,
        path: str = "auto",
        eager: bool = True,
    ) -> None:
        if path not in ("auto", *PATHS):
            raise ConfigError(f"path must be one of {('auto', *PATHS)}, got {path!r}")
        self.spec = ModelSpec.from_hf_config(hf_config)
        if layout is None:
            layout = ReceiverLayout.build(self.spec, engine="vllm", tp=place.tp, ep=place.ep)
        elif layout.table.src_shapes != self.spec.canonical_shapes() or (layout.tp, layout.ep) != (
            place.tp,
            place.ep,
        ):
            raise ConfigError(
                f"the receiver layout given is for tp={layout.tp} ep={layout.ep} and "
                f"{len(layout.table.src_shapes)} canonical tensors; this worker runs "
                f"tp={place.tp} ep={place.ep} with a {self.spec.model_type!r} model of "
                f"{len(self.spec.canonical_shapes())}: probe this engine's model again"
            )
        self.layout = layout
        self.place = place
        self.shard = self._shard_id(place)
        self.specs = self.layout.local_specs(self.shard)
        params = dict(model.named_parameters())
        # layout name -> vLLM's parameter name (the same but for renamings listed in _ALIASES)
        self.engine_names = {n: _engine_name(n, params) for n in self.specs}
        live = {n: params[e] for n, e in self.engine_names.items() if e in params}
        missing = [n for n in self.specs if n not in live]
        if missing:
            raise ConfigError(
                f"the vLLM model has no parameters {missing[:4]} of receiver shard "
                f"{self.shard!r}; is this the model of the store, served with tp={place.tp}?"
            )
        check_every_parameter_written("vLLM", params, self.engine_names.values(), self.shard)
        self.targets: dict[str, torch.Tensor] = {}
        # local name -> the engine tensor a BF16 master mirrors (None: packing dropped it),
        # its dtype, and the layers whose packed kernels are built from it
        self._mirrors: dict[str, tuple[torch.Tensor | None, torch.dtype, list[torch.nn.Module]]]
        self._mirrors = {}
        # local name -> (the expert parameter vLLM's CPU MoE kernel reads, its prepack ISA)
        self._moe: dict[str, tuple[torch.Tensor, str]] = {}
        # local name -> the bytes' digest of its expert parameter as last prepacked here
        self._moe_digests: dict[str, bytes] = {}
        # id(layer) -> (layer, the packed kernel it computes with, as built or last rebuilt)
        self._kernels: dict[int, tuple[torch.nn.Module, Any]] = {}
        self._lost = False
        for name, spec in self.specs.items():
            p = live[name].data
            layer = model.get_submodule(self.engine_names[name].rpartition(".")[0])
            isa = _moe_prepack_isa(layer, self.engine_names[name])
            if isa is not None:
                # vLLM's CPU MoE experts hold their weights prepacked *in the parameter*
                # (same shape and dtype, bytes reordered for the kernel): its values cannot be
                # read back, and a write in checkpoint order would scramble them. A BF16 master
                # takes the writes; the refresh prepacks it into the parameter.
                if tuple(p.shape) != spec.shape or p.dtype != spec.dtype:
                    raise ConfigError(
                        f"vLLM expert weight {name!r} is {tuple(p.shape)} {p.dtype} (padded by "
                        f"the CPU MoE kernel?); the layout says {spec.shape} {spec.dtype}"
                    )
                self.targets[name] = torch.zeros(spec.shape, dtype=spec.dtype)
                self._moe[name] = (p, isa)
                self._lost = True
                continue
            packed = _is_packed(layer, p)
            if p.numel() and tuple(p.shape) != spec.shape:
                raise ConfigError(
                    f"vLLM parameter {name!r} is {tuple(p.shape)}; the receiver layout of "
                    f"shard {self.shard!r} says {spec.shape}"
                )
            if not p.is_floating_point():
                raise ConfigError(f"vLLM parameter {name!r} is {p.dtype}, not a float tensor")
            if p.dtype not in _HOLDS_BF16:
                raise ConfigError(
                    f"vLLM parameter {name!r} is {p.dtype}, which cannot hold every BF16 value "
                    "(float16 rounds those below its normal range and overflows above 65504): "
                    "the engine would compute with weights other than the trainer's. Serve the "
                    "model in bfloat16 (dtype='bfloat16') or float32"
                )
            if not packed and p.dtype == spec.dtype:
                self.targets[name] = p  # the engine computes with this very tensor
                continue
            # A BF16 master the receiver writes into: the packed kernel owns the values (the
            # parameter is empty, or for lm_head a tensor the kernel ignores), or the engine
            # computes in a wider dtype (fp32 holds BF16 values exactly, so widening is exact).
            if p.numel():
                master = p.to(spec.dtype)
            else:
                master = torch.zeros(spec.shape, dtype=spec.dtype, device=p.device)
                self._lost = True
            self.targets[name] = master
            self._mirrors[name] = (p if p.numel() else None, p.dtype, [layer] if packed else [])
        self._tied: dict[str, list[torch.nn.Module]] = {}
        self._add_tied_kernels(model)
        for layer in self._packed_layers():
            self._kernels[id(layer)] = (layer, layer.cpu_linear)
        if path == "auto":
            path = "repack" if self._mirrors or self._moe else "inplace"
        if path == "inplace" and (self._mirrors or self._moe):
            raise ConfigError(
                f"path 'inplace' cannot reach {sorted({*self._mirrors, *self._moe})[:3]} (packed CPU kernels or "
                "a non-BF16 engine dtype); use path 'repack'"
            )
        if path == "repack" and self.packed and not eager:
            raise ConfigError(
                "packed CPU kernels are re-built after each update; a compiled graph would keep "
                "the old ones: start the engine with enforce_eager=True"
            )
        self.path = path
        log.info(
            "vLLM shard %s: %d tensors, path %s, %d BF16 masters, %d packed",
            self.shard,
            len(self.targets),
            self.path,
            len(self._mirrors),
            len(self.packed),
        )

    def _shard_id(self, place: ShardPlace) -> str:
        for info in self.layout.shards():
            if info.tp_rank == place.tp_rank and info.ep_rank == place.ep_rank:
                return info.id
        raise ConfigError(f"no receiver shard for {place} in the vLLM layout")

    def _add_tied_kernels(self, model: torch.nn.Module) -> None:
        """A packed kernel that another module built from a target's engine tensor (a tied
        ``lm_head``: its own packed copy of ``embed_tokens``' weight) is rebuilt when that
        target changes, whether the target is written in place or through a BF16 master (vLLM's
        CPU embedding method packs ``embed_tokens`` too, so with packing kernels the tied
        weight has a master and ``lm_head`` kept the logits of the loaded weights)."""
        by_ptr: dict[int, str] = {}
        for n, t in self.targets.items():
            engine_tensor = self._mirrors[n][0] if n in self._mirrors else t
            if engine_tensor is not None:
                by_ptr[engine_tensor.data_ptr()] = n
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor):
                continue
            name = by_ptr.get(weight.data_ptr()) if weight.numel() else None
            if name is None or weight.ndim != 2:
                continue
            if name in self._mirrors and any(m is module for m in self._mirrors[name][2]):
                continue  # the target's own layer: rebuilt from its master already
            if not kernel_reads_weight(module, weight):
                self._tied.setdefault(name, []).append(module)

    @property
    def packed(self) -> list[str]:
        """Targets whose kernels compute with a packed copy (rebuilt after a write)."""
        packed = {n for n, (_, _, layers) in self._mirrors.items() if layers}
        return sorted(packed | set(self._tied) | set(self._moe))

    @property
    def mirrored(self) -> list[str]:
        """Targets that are BF16 masters of an engine tensor (the ``repack`` path)."""
        return sorted({*self._mirrors, *self._moe})

    @property
    def values_lost(self) -> bool:
        """True when load-time packing dropped values (those masters hold zeros): the shard
        holds no version until a full one (an anchor) is written."""
        return self._lost

    def _packed_layers(self) -> Iterable[torch.nn.Module]:
        for _, _, layers in self._mirrors.values():
            yield from layers
        for layers in self._tied.values():
            yield from layers

    def drifted(self) -> list[str]:
        """Targets whose engine side no longer holds what this shard last wrote there: a
        packed layer computing with a kernel this shard did not build, an engine tensor that
        differs from its BF16 master, an expert parameter whose bytes changed since this
        shard prepacked it. Empty on the in-place path (the receiver hashes the very tensors
        the engine computes with). Reads every mirrored engine tensor that keeps values,
        a chunk at a time; the rest is O(layers)."""
        out = set()
        for name, (engine_tensor, _, layers) in self._mirrors.items():
            if self._rebuilt_elsewhere(layers) or (
                engine_tensor is not None and not _holds(engine_tensor, self.targets[name])
            ):
                out.add(name)
        out.update(name for name, layers in self._tied.items() if self._rebuilt_elsewhere(layers))
        for name, (param, _) in self._moe.items():
            seen = self._moe_digests.get(name)
            if seen is not None and tensor_digest(param) != seen:
                out.add(name)
        return sorted(out)

    def _rebuilt_elsewhere(self, layers: list[torch.nn.Module]) -> bool:
        """Whether a packed layer computes with a kernel this shard did not build."""
        return any(self._kernels[id(layer)][1] is not layer.cpu_linear for layer in layers)

    def refresh(self, names: Iterable[str]) -> int:
        """Bring the engine's tensors and kernels up to date with the masters in ``names``:
        widen into the engine tensor, and re-run vLLM's post-load processing for packed
        layers. Returns the number of tensors refreshed (0 on the in-place path)."""
        done = 0
        with torch.no_grad():
            for name in names:
                if name in self._moe:
                    param, isa = self._moe[name]
                    # vLLM's own prepack (cpu_prepack_moe_weight), into the parameter's storage
                    torch.ops._C.prepack_moe_weight(self.targets[name].contiguous(), param, isa)
                    self._moe_digests[name] = tensor_digest(param)
                    done += 1
                if name in self._mirrors:
                    engine_tensor, dtype, layers = self._mirrors[name]
                    master = self.targets[name]
                    if engine_tensor is not None:
                        engine_tensor.copy_(master)  # BF16 -> the engine's dtype: exact
                    for layer in layers:
                        weight = engine_tensor if engine_tensor is not None else master.to(dtype)
                        _repack(layer, weight)
                        self._kernels[id(layer)] = (layer, layer.cpu_linear)
                    done += 1
                # after the engine tensor holds the new values: tied kernels pack from it
                for layer in self._tied.get(name, ()):
                    _repack(layer, layer.weight)
                    self._kernels[id(layer)] = (layer, layer.cpu_linear)
                    done += 1
        return done


# Parameter renamings between vLLM releases, tried in order when a layout name is absent:
# vLLM 0.32's FusedMoE keeps the routed experts' weights in a ``routed_experts`` submodule.
_ALIASES = (
    (".mlp.experts.w13_weight", ".mlp.experts.routed_experts.w13_weight"),
    (".mlp.experts.w2_weight", ".mlp.experts.routed_experts.w2_weight"),
)


def _engine_name(name: str, params: dict[str, torch.Tensor]) -> str:
    if name in params:
        return name
    for old, new in _ALIASES:
        if name.endswith(old) and (alias := name[: -len(old)] + new) in params:
            return alias
    return name


def _moe_prepack_isa(layer: torch.nn.Module, engine_name: str) -> str | None:
    """The ISA vLLM's CPU MoE experts prepacked ``engine_name`` with, or None if the layer's
    expert weights are read as loaded (GPU kernels, zentorch, not an expert weight)."""
    if engine_name.rpartition(".")[2] not in ("w13_weight", "w2_weight"):
        return None
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or "CPU" not in type(experts).__name__ or not hasattr(experts, "isa"):
        return None
    if getattr(experts, "_use_zentorch", False):
        return None
    return experts.isa


_COMPARE_ELEMENTS = 1 << 20  # a chunk of :func:`_holds`: 4 MiB of a float32 engine tensor


def _holds(engine_tensor: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether ``engine_tensor`` holds exactly ``master``'s BF16 values, widened to its
    dtype (the master widened a chunk at a time: narrowing the engine's values instead would
    round away a difference)."""
    flat, want = engine_tensor.reshape(-1), master.reshape(-1)
    for lo in range(0, flat.numel(), _COMPARE_ELEMENTS):
        hi = lo + _COMPARE_ELEMENTS
        if not torch.equal(flat[lo:hi], want[lo:hi].to(flat.dtype)):
            return False
    return True


def _is_packed(layer: torch.nn.Module, p: torch.Tensor) -> bool:
    if not hasattr(layer, "cpu_linear"):
        return False
    return p.numel() == 0 or (p.ndim == 2 and not kernel_reads_weight(layer, p))


def _repack(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """vLLM's own post-load step for this layer, from ``weight``. A linear layer's processing
    (``remove_weight=True``) swaps ``layer.weight`` for an empty tensor again; the master
    survives on the shard. Embedding-type layers (``lm_head``) keep ``weight``."""
    if layer.weight.data_ptr() != weight.data_ptr() or layer.weight.shape != weight.shape:
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    quant_method = getattr(layer, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
        quant_method.process_weights_after_loading(layer)
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
