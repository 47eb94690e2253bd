"""``deltasync demo``: a trainer and two rollout-worker processes, synced every step.

The trainer (this process) holds a config-built ``transformers`` Qwen3 in fp32 and takes real
REINFORCE steps with AdamW at an RL learning rate. After each step ``TrainerSync`` publishes
the changed BF16 elements to a local-filesystem store; two receiver processes holding
vLLM-convention TP=2 shards pull, stage, journal, apply in place and verify. The trainer checks
every receiver's state digest against ``split(bf16(trainer))``, and every step it also measures a
dense refit of the same version (full shard files written, fetched and loaded), so the summary
compares the two on the same run. Every process reaches the store through an emulated link
(``link_gbps``, 1 Gbit/s by default: ``ThrottledStore``, the benchmark's link), as a trainer and
rollout workers on different hosts do; 0 uses the local disk at memory speed, where a dense
refit of a model this small costs no more than a delta.

A run that ends early (a receiver process dies or fails: :class:`ChildGoneError` /
:class:`ChildFailedError`, typed; a Ctrl-C) stops its receivers and removes its temporary run
directory on the way out, and the exception carries the summary so far as ``summary``
(``exact`` false, ``steps_done``), for the CLI's final JSON line.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as st_save

from deltasync.errors import ConfigError
from deltasync_examples.demo.policy import PolicyConfig, RolloutConfig, build_policy, pg_step
from deltasync_examples.demo.receiver_proc import open_demo_store, receiver_main
from deltasync_examples.demo.run_dir import check_store_dir, run_dir
from deltasync_examples.harness import FAILED_JOIN_S, close_all, spawn
from deltasync_examples.oracle import dense_shards, reference_digests


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = 12
    lr: float = 3e-6
    tp: int = 2
    store: str | None = None  # a local directory, absent or empty; default: a temporary one
    link_gbps: float = 1.0  # each process's link to the store (emulated); 0: none
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"DemoConfig.steps must be an int >= 1, got {self.steps!r}")
        if not 0 < self.lr < 1:
            raise ConfigError(f"DemoConfig.lr must be in (0, 1), got {self.lr!r}")
        gbps = self.link_gbps
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not gbps >= 0:
            raise ConfigError(
                f"DemoConfig.link_gbps must be a number >= 0 (0: no emulated link), got {gbps!r}"
            )
        check_store_dir("DemoConfig.store", self.store)


def run(cfg: DemoConfig, console=None) -> dict:
    """Run the demo in its run directory (``cfg.store``, or a temporary one removed at the
    end); return the summary the CLI prints as one JSON line."""
    with run_dir(cfg.store, prefix="deltasync-demo-") as root:
        return _run(cfg, root, console)


def _run(cfg: DemoConfig, root: str, console) -> dict:
    from rich.console import Console
    from rich.table import Table

    from deltasync import (
        AdamWTracker,
        ModelSpec,
        Publisher,
        PublisherConfig,
        ReceiverLayout,
        TrainerLayout,
        TrainerSync,
    )

    if console is None:  # wide enough for the tables even when stdout is not a terminal
        console = Console() if Console().is_terminal else Console(width=150)
    store_root = os.path.join(root, "store")
    hf_config = cfg.policy.hf_config()
    spec = ModelSpec.from_hf_config(hf_config)
    rlayout = ReceiverLayout.build(spec, engine="vllm", tp=cfg.tp)
    tlayout = TrainerLayout.build(spec)
    shards = [s.id for s in rlayout.shards()]

    model = build_policy(cfg.policy)
    named = list(model.named_parameters())
    params = {n: p.detach() for n, p in named}
    n_params = sum(p.numel() for p in params.values())
    opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, weight_decay=0.01)
    store = open_demo_store(store_root, cfg.link_gbps)
    tracker = AdamWTracker(opt, named)
    sync = TrainerSync(
        tracker,
        Publisher(
            store,
            receiver_layout=rlayout,
            trainer_layout=tlayout,
            config=PublisherConfig(anchor_every=50),
        ),
        params,
    )
    link = f"an emulated {cfg.link_gbps:g} Gbit/s link" if cfg.link_gbps else "the local disk"
    console.print(
        f"[bold]deltasync demo[/]: Qwen3 {n_params / 1e6:.1f} M params (fp32 trainer, AdamW lr={cfg.lr:g}), "
        f"2 receiver processes with vLLM TP={cfg.tp} shards {shards}, store {store_root} "
        f"(each process through {link}{'; removed at exit, --store keeps one' if cfg.store is None else ''})"
    )
    sync.step_published(0, anchor=True)  # version 0: the anchor receivers bootstrap from

    rows: list[dict] = []
    conns = []
    finished = False
    try:
        for shard in shards:  # one at a time: a failed start still stops the ones before
            conns.append(
                spawn(
                    receiver_main,
                    store_root,
                    cfg.link_gbps,
                    os.path.join(root, f"rx-{shard}"),
                    hf_config,
                    cfg.tp,
                    shard,
                    name=f"demo receiver {shard}",
                )
            )
        for c in conns:
            c.recv()
        for c in conns:
            c.call("pull", 0)

        def expected() -> dict[str, str]:
            # bf16(trainer) as vLLM's own loaders place it: apart from the layout under test
            return reference_digests(params, tlayout, rlayout)

        table = Table(title="per step")
        for h in [
            "step",
            "reward",
            "changed",
            "sent",
            "dense",
            "stall s",
            "pull s",
            "pause ms",
            "dense s",
            "verified",
        ]:
            table.add_column(h, justify="right")
        gen = torch.Generator().manual_seed(cfg.policy.seed)
        all_ok = True
        for v in range(1, cfg.steps + 1):
            stats = pg_step(model, opt, cfg.rollout, cfg.policy.vocab_size, gen)
            t0 = time.perf_counter()
            reps = sync.step_published(v)
            stall = time.perf_counter() - t0
            for c in conns:
                c.send("pull", v)
            got = [c.recv() for c in conns]
            pull_wall = time.perf_counter() - t0 - stall
            exp = expected()
            ok = all(
                g["version"] == v and g["digest"] == exp[s]
                for g, s in zip(got, shards, strict=False)
            )
            # dense refit of the same version, measured: write full shard files, receivers load them
            t1 = time.perf_counter()
            dense_bytes = 0
            shards_full = dense_shards(params, tlayout, rlayout)
            for s, tensors in shards_full.items():
                data = st_save({n: t.contiguous() for n, t in tensors.items()})
                store.put(f"dense-refit/{s}.safetensors", data)
                dense_bytes += len(data)
            dense_stall = time.perf_counter() - t1
            dense_rx = [
                c.call("dense", f"dense-refit/{s}.safetensors")
                for c, s in zip(conns, shards, strict=False)
            ]
            ok &= all(d["same"] for d in dense_rx)
            all_ok &= ok
            sent = sum(r.bytes_sent for r in reps)
            changed = sum(r.elements_sent for r in reps)
            # elements sent counts replicated copies (e.g. kv heads, norms) once per shard
            row = dict(
                step=v,
                reward=stats["reward"],
                changed_frac=changed / n_params,
                bytes=sent,
                dense_bytes=dense_bytes,
                stall_s=stall,
                pull_s=pull_wall,
                pause_s=max(g["pause_s"] for g in got),
                dense_s=dense_stall + max(d["fetch_s"] + d["load_s"] for d in dense_rx),
                dense_pause_s=max(d["load_s"] for d in dense_rx),
                total_s=stall + pull_wall,
                ok=ok,
            )
            rows.append(row)
            table.add_row(
                str(v),
                f"{stats['reward']:.3f}",
                f"{100 * row['changed_frac']:.2f}%",
                f"{sent / 2**10:.0f} KiB",
                f"{dense_bytes / 2**10:.0f} KiB",
                f"{stall:.3f}",
                f"{pull_wall:.3f}",
                f"{1e3 * row['pause_s']:.1f}",
                f"{row['dense_s']:.3f}",
                "[green]bit-exact[/]" if ok else "[red]MISMATCH[/]",
            )
            console.print(
                f"step {v:3d}  reward {stats['reward']:.3f}  changed {100 * row['changed_frac']:.2f}%  "
                f"sent {sent / 2**10:.0f} KiB (dense {dense_bytes / 2**10:.0f} KiB)  stall {stall:.3f}s  "
                f"pull {pull_wall:.3f}s  pause {1e3 * row['pause_s']:.1f} ms  "
                f"{'bit-exact' if ok else 'MISMATCH'}"
            )
        finished = True
    except BaseException as exc:
        # whatever ends the run early (a receiver gone, a Ctrl-C) carries what it measured
        exc.summary = _summary(cfg, rows, exact=False)
        raise
    finally:
        close_all(conns, join_s=10.0 if finished else FAILED_JOIN_S)
    console.print(table)
    out = _summary(cfg, rows, exact=all_ok)
    med = out["medians"]
    summary = Table(title=f"summary (medians per step; the store through {link})")
    for h in ["", "deltasync", "dense refit", "ratio"]:
        summary.add_column(h, justify="right")
    summary.add_row(
        "bytes moved",
        f"{med['bytes'] / 2**10:.0f} KiB",
        f"{med['dense_bytes'] / 2**10:.0f} KiB",
        f"{med['dense_bytes'] / max(med['bytes'], 1):.1f}x fewer",
    )
    summary.add_row(
        "sync time (stall + pull)",
        f"{med['total_s']:.3f} s",
        f"{med['dense_s']:.3f} s",
        f"{med['dense_s'] / max(med['total_s'], 1e-9):.1f}x",
    )
    summary.add_row(
        "receiver pause",
        f"{1e3 * med['pause_s']:.1f} ms",
        f"{1e3 * med['dense_pause_s']:.1f} ms",
        "",
    )
    summary.add_row("changed elements", f"{100 * med['changed_frac']:.2f}%", "100%", "")
    summary.add_row("every receiver bit-exact", "yes" if all_ok else "NO", "", "")
    console.print(summary)
    return out


_MEDIANS = (
    "bytes",
    "dense_bytes",
    "stall_s",
    "pull_s",
    "pause_s",
    "dense_s",
    "dense_pause_s",
    "total_s",
    "changed_frac",
)


def _summary(cfg: DemoConfig, rows: list[dict], *, exact: bool) -> dict:
    """The run's summary over the steps done (``rows``; None where none was)."""
    return {
        "steps": cfg.steps,
        "steps_done": len(rows),
        "exact": exact,
        "medians": {k: statistics.median(r[k] for r in rows) for k in _MEDIANS} if rows else None,
        "reward_first": rows[0]["reward"] if rows else None,
        "reward_last": rows[-1]["reward"] if rows else None,
    }
