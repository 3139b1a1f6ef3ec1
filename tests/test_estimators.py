"""The advantage-estimator table (posttrain/algorithms/estimators.py): each entry's estimate by
hand, what the table promises the recipe, and the config's one-line errors built from it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posttrain.algorithms import gae, whiten
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.config import build_config
from posttrain.errors import UserError
from posttrain.recipes import online_config


def test_group_entry_gives_the_seeds_advantages():
    """The seed: rewards [0, 1, 0, 0], population std sqrt(3)/4, so A = [-1/sqrt(3), sqrt(3), -1/sqrt(3), -1/sqrt(3)]."""
    mask = torch.ones(4, 3, dtype=torch.bool)
    estimate = ADVANTAGE_ESTIMATORS["group"].estimate(StepRewards(torch.tensor([0.0, 1.0, 0.0, 0.0]), mask, mask, 4),
                                                      advantage_scale="group", advantage_eps=0.0, unbiased_std=False)
    third = -1 / math.sqrt(3)
    assert estimate.advantages.tolist() == pytest.approx([third, math.sqrt(3), third, third])
    assert estimate.returns is None and estimate.metrics == {}


def test_group_entry_charges_a_kl_in_the_reward_per_sequence_over_every_sampled_token():
    """Rewards [1, 0] less 0.5 x the KL summed over every sampled token (row 0's third token is out
    of the loss but was sampled, so it pays; row 1's third was not sampled): 1 - 0.5 x 0.6 = 0.7 and
    0 - 0.5 x 0.2 = -0.1; unscaled group advantages subtract the mean 0.3: [0.4, -0.4]."""
    sampled = torch.tensor([[True, True, True], [True, True, False]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.1, 9.0]])
    estimate = ADVANTAGE_ESTIMATORS["group"].estimate(StepRewards(torch.tensor([1.0, 0.0]), mask, sampled, 2, kl=kl, kl_beta=0.5),
                                                      advantage_scale="none", advantage_eps=0.0, unbiased_std=False)
    assert estimate.advantages.tolist() == pytest.approx([0.4, -0.4])  # centred (0.7, -0.1): mean 0.3


def test_gae_entry_is_gae_over_the_token_rewards_then_whitened():
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    values, kl = torch.randn(2, 3), torch.rand(2, 3)
    rewards = torch.tensor([1.0, float("nan")])  # an unscored row: reward 0
    estimate = ADVANTAGE_ESTIMATORS["gae"].estimate(StepRewards(rewards, mask, mask, 1, kl=kl, kl_beta=0.1, values=values),
                                                    gamma=1.0, lam=0.95, whiten_advantages=True)
    token_rewards = -0.1 * kl * mask
    token_rewards[0, 2] += 1.0  # the sequence reward on its last counted token
    advantages, returns = gae(token_rewards, values, mask, 1.0, 0.95)
    assert torch.allclose(estimate.advantages, whiten(advantages, mask))
    assert torch.allclose(estimate.returns, returns)
    assert set(estimate.metrics) == {"values/mean", "returns/mean", "explained_variance"}


def test_every_entry_names_real_settings_and_a_real_command():
    fields = {f.name for f in dataclasses.fields(online_config.Loss)}
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        assert entry.name == name and set(entry.settings) <= fields, name
        assert entry.command in ("grpo", "ppo") and entry.kl_metric in ("update", "rollout")
        assert "{estimator}" in entry.kl_in_reward
        assert entry.per_token == entry.needs_critic  # today's two entries; a per-token REINFORCE++ would differ


def config(advantage, **loss):
    factory = online_config.ppo_config if advantage == "gae" else online_config.grpo_config
    return build_config(factory, None, {"loss": {"advantage": advantage, **loss}})


def test_an_unknown_estimator_is_one_line_naming_the_table():
    with pytest.raises(UserError, match=r"^loss.advantage must be one of group, gae, got 'rloo'$"):
        config("rloo")


@pytest.mark.parametrize("advantage, field, value, owner", [("group", "lam", 0.9, "gae"), ("gae", "unbiased_std", True, "group")])
def test_another_estimators_setting_is_refused_naming_its_owner(advantage, field, value, owner):
    with pytest.raises(UserError, match=rf"^loss.{field} applies to loss.advantage {owner} only \(this run: {advantage}\)$"):
        config(advantage, **{field: value})


def test_the_card_settings_are_the_shared_ones_and_the_estimators_own():
    group = config("group").loss.settings()
    assert "advantage_scale" in group and "lam" not in group and "clip_low" in group
    gae_settings = config("gae").loss.settings()
    assert "lam" in gae_settings and "advantage_scale" not in gae_settings
