"""Engine adapters: an inference engine's live weights, as a receiver sees them.

- :class:`EngineAdapter` (``base``): ``params()``, ``apply(updates)``, ``version``;
- :class:`HFEngine` (``hf``): a transformers model, the ``hf`` shard, written in place;
- :class:`TPQwen3Engine` (``tp_qwen3``): vLLM-convention TP shards with a forward pass that
  proves them right;
- ``vllm_ext.VllmWorkerExtension``: inside a vLLM worker (imported by vLLM by its dotted name,
  never from here, so this package does not need vLLM installed).
"""

from deltasync.engines.base import UNLOADED, EngineAdapter, TensorDictEngine, load_dense
from deltasync.engines.hf import HFEngine, build_hf_model
from deltasync.engines.tp_qwen3 import Qwen3Arch, TPQwen3Engine

__all__ = [
    "UNLOADED",
    "EngineAdapter",
    "HFEngine",
    "Qwen3Arch",
    "TPQwen3Engine",
    "TensorDictEngine",
    "build_hf_model",
    "load_dense",
]
