"""The entropy link of the loss (issue 43): `loss.entropy.coef` (the bonus -coef x H_t with its
gradient, aggregated like the surrogate, split-invariant, absent at coef 0), the Clip-Cov and KL-Cov
surrogates on hand-computed rows, `entropy/slope`, `posttrain explain entropy`, and a CLI run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import aggregate, token_logprobs
from posttrain.algorithms.covariance import clip_cov_surrogate, kl_cov_surrogate, token_covariance
from posttrain.algorithms.logprobs import entropy, token_entropy
from posttrain.algorithms.surrogates import SURROGATES
from posttrain.distributed import World
from posttrain.evaluation.stats import least_squares_slope
from posttrain.losses import policy_gradient
from posttrain.models.forward import scores_from_logits
from posttrain.losses.policy_gradient_config import ClipCov, Critic, Entropy, Loss, Update
from posttrain.optim import Trainable
from tests.test_explain import run_json
from tests.test_grpo import ROOT, SMALL

N, T, V = 4, 5, 7


def test_entropy_equals_the_metric_and_its_gradient_matches_finite_differences():
    """float64, temperature 0.7, chunks of 4 positions: the value equals `token_entropy`'s, the
    autograd gradient of sum_t w_t H_t equals central differences (step 1e-6) to 1e-8."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, V, generator=generator, dtype=torch.float64)
    weights = torch.randn(2, 3, generator=generator, dtype=torch.float64)
    assert torch.allclose(entropy(logits, 0.7, chunk_size=4), token_entropy(logits, 0.7).double(), atol=1e-6)
    leaf = logits.clone().requires_grad_(True)
    (entropy(leaf, 0.7, chunk_size=4) * weights).sum().backward()
    numeric = torch.zeros_like(logits)
    for index in range(logits.numel()):
        step = torch.zeros(logits.numel(), dtype=torch.float64)
        step[index] = 1e-6
        step = step.reshape(logits.shape)
        numeric.view(-1)[index] = ((entropy(logits + step, 0.7) - entropy(logits - step, 0.7)) * weights).sum() / 2e-6
    assert torch.allclose(leaf.grad, numeric, atol=1e-8)


def test_entropy_of_the_worked_example():
    """logits [1, 0, -1]: p = e^z / (e + 1 + 1/e) = [0.665241, 0.244728, 0.090031],
    H = -sum p log p = 0.832396, dH/dz_v = -p_v (log p_v + H) = [-0.282587, 0.140770, 0.141817]."""
    logits = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    value = entropy(logits)
    value.backward()
    assert value.item() == pytest.approx(0.832396, abs=1e-6)
    assert logits.grad.tolist() == pytest.approx([-0.282587, 0.140770, 0.141817], abs=1e-6)


class TableTrainer(torch.nn.Module):
    """A policy whose logits are a parameter table (N, T, V): the trainer's interface, no model."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(logits.clone())

    def forward(self, inputs, rows, P, T, targets, temperature, entropy_grad=False, score_mask=None, detach_hidden=False):
        return scores_from_logits(self.table[rows], targets, temperature, entropy_grad)


def table_case(coef: float, aggregation: str = "token_mean", micro_batch_size: int = N, surrogate: str = "clip", **sections):
    """A fixed batch of N rows of T tokens (the last token of rows 1 and 3 masked), old log-probs
    0.1-0.3 off the current ones (so some ratios clip), group advantages; the trainer, the update
    batch and the settings."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(N, T, V, generator=generator)
    targets = torch.randint(V, (N, T), generator=generator)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[1, -1] = mask[3, -1] = False
    old = token_logprobs(logits, targets, 0.8) + 0.3 * torch.rand(N, T, generator=generator) - 0.1
    rollout = SimpleNamespace(prompt_ids=torch.zeros(N, 1, dtype=torch.long), completion_ids=targets, forward_inputs=dict,
                              sampler_logprobs=old, logprobs=old, mask=mask)
    batch = policy_gradient.UpdateBatch(rollout, mask, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.zeros(N, dtype=torch.long),
                                        seed=0, old_logprobs=old)
    loss = Loss(aggregation=aggregation, surrogate=surrogate, entropy=Entropy(coef), **sections)
    settings = policy_gradient.UpdateSettings(loss=loss, update=Update(micro_batch_size=micro_batch_size), critic=Critic(),
                                              temperature=0.8, max_length=T, group_size=2, minibatch_seed=0)
    return TableTrainer(logits), batch, settings


def full_micro_loss(trainer, batch, settings):
    micro = policy_gradient._Micro(torch.arange(N), batch.mask, batch.mask.sum(), N)
    trainer.zero_grad()
    result = policy_gradient._micro_loss(trainer, batch, {}, micro, settings)
    result.loss.backward()
    return result, trainer.table.grad.clone()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_the_bonus_is_minus_coef_times_the_entropy_aggregated_like_the_surrogate(aggregation):
    """coef 0 is the surrogate alone (aggregate(clipped_surrogate)), the entropy a metric without
    gradient; coef 0.3 is that minus 0.3 x aggregate(H) under the same normalisers, in value and in gradient."""
    trainer, batch, settings = table_case(0.0, aggregation)
    plain, plain_grad = full_micro_loss(trainer, batch, settings)
    assert not plain.scores.entropy.requires_grad
    logits = trainer.table.detach().clone().requires_grad_(True)
    logprobs = token_logprobs(logits, batch.rollout.completion_ids, 0.8)
    per_token, _ = SURROGATES["clip"].function(logprobs, batch.old_logprobs, batch.advantages, batch.mask, low=0.2, high=0.2, dual=None)
    by_hand = aggregate(per_token, batch.mask, aggregation, batch.mask.sum(), N, max_length=T)
    by_hand.backward()
    assert torch.equal(plain.loss.detach(), by_hand.detach()) and torch.equal(plain_grad, logits.grad)

    trainer, batch, settings = table_case(0.3, aggregation)
    bonus, bonus_grad = full_micro_loss(trainer, batch, settings)
    logits = trainer.table.detach().clone().requires_grad_(True)
    entropy_term = aggregate(entropy(logits, 0.8), batch.mask, aggregation, batch.mask.sum(), N, max_length=T)
    entropy_term.backward()
    assert bonus.loss.item() == pytest.approx(plain.loss.item() - 0.3 * entropy_term.item(), abs=1e-6)
    assert torch.allclose(bonus_grad, plain_grad - 0.3 * logits.grad, atol=1e-6)


def run_step(coef: float, micro_batch_size: int, aggregation: str = "token_mean", **surrogate):
    """One `policy_gradient.step` with SGD at lr 1 (the parameter change is the gradient)."""
    trainer, batch, settings = table_case(coef, aggregation, micro_batch_size, **surrogate)
    before = trainer.table.detach().clone()
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    models = policy_gradient.PolicyModels(Trainable(trainer, optimizer, scheduler), trainer)
    metrics = policy_gradient.step(models, batch, settings, World())
    return before - trainer.table.detach(), metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_bonus_does_not_depend_on_the_micro_batch_split(aggregation):
    """Micro-batches of 4, 3 (+1) and 1 rows: the same update and loss; entropy/bonus = coef x entropy."""
    (reference, metrics), *others = [run_step(0.1, size, aggregation) for size in (4, 3, 1)]
    assert metrics["entropy/bonus"] == pytest.approx(0.1 * metrics["entropy"])
    for delta, other in others:
        assert torch.allclose(delta, reference, atol=1e-6) and other["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    plain_delta, plain = run_step(0.0, 4, aggregation)
    assert "entropy/bonus" not in plain and not torch.allclose(plain_delta, reference)


def test_kl_cov_by_hand():
    """One row, log pi [-1, -2, -3], old = log pi - [0.1, 0, 0], A [1, 0, -1]: means -2 and 0, so
    cov = [(1)(1), (0)(0), (-1)(-1)] = [1, 0, 1]; fraction 0.4 of 3 tokens -> floor(1.2) = 1 token,
    the tie to the first: I_KL = {0}. loss = [-e^0.1 + |0.1|, -0 x 1, -(-1) x 1] = [-1.005171, 0, 1];
    d loss_0 / d log pi_0 = -e^0.1 + 1 = -0.105171 (unclipped; the penalty's slope is +1)."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    old = logprobs.detach() - torch.tensor([[0.1, 0.0, 0.0]], dtype=torch.float64)
    advantages, mask = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    assert token_covariance(logprobs, advantages, mask).tolist() == [[1.0, 0.0, 1.0]]
    loss, stats = kl_cov_surrogate(logprobs, old, advantages, mask, fraction=0.4, coef=1.0)
    assert stats["cov_penalised"].tolist() == [[True, False, False]]
    assert loss.tolist()[0] == pytest.approx([-math.exp(0.1) + 0.1, 0.0, 1.0])
    loss.sum().backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-math.exp(0.1) + 1, 0.0, 1.0])
    # Half the tokens (floor(1.5) = 1) still one; the masked token never counts nor is chosen.
    mask[0, 0] = False
    _, stats = kl_cov_surrogate(logprobs, old, advantages, mask, fraction=0.5)
    assert stats["cov_penalised"].tolist() == [[False, True, False]] or stats["cov_penalised"].tolist() == [[False, False, True]]


def test_clip_cov_by_hand():
    """One row on-policy, log pi [0, -1, -2, -3] (mean -1.5), A [3, 0, -3, 0] (mean 0):
    cov = [4.5, 0, 1.5, 0]; the band (1, 5) holds tokens 0 and 2. fraction 0.5 -> floor(2) = 2:
    both lose their loss and gradient, tokens 1 and 3 keep theirs (-r A = 0 here, gradient -A).
    fraction 0.25 -> one of the two, the same one for the same seed, each for some seed. With
    token 0 already clipped by PPO (r = e^0.5 > 1.2, A > 0) only token 2 can be drawn."""
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    advantages, mask = torch.tensor([[3.0, 0.0, -3.0, 0.0]], dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool)
    assert token_covariance(logprobs, advantages, mask).tolist() == [[4.5, 0.0, 1.5, 0.0]]
    loss, stats = clip_cov_surrogate(logprobs, logprobs.detach(), advantages, mask, fraction=0.5)
    assert stats["cov_clipped"].tolist() == [[True, False, True, False]]
    loss.sum().backward()
    assert loss.tolist() == [[0.0, 0.0, 0.0, 0.0]] and logprobs.grad.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    picks = {tuple(clip_cov_surrogate(logprobs, logprobs.detach(), advantages, mask, fraction=0.25, seed=seed)[1]["cov_clipped"][0].tolist())
             for seed in range(20)}
    assert picks == {(True, False, False, False), (False, False, True, False)}
    again = [clip_cov_surrogate(logprobs, logprobs.detach(), advantages, mask, fraction=0.25, seed=7)[1]["cov_clipped"] for _ in range(2)]
    assert torch.equal(*again)
    old = logprobs.detach() - torch.tensor([[0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    _, stats = clip_cov_surrogate(logprobs, old, advantages, mask, fraction=0.5)
    assert stats["clipped_high"][0, 0] and stats["cov_clipped"].tolist() == [[False, False, True, False]]


@pytest.mark.parametrize("surrogate", ["clip_cov", "kl_cov"])
def test_the_covariance_surrogates_run_through_the_step(surrogate):
    """The loss step passes clip_cov its seed and logs each surrogate's fractions (clip/cov,
    cov/penalised): one micro-batch of 18 counted tokens, max(1, floor(18 x 2e-4)) = 1 token chosen
    (clip_cov's band opened to every covariance, so that a token is eligible); a rerun draws alike."""
    sections = {"clip_cov": ClipCov(lower=-1e9)} if surrogate == "clip_cov" else {}
    (delta, metrics), (again, _) = (run_step(0.0, N, surrogate=surrogate, **sections) for _ in range(2))
    name = {"clip_cov": "clip/cov", "kl_cov": "cov/penalised"}[surrogate]
    assert metrics[name] == pytest.approx(1 / 18) and math.isfinite(metrics["loss"]) and torch.equal(delta, again)


def test_least_squares_slope():
    """[3, 2.5, 2] falls 0.5 a step; [1, 2, 1, 2]: centred x -1.5..1.5, y -0.5, 0.5, -0.5, 0.5 ->
    sum xy 1 / sum x^2 5 = 0.2; one point has no slope."""
    assert least_squares_slope([3.0, 2.5, 2.0]) == pytest.approx(-0.5)
    assert least_squares_slope([1.0, 2.0, 1.0, 2.0]) == pytest.approx(0.2)
    assert least_squares_slope([1.0]) is None and least_squares_slope([]) is None


def test_explain_entropy(capsys):
    result = run_json(capsys, "entropy", "--coef", "0.1")
    assert set(result) == {"probabilities", "entropy", "grad", "analytic_grad", "bonus", "bonus_grad"}
    assert result["probabilities"] == pytest.approx([0.665241, 0.244728, 0.090031], abs=1e-6)
    assert result["entropy"] == pytest.approx(0.832396, abs=1e-6) and result["bonus"] == pytest.approx(-0.0832396, abs=1e-7)
    assert result["grad"] == pytest.approx(result["analytic_grad"], abs=1e-12)
    assert result["bonus_grad"] == pytest.approx([0.0282587, -0.0140770, -0.0141817], abs=1e-7)
    uniform = run_json(capsys, "entropy", "--logits", "0", "0", "0", "0")
    assert uniform["entropy"] == pytest.approx(math.log(4)) and uniform["grad"] == pytest.approx([0.0] * 4)


def test_explain_kl_cov(capsys):
    """The by-hand row of `test_kl_cov_by_hand` through the CLI."""
    result = run_json(capsys, "kl_cov", "--logprob", "-1", "-2", "-3", "--old", "-1.1", "-2", "-3", "--advantages", "1", "0", "-1",
                      "--fraction", "0.4")
    assert result["covariance"] == pytest.approx([1.0, 0.0, 1.0]) and result["penalised"] == [True, False, False]
    assert result["loss"] == pytest.approx(-math.exp(0.1) + 0.1 + 1.0) and result["grad"] == pytest.approx([1 - math.exp(0.1), 0.0, 1.0])


@pytest.mark.parametrize("overrides, message", [
    (["--loss.entropy.coef", "-0.1"], "loss.entropy.coef must be >= 0"),
    (["--loss.surrogate", "kl_cov", "--loss.kl_cov.fraction", "0"], "loss.kl_cov needs 0 < fraction <= 1"),
    (["--loss.clip_cov.fraction", "0.1"], "loss.clip_cov applies to loss.surrogate clip_cov only (this run: clip)"),
])
def test_bad_entropy_settings_are_one_line(tmp_path, capsys, overrides, message):
    from posttrain.cli import main

    assert main(["grpo", "--output-dir", str(tmp_path / "run"), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_grpo_run_with_the_bonus_logs_it_and_cards_it(tmp_path):
    """`posttrain grpo ... --loss.entropy.coef 0.01` for 2 steps: entropy/bonus = 0.01 x entropy,
    entropy/slope None at step 1 and (entropy_2 - entropy_1) at step 2, the card states the bonus."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-m", "posttrain", "grpo", *SMALL, "--reward", "callable:rewards_for_tests.digits",
                             "--max-steps", "2", "--acceptance.eval_every", "0", "--loss.entropy.coef", "0.01",
                             "--output-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["entropy/bonus"] == pytest.approx(0.01 * row["entropy"]) and math.isfinite(row["loss"])
    assert rows[0]["entropy/slope"] is None and rows[1]["entropy/slope"] == pytest.approx(rows[1]["entropy"] - rows[0]["entropy"])
    card = json.loads((run_dir / "run_card.json").read_text())["links"]["loss"]
    assert card["entropy"] == {"coef": 0.01} and card["entropy_bonus_meaning"].startswith("- 0.01 x H_t")
