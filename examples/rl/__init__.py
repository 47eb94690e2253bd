"""Online RL on top of deltasync: GRPO trainer, rollout worker processes, a toy task.

Data flow: ``loop`` (trainer: GRPO step -> TrainerSync.publish -> reference probe) ->
store -> ``worker`` (Receiver.pull into engine shards -> probe check -> ``sampling``) ->
trajectories tagged with their version -> ``loop``. ``task``/``tokenizer`` are the verifiable
toy problem, ``grpo`` the loss, ``policy_engine`` the engine both sides build, ``fleet`` the
processes.
"""

from deltasync_examples.rl.config import RLConfig
from deltasync_examples.rl.loop import ProbeMismatchError, RolloutError, run_rl
from deltasync_examples.rl.task import ReverseTask
from deltasync_examples.rl.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "ProbeMismatchError",
    "RLConfig",
    "ReverseTask",
    "RolloutError",
    "run_rl",
]
