"""Our RLOO (`loss.advantage rloo`, the tiny-rloo preset's loss choices) beside TRL's own RLOOTrainer
code as installed: the same advantages for the same rewards and log-probs, and the same gradient of
the loss with respect to each token's log-prob.

TRL is not re-typed here: its real `RLOOTrainer._generate_and_score_completions` and `_compute_loss`
are called unbound on a stand-in that serves our tensors (generation, the policy's and the
reference's per-token log-probs, the rewards) and no-op bookkeeping (one process, no vLLM, no
images). Our side is what `online.step` calls: the estimator's entry with `StepRewards` built as the
step builds it, the k1 estimate of the old policy against the reference, and the surrogate entry
aggregated as `loss.aggregation` says.

Conventions, mapped (TRL 1.16 -> ours):

* `beta` -> `loss.kl.beta` with `loss.kl.estimator k1`, `loss.kl.placement reward`: TRL charges each
  reward beta x the sum over the completion of (old - ref) log-probs; ours `kl_in_reward(per_token=False)`.
* the leave-one-out baseline over scorable siblings, NaN rewards (every reward function returned
  None) out of it and advantage 0 -> `rloo_advantages` (NaN = unscored).
* `normalize_advantages` False (TRL's default) -> ours has no normalisation for rloo; True has no
  equivalent (shown below).
* the loss: TRL's sequence ratio exp(sum_t log pi - sum_t log pi_old), clipped, mean over sequences
  -> our per-token clip under `seq_mean_token_sum`. Equal gradients on-policy (ratio 1: mu = 1, one
  mini-batch, as the preset has); off-policy they differ (a product of token ratios vs each token's
  own), shown below.
* `mask_truncated_completions` -> `loss.mask_truncated`: TRL sums the KL over the masked completion,
  so a truncated row pays no KL; ours charges every sampled token (shown below).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import aggregate, kl_estimate
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.algorithms.surrogates import SURROGATES
from posttrain.config import build_config
from posttrain.recipes import online_config

trl_rloo = pytest.importorskip("trl.trainer.rloo_trainer")
if not hasattr(trl_rloo, "RLOOTrainer"):
    pytest.skip("this TRL has no RLOOTrainer", allow_module_level=True)
RLOOTrainer = trl_rloo.RLOOTrainer

EOS, PAD, OTHER = 2, 0, 5
PADDING = 100.0
"""Every padded log-prob: a sum that reads padding is far off."""


@pytest.fixture(scope="module")
def preset():
    """The tiny-rloo preset's loss section (its start lifted: the tiny model)."""
    loss = build_config(online_config.grpo_config, "tiny-rloo", {"model": "tiny"}).loss
    assert (loss.advantage, loss.kl.estimator, loss.kl.placement, loss.aggregation, loss.surrogate) == \
        ("rloo", "k1", "reward", "seq_mean_token_sum", "clip")
    return loss


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """accelerate's gather / gather_object inside TRL's method: the identity of one process."""
    monkeypatch.setattr(trl_rloo, "gather", lambda tensor: tensor)
    monkeypatch.setattr(trl_rloo, "gather_object", lambda values: values)


def stand_in(**fields):
    """What TRL's methods read of `self`, besides the per-call fields given."""
    accelerator = SimpleNamespace(device="cpu", process_index=0, num_processes=1, reduce=lambda x, reduction: x,
                                  gather=lambda x: x, gather_for_metrics=lambda x: x)
    logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": defaultdict(list)}
    return SimpleNamespace(accelerator=accelerator, model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
                           _tokenizer=SimpleNamespace(pad_token_id=PAD), pad_to_multiple_of=None, eos_token_ids=[EOS],
                           args=SimpleNamespace(per_device_train_batch_size=1, gradient_checkpointing_kwargs=None),
                           reward_weights=torch.ones(1), reward_clip_range=None, reward_func_names=["reward"],
                           _metrics={"train": defaultdict(list)}, _logs=logs, _pending_extra_logs={}, _pending_metrics={},
                           log_multimodal=False, aux_loss_enabled=False, **fields)


def trl_advantages(rewards, old, ref, lengths, group_size, beta, normalize=False, truncated=(), mask_truncated=False):
    """TRL's `_generate_and_score_completions` on our tensors: `old` and `ref` (N, T) are what its policy
    and reference forwards return; row i has lengths[i] completion tokens, ending in EOS unless i is in
    `truncated`. Returns its (N,) advantages and completion mask."""
    reference = object()
    completion_ids = [[OTHER] * (length - 1) + [OTHER if row in truncated else EOS] for row, length in enumerate(lengths)]
    trainer = stand_in(
        _generate=lambda prompts: ([[1]] * len(prompts), completion_ids, ["completion"] * len(prompts)),
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (ref if model is reference else old, None, None),
        _calculate_rewards=lambda *a: rewards.unsqueeze(1), ref_model=reference, num_generations=group_size,
        beta=beta, normalize_advantages=normalize, mask_truncated_completions=mask_truncated)
    output = RLOOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * len(lengths))
    return output["advantages"], output["completion_mask"].bool()


def our_advantages(loss, rewards, old, ref, sampled, group_size, beta):
    """What `online.step` computes: rows with a reward reach the loss (`mask`), every sampled token
    pays the KL in the reward (`sampled`)."""
    mask = sampled & ~torch.isnan(rewards)[:, None]
    kl = kl_estimate(old, ref, loss.kl.estimator)
    entry = ADVANTAGE_ESTIMATORS[loss.advantage]
    return entry.estimate(StepRewards(rewards, mask, sampled, group_size, kl=kl, kl_beta=beta), **loss.estimator_settings()).advantages


def batch(lengths, seed=0):
    """Old and reference per-token log-probs (N, T) with PADDING beyond each row's length, and the mask."""
    generator = torch.Generator().manual_seed(seed)
    T = max(lengths)
    sampled = torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths)[:, None]
    old = -torch.rand(len(lengths), T, generator=generator, dtype=torch.float64) * 3
    ref = old + torch.randn(len(lengths), T, generator=generator, dtype=torch.float64) * 0.3
    return old.masked_fill(~sampled, PADDING), ref.masked_fill(~sampled, -PADDING), sampled


def test_hand_example_rewards_0100(preset):
    """No KL: A_i = r_i - mean of the other three: [0 - 1/3, 1 - 0, 0 - 1/3, 0 - 1/3]."""
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    old, ref, sampled = batch([3, 3, 3, 3])
    theirs, _ = trl_advantages(rewards, old, ref, [3] * 4, 4, beta=0.0)
    ours = our_advantages(preset, rewards, old, ref, sampled, 4, beta=0.0)
    assert theirs.tolist() == pytest.approx([-1 / 3, 1, -1 / 3, -1 / 3], abs=1e-12)
    assert ours.tolist() == pytest.approx([-1 / 3, 1, -1 / 3, -1 / 3], abs=1e-12)


LENGTHS = [5, 2, 7, 1, 4, 7, 3, 6, 2, 5, 7, 4]
"""B = 3 prompts x G = 4, ragged completions (T = 7)."""


@pytest.mark.parametrize("beta", ["preset", 0.5])
def test_advantages_with_the_k1_kl_in_the_reward_equal_trls(preset, beta):
    """TRL's beta = our loss.kl.beta (k1, in the reward): the same advantages to 1e-12 on ragged rows whose
    padding holds +-100, and the KL moves them (so a KL left out, or summed over padding, fails)."""
    beta = preset.kl.beta if beta == "preset" else beta
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0.5], dtype=torch.float64)
    old, ref, sampled = batch(LENGTHS)
    theirs, completion_mask = trl_advantages(rewards, old, ref, LENGTHS, 4, beta)
    assert torch.equal(completion_mask, sampled)
    ours = our_advantages(preset, rewards, old, ref, sampled, 4, beta)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)
    without_kl = our_advantages(preset, rewards, old, ref, sampled, 4, 0.0)
    assert (ours - without_kl).abs().max() > beta * 0.1
    assert ours.view(3, 4).sum(-1).abs().max() < 1e-12  # leave-one-out advantages sum to zero in each group


def test_unscorable_rows_are_out_of_the_baseline_and_get_zero_on_both_sides(preset):
    """Group 0: row 1 unscored (NaN), so row 0's baseline is the mean of rows 2, 3 only: 1 - (0 + 0)/2 = 1.
    Group 1: one scored row, so no sibling and advantage 0 everywhere."""
    nan = float("nan")
    rewards = torch.tensor([1, nan, 0, 0, nan, 1, nan, nan], dtype=torch.float64)
    lengths = LENGTHS[:8]
    old, ref, sampled = batch(lengths, seed=1)
    for beta in (0.0, preset.kl.beta):
        theirs, _ = trl_advantages(rewards, old, ref, lengths, 4, beta)
        ours = our_advantages(preset, rewards, old, ref, sampled, 4, beta)
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12), beta
    assert ours[4:].tolist() == [0.0] * 4 and ours[1] == 0.0
    assert our_advantages(preset, rewards, old, ref, sampled, 4, 0.0)[:4].tolist() == pytest.approx([1.0, 0.0, -0.5, -0.5])


def test_trls_normalize_advantages_has_no_equivalent_here(preset):
    """normalize_advantages=True divides by the batch's sample std (n - 1) + 1e-4: [-1/3, 1, -1/3, -1/3]
    has std sqrt((3/9 + 1) / 3) = 2/3, so [-0.49993, 1.49978, ...]. Ours (rloo has no such setting)
    stays TRL's default, False."""
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    old, ref, _ = batch([3] * 4)
    normalized, _ = trl_advantages(rewards, old, ref, [3] * 4, 4, 0.0, normalize=True)
    scale = 1 / (2 / 3 + 1e-4)
    assert normalized.tolist() == pytest.approx([-scale / 3, scale, -scale / 3, -scale / 3], abs=1e-7)
    assert preset.estimator_settings() == {}


def test_under_mask_truncated_trl_charges_no_kl_to_a_truncated_row_and_we_do(preset):
    """Rows 2 and 5 hit the length limit (no EOS). TRL's mask_truncated_completions zeroes their
    completion mask before the KL sum, so they enter the baseline with the bare reward; our
    loss.mask_truncated drops them from the loss only, and `online.step` charges every sampled token
    (StepRewards.sampled = rollout.mask). TRL's numbers are ours with those rows' KL left out."""
    beta, truncated = 0.5, (2, 5)
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float64)
    lengths = LENGTHS[:8]
    old, ref, sampled = batch(lengths, seed=2)
    theirs, completion_mask = trl_advantages(rewards, old, ref, lengths, 4, beta, truncated=truncated, mask_truncated=True)
    assert not completion_mask[list(truncated)].any()
    ours = our_advantages(preset, rewards, old, ref, sampled, 4, beta)
    assert (ours - theirs).abs().max() > 0.1
    assert torch.allclose(our_advantages(preset, rewards, old, ref, completion_mask, 4, beta), theirs, rtol=0, atol=1e-12)


def trl_loss(logprobs, old, advantages, mask, epsilon):
    """TRL's `RLOOTrainer._compute_loss` on our tensors (its forward returns `logprobs`)."""
    trainer = stand_in(_get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
                       epsilon_low=epsilon, epsilon_high=epsilon)
    ids = torch.full(mask.shape, OTHER)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": torch.ones_like(ids[:, :1]), "completion_ids": ids,
              "completion_mask": mask.long(), "old_logps": (old * mask).sum(1), "advantages": advantages}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


def our_loss(loss, logprobs, old, advantages, mask):
    """The loss step's: the surrogate entry per token, aggregated as loss.aggregation says."""
    per_token, _ = SURROGATES[loss.surrogate].function(logprobs, old, advantages, mask, **loss.surrogate_settings())
    return aggregate(per_token, mask, loss.aggregation)


def gradients(loss_of, base):
    logprobs = base.clone().requires_grad_(True)
    value = loss_of(logprobs)
    value.backward()
    return value.detach(), logprobs.grad


def test_on_policy_the_gradient_on_each_token_equals_trls(preset):
    """mu = 1 (the preset): old = the detached log-probs, ratio 1. TRL's d loss / d log pi_t =
    -A_i / N on every completion token of row i (its loss is -mean_i(s_i A_i), s_i = exp(sum_t log r_t));
    ours the same (-A_i r_t per token, summed per row, mean over rows), 0 on padding."""
    old, ref, mask = batch(LENGTHS, seed=3)
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0.5], dtype=torch.float64)
    advantages = our_advantages(preset, rewards, old, ref, mask, 4, preset.kl.beta)
    base = old.masked_fill(~mask, 0.0)
    theirs_value, theirs = gradients(lambda lp: trl_loss(lp, lp.detach(), advantages, mask, preset.clip.low), base)
    ours_value, ours = gradients(lambda lp: our_loss(preset, lp, lp.detach(), advantages, mask), base)
    expected = (-advantages[:, None] / len(LENGTHS)).expand_as(base) * mask
    assert torch.allclose(theirs, expected, rtol=0, atol=1e-12)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)
    assert ours.abs().sum() > 0.1
    # The loss values are not the same number: TRL's -mean_i(A_i) (0: each group's advantages sum to 0),
    # ours -mean_i(|y_i| A_i), a token-summed surrogate. Only the gradients are comparable.
    assert float(theirs_value) == pytest.approx(0.0, abs=1e-12)
    assert float(ours_value) == pytest.approx(float(-(advantages * mask.sum(-1)).mean()), abs=1e-12)


def test_off_policy_trls_sequence_ratio_and_our_token_ratios_differ(preset):
    """With old != current (mu > 1 or several mini-batches), inside the clip range: TRL weights each
    token of row i by the sequence's ratio exp(sum_t log r_t), ours by the token's own r_t. Row 0, two
    tokens, log r = [0.05, -0.02], A = 1, N = 1: TRL -exp(0.03) on both, ours [-exp(0.05), -exp(-0.02)]."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    base = old + torch.tensor([[0.05, -0.02]], dtype=torch.float64)
    advantages = torch.tensor([1.0], dtype=torch.float64)
    _, theirs = gradients(lambda lp: trl_loss(lp, old, advantages, mask, preset.clip.low), base)
    _, ours = gradients(lambda lp: our_loss(preset, lp, old, advantages, mask), base)
    assert theirs[0].tolist() == pytest.approx([-math.exp(0.03)] * 2, abs=1e-12)
    assert ours[0].tolist() == pytest.approx([-math.exp(0.05), -math.exp(-0.02)], abs=1e-12)
