"""The advantage-estimator table's seam and the policy-gradient step as a library call.

1. A test-only estimator, added the way a user adds one (an entry in `ADVANTAGE_ESTIMATORS`, here
   from this module, nothing under posttrain/ changed), runs through `posttrain grpo` (the recipe's
   `run`) and its advantages reach the loss: a constant +1 for every row gives a known loss.
2. `losses.policy_gradient.prepare` + `step` called directly, with models and settings built by hand
   (no recipe State), give the same metrics and weights as the recipe's `online.step` on the same batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.algorithms import exact_kl
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, AdvantageEstimator, Estimate, StepRewards
from posttrain.config import build_config
from posttrain.data.examples import derived_seed
from posttrain.distributed import World
from posttrain.hardware import cpu_placement
from posttrain.losses.policy_gradient import PolicyModels, UpdateSettings, prepare, step
from posttrain.models import make_reference
from posttrain.models.forward import TrainingForward, policy_scores
from posttrain.models.loading import load_policy
from posttrain.optim import Trainable, make_optimizer
from posttrain.recipes import online, online_config
from posttrain.runs.checkpoint import seed_everything
from tests.rewards_for_tests import digits
from tests.test_online_step import SMALL, fixed_batch


def constant_estimate(inputs: StepRewards) -> Estimate:
    """Advantage +1 for every row, whatever its reward; logs how many rows it saw."""
    rows = inputs.rewards.shape[0]
    return Estimate(torch.ones(rows), metrics={"constant/rows": torch.tensor(float(rows))})


CONSTANT = AdvantageEstimator(
    name="constant", command="grpo", algorithm="test-only: advantage +1 for every row", estimate=constant_estimate,
    section=None, needs_critic=False, per_token=False, min_group_size=1, kl_in_reward="not used by this test",
    kl_metric="update", plotted=("reward/mean", "loss"),
)


def test_an_estimator_added_from_outside_runs_through_posttrain_grpo(tmp_path, monkeypatch):
    """`loss.advantage constant`, 2 steps of 2 prompts x G=4, mu = 1, one mini-batch, no KL: every
    step is on-policy (old = the detached log-probs, ratio exactly 1), so each counted token's
    clipped surrogate is -min(r A, clip(r) A) = -1 x 1 = -1, and the token mean over the step's
    counted tokens is loss = -1 (whatever the rows' lengths; a group baseline would give about 0).
    The estimator's own metric (constant/rows = 8 = 2 x 4) and advantages/abs_mean = 1 are logged,
    the run card names its algorithm."""
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "constant", CONSTANT)
    settings = {**SMALL, "max_steps": 2, "output_dir": str(tmp_path / "run"), "loss": {"advantage": "constant"},
                "acceptance": {"eval_every": 0, "sets": []}}
    config = build_config(online_config.grpo_config, None, settings)
    run_dir = online.run(config, reward=digits)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["loss"] == pytest.approx(-1.0, abs=1e-6)
        assert row["advantages/abs_mean"] == 1.0 and row["constant/rows"] == 8.0
        assert row["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and row["clip/low"] == row["clip/high"] == 0.0
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["loss"]["algorithm"] == CONSTANT.algorithm and card["run"]["config"]["loss"]["advantage"] == "constant"


def library_models(config):
    """The policy, its frozen reference, the trainer and the optimizer built from the library's
    parts (what `online.setup` builds, without a State): GRPO with a reference, in one process."""
    placement = cpu_placement()
    seed_everything(config.seed)
    policy, _ = load_policy(config.model, config.lora_rank, config.lora_alpha, placement)
    reference = make_reference(policy)
    trainer = TrainingForward(policy, policy_scores, placement, shared_prefix=True)
    total = config.max_steps * config.update.epochs * config.update.mini_batches
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, total)
    return PolicyModels(Trainable(trainer, optimizer, scheduler, config.optim.max_grad_norm), policy, reference=reference,
                        placement=placement)


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_prepare_and_step_from_the_library_equal_the_recipes_step(placement):
    """One batch (2 prompts x 4, hand-set rewards), GRPO with a k3 KL (in the loss: measured in the
    update; in the reward: charged before the advantages, old log-probs precomputed) and 2
    mini-batches (the second off-policy): the library's prepare + step on hand-built models and
    settings, and the recipe's `online.step` on its State, give the same metrics (the recipe adds
    only lr and entropy/slope, a fit over its steps) and the same weights, exactly."""
    overrides = {**SMALL, "loss": {**SMALL["loss"], "kl": {"beta": 0.05, "placement": placement}},
                 "update": {"mini_batches": 2, "micro_batch_size": 4}}
    config = build_config(online_config.grpo_config, None, overrides)
    state = online.setup(config, reward=digits)
    batch = fixed_batch(state)
    models = library_models(config)
    torch.manual_seed(0)
    expected = online.step(state, batch)
    settings = UpdateSettings(config.loss, config.update, config.critic, config.sampling.temperature, config.sampling.max_new_tokens,
                              config.data.group_size, minibatch_seed=derived_seed(config.seed, "minibatch", "0"),
                              exact_kl_tokens=config.exact_kl_tokens)
    torch.manual_seed(0)
    update_batch, got = prepare(models, batch, settings, World())
    got.update(step(models, update_batch, settings, World()))
    assert "kl/exact" in got and "mismatch/logprob_abs_mean" in got and "kl/estimate" in got
    assert {name: value for name, value in expected.items() if name not in ("lr", "entropy/slope")} == got
    for (name, mine), theirs in zip(models.policy_model.named_parameters(), state.policy.parameters(), strict=True):
        assert torch.equal(mine, theirs), name


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_exact_kl_from_the_kept_logits_equals_separate_forwards(mini_batches):
    """`kl/exact` is measured on logits the step's forwards keep (the reference's no-grad forward;
    the policy's old-log-prob forward with 2 mini-batches, the update's own forward with 1), not on
    forwards of its own. It equals the exact KL of plain full forwards of both models before the
    step, over the first 10 counted tokens in row order (here spanning micro-batches of one row), on
    a policy moved away from its reference."""
    overrides = {**SMALL, "exact_kl_tokens": 10, "loss": {**SMALL["loss"], "kl": {"beta": 0.05, "placement": "loss"}},
                 "update": {"mini_batches": mini_batches, "micro_batch_size": 1}}
    config = build_config(online_config.grpo_config, None, overrides)
    state = online.setup(config, reward=digits)
    batch = fixed_batch(state)
    models = library_models(config)
    with torch.no_grad():
        for parameter in models.policy_model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel())))
        inputs, P, T = batch.rollout.forward_inputs(), batch.rollout.prompt_ids.shape[1], batch.rollout.completion_ids.shape[1]
        logits = models.policy_model(**inputs).logits[:, P - 1: P - 1 + T]
        ref_logits = models.reference(**inputs).logits[:, P - 1: P - 1 + T]
    rows, columns = batch.rollout.mask.nonzero()[:10].unbind(1)
    assert len(set(rows.tolist())) >= 2  # the positions span rows, so micro-batches
    expected = float(exact_kl(logits[rows, columns], ref_logits[rows, columns], temperature=config.sampling.temperature).mean())
    settings = UpdateSettings(config.loss, config.update, config.critic, config.sampling.temperature, config.sampling.max_new_tokens,
                              config.data.group_size, minibatch_seed=1, exact_kl_tokens=config.exact_kl_tokens)
    update_batch, _ = prepare(models, batch, settings, World())
    assert (update_batch.old_logprobs is not None) == (mini_batches > 1)
    got = step(models, update_batch, settings, World())["kl/exact"]
    assert expected > 1e-3 and got == pytest.approx(expected, rel=1e-5)
