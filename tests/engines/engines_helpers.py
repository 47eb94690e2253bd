"""Test helpers: a small AdamW trainer and its per-shard updates, built from public APIs.

The trainer path here is deliberately the plain one (tracker -> trainer layout -> receiver
layout -> TensorUpdate -> wire format) so the engine tests exercise what a receiver gets.
"""

from __future__ import annotations

import torch
from kit import HFTrainer, TinyTrainer, bits_equal, expected_shards, tiny_qwen3  # noqa: F401 - bits_equal is re-exported

from deltasync.format import TensorUpdate, decode_blob, encode_blob
from deltasync.layout import ModelSpec, ReceiverLayout, TrainerLayout
from deltasync.trainer import AdamWTracker


def tiny_hf_config(*, heads=4, kv_heads=2, tie=False, vocab=203, hidden=64, layers=2) -> dict:
    """The kit's tiny Qwen3 with the engine tests' sizes (vocab 203: padded to 256 by vLLM)."""
    return tiny_qwen3(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        intermediate_size=96,
        vocab_size=vocab,
        tie_word_embeddings=tie,
    )


# The engine-side tests' model: the tiny config as the SGLang loader and the vLLM shard see it.
ENGINE_CONFIG = tiny_hf_config()


class TrackedHFTrainer(HFTrainer):
    """fp32 master weights, AdamW at a high lr (so most elements change), a tracker."""

    def __init__(self, hf_config: dict, *, seed: int = 0, lr: float = 1e-3) -> None:
        super().__init__(seed=seed, lr=lr, hf_config=hf_config, batch=(4, 9))
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.trainer_layout = TrainerLayout(self.spec)
        self.tracker = AdamWTracker(self.opt, self.model.named_parameters())

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
            TensorUpdate(
                name=n, shape=specs[shard][n].shape, dtype=torch.bfloat16, indices=i, values=v
            )
            for n, (i, v) in locals_.items()
        ]
    return out


def through_the_wire(
    updates: list[TensorUpdate], layout: ReceiverLayout, shard: str, version: int
) -> list[TensorUpdate]:
    """Encode and decode, validated against the shard's layout, as a receiver would."""
    blob = encode_blob(updates, version=version, base_version=version - 1, shard=shard, writer="w0")
    return decode_blob(blob, expected=layout.local_specs(shard), shard=shard).updates


# --- engine-side fakes for the vLLM shard and the SGLang loader (no vLLM/SGLang needed) -------


class FakeLinear(torch.nn.Module):
    """A linear layer following vLLM's CPU contract: ``cpu_linear(x, weight, bias)`` computes
    the layer, and ``quant_method.process_weights_after_loading(layer)`` is its post-load step.

    ``packs=True`` behaves like vLLM's oneDNN / SGL-kernel dispatch: the post-load step copies
    the weight into a buffer of the kernel's own and (``remove_weight``) replaces
    ``layer.weight`` with an empty tensor; the kernel then ignores the weight it is given.
    ``packs=False`` is the ``F.linear`` fallback: the kernel reads the weight argument."""

    def __init__(self, weight: torch.Tensor, *, packs: bool, remove_weight: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.packs = packs
        self.remove_weight = remove_weight
        self.quant_method = self
        self.packed_copy: torch.Tensor | None = None
        self.repacks = 0
        self.process_weights_after_loading(self)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        assert layer is self
        if not self.packs:
            self.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)
            return
        packed = self.weight.detach().clone()  # the kernel's own copy
        self.packed_copy = packed
        self.repacks += 1
        self.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, packed, b)
        if self.remove_weight:
            self.weight = torch.nn.Parameter(
                torch.empty(0, dtype=packed.dtype), requires_grad=False
            )

    def served_weight(self) -> torch.Tensor:
        """What the kernel computes with."""
        return self.packed_copy if self.packs else self.weight.data


def module_tree(tensors: dict[str, torch.Tensor], *, packs: bool = False, dtype=None):
    """An ``nn.Module`` whose ``named_parameters()`` are ``tensors`` (dotted names, as an engine
    names them). 2-D ``*_proj.weight`` / ``lm_head.weight`` tensors become :class:`FakeLinear`
    layers (``lm_head`` keeps its weight after packing, as vLLM's embedding method does)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        t = t.clone() if dtype is None else t.to(dtype)
        *path, leaf = name.split(".")
        owner_path, attr = path[:-1], path[-1]
        node = root
        for part in owner_path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        linear = leaf == "weight" and t.ndim == 2 and (attr.endswith("_proj") or attr == "lm_head")
        if linear:
            node.add_module(attr, FakeLinear(t, packs=packs, remove_weight=attr != "lm_head"))
        else:
            if not hasattr(node, attr):
                node.add_module(attr, torch.nn.Module())
            getattr(node, attr).register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


class StoreTrainer(TinyTrainer):
    """The kit's masked-quadratic AdamW trainer (10% of the elements get a gradient each step),
    publishing each version to a store with TrainerSync, as a trainer process would."""

    def __init__(self, hf_config: dict, store, *, tp: int = 1, seed: int = 0) -> None:
        from deltasync import AdamWTracker, Publisher, PublisherConfig, TrainerSync

        super().__init__(ModelSpec.from_hf_config(hf_config), seed=seed, lr=1e-3, density=0.1)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.trainer_layout = TrainerLayout(self.spec)
        self.layout = ReceiverLayout.build(self.spec, engine="vllm", tp=tp)
        publisher = Publisher(
            store, receiver_layout=self.layout, config=PublisherConfig(anchor_every=50)
        )
        tracker = AdamWTracker(self.opt, list(self.params.items()))
        self.sync = TrainerSync(tracker, publisher, self.params)

    def publish(self, version: int) -> None:
        self.sync.step_published(version)

    def split(self) -> dict[str, dict[str, torch.Tensor]]:
        """The oracle: a dense split of the canonical BF16 weights."""
        return expected_shards(self.params, self.trainer_layout, self.layout)


def corrupt_one_blob(store_dir, version: int, shard: str) -> None:
    """Flip one byte in the middle of ``shard``'s blob of ``version`` in a directory store."""
    from pathlib import Path

    (blob,) = sorted((Path(store_dir) / f"v{version:08d}" / shard).glob("*.blob"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
