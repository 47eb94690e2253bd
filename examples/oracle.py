"""The dense-refit oracle: what every receiver shard must hold, computed without deltasync's sync.

``dense_shards`` casts the trainer's full fp32 parameters to BF16 (round to nearest even),
maps them to canonical (HF checkpoint) tensors and splits those into every receiver shard with
the layouts: exactly what a full refit would write. ``reference_shards`` fills vLLM shards the
way vLLM's own weight loaders do (``VllmReferenceLoader``, written apart from the layout
tables), so that a wrong table cannot agree with itself. ``reference_digests`` hashes each
shard with :func:`bits_digest`, which the demo's and the
benchmark's receiver processes apply to their live tensors: the comparison never goes through
the product's own digests or expectations.

This module knows layouts and digests; nothing about trackers, blobs, stores or transports.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltasync import ReceiverLayout, TrainerLayout


def dense_shards(
    params: Mapping[str, torch.Tensor],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> dict[str, dict[str, torch.Tensor]]:
    """Every receiver shard's BF16 tensors from the FULL trainer parameters.

    Args:
        params: every trainer parameter by name, full shapes (fp32 master weights or BF16).
        trainer_layout: maps trainer names to canonical tensors.
        receiver_layout: splits canonical tensors into receiver shards.

    Returns:
        ``{shard: {local name: BF16 tensor}}``, storage names only (as receivers hold them).
    """
    bf16 = {n: p.detach().to(torch.bfloat16).cpu() for n, p in params.items()}
    shards = receiver_layout.split(trainer_layout.to_canonical(bf16))
    return {
        shard: {n: tensors[n] for n in receiver_layout.local_specs(shard)}
        for shard, tensors in shards.items()
    }


def reference_shards(
    params: Mapping[str, torch.Tensor],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`dense_shards`, for a ``vllm`` layout through vLLM's loading conventions instead of
    the layout's split: each shard's parameters as ``VllmReferenceLoader`` (vLLM's
    ``weight_loader`` functions re-stated: vocabulary padding, fused q/k/v and gate/up, row and
    column parallel, experts) fills them from the dense BF16 checkpoint. Other engines: the
    split (an ``hf`` shard is the checkpoint itself)."""
    if receiver_layout.engine != "vllm":
        return dense_shards(params, trainer_layout, receiver_layout)
    from deltasync.layout.reference_loader import VllmReferenceLoader

    bf16 = {n: p.detach().to(torch.bfloat16).cpu() for n, p in params.items()}
    checkpoint = trainer_layout.to_canonical(bf16)
    out = {}
    for shard in receiver_layout.shards():
        engine = VllmReferenceLoader(
            receiver_layout.spec,
            tp=receiver_layout.tp,
            tp_rank=shard.tp_rank,
            ep=receiver_layout.ep,
            ep_rank=shard.ep_rank,
        )
        engine.load_weights(checkpoint.items())
        held = dict(engine.named_parameters())
        names = receiver_layout.local_specs(shard.id)
        if held.keys() != names.keys():
            raise RuntimeError(
                f"shard {shard.id}: the layout names {sorted(set(names) ^ set(held))[:5]} that "
                "vLLM's loaders do not (or the reverse)"
            )
        out[shard.id] = held
    return out


def bits_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A digest of the tensors' names, dtypes, shapes and bit patterns (sorted by name)."""
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_digests(
    params: Mapping[str, torch.Tensor],
    trainer_layout: TrainerLayout,
    receiver_layout: ReceiverLayout,
) -> dict[str, str]:
    """``{shard: bits_digest}`` of :func:`reference_shards`."""
    return {
        shard: bits_digest(tensors)
        for shard, tensors in reference_shards(params, trainer_layout, receiver_layout).items()
    }


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Same names, and every tensor bitwise equal (integer views: -0.0 and NaN payloads count)."""
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape
        and a[n].dtype == b[n].dtype
        and torch.equal(a[n].view(torch.int16), b[n].view(torch.int16))
        for n in a
    )
