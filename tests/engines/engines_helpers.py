"""Test helpers: a small AdamW trainer and its per-shard updates, built from public APIs.

The trainer path here is deliberately the plain one (tracker -> trainer layout -> receiver
layout -> TensorUpdate -> wire format) so the engine tests exercise what a receiver gets.
"""

from __future__ import annotations

import torch
from kit import bits_equal, tiny_qwen3  # noqa: F401 - bits_equal is re-exported

from deltasync.format import TensorUpdate, decode_blob, encode_blob
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.trainer import AdamWTracker


def tiny_hf_config(*, heads=4, kv_heads=2, tie=False, vocab=203, hidden=64, layers=2) -> dict:
    return tiny_qwen3(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=16, intermediate_size=96, vocab_size=vocab,
        tie_word_embeddings=tie,
    )  # fmt: skip


class TinyTrainer:
    """fp32 master weights, AdamW at a high lr (so most elements change), a tracker."""

    def __init__(self, hf_config: dict, *, seed: int = 0, lr: float = 1e-3) -> None:
        from deltasync.engines import build_hf_model

        torch.manual_seed(seed)
        self.model = build_hf_model(hf_config, dtype=torch.float32).train()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.trainer_layout = TrainerLayout(self.spec)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.tracker = AdamWTracker(self.opt, self.model.named_parameters())
        self.vocab = hf_config["vocab_size"]
        self.gen = torch.Generator().manual_seed(seed + 1)

    def step(self) -> None:
        ids = torch.randint(0, self.vocab, (4, 9), generator=self.gen)
        logits = self.model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1)
        )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def canonical_bf16(self) -> dict[str, torch.Tensor]:
        sd = {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}
        return self.trainer_layout.to_canonical(sd)

    def canonical_changes(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Changed canonical elements since the last call, ``{name: (indices, bf16 values)}``;
        clears the tracker (the receivers' new baseline)."""
        changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        params = dict(self.model.named_parameters())
        for name, idx in self.tracker.changed().items():
            values = params[name].detach().reshape(-1)[idx].to(torch.bfloat16)
            changes.update(self.trainer_layout.route_values(name, idx, values))
        self.tracker.clear()
        return changes


def shard_updates(
    changes: dict[str, tuple[torch.Tensor, torch.Tensor]], layout: ReceiverLayout
) -> dict[str, list[TensorUpdate]]:
    """Canonical changes -> per-shard updates of one receiver layout."""
    out: dict[str, list[TensorUpdate]] = {}
    specs = {s.id: layout.local_specs(s.id) for s in layout.shards()}
    for shard, locals_ in layout.route_changes(changes).items():
        out[shard] = [
            TensorUpdate(name=n, shape=specs[shard][n].shape, dtype=torch.bfloat16,
                         indices=i, values=v)
            for n, (i, v) in locals_.items()
        ]  # fmt: skip
    return out


def through_the_wire(
    updates: list[TensorUpdate], layout: ReceiverLayout, shard: str, version: int
) -> list[TensorUpdate]:
    """Encode and decode, validated against the shard's layout, as a receiver would."""
    blob = encode_blob(updates, version=version, base_version=version - 1, shard=shard, writer="w0")
    return decode_blob(blob, expected=layout.local_specs(shard), shard=shard).updates
