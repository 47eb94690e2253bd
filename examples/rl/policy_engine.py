"""The rollout engine of the RL demo, built the same way in workers and in the trainer.

A rollout worker holds an engine whose tensors start empty and are filled only by
``Receiver.pull``; the trainer builds the *same* engine class from a dense split of its BF16
weights to compute the reference probe logits. Same class, same weights, same compute dtype,
one thread each: the logits must then be bit-identical, and any difference is a sync bug.

This module knows the two engine kinds and the receiver layout they use; nothing about
processes, stores or RL.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltasync.engines import HFEngine, TensorDictEngine, TPQwen3Engine
from deltasync.layout import ModelSpec, ReceiverLayout


class RolloutEngine:
    """``shards()``: shard id -> engine adapter the receivers write into; ``logits(ids)``."""

    def __init__(self, engine_kind: str, hf_config: dict, tp: int) -> None:
        self.kind = engine_kind
        spec = ModelSpec.from_hf_config(hf_config)
        if engine_kind == "tp":
            self.layout = ReceiverLayout.build(spec, engine="vllm", tp=tp)
            self._tp = TPQwen3Engine(spec, _arch(hf_config), tp=tp, compute_dtype=torch.float32)
            self._shards = dict(self._tp.ranks)
        else:
            self.layout = ReceiverLayout.build(spec, engine="hf")
            self._hf = HFEngine.from_config(hf_config)
            (sid,) = [s.id for s in self.layout.shards()]
            self._shards = {sid: self._hf}

    @classmethod
    def from_canonical(
        cls, engine_kind: str, hf_config: dict, tp: int, canonical: Mapping[str, torch.Tensor]
    ) -> RolloutEngine:
        """A dense load of ``canonical`` (the trainer's reference of one version)."""
        engine = cls(engine_kind, hf_config, tp)
        for sid, tensors in engine.layout.split(canonical).items():
            adapter = engine.shards()[sid]
            with torch.no_grad():
                for name, t in tensors.items():
                    adapter.params()[name].copy_(t)
            adapter.version = 0
        return engine

    def shards(self) -> Mapping[str, TensorDictEngine | HFEngine]:
        return self._shards

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "tp":
            return self._tp.logits(input_ids)
        return self._hf.logits(input_ids)


def _arch(hf_config: dict):
    from deltasync.engines import Qwen3Arch

    return Qwen3Arch.from_hf_config(hf_config)
