"""RLConfig: every knob of ``deltasync rl-demo``, validated at construction.

Keyword-only and frozen; each error names the field. The CLI is a projection of these fields.
This module knows settings only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deltasync.errors import ConfigError
from deltasync_examples.demo.policy import PolicyConfig
from deltasync_examples.demo.run_dir import check_store_dir
from deltasync_examples.models import TINY_QWEN3
from deltasync_examples.rl.task import ReverseTask

ENGINES = ("tp", "hf")


def _int(name: str, value: object, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"RLConfig.{name} must be an int >= {lo}, got {value!r}")


def _pos(name: str, value: object, *, finite: bool = True) -> None:
    # inf is refused where it would reach the arithmetic (lr inf trains the policy to NaN);
    # a timeout may be inf (wait forever)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (finite and not math.isfinite(value)):
        what = "a finite number" if finite else "a number"
        raise ConfigError(f"RLConfig.{name} must be {what} > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """- ``engine``: what rollout workers generate with: ``tp`` (vLLM-convention TP shards,
      :class:`~deltasync.engines.TPQwen3Engine`, ``tp`` ranks per worker) or ``hf`` (the
      transformers model, :class:`~deltasync.engines.HFEngine`);
    - ``max_staleness``: a trajectory sampled at version v may train the policy at version at
      most v + max_staleness (0: fully synchronous);
    - ``kill_worker_at``: fault injection: SIGKILL worker 0 after publishing this version and
      restart it ``restart_after`` versions later; it must catch up from the store and stay
      exact;
    - ``timeout_s``: the longest any single wait (a worker's answer, a version) may take;
    - ``store``: the run directory (a local path, absent or empty); None: a temporary one,
      removed at the end.
    """

    steps: int = 40
    workers: int = 2
    engine: str = "tp"
    tp: int = 2
    max_staleness: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 3e-3
    temperature: float = 1.0
    clip: float = 0.2
    seed: int = 0
    task: ReverseTask = field(default_factory=ReverseTask)
    hidden_size: int = TINY_QWEN3["hidden_size"]
    num_layers: int = TINY_QWEN3["num_hidden_layers"]
    num_heads: int = TINY_QWEN3["num_attention_heads"]
    num_kv_heads: int = TINY_QWEN3["num_key_value_heads"]
    head_dim: int = TINY_QWEN3["head_dim"]
    intermediate_size: int = TINY_QWEN3["intermediate_size"]
    kill_worker_at: int | None = None
    restart_after: int = 2
    store: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _int("steps", self.steps, 1)
        _int("workers", self.workers, 1)
        if self.engine not in ENGINES:
            raise ConfigError(f"RLConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        _int("tp", self.tp, 1)
        if self.engine == "hf" and self.tp != 1:
            raise ConfigError("RLConfig.tp must be 1 with engine 'hf' (one unsharded model)")
        _int("max_staleness", self.max_staleness, 0)
        _int("prompts_per_step", self.prompts_per_step, 1)
        _int("group_size", self.group_size, 2)
        for name in ("lr", "temperature", "clip"):
            _pos(name, getattr(self, name))
        _pos("timeout_s", self.timeout_s, finite=False)
        _int("seed", self.seed, 0)
        if self.kill_worker_at is not None:
            _int("kill_worker_at", self.kill_worker_at, 1)
            if self.kill_worker_at >= self.steps:
                raise ConfigError(
                    f"RLConfig.kill_worker_at ({self.kill_worker_at}) must be < steps ({self.steps})"
                )
            if self.workers < 2:
                raise ConfigError("RLConfig.kill_worker_at needs workers >= 2 (one keeps serving)")
        _int("restart_after", self.restart_after, 0)
        check_store_dir("RLConfig.store", self.store)
        self.policy()  # validates the model dimensions

    def policy(self) -> PolicyConfig:
        return PolicyConfig(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.task.tokenizer.vocab_size,
            seed=self.seed,
        )

    def hf_config(self) -> dict:
        return self.policy().hf_config()
