"""The advantage-estimator table (posttrain/algorithms/estimators.py): each entry's estimate by
hand, what the table promises the recipe, and the config's one-line errors built from it."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import pytest
import torch

from posttrain.algorithms import gae, whiten
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.losses.policy_gradient_config import MOVED
from posttrain.recipes import online_config


def test_group_entry_gives_the_seeds_advantages():
    """The seed: rewards [0, 1, 0, 0], population std sqrt(3)/4, so A = [-1/sqrt(3), sqrt(3), -1/sqrt(3), -1/sqrt(3)]."""
    mask = torch.ones(4, 3, dtype=torch.bool)
    estimate = ADVANTAGE_ESTIMATORS["group"].estimate(StepRewards(torch.tensor([0.0, 1.0, 0.0, 0.0]), mask, mask, 4),
                                                      scale="group", eps=0.0, unbiased_std=False)
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
                                                      scale="none", eps=0.0, unbiased_std=False)
    assert estimate.advantages.tolist() == pytest.approx([0.4, -0.4])  # centred (0.7, -0.1): mean 0.3


def test_gae_entry_is_gae_over_the_token_rewards_then_whitened():
    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    values, kl = torch.randn(2, 3), torch.rand(2, 3)
    rewards = torch.tensor([1.0, float("nan")])  # an unscored row: reward 0
    estimate = ADVANTAGE_ESTIMATORS["gae"].estimate(StepRewards(rewards, mask, mask, 1, kl=kl, kl_beta=0.1, values=values),
                                                    gamma=1.0, lam=0.95, whiten=True)
    token_rewards = -0.1 * kl * mask
    token_rewards[0, 2] += 1.0  # the sequence reward on its last counted token
    advantages, returns = gae(token_rewards, values, mask, 1.0, 0.95)
    assert torch.allclose(estimate.advantages, whiten(advantages, mask))
    assert torch.allclose(estimate.returns, returns)
    assert set(estimate.metrics) == {"values/mean", "returns/mean", "explained_variance"}


def test_gae_normalize_rewards_standardises_the_scored_rows_first():
    """loss.gae.normalize_rewards: rewards [1, 3, NaN] -> [-1, 1, NaN] (mean 2, population std 1)
    before GAE; the unscored row still gets reward 0. A learned reward's offset and scale then do not
    matter: [11, 13] gives the same advantages as [1, 3]."""
    from posttrain.algorithms.estimators import standardized_rewards

    assert standardized_rewards(torch.tensor([1.0, 3.0, float("nan")])).tolist()[:2] == [-1.0, 1.0]
    mask = torch.ones(3, 2, dtype=torch.bool)
    values = torch.zeros(3, 2)
    inputs = lambda rewards: StepRewards(torch.tensor(rewards), mask, mask, 1, values=values)
    estimate = ADVANTAGE_ESTIMATORS["gae"].estimate(inputs([1.0, 3.0, float("nan")]), gamma=1.0, lam=1.0, whiten=False, normalize_rewards=True)
    assert estimate.returns.tolist() == [[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]
    shifted = ADVANTAGE_ESTIMATORS["gae"].estimate(inputs([11.0, 13.0, float("nan")]), gamma=1.0, lam=1.0, whiten=False, normalize_rewards=True)
    assert torch.allclose(shifted.advantages, estimate.advantages)


def test_silent_fraction_by_hand():
    """Rewards [1, 1 | 0, 1 | NaN, 2], G = 2. Groups: (1, 1) equal, (0, 1) differ, (NaN, 2) one
    scored row: 2 of 3 silent. The batch: 1, 1, 0, 1, 2 differ: 0. Rows 2-4 out of the loss: the
    batch's counted rewards are 1, 1: silent, 1.0; a group with no counted row is silent too."""
    from posttrain.algorithms.estimators import silent_fraction

    rewards, every = torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0]), torch.ones(6, dtype=torch.bool)
    assert silent_fraction(rewards, every, 2, "group").item() == pytest.approx(2 / 3)
    assert silent_fraction(rewards, every, 2, "batch").item() == 0.0
    first_two = torch.tensor([True, True, False, False, False, False])
    assert silent_fraction(rewards, first_two, 2, "batch").item() == 1.0
    assert silent_fraction(rewards, first_two, 2, "group").item() == 1.0
    with pytest.raises(ValueError, match="scope"):
        silent_fraction(rewards, every, 2, "token")


def _estimate(name: str, rewards: list[float]):
    torch.manual_seed(0)
    mask = torch.ones(len(rewards), 3, dtype=torch.bool)
    inputs = StepRewards(torch.tensor(rewards), mask, mask, 2, values=torch.randn(len(rewards), 3))
    return ADVANTAGE_ESTIMATORS[name].estimate(inputs, **online_config.Loss(advantage=name).estimator_settings()).advantages


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_each_estimator_says_when_its_advantages_carry_no_reward_signal(name):
    """What the signal check counts is what each estimator makes of the rewards. Rewards [0, 0 | 1, 1]
    (G = 2): within each group equal, across the batch not. Group estimators (group, rloo,
    reinforce_pp_baseline) give advantage 0 everywhere: silent, 1.0. reinforce_pp whitens returns
    over the batch (-1, -1, 1, 1: signal, 0.0) and gae sees the reward beside the critic (0.0). Every
    reward 0: every estimator silent; reinforce_pp's advantages are 0, gae's are the critic's alone
    (the same whatever row had which reward)."""
    entry, counted = ADVANTAGE_ESTIMATORS[name], torch.ones(4, dtype=torch.bool)
    between_groups = _estimate(name, [0.0, 0.0, 1.0, 1.0])
    silent = entry.silent_fraction(torch.tensor([0.0, 0.0, 1.0, 1.0]), counted, 2).item()
    if entry.signal_scope == "group":
        assert silent == 1.0 and torch.count_nonzero(between_groups) == 0
    else:
        assert silent == 0.0 and torch.count_nonzero(between_groups) > 0
    assert entry.silent_fraction(torch.zeros(4), counted, 2).item() == 1.0
    nothing = _estimate(name, [0.0, 0.0, 0.0, 0.0])
    assert torch.count_nonzero(nothing) == 0 or entry.needs_critic, "without a critic, equal rewards give advantage 0"
    assert {entry.signal_scope for entry in ADVANTAGE_ESTIMATORS.values()} == {"group", "batch"}
    assert entry.signal_scope == ("group" if entry.min_group_size > 1 else "batch"), "a group baseline is the group's signal"


def test_every_entry_names_real_settings_and_a_real_command():
    fields = {f.name: f for f in dataclasses.fields(online_config.Loss)}
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        assert entry.name == name and (entry.section is None or dataclasses.is_dataclass(fields[entry.section].default_factory())), name
        settings = online_config.Loss(advantage=name).estimator_settings()  # what estimate() is called with
        assert set(settings) == set(inspect.signature(entry.estimate).parameters) - {"inputs"}, name
        assert entry.command in ("grpo", "ppo") and entry.kl_metric in ("update", "rollout")
        assert "{estimator}" in entry.kl_in_reward and entry.peers
        assert entry.command == ("ppo" if entry.needs_critic else "grpo")
        # A rollout KL metric needs the old log-probs precomputed, which only a critic guarantees.
        assert entry.kl_metric == "update" or entry.needs_critic, name
    assert {name for name, e in ADVANTAGE_ESTIMATORS.items() if e.per_token} == {"gae", "reinforce_pp", "reinforce_pp_baseline", "distill"}


def config(advantage, **loss):
    factory = online_config.ppo_config if advantage == "gae" else online_config.grpo_config
    return build_config(factory, None, {"loss": {"advantage": advantage, **loss}})


def test_an_unknown_estimator_is_one_line_naming_the_table():
    with pytest.raises(UserError, match=r"^loss.advantage must be one of group, gae, rloo, reinforce_pp, reinforce_pp_baseline, distill, "
                                         r"got 'vtrace'$"):
        config("vtrace")


@pytest.mark.parametrize("advantage, section, field, value", [("group", "gae", "lam", 0.9), ("gae", "group", "unbiased_std", True)])
def test_another_estimators_setting_is_refused_naming_its_owner(advantage, section, field, value):
    with pytest.raises(UserError, match=rf"^loss.{section} applies to loss.advantage {section} only \(this run: {advantage}\)$"):
        config(advantage, **{section: {field: value}})


def test_the_card_settings_are_the_shared_ones_and_the_estimators_own():
    group = config("group").loss.settings()
    assert "group" in group and "gae" not in group and group["clip"] == {"low": 0.2, "high": 0.2, "dual": None}
    gae_settings = config("gae").loss.settings()
    assert gae_settings["gae"]["lam"] == 0.95 and "group" not in gae_settings and "clip" in gae_settings


def test_every_surrogate_names_its_section_and_its_statistics():
    """Each surrogate's section is a `loss` field whose settings are its keyword arguments, and the
    statistics it names are ones it returns (the clipped ratio on the seed's numbers: r = 1.3 > 1.2)."""
    from posttrain.algorithms.surrogates import SURROGATES

    fields = {f.name for f in dataclasses.fields(online_config.Loss)}
    for name, entry in SURROGATES.items():
        settings = online_config.Loss(surrogate=name).surrogate_settings()
        assert entry.name == name and entry.section in fields, name
        old = torch.log(torch.tensor([[0.20]]))
        _, stats = entry.function(torch.log(torch.tensor([[0.26]])), old, torch.tensor([3.0 ** 0.5]), torch.ones(1, 1, dtype=torch.bool),
                                  **settings)
        assert {key for _, key in entry.fractions} | {"ratio"} <= set(stats), name
        assert entry.describe(settings)
    _, stats = SURROGATES["clip"].function(torch.log(torch.tensor([[0.26]])), torch.log(torch.tensor([[0.20]])),
                                           torch.tensor([3.0 ** 0.5]), torch.ones(1, 1, dtype=torch.bool), low=0.2, high=0.2, dual=None)
    assert stats["ratio"].item() == pytest.approx(1.3) and bool(stats["clipped_high"])


def test_an_unknown_surrogate_is_one_line_naming_the_table():
    with pytest.raises(UserError, match=r"^loss.surrogate must be one of clip, gspo, cispo, clip_cov, kl_cov, got 'sapo'$"):
        config("group", surrogate="sapo")


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_every_key_the_loss_split_renamed_is_one_line_naming_where_it_went(old, new):
    """A preset or flag from before the split: one line, `loss.kl_beta moved to loss.kl.beta`; the
    new key, with the same value, is accepted."""
    value = DEFAULTS[new]
    with pytest.raises(UserError, match=rf"^command line: {re.escape(old)} moved to {re.escape(new)}$"):
        build_config(online_config.grpo_config, None, parse_overrides([f"--{old}", str(value)]))
    factory = online_config.ppo_config if new.startswith("loss.gae.") else online_config.grpo_config
    extra = ["--loss.kl.beta", "0.1"] if new == "loss.kl.reference_refresh_every" else []
    config = build_config(factory, None, parse_overrides([f"--{new}", str(value), *extra]))
    where, _, name = new.rpartition(".")
    target = config
    for part in where.split("."):
        target = getattr(target, part)
    assert getattr(target, name) == value


DEFAULTS = {"loss.clip.low": 0.1, "loss.clip.high": 0.28, "loss.clip.dual": 3.0, "loss.group.scale": "batch", "loss.group.eps": 0.01,
            "loss.group.unbiased_std": True, "loss.gae.gamma": 0.9, "loss.gae.lam": 0.9, "loss.gae.whiten": False,
            "loss.kl.beta": 0.1, "loss.kl.estimator": "k1", "loss.kl.placement": "reward", "loss.kl.reference_refresh_every": 2,
            "data.dynamic_sampling": True, "data.max_refill_rounds": 2}
"""A valid non-default value for each new key (gae's through ppo, whose estimator reads them)."""
