"""Layouts: where each canonical (HF checkpoint) element lives on the trainer and on receivers.

- :class:`ModelSpec`: canonical tensor names and shapes from a Qwen3 / Qwen3-MoE config;
- :class:`TrainerLayout`: transformers-model parameters (or FSDP2 dim-0 shards) → canonical;
- :class:`ReceiverLayout`: canonical → receiver shards (``hf`` or ``vllm`` convention, TP/EP);
- :class:`LayoutTable` / :class:`Block`: the data both are made of.
"""

from deltasync.layout.blocks import Block
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.receiver_layout import ENGINES, ReceiverLayout, ShardInfo
from deltasync.layout.table import LayoutTable, Placement
from deltasync.layout.trainer_layout import TrainerLayout, fsdp_dim0_rows
from deltasync.layout.vllm_rules import pad_vocab

__all__ = [
    "ENGINES",
    "Block",
    "LayoutTable",
    "ModelSpec",
    "Placement",
    "ReceiverLayout",
    "ShardInfo",
    "TrainerLayout",
    "fsdp_dim0_rows",
    "pad_vocab",
]
