"""One vLLM engine in its own process (vLLM keeps global state; one engine per process).

``python vllm_job.py SPEC.json``: start an engine from ``spec["checkpoint"]`` with the deltasync
worker extension, optionally prepare it (``mode``), dense-load ``load`` (a torch file of
``{shard: {name: tensor}}``), apply the blobs in ``blobs`` (``[[version, path], ...]``), and
generate greedily with logprobs from ``prompts`` before and after; save both, and the shard's
state, to ``spec["out"]``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc runs in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch


def main(path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(path) as f:
        spec = json.load(f)
    llm = LLM(
        model=spec["checkpoint"],
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        enforce_eager=True,  # a compiled graph would keep the kernels it captured
        max_model_len=64,
        max_num_seqs=8,
        seed=0,
        worker_extension_cls="deltasync.engines.vllm_ext.VllmWorkerExtension",
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=5,
                            detokenize=False)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def generate() -> tuple[list, list]:
        results = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(r.outputs[0].token_ids) for r in results]
        logprobs = [
            [{tok: lp.logprob for tok, lp in step.items()} for step in r.outputs[0].logprobs]
            for r in results
        ]
        return tokens, logprobs

    out: dict = {"before": generate()}
    if spec.get("mode"):
        out["prepare"] = llm.collective_rpc(
            "deltasync_prepare", args=(spec["mode"], spec["version"])
        )
        if spec.get("load"):
            llm.collective_rpc("deltasync_load", args=(torch.load(spec["load"]), spec["version"]))
        written = 0
        for version, blob_path in spec.get("blobs", []):
            with open(blob_path, "rb") as f:
                blob = f.read()
            written += sum(
                llm.collective_rpc("deltasync_apply", args=({"tp0": blob}, version, version - 1))
            )
        out["written"] = written
        out["state"] = llm.collective_rpc("deltasync_state")[0]
    out["tokens"], out["logprobs"] = generate()
    torch.save(out, spec["out"])


if __name__ == "__main__":
    main(sys.argv[1])
