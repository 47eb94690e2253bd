"""Layouts: where each canonical (HF checkpoint) element lives on the trainer and on receivers.

- :class:`ModelSpec`: canonical tensor names and shapes from a config (Qwen3, Qwen3-MoE,
  Llama, Mistral, Qwen2, Gemma);
- :class:`TrainerLayout`: transformers-model parameters (or FSDP2 dim-0 shards) → canonical;
- :class:`ReceiverLayout`: canonical → receiver shards (``hf`` or ``vllm`` convention, TP/EP);
- :class:`LayoutTable` / :class:`Block`: the data both are made of;
- :func:`probe_shard` / :func:`probe_receiver_layout`: layouts learned from an engine's own
  ``load_weights`` (:class:`VllmReferenceLoader` re-states vLLM's; :class:`ProbeCache` keeps
  them per model config, engine and parallel sizes).
"""

from deltasync.layout.blocks import Block
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.probe import ProbeConfig, probe_shard
from deltasync.layout.probe_blocks import ShardProbe, assemble_table
from deltasync.layout.probed import ProbeCache, probe_receiver_layout
from deltasync.layout.receiver_layout import ENGINES, ReceiverLayout, ShardInfo
from deltasync.layout.reference_loader import VllmReferenceLoader
from deltasync.layout.table import LayoutTable, Placement
from deltasync.layout.trainer_layout import TrainerLayout, fsdp_dim0_rows
from deltasync.layout.vllm_rules import pad_vocab

__all__ = [
    "ENGINES",
    "Block",
    "LayoutTable",
    "ModelSpec",
    "Placement",
    "ProbeCache",
    "ProbeConfig",
    "ReceiverLayout",
    "ShardInfo",
    "ShardProbe",
    "TrainerLayout",
    "VllmReferenceLoader",
    "assemble_table",
    "fsdp_dim0_rows",
    "pad_vocab",
    "probe_receiver_layout",
    "probe_shard",
]
