"""Applications built on deltasync, installed beside it as ``deltasync_examples``.

    demo/          ``deltasync demo``: a Qwen3 trainer and two rollout processes, synced every step
    rl/            ``deltasync rl-demo``: online GRPO with rollout workers that prove exact logits
    cluster_job.py ``deltasync cluster-worker``: one rank of a synthetic in-cluster sync job
    harness.py     the one process-over-pipes harness (the demo, the RL demo and the benchmarks)
    models.py      the one tiny Qwen3 config and the one synthetic trainer (seeded AdamW steps)

They use only deltasync's public API; the library knows nothing about them.
"""
