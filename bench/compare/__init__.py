"""``deltasync bench``: dense refit vs snapshot delta vs deltasync, one workload, one run.

workload.py     model shapes, presets, the trainer's real AdamW steps
systems/        the three systems, trainer side and receiver side each
roles.py        the processes (one trainer, N receivers), driven over pipes
memory.py       per-process peak RSS over one sync (Linux VmHWM reset)
run.py          the orchestrator: spawn, step, verify, collect medians
report.py       table, PNG plot, final JSON line
"""
