"""The online loss link's new rows: RLOO, REINFORCE++ and REINFORCE++-baseline advantages, GSPO and
CISPO surrogates. Hand-computed values and gradients (issue 28's examples), on-policy GSPO equal to
GRPO under per-sequence mean aggregation, the combinations refused in one line, and a real run of
every estimator x surrogate on the tiny model."""

import json
import math

import pytest
import torch

from posttrain.algorithms import aggregate
from posttrain.algorithms.advantages import reinforce_returns
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.algorithms.policy import cispo_surrogate, clipped_surrogate, sequence_clipped_surrogate
from posttrain.algorithms.surrogates import SURROGATES
from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.recipes import online, online_config
from tests.rewards_for_tests import digits


def inputs(rewards, group_size, T=3, kl=None, beta=0.0, mask=None):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), T, dtype=torch.bool) if mask is None else mask
    return StepRewards(rewards, mask, mask, group_size, kl=kl, kl_beta=beta)


def test_rloo_leaves_each_sample_out_of_its_own_baseline():
    estimate = ADVANTAGE_ESTIMATORS["rloo"].estimate(inputs([0, 1, 0, 0], 4))
    assert estimate.advantages.tolist() == pytest.approx([-1 / 3, 1, -1 / 3, -1 / 3])
    # A KL in the reward is summed per sequence first (the paper's and TRL's k1 in the reward).
    kl = torch.tensor([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    charged = ADVANTAGE_ESTIMATORS["rloo"].estimate(inputs([0, 1, 0, 0], 4, kl=kl, beta=1.0)).advantages
    assert charged.tolist() == pytest.approx([-0.3 - 1 / 3, 1 + 0.3 / 3, -0.7 / 3, -0.7 / 3])  # charged rewards [-0.3, 1, 0, 0]
    assert float(charged.sum()) == pytest.approx(0.0, abs=1e-6)  # leave-one-out advantages sum to zero in a group


def test_reinforce_pp_returns_and_whitening():
    mask = torch.ones(1, 3, dtype=torch.bool)
    token_rewards = torch.tensor([[-0.05, -0.1, 1 - 0.15]])  # R = 1 on the last token, -beta x k1 KL [0.1, 0.2, 0.3], beta 0.5
    assert reinforce_returns(token_rewards, mask)[0].tolist() == pytest.approx([0.70, 0.75, 0.85])
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    entry = ADVANTAGE_ESTIMATORS["reinforce_pp"]
    raw = entry.estimate(inputs([1.0], 1, kl=kl, beta=0.5, mask=mask), whiten=False)
    assert raw.advantages[0].tolist() == pytest.approx([0.70, 0.75, 0.85])
    # Whitened over every counted token of the batch: zero mean, unit population std; padding stays 0.
    mask = torch.tensor([[True, True, True], [True, True, False]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.2, 0.2, 0.0]])
    white = entry.estimate(inputs([1.0, 0.0], 1, kl=kl, beta=0.5, mask=mask), whiten=True).advantages
    counted = white[mask]
    assert float(counted.mean()) == pytest.approx(0.0, abs=1e-6) and float(counted.std(correction=0)) == pytest.approx(1.0, abs=1e-4)
    assert white[1, 2] == 0
    returns = torch.tensor([0.70, 0.75, 0.85, -0.2, -0.1])  # row 2: R = 0, KL 0.2 on both tokens
    assert counted.tolist() == pytest.approx(((returns - returns.mean()) / returns.std(correction=0)).tolist(), abs=1e-4)


def test_reinforce_returns_flow_across_a_hole_in_the_mask():
    """A tool's output between two turns is a hole in the loss mask: it earns nothing and gets 0,
    and the return flows across it (verl's REINFORCE++ resets at every masked token instead, so the
    first turn would never see the outcome; docs/algorithms.md 3b)."""
    token_rewards = torch.tensor([[-0.1, -0.1, 5.0, 5.0, -0.1, 1.0]])  # 5.0: inside the hole, ignored
    mask = torch.tensor([[True, True, False, False, True, True]])
    assert reinforce_returns(token_rewards, mask)[0].tolist() == pytest.approx([0.7, 0.8, 0.0, 0.0, 0.9, 1.0])


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    entry = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"]
    estimate = entry.estimate(inputs([1.0, 0.0, 1.0, 1.0], 2, T=2), whiten=False)
    assert estimate.advantages.tolist() == [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]
    unscored = entry.estimate(inputs([1.0, float("nan")], 2, T=1), whiten=False).advantages
    assert unscored.tolist() == [[0.0], [0.0]], "an unscored row is left out of its group's mean and gets no signal"
    assert entry.min_group_size == 2 and ADVANTAGE_ESTIMATORS["reinforce_pp"].min_group_size == 1


def gspo_gradient(log_ratios, advantage, low, high):
    old = torch.zeros(1, len(log_ratios))
    logprobs = torch.tensor([log_ratios], requires_grad=True)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, stats = sequence_clipped_surrogate(logprobs, old, torch.tensor([advantage]), mask, low, high)
    aggregate(loss, mask, "seq_mean_token_mean").backward()
    return logprobs.grad[0].tolist(), stats


def test_gspo_sequence_ratio_and_its_gradient():
    grad, stats = gspo_gradient([0.1, -0.3, 0.5], 1.0, 0.2, 0.2)
    assert stats["ratio"][0].tolist() == pytest.approx([math.exp(0.1)] * 3)
    assert grad == pytest.approx([-0.368390] * 3, abs=1e-6)  # -s / |y|, s = exp(0.1) = 1.105171
    grad, stats = gspo_gradient([0.1, -0.3, 0.5], 1.0, 3e-4, 4e-4)  # the paper's range: s is clipped
    assert grad == [0.0, 0.0, 0.0] and bool(stats["clipped_high"].all())


def test_gspo_averages_the_log_ratios_before_clamping():
    """One token's log-ratio past MAX_LOG_RATIO must not move s across the clip boundary: TRL's
    GRPOTrainer (importance_sampling_level="sequence") and verl's compute_policy_loss_gspo both give
    s = exp(mean) = exp(2.5 / 6) = 1.517 here, loss -1.2 (clipped at 1 + 0.2), gradient 0."""
    log_ratios = [25.0, -4.5, -4.5, -4.5, -4.5, -4.5]
    grad, stats = gspo_gradient(log_ratios, 1.0, 0.2, 0.2)
    assert stats["ratio"][0, 0].item() == pytest.approx(math.exp(2.5 / 6), rel=1e-6)
    assert grad == [0.0] * 6 and bool(stats["clipped_high"].all())
    old = torch.zeros(1, 6)
    loss, _ = sequence_clipped_surrogate(torch.tensor([log_ratios]), old, torch.tensor([1.0]), torch.ones(1, 6, dtype=torch.bool), 0.2, 0.2)
    assert aggregate(loss, torch.ones(1, 6, dtype=torch.bool), "seq_mean_token_mean").item() == pytest.approx(-1.2)
    # a masked-out token's log-ratio (here an infinite one) is no part of the mean
    mask = torch.tensor([[True, True, False]])
    loss, stats = sequence_clipped_surrogate(torch.tensor([[0.1, 0.3, float("inf")]]), torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.5, 0.5)
    assert stats["ratio"][0, 0].item() == pytest.approx(math.exp(0.2)) and torch.isfinite(loss[mask]).all()


def test_on_policy_gspo_is_grpo_under_per_sequence_mean():
    torch.manual_seed(0)
    base = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([0.7, -1.2, 0.4])
    grads = []
    for surrogate in (lambda lp: sequence_clipped_surrogate(lp, lp.detach(), advantages, mask)[0],
                      lambda lp: clipped_surrogate(lp, lp.detach(), advantages)[0]):
        logprobs = base.clone().requires_grad_(True)
        aggregate(surrogate(logprobs), mask, "seq_mean_token_mean").backward()
        grads.append(logprobs.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_cispo_keeps_the_gradient_where_the_ppo_clip_drops_it():
    old = torch.zeros(1, 1)
    logprobs = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, stats = cispo_surrogate(logprobs, old, torch.tensor([2.0]), low=0.0, high=1.28)
    loss.sum().backward()
    assert float(logprobs.grad) == pytest.approx(-2.56) and bool(stats["clipped_high"])
    logprobs.grad = None
    clipped_surrogate(logprobs, old, torch.tensor([2.0]), 0.2, 0.28)[0].sum().backward()
    assert float(logprobs.grad) == 0.0


def config(tmp_path, *extra):
    args = ["--data.eval_size", "4", "--data.train_size", "40", "--data.prompts_per_step", "2", "--data.group_size", "4",
            "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3", "--max-steps", "2",
            "--acceptance.eval_every", "0", "--acceptance.sets", "[]", *extra]
    built = build_config(online_config.grpo_config, None, parse_overrides(args))
    built.output_dir = str(tmp_path / "run")
    return built


@pytest.mark.parametrize("extra, message", [
    (["--loss.surrogate", "gspo"], "loss.aggregation must be seq_mean_token_mean with loss.surrogate gspo"),
    (["--loss.gspo.low", "0.1"], "loss.gspo applies to loss.surrogate gspo only (this run: clip)"),
    (["--loss.reinforce.whiten", "false"], "loss.reinforce applies to loss.advantage reinforce_pp or reinforce_pp_baseline only"),
    (["--loss.surrogate", "cispo", "--loss.cispo.high", "0"], "loss.cispo needs 0 <= low < high"),
    (["--loss.advantage", "rloo", "--data.group_size", "1"], "data.group_size must be at least 2"),
    (["--loss.advantage", "reinforce_pp_baseline", "--data.group_size", "1"], "data.group_size must be at least 2"),
])
def test_combinations_that_make_no_sense_are_one_line(tmp_path, extra, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, *extra)


def test_the_shared_reinforce_section_is_accepted_by_both_of_its_estimators(tmp_path):
    for advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        assert config(tmp_path, "--loss.advantage", advantage, "--loss.reinforce.whiten", "false").loss.reinforce.whiten is False


@pytest.mark.parametrize("advantage, surrogate, extra", [
    ("rloo", "clip", ["--loss.kl.beta", "0.05", "--loss.kl.estimator", "k1", "--loss.kl.placement", "reward",
                      "--loss.aggregation", "seq_mean_token_sum"]),
    ("reinforce_pp", "clip", ["--loss.kl.beta", "0.05", "--loss.kl.placement", "reward", "--data.group_size", "1",
                              "--data.prompts_per_step", "4"]),
    ("reinforce_pp_baseline", "cispo", ["--loss.kl.beta", "0.05"]),
    ("group", "gspo", ["--loss.aggregation", "seq_mean_token_mean", "--update.mini_batches", "2"]),
    ("rloo", "cispo", ["--update.epochs", "2"]),
    ("group", "clip_cov", ["--update.epochs", "2", "--loss.clip_cov.fraction", "0.2", "--loss.clip_cov.lower", "0"]),
    ("group", "kl_cov", ["--update.mini_batches", "2", "--loss.kl_cov.fraction", "0.2"]),
])
def test_every_estimator_and_surrogate_trains_on_the_tiny_model(tmp_path, advantage, surrogate, extra):
    run_dir = online.run(config(tmp_path, "--loss.advantage", advantage, "--loss.surrogate", surrogate, *extra), reward=digits)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["ratio/mean"] > 0
    card = json.loads((run_dir / "run_card.json").read_text())["links"]["loss"]
    assert card["advantage"] == advantage and card["surrogate"] == surrogate
    assert card["algorithm"] == ADVANTAGE_ESTIMATORS[advantage].algorithm
    assert card["advantage_as_peers_spell_it"] == ADVANTAGE_ESTIMATORS[advantage].peers != ""
    assert card["surrogate_as_peers_spell_it"] == SURROGATES[surrogate].peers != ""
    assert surrogate in card and (advantage not in ("reinforce_pp", "reinforce_pp_baseline") or "reinforce" in card)


@pytest.mark.parametrize("argv, key, expected", [
    (["rloo", "--rewards", "0", "1", "0", "0"], "advantages", [-1 / 3, 1, -1 / 3, -1 / 3]),
    (["reinforce", "--reward", "1", "--kl", "0.1", "0.2", "0.3", "--beta", "0.5"], "returns", [0.70, 0.75, 0.85]),
    (["gspo", "--log-ratios", "0.1", "-0.3", "0.5", "--advantage", "1", "--clip-low", "0.2", "--clip-high", "0.2"], "grad",
     [-0.368390] * 3),
    (["gspo", "--log-ratios", "0.1", "-0.3", "0.5", "--advantage", "1"], "grad", [0.0] * 3),
    (["cispo", "--ratio", "1.5", "--advantage", "2", "--max", "1.28"], "grad", -2.56),
])
def test_explain_computes_the_new_rows_with_the_library(capsys, argv, key, expected):
    from posttrain.cli import main

    assert main(["explain", *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[key] == pytest.approx(expected, abs=1e-6)


def trl_loss(loss_type: str, level: str, logprobs, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.2):
    """TRL 1.16's own GRPOTrainer._compute_loss on our tensors: the method called unbound on a stand-in
    that serves the log-probs (no model), with its KL, entropy bonus, vLLM correction and masks off."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    accelerator = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
                                  num_processes=1, sync_gradients=True)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, args=SimpleNamespace(delta=None),
        use_vllm=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=accelerator, _metrics={"train": defaultdict(list)}, _entropy_bonus_enabled=False, aux_loss_enabled=False)
    stand_in.args.steps_per_generation = 1
    ids = torch.zeros(mask.shape, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1] + 1, "completion_ids": ids, "completion_mask": mask.long(),
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


def test_gspo_and_cispo_equal_trls_own_loss_and_gradient():
    """TRL importance_sampling_level="sequence" with loss_type "grpo" (its per-sequence mean) is our gspo
    under seq_mean_token_mean; TRL loss_type "cispo" (epsilon_high the absolute cap, no lower bound,
    divided by the batch's tokens) is our cispo (low 0) under token_mean."""
    pytest.importorskip("trl")
    torch.manual_seed(1)
    old = torch.randn(3, 4) * 0.1 - 1.0
    base = old + torch.randn(3, 4) * 0.2
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5, 0.3])
    cases = [("grpo", "sequence", 0.05, 0.08, "seq_mean_token_mean",
              lambda lp: sequence_clipped_surrogate(lp, old, advantages, mask, 0.05, 0.08)[0]),
             ("cispo", "token", 0.2, 1.1, "token_mean", lambda lp: cispo_surrogate(lp, old, advantages, 0.0, 1.1)[0])]
    for loss_type, level, low, high, mode, ours in cases:
        theirs_lp, ours_lp = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
        theirs = trl_loss(loss_type, level, theirs_lp, old, advantages, mask, low, high)
        mine = aggregate(ours(ours_lp), mask, mode)
        theirs.backward()
        mine.backward()
        assert float(mine.detach()) == pytest.approx(float(theirs.detach()), abs=1e-6), loss_type
        assert torch.allclose(ours_lp.grad, theirs_lp.grad, atol=1e-6), loss_type
        assert ours_lp.grad.abs().sum() > 0
