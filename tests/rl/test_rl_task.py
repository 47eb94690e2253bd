"""The toy task, its tokenizer and GRPO's advantages: pure functions, checked on hand examples."""

from __future__ import annotations

import pytest
import torch

from deltasync.errors import ConfigError
from deltasync_examples.rl import CharTokenizer, ReverseTask, RLConfig
from deltasync_examples.rl.grpo import group_advantages
from deltasync_examples.rl.tokenizer import BOS, EOS


def test_tokenizer_round_trips_and_stops_at_eos():
    tok = CharTokenizer("abc=")
    ids = tok.encode("ca=b")
    assert ids == [5, 3, 6, 4]
    assert tok.decode([*ids, EOS, *tok.encode("a")]) == "ca=b"
    assert tok.decode([BOS, *ids]) == "ca=b"
    assert tok.vocab_size == 7


def test_tokenizer_refuses_an_unknown_character_instead_of_guessing():
    with pytest.raises(ConfigError, match="'z'"):
        CharTokenizer("abc").encode("az")


def test_reverse_task_prompts_are_bos_string_separator_and_rewards_count_positions():
    task = ReverseTask(letters="abcd", length=3)
    tok = task.tokenizer
    prompts = task.prompts(5, torch.Generator().manual_seed(0))
    assert prompts.shape == (5, 5)
    assert (prompts[:, 0] == BOS).all() and (prompts[:, -1] == tok.encode("=")[0]).all()
    p = torch.tensor([[BOS, *tok.encode("abc"), tok.encode("=")[0]]] * 3)
    answers = torch.tensor([tok.encode("cba"), tok.encode("cbd"), tok.encode("abc")])
    assert task.rewards(p, answers).tolist() == pytest.approx([1.0, 2 / 3, 1 / 3])


def test_group_advantages_are_zero_mean_per_group_and_zero_for_equal_rewards():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2]), group_size=2)
    assert adv.view(3, 2).sum(dim=1).abs().max() < 1e-6
    assert adv[2:].abs().max() == 0 and adv[0] > 0 > adv[1]


def test_rl_config_names_the_bad_field():
    with pytest.raises(ConfigError, match="max_staleness"):
        RLConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="kill_worker_at"):
        RLConfig(steps=3, kill_worker_at=3)
    with pytest.raises(ConfigError, match="tp must be 1"):
        RLConfig(engine="hf", tp=2)
