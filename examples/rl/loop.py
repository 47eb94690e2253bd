"""The online RL loop: GRPO on the trainer, rollouts on workers, deltasync every step.

Version v is the policy after v optimizer steps; version 0 is published as an anchor, every
later one as a delta through :class:`~deltasync.publish.TrainerSync` on a local store. Step s
trains the policy at version s-1 on a batch of trajectories, publishes version s, computes the
dense BF16 reference logits of the probe batch for s and sends their bits to every worker.

Bounded staleness: the batch for step s may only hold trajectories sampled at version
``>= s-1-max_staleness``; requests carry that minimum (a worker waits for it), and the trainer
checks every answer again and drops (and re-asks) anything older. Requests for step s+1 go out
before step s trains, so with ``max_staleness >= 1`` the workers generate while the trainer
computes: the usual one-step-off-policy pipeline.

Exactness: every worker compares its probe logits with the reference at every version it
generates from, and at the end (and after a restart) on request; one mismatch fails the run
(:class:`ProbeMismatchError`). Whatever ends a run early (that, a worker that dies or fails:
:class:`RolloutError`, a Ctrl-C) stops the workers and carries the summary so far as
``summary``. Fault injection (``kill_worker_at``) SIGKILLs worker 0 and
restarts it later; it must catch up from the store and prove the version it reached.

This module knows the RL protocol and the sync calls; processes live in :mod:`.fleet`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch

from deltasync.errors import DeltaSyncError, IntegrityError
from deltasync_examples.demo.run_dir import run_dir
from deltasync_examples.harness import FAILED_JOIN_S
from deltasync_examples.rl.config import RLConfig
from deltasync_examples.rl.fleet import Fleet, WorkerGone
from deltasync_examples.rl.grpo import Batch, grpo_step
from deltasync_examples.rl.policy_engine import RolloutEngine
from deltasync_examples.rl.sampling import logits_bits, probe_batch
from deltasync_examples.rl.worker import WorkerArgs


class ProbeMismatchError(IntegrityError):
    """A rollout worker's probe logits differ from the trainer's dense reference.

    ``summary`` holds the run's summary up to the failure (``probe_exact`` false)."""

    summary: dict | None = None


class RolloutError(DeltaSyncError):
    """A rollout worker failed, died unexpectedly or did not answer in time.

    ``summary`` holds the run's summary up to the failure, as for ProbeMismatchError."""

    summary: dict | None = None


class _Trainer:
    def __init__(self, cfg: RLConfig, root: str) -> None:
        from deltasync import (
            AdamWTracker,
            LocalStore,
            ModelSpec,
            Publisher,
            PublisherConfig,
            TrainerLayout,
            TrainerSync,
        )
        from deltasync.engines import build_hf_model

        self.cfg, self.hf_config = cfg, cfg.hf_config()
        torch.manual_seed(cfg.seed)
        self.model = build_hf_model(self.hf_config, dtype=torch.float32).train()
        named = list(self.model.named_parameters())
        self.params = {n: p.detach() for n, p in named}
        self.opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, weight_decay=0.0)
        self.tlayout = TrainerLayout(ModelSpec.from_hf_config(self.hf_config))
        layout = RolloutEngine(cfg.engine, self.hf_config, cfg.tp).layout
        self.store_root = os.path.join(root, "store")
        publisher = Publisher(
            LocalStore(self.store_root),
            receiver_layout=layout,
            trainer_layout=self.tlayout,
            config=PublisherConfig(anchor_every=20),
        )
        self.sync = TrainerSync(AdamWTracker(self.opt, named), publisher, self.params)
        self.probe = probe_batch(self.hf_config["vocab_size"])
        self.refs: dict[int, np.ndarray] = {}
        self.published: list[int] = []  # versions published, in order (the summary's)

    def publish(self, version: int) -> None:
        self.sync.step_published(version, anchor=version == 0)
        self.published.append(version)
        bf16 = {n: t.to(torch.bfloat16) for n, t in self.params.items()}
        engine = RolloutEngine.from_canonical(
            self.cfg.engine, self.hf_config, self.cfg.tp, self.tlayout.to_canonical(bf16)
        )
        self.refs[version] = logits_bits(engine.logits(self.probe)).numpy()
        for v in [v for v in self.refs if v < version - self.cfg.max_staleness]:
            del self.refs[v]


def run_rl(cfg: RLConfig, log: Callable[[str], None] = print) -> dict:
    """Run the loop in its run directory (``cfg.store``, refused when an earlier run used it,
    or a temporary one removed at the end); return the summary (the CLI prints it as one JSON
    line)."""
    with run_dir(cfg.store, prefix="deltasync-rl-") as root:
        return _run(cfg, root, log)


def _run(cfg: RLConfig, root: str, log: Callable[[str], None]) -> dict:
    torch.set_num_threads(1)  # the reference must use the workers' kernels and thread count
    t_start = time.perf_counter()
    trainer = _Trainer(cfg, root)
    task, gen = cfg.task, torch.Generator().manual_seed(cfg.seed)
    trainer.publish(0)
    fleet = Fleet(
        [
            WorkerArgs(
                index=i,
                incarnation=0,
                store_root=trainer.store_root,
                state_root=os.path.join(root, "workers"),
                engine=cfg.engine,
                tp=cfg.tp,
                hf_config=trainer.hf_config,
                temperature=cfg.temperature,
                seed=cfg.seed,
                timeout_s=cfg.timeout_s,
            )
            for i in range(cfg.workers)
        ]
    )
    state = {
        "next_id": 0,
        "probes": [],
        "killed": None,
        "rejoined": None,
        "inbox": [],
        "published": trainer.published,
    }

    def wait(pred: Callable[[dict], bool], what: str) -> dict:
        """Handle messages until one satisfies ``pred``; fail loudly on errors and deaths."""
        deadline = time.monotonic() + cfg.timeout_s
        while True:
            try:
                msgs = fleet.receive(0.2)
            except WorkerGone as gone:
                raise RolloutError(
                    f"rollout worker {gone.index} died ({gone.ended}) while {what}"
                ) from None
            if not msgs and time.monotonic() > deadline:
                raise RolloutError(f"no answer within {cfg.timeout_s}s while {what}")
            state["inbox"].extend(msgs)
            inbox, state["inbox"] = state["inbox"], []
            while inbox:
                msg = inbox.pop(0)
                if msg["kind"] == "error":
                    raise RolloutError(
                        f"worker {msg['worker']} failed: {msg['error']}\n{msg['trace']}"
                    )
                if msg["kind"] == "probe":
                    state["probes"].append(msg)
                    if not msg["exact"]:
                        raise ProbeMismatchError(
                            f"worker {msg['worker']}'s probe logits at version {msg['version']} "
                            "are not bit-identical to the trainer's dense BF16 reference: its "
                            "weights are not the trainer's"
                        )
                if msg["kind"] == "trajectories" and msg["request"] is None:
                    continue  # answer of a killed worker's request, already reassigned
                if pred(msg):
                    state["inbox"].extend(inbox)
                    return msg
                if msg["kind"] == "trajectories":
                    state["inbox"].append(msg)  # for a later wait (e.g. the next step's)

    def submit(step: int) -> set[int]:
        min_version = max(0, step - 1 - cfg.max_staleness)
        per = -(-cfg.prompts_per_step // (2 * cfg.workers))  # a few requests per worker
        ids, left = set(), cfg.prompts_per_step
        while left:
            n = min(per, left)
            left -= n
            prompts = task.prompts(n, gen).repeat_interleave(cfg.group_size, dim=0)
            rid = state["next_id"]
            state["next_id"] += 1
            fleet.assign(
                {
                    "id": rid,
                    "step": step,
                    "min_version": min_version,
                    "prompts": prompts.numpy(),
                    "gen_len": task.answer_len,
                }
            )
            ids.add(rid)
        return ids

    def prove(index: int, version: int) -> dict:
        fleet.request_check(index, version)
        return wait(
            lambda m: m["kind"] == "probe" and m["worker"] == index and m["version"] >= version,
            f"worker {index} proved version {version}",
        )

    history: list[dict] = []
    finished = False
    try:
        fleet.start_all(dict(trainer.refs))
        for _ in range(cfg.workers):
            wait(lambda m: m["kind"] == "ready", "starting the rollout workers")
        outstanding = submit(1)
        for step in range(1, cfg.steps + 1):
            policy_version = step - 1
            rows = []
            while outstanding:
                msg = wait(lambda m: m["kind"] == "trajectories", f"collecting step {step}")
                if msg["id"] not in outstanding:
                    continue
                outstanding.discard(msg["id"])
                if policy_version - msg["version"] > cfg.max_staleness:  # never by construction
                    raise RolloutError(f"trajectory from version {msg['version']} is too stale")
                rows.append((msg["request"], msg))
            if step < cfg.steps:
                outstanding = submit(step + 1)  # workers sample while this step trains
            prompts = torch.cat([torch.from_numpy(req["prompts"]) for req, _ in rows])
            answers = torch.cat([torch.from_numpy(m["answers"]) for _, m in rows])
            batch = Batch(
                prompts=prompts,
                answers=answers,
                logprobs=torch.cat([torch.from_numpy(m["logprobs"]) for _, m in rows]),
                rewards=task.rewards(prompts, answers),
                group_size=cfg.group_size,
            )
            stats = grpo_step(
                trainer.model, trainer.opt, batch, clip=cfg.clip, temperature=cfg.temperature
            )
            trainer.publish(step)
            fleet.broadcast_ref(step, trainer.refs[step])
            versions = sorted({m["version"] for _, m in rows})
            history.append(
                {
                    "step": step,
                    "reward": float(batch.rewards.mean()),
                    "sampled_versions": versions,
                    "staleness": max(policy_version - v for v in versions),
                    **stats,
                }
            )
            log(
                f"step {step:3d}  reward {history[-1]['reward']:.3f}  sampled at v{versions}  "
                f"-> published v{step}"
            )
            if cfg.kill_worker_at == step:
                for req in fleet.kill(0):  # its unanswered requests go to the others
                    fleet.assign(req)
                state["killed"] = step
                log(f"  SIGKILL rollout worker 0 after publishing v{step}")
            if (
                state["killed"] is not None
                and state["rejoined"] is None
                and (step == state["killed"] + cfg.restart_after or step == cfg.steps)
            ):
                fleet.restart(0, dict(trainer.refs))
                wait(lambda m: m["kind"] == "ready" and m["worker"] == 0, "restarting worker 0")
                state["rejoined"] = prove(0, step)["version"]
                log(
                    f"  worker 0 restarted, caught up from the store to v{state['rejoined']}: exact"
                )
        for index in fleet.alive():  # every worker proves the final version
            prove(index, cfg.steps)
        finished = True
    except BaseException as exc:  # a mismatch, a worker gone, a Ctrl-C: report what ran
        exc.summary = _summary(cfg, history, state, time.perf_counter() - t_start, fleet.restarts)
        raise
    finally:
        fleet.stop(join_s=10.0 if finished else FAILED_JOIN_S)
    return _summary(cfg, history, state, time.perf_counter() - t_start, fleet.restarts)


def _summary(cfg: RLConfig, history: list[dict], state: dict, wall_s: float, restarts: int):
    k = max(1, len(history) // 5)  # rewards are noisy per step: average the first/last fifth
    rewards = [h["reward"] for h in history] or [float("nan")]
    probes = state["probes"]
    return {
        "steps": cfg.steps,
        "versions": list(state["published"]),  # a run stopped early published fewer
        "reward_first": sum(rewards[:k]) / len(rewards[:k]),
        "reward_last": sum(rewards[-k:]) / len(rewards[-k:]),
        "probe_exact": bool(probes) and all(p["exact"] for p in probes),
        "max_staleness": max((h["staleness"] for h in history), default=0),
        "staleness_limit": cfg.max_staleness,
        "engine": cfg.engine if cfg.engine == "hf" else f"tp{cfg.tp}",
        "workers": cfg.workers,
        "probe_checks": len(probes),
        # per worker process ("index.incarnation"), in the order the checks happened
        "probe_versions": {
            key: [p["version"] for p in probes if f"{p['worker']}.{p['incarnation']}" == key]
            for key in dict.fromkeys(f"{p['worker']}.{p['incarnation']}" for p in probes)
        },
        "sampled_versions": [h["sampled_versions"] for h in history],
        "killed_at": state["killed"],
        "rejoined_at": state["rejoined"],
        "restarts": restarts,
        "wall_s": round(wall_s, 2),
    }
