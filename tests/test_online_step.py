"""The online recipe's public step, by hand on a tiny batch: mu > 1 epochs and several mini-batches
(ratio exactly 1 on the first on-policy pass, not after an optimizer step, clipping at the configured
bounds), and GRPO / PPO with LoRA through the whole run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.algorithms import clipped_surrogate
from posttrain.config import build_config
from posttrain.data.examples import derived_seed
from posttrain.data.scored_batch import ScoredBatch
from posttrain.algorithms import surrogates
from posttrain.recipes import online, online_config
from posttrain.runs.timer import Timer
from posttrain.rollout import generate
from posttrain.rewards import Verdict
from posttrain.rewards.scores import Scores
from tests.rewards_for_tests import digits

SMALL = {
    "data": {"eval_size": 8, "train_size": 200, "prompts_per_step": 2, "group_size": 4},
    "sampling": {"max_new_tokens": 6}, "update": {"micro_batch_size": 8},
    "optim": {"lr": 3e-3, "max_grad_norm": None}, "loss": {"clip": {"low": 0.1, "high": 0.3}},
}


def fixed_batch(state) -> ScoredBatch:
    """Two prompts x 4 samples from the state's own policy, with hand-set rewards (mean 0.5 in each
    group, so every advantage is +-1 / std, never 0)."""
    rollout = generate(state.policy, state.tokenizer, ["12+34=", "5+6="], group_size=4, sampling=state.config.sampling, seed=3)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    return ScoredBatch(rollout=rollout, examples=[], rendered=[], scores=Scores.of([Verdict.ok(r, "") for r in rewards]),
                       owners=torch.zeros(8, dtype=torch.long), stats={})


def recorded_surrogates(monkeypatch) -> list[dict]:
    """Every call of the loss step's clipped surrogate: its advantages and statistics."""
    calls = []

    def recording(logprobs, old, advantages, low, high, dual):
        per_token, stats = clipped_surrogate(logprobs, old, advantages, low, high, dual)
        calls.append({"advantages": advantages.detach().clone(), **{k: v.detach().clone() for k, v in stats.items()}})
        return per_token, stats

    monkeypatch.setattr(surrogates, "clipped_surrogate", recording)  # what the `clip` entry calls
    return calls


def check_clipping(call: dict, mask: torch.Tensor) -> None:
    """PPO-clip by hand: a token is clipped high when A > 0 and r > 1 + 0.3, low when A < 0 and r < 1 - 0.1."""
    ratio, advantages = call["ratio"], call["advantages"][:, None].expand_as(call["ratio"])
    assert torch.equal(call["clipped_high"] & mask, (advantages > 0) & (ratio > 1.3) & mask)
    assert torch.equal(call["clipped_low"] & mask, (advantages < 0) & (ratio < 0.9) & mask)


def test_two_epochs_ratio_one_then_moved_and_clipped(monkeypatch):
    """mu = 2, one mini-batch of all 8 rows: the old log-probs come from a no-grad forward before the
    update; the first epoch's forward reproduces them (ratio exactly 1, nothing clipped), one AdamW
    step later the second epoch's ratios moved (a large lr: some beyond the clip bounds, and exactly
    those tokens are clipped)."""
    config = build_config(online_config.grpo_config, None, {**SMALL, "update": {"epochs": 2, "micro_batch_size": 8}, "optim": {"lr": 3e-2, "max_grad_norm": None}})
    state = online.setup(config, reward=digits)
    batch = fixed_batch(state)
    calls = recorded_surrogates(monkeypatch)
    metrics = online.step(state, batch, Timer())
    assert len(calls) == 2
    mask = batch.rollout.mask
    first, second = calls
    assert torch.equal(first["ratio"][mask], torch.ones(int(mask.sum())))
    assert not (first["clipped_low"] | first["clipped_high"]).any()
    assert not torch.allclose(second["ratio"][mask], torch.ones(int(mask.sum())))
    assert (second["clipped_low"] | second["clipped_high"])[mask].any(), "lr 3e-2 should push some ratios past the bounds"
    check_clipping(second, mask)
    assert metrics["ratio/min"] < 1 < metrics["ratio/max"] and metrics["clip/low"] + metrics["clip/high"] > 0


def test_two_mini_batches_second_is_off_policy(monkeypatch):
    """mu = 1, 2 mini-batches of 4 rows (drawn by a seeded permutation): the first mini-batch is
    on-policy (ratio exactly 1), the second follows an optimizer step (ratio moved); two optimizer
    steps in all (the scheduler says so)."""
    config = build_config(online_config.grpo_config, None, {**SMALL, "update": {"mini_batches": 2, "micro_batch_size": 8}, "optim": {"lr": 3e-2, "max_grad_norm": None}})
    state = online.setup(config, reward=digits)
    batch = fixed_batch(state)
    calls = recorded_surrogates(monkeypatch)
    online.step(state, batch, Timer())
    assert len(calls) == 2 and all(call["ratio"].shape[0] == 4 for call in calls)
    assert state.scheduler.last_epoch == 2
    # The documented draw: a permutation seeded by (seed, "minibatch", step), split in two.
    order = torch.randperm(8, generator=torch.Generator().manual_seed(derived_seed(config.seed, "minibatch", "0")))
    first, second = (batch.rollout.mask[rows] for rows in torch.tensor_split(order, 2))
    assert torch.equal(calls[0]["ratio"][first], torch.ones(int(first.sum()))), "first mini-batch: on-policy"
    assert not torch.allclose(calls[1]["ratio"][second], torch.ones(int(second.sum()))), "second: after one optimizer step"
    check_clipping(calls[1], second)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_lora_two_steps(tmp_path, recipe):
    """GRPO and PPO with LoRA adapters, 2 steps: finite losses, the adapter changed, and the
    checkpoint is the adapter (the base weights are not rewritten); the config is left as it was."""
    factory = online_config.grpo_config if recipe == "grpo" else online_config.ppo_config
    settings = {**SMALL, "lora_rank": 4, "max_steps": 2, "output_dir": str(tmp_path / recipe), "optim": {"lr": 1e-2}}
    if recipe == "ppo":
        settings["critic"] = {"lr": 1e-3}
    config = build_config(factory, None, settings)
    before = copy.deepcopy(config)
    run_dir = online.run(config, reward=digits)
    assert config == before, "run() treats its config as read-only"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in steps)
    adapter = sorted((run_dir / "checkpoints").iterdir())[-1] / "model" / "adapter_model.safetensors"
    weights = load_file(adapter)
    lora_b = [value for name, value in weights.items() if "lora_B" in name]
    assert lora_b and any(value.abs().sum() > 0 for value in lora_b), "LoRA B starts at zero: a non-zero B was trained"
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["loss"]["algorithm"].startswith(recipe.upper())


def test_the_online_data_source_samples_through_the_states_sampler():
    """The sampler seam: a sampler that records what it is given and delegates to `single_turn`
    gives the same batch as the default, and receives the step's examples beside their prompts."""
    from posttrain.rollout.sampler import single_turn

    config = build_config(online_config.grpo_config, None, copy.deepcopy(SMALL))
    default = online.sample(online.setup(config, reward=digits))
    state, calls = online.setup(config, reward=digits), []

    def recording(policy, tokenizer, examples, prompts, **settings):
        calls.append((list(examples), list(prompts), settings))
        return single_turn(policy, tokenizer, examples, prompts, **settings)

    state.sampler = recording
    batch = online.sample(state)
    assert torch.equal(batch.rollout.completion_ids, default.rollout.completion_ids)
    (examples, prompts, settings), = calls
    assert [e.id for e in examples] == [e.id for e in batch.examples] and prompts == batch.rendered
    assert settings["group_size"] == 4 and settings["shard"] is None
