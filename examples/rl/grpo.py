"""GRPO on the trainer: group-relative advantages and a clipped importance-weighted loss.

Each prompt is sampled ``group_size`` times; a completion's advantage is its reward minus the
group's mean, divided by the group's standard deviation (GRPO, no value network). Completions
may come from an older policy version (bounded staleness), so the loss weights each token by
``exp(logp_now - logp_behaviour)`` clipped to ``[1 - clip, 1 + clip]`` (PPO-style), with the
behaviour log-probabilities the rollout worker reported.

This module knows models, tensors and losses; nothing about processes, versions or syncing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Batch:
    """Trajectories of one GRPO step, groups contiguous: rows ``[g*G, (g+1)*G)`` share a prompt."""

    prompts: torch.Tensor  # (n, prompt_len) int64
    answers: torch.Tensor  # (n, gen_len) int64
    logprobs: torch.Tensor  # (n, gen_len) fp32, behaviour policy
    rewards: torch.Tensor  # (n,) fp32
    group_size: int


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    r = rewards.view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def grpo_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    *,
    clip: float = 0.2,
    temperature: float = 1.0,
) -> dict[str, float]:
    """One optimizer step on ``batch``; returns the loss and the mean clipped fraction."""
    adv = group_advantages(batch.rewards, batch.group_size).unsqueeze(1)
    seq = torch.cat([batch.prompts, batch.answers], dim=1)
    p = batch.prompts.shape[1]
    logits = model(input_ids=seq).logits[:, p - 1 : -1, :].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp.gather(-1, batch.answers.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - batch.logprobs)
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {
        "loss": float(loss.detach()),
        "clipped": float(((ratio - clipped).abs() > 0).float().mean()),
    }
