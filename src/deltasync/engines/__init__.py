"""Engine adapters: an inference engine's live weights, as a receiver sees them.

- :class:`EngineAdapter` (``base``): ``params()``, ``apply(updates)``, ``version``;
- :class:`HFEngine` (``hf``): a transformers model, the ``hf`` shard, written in place;
- :class:`TPQwen3Engine` (``tp_qwen3``): vLLM-convention TP shards with a forward pass that
  proves them right;
- vLLM's weight-transfer backend ``"deltasync"``: ``vllm_plugin`` (the ``vllm.general_plugins``
  entry point), ``vllm_backend`` (worker side), ``vllm_trainer`` (trainer side),
  ``vllm_shard`` (a worker's live tensors and packed CPU kernels). Imported by vLLM or by the
  caller, never from here, so this package does not need vLLM installed.
"""

from deltasync.engines.adapters import (
    UNLOADED,
    EngineAdapter,
    HFEngine,
    TensorDictEngine,
    build_hf_model,
    load_dense,
)
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
