"""SimPO, CPO, ORPO and KTO (posttrain.algorithms.reference_free): hand-computed values, gradients
against their closed forms, finiteness at extreme inputs, per-row independence, and parity with
TRL 1.16's own loss code (CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss, the CPO/ORPO
get_batch_loss_metrics that add the NLL term, KTOTrainer._compute_loss), called on minimal stand-in
objects instead of trainers. The TRL tests skip when TRL is not installed.
"""

import math
import types
import warnings
from collections import defaultdict

import pytest
import torch

from posttrain.algorithms import (
    KTO_CLASS_BALANCE_BAND,
    cpo_loss,
    dpo_loss,
    kto_class_balance,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

CPU = torch.device("cpu")


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _mean_logps(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """(n,) mean log-probs in (-3, -0.05), on both sides of log1mexp's -ln 2 branch point."""
    generator = torch.Generator().manual_seed(seed)
    return (-0.05 - 2.95 * torch.rand(n, generator=generator)).to(dtype)


# ---------------------------------------------------------------------------------------------- hand values


def test_simpo_hand_value_gamma_is_absolute():
    """beta 2.5, gamma 1.375, chosen mean -0.5, rejected -1.0:
    margin = 2.5 * (-0.5 - (-1.0)) - 1.375 = -0.125, loss = -log sigmoid(-0.125) = log(1 + e^0.125) = 0.757599.
    Were gamma a ratio gamma / beta, the margin would be 2.5 * (0.5 - 1.375) = -2.1875 (loss 2.2950): it is not.
    Rewards: beta * mean log-prob = -1.25, -2.5."""
    losses, chosen_rewards, rejected_rewards = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=2.5, gamma=1.375)
    assert losses.item() == pytest.approx(0.757599, abs=1e-6)
    assert losses.item() == pytest.approx(math.log1p(math.exp(0.125)), abs=1e-6)
    assert (chosen_rewards.item(), rejected_rewards.item()) == (-1.25, -2.5)
    assert simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]))[0].item() == pytest.approx(0.757599, abs=1e-6)  # the defaults


def test_simpo_without_margin_is_dpo_on_means_with_no_reference():
    """gamma = 0 leaves -log sigmoid(beta (mean_w - mean_l)): DPO's loss on mean log-probs with reference log-probs 0."""
    chosen, rejected = _mean_logps(5, 0), _mean_logps(5, 1)
    zeros = torch.zeros(5, dtype=torch.float64)
    assert torch.allclose(simpo_loss(chosen, rejected, beta=2.0, gamma=0.0)[0], dpo_loss(chosen, rejected, zeros, zeros, beta=2.0)[0])


def test_cpo_hand_value_and_total():
    """beta 0.1, chosen -10, rejected -20: beta * (-10 + 20) = 1, loss = log(1 + e^-1) = 0.313262; it is DPO
    with reference log-probs 0. The NLL is the caller's: with a chosen NLL 0.5 and weight 1, total 0.813262."""
    chosen, rejected = torch.tensor([-10.0]), torch.tensor([-20.0])
    losses, chosen_rewards, rejected_rewards = cpo_loss(chosen, rejected, beta=0.1)
    assert losses.item() == pytest.approx(0.313262, abs=1e-6)
    assert (losses.mean() + 1.0 * 0.5).item() == pytest.approx(0.813262, abs=1e-6)
    assert chosen_rewards.item() == pytest.approx(-1.0) and rejected_rewards.item() == pytest.approx(-2.0)
    zeros = torch.zeros(1)
    assert torch.equal(losses, dpo_loss(chosen, rejected, zeros, zeros, beta=0.1)[0])


def test_orpo_hand_values():
    """chosen mean log-prob ln 0.5, rejected ln 0.25: odds 0.5 / 0.5 = 1 and 0.25 / 0.75 = 1/3, log odds ratio ln 3,
    L_OR = -log sigmoid(ln 3) = -log(3/4) = ln(4/3) = 0.287682; lam 0.1 returns 0.0287682; with the chosen's
    NLL -ln 0.5 = 0.693147 (L_SFT, the caller's) the ORPO objective is 0.693147 + 0.0287682 = 0.721915."""
    chosen, rejected = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert orpo_loss(chosen, rejected, lam=1.0)[0].item() == pytest.approx(0.287682, abs=1e-6)
    losses, chosen_rewards, rejected_rewards = orpo_loss(chosen, rejected, lam=0.1)
    assert losses.item() == pytest.approx(0.0287682, abs=1e-6)
    assert (-chosen + losses).item() == pytest.approx(0.721915, abs=1e-6)
    assert chosen_rewards.item() == pytest.approx(0.1 * math.log(0.5)) and rejected_rewards.item() == pytest.approx(0.1 * math.log(0.25))


def test_kto_hand_values():
    """beta 0.1, mismatched log-ratios [0.8, 0.2]: z0 = max(0, 0.5) = 0.5.
    desirable r = 2:   1 - sigmoid(0.1 * (2 - 0.5)) = 1 - sigmoid(0.15) = 0.462570;
    undesirable r = 2: 1 - sigmoid(0.1 * (0.5 - 2)) = 1 - sigmoid(-0.15) = 0.537430; times w_u = 2: 1.074860.
    desirable r = -1 with w_d = 1.5: 1.5 * (1 - sigmoid(-0.15)) = 0.806145. Rewards beta * r."""
    r = torch.tensor([2.0, 2.0, -1.0])
    losses, rewards, reference_point = kto_loss(r, torch.tensor([0.8, 0.2]), torch.tensor([True, False, True]), beta=0.1)
    assert reference_point.item() == pytest.approx(0.5)
    assert losses.tolist() == pytest.approx([0.462570, 0.537430, 1 - _sigmoid(-0.15)], abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.2, 0.2, -0.1])
    weighted, _, _ = kto_loss(r, torch.tensor([0.8, 0.2]), torch.tensor([True, False, True]), beta=0.1,
                              desirable_weight=1.5, undesirable_weight=2.0)
    assert weighted.tolist() == pytest.approx([1.5 * 0.462570, 1.074860, 0.806145], abs=1e-6)


def test_kto_reference_point_floored_at_zero():
    """mismatched [-0.8, 0.2]: mean -0.3, z0 = max(0, -0.3) = 0; desirable r = 2: 1 - sigmoid(0.2) = 0.450166."""
    losses, _, reference_point = kto_loss(torch.tensor([2.0]), torch.tensor([-0.8, 0.2]), torch.tensor([True]), beta=0.1)
    assert reference_point.item() == 0.0
    assert losses.item() == pytest.approx(0.450166, abs=1e-6)


def test_kto_needs_mismatched_pairs():
    with pytest.raises(ValueError, match="mismatched"):
        kto_loss(torch.tensor([1.0]), torch.tensor([]), torch.tensor([True]))


def test_kto_class_balance():
    """300 desirable, 100 undesirable, weights 1: 300 / 100 = 3, outside [1, 4/3]; undesirable_weight 2.25
    gives 300 / 225 = 4/3 and 3 gives 1, the band's ends; desirable_weight 4/9 gives 4/3."""
    assert KTO_CLASS_BALANCE_BAND == (1.0, 4.0 / 3.0)
    assert kto_class_balance(300, 100, 1.0, 1.0) == 3.0
    assert kto_class_balance(300, 100, 1.0, 2.25) == pytest.approx(4.0 / 3.0)
    assert kto_class_balance(300, 100, 1.0, 3.0) == pytest.approx(1.0)
    assert kto_class_balance(300, 100, 4.0 / 9.0, 1.0) == pytest.approx(4.0 / 3.0)
    for bad in [(0, 100, 1.0, 1.0), (300, 0, 1.0, 1.0), (300, 100, 1.0, 0.0)]:
        with pytest.raises(ValueError):
            kto_class_balance(*bad)


# ---------------------------------------------------------------------------------------------- gradients


def test_simpo_and_cpo_gradients_are_closed_form():
    """SimPO: m = beta (c - r) - gamma, dL/dc = -beta sigmoid(-m), dL/dr = +beta sigmoid(-m).
    CPO: the same with gamma = 0 on summed log-probs."""
    for loss, kwargs, gamma in [(simpo_loss, {"beta": 2.5, "gamma": 1.375}, 1.375), (cpo_loss, {"beta": 0.1}, 0.0)]:
        beta = kwargs["beta"]
        chosen, rejected = _mean_logps(6, 2).requires_grad_(), _mean_logps(6, 3).requires_grad_()
        loss(chosen, rejected, **kwargs)[0].sum().backward()
        weight = beta * torch.sigmoid(-(beta * (chosen - rejected) - gamma)).detach()
        assert torch.allclose(chosen.grad, -weight) and torch.allclose(rejected.grad, weight)


def test_orpo_gradients_are_closed_form():
    """lo(x) = x - log(1 - e^x) has lo'(x) = 1 / (1 - p); with d = lo(c) - lo(r),
    dL/dc = -lam sigmoid(-d) / (1 - p_c) and dL/dr = +lam sigmoid(-d) / (1 - p_r)."""
    lam = 0.1
    chosen, rejected = _mean_logps(8, 4).requires_grad_(), _mean_logps(8, 5).requires_grad_()
    orpo_loss(chosen, rejected, lam=lam)[0].sum().backward()
    c, r = chosen.detach(), rejected.detach()
    d = (c - torch.log1p(-c.exp())) - (r - torch.log1p(-r.exp()))
    assert torch.allclose(chosen.grad, -lam * torch.sigmoid(-d) / (1 - c.exp()))
    assert torch.allclose(rejected.grad, lam * torch.sigmoid(-d) / (1 - r.exp()))


def test_kto_gradients_are_closed_form_and_reference_point_is_detached():
    """u = beta (r - z0): desirable dL/dr = -w_d beta sigmoid(u) sigmoid(-u); undesirable, L = w_u sigmoid(u),
    dL/dr = +w_u beta sigmoid(u) sigmoid(-u). No gradient reaches the mismatched log-ratios (z0 is detached)."""
    beta, w_d, w_u = 0.5, 1.5, 2.0
    r = torch.tensor([2.0, -1.0, 0.3, 4.0], dtype=torch.float64, requires_grad=True)
    mismatched = torch.tensor([0.9, 0.1, 0.6], dtype=torch.float64, requires_grad=True)
    desirable = torch.tensor([True, True, False, False])
    losses, _, reference_point = kto_loss(r, mismatched, desirable, beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    losses.sum().backward()
    assert mismatched.grad is None and not reference_point.requires_grad
    u = beta * (r.detach() - reference_point)
    slope = beta * torch.sigmoid(u) * torch.sigmoid(-u)
    assert torch.allclose(r.grad, torch.where(desirable, -w_d * slope, w_u * slope))


def test_log_odds_equals_naive_formula():
    """Optimised against naive: in float64, away from p = 1, the stable log odds equal x - log(1 - e^x) on
    both sides of -ln 2 (the ORPO loss with the rejected at log odds 0, ln 0.5, gives -lam log sigmoid(lo(c)))."""
    x = torch.tensor([-20.0, -3.0, -0.7, -0.6931, -0.69, -0.3, -1e-3], dtype=torch.float64)
    naive = x - torch.log(1 - torch.exp(x))
    half = torch.full_like(x, math.log(0.5))
    assert torch.allclose(orpo_loss(x, half, lam=1.0)[0], -torch.nn.functional.logsigmoid(naive), rtol=1e-12)


# ---------------------------------------------------------------------------------------------- extremes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_orpo_finite_as_p_goes_to_one_and_zero(dtype):
    """Mean log-probs 0 (p = 1, clamped to -tiny), -1e-8, -1e-30 and -1e4 (p = 0): values and gradients finite.
    A chosen at p -> 1 has log odds -> +inf, so its L_OR -> 0 against a rejected at ln 0.5; a rejected at
    p -> 1 against a chosen at ln 0.5 costs about its log odds (log(1/(1-p)), ~18.4 at -1e-8)."""
    extremes = torch.tensor([0.0, -1e-8, -1e-30, -1e4], dtype=dtype)
    half = torch.full_like(extremes, math.log(0.5))
    for chosen, rejected in [(extremes.clone().requires_grad_(), half.clone().requires_grad_()),
                             (half.clone().requires_grad_(), extremes.clone().requires_grad_())]:
        losses, _, _ = orpo_loss(chosen, rejected, lam=1.0)
        losses.sum().backward()
        assert torch.isfinite(losses).all() and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    if dtype == torch.float32:
        losses = orpo_loss(half, extremes, lam=1.0)[0]
        assert losses[1].item() == pytest.approx(-math.log(1e-8), rel=1e-3)  # log odds of p = e^-1e-8 ~ ln(1e8)
        assert orpo_loss(extremes, half, lam=1.0)[0][:3].max().item() < 1e-7


def test_simpo_cpo_kto_finite_for_huge_margins():
    """|margin| ~ 1e4-1e6: logsigmoid keeps the losses finite (a huge wrong margin costs about the margin, with
    gradient -beta on the chosen); sigmoid keeps KTO's in [0, w]."""
    big = torch.tensor([1e5, -1e5, 0.0], requires_grad=True)
    small = torch.tensor([-1e5, 1e5, -3.0], requires_grad=True)
    for loss, kwargs in [(simpo_loss, {"beta": 10.0, "gamma": 5.0}), (cpo_loss, {"beta": 0.1})]:
        big.grad = small.grad = None
        losses = loss(big, small, **kwargs)[0]
        losses.sum().backward()
        assert torch.isfinite(losses).all() and torch.isfinite(big.grad).all() and torch.isfinite(small.grad).all()
        assert losses[0].item() == 0.0 and big.grad[1].item() == pytest.approx(-kwargs["beta"])
    r = torch.tensor([1e6, -1e6, 1e6, -1e6], requires_grad=True)
    losses = kto_loss(r, torch.tensor([1e6, -1e6]), torch.tensor([True, True, False, False]))[0]
    losses.sum().backward()
    assert losses.tolist() == [0.0, 1.0, 1.0, 0.0] and torch.isfinite(r.grad).all()


# ---------------------------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("loss, kwargs", [(simpo_loss, {}), (cpo_loss, {}), (orpo_loss, {"lam": 0.3})])
def test_pairwise_losses_are_per_row(loss, kwargs):
    """Each row's loss depends on its own pair only: batch values equal one-row values, and the Jacobian of the
    (M,) losses in each input is diagonal."""
    chosen, rejected = _mean_logps(5, 6), _mean_logps(5, 7)
    batched = loss(chosen, rejected, **kwargs)[0]
    alone = torch.cat([loss(chosen[i:i + 1], rejected[i:i + 1], **kwargs)[0] for i in range(5)])
    assert torch.allclose(batched, alone, rtol=1e-12)
    for jacobian in torch.autograd.functional.jacobian(lambda c, r: loss(c, r, **kwargs)[0], (chosen, rejected)):
        assert torch.count_nonzero(jacobian - torch.diag(torch.diagonal(jacobian))) == 0


def test_kto_rows_interact_only_through_the_detached_reference_point():
    """With the same mismatched log-ratios, each row's loss alone equals its batched loss, and the Jacobian of
    the losses in the policy log-ratios is diagonal (z0 carries no gradient between rows)."""
    r, mismatched = torch.tensor([2.0, -1.0, 0.3, 4.0], dtype=torch.float64), torch.tensor([0.9, 0.1, 0.6], dtype=torch.float64)
    desirable = torch.tensor([True, False, True, False])
    batched = kto_loss(r, mismatched, desirable)[0]
    alone = torch.cat([kto_loss(r[i:i + 1], mismatched, desirable[i:i + 1])[0] for i in range(4)])
    assert torch.allclose(batched, alone, rtol=1e-12)
    jacobian = torch.autograd.functional.jacobian(lambda x: kto_loss(x, mismatched, desirable)[0], r)
    assert torch.count_nonzero(jacobian - torch.diag(torch.diagonal(jacobian))) == 0


# ---------------------------------------------------------------------------------------------- parity with TRL


@pytest.fixture(scope="module")
def trl_trainers():
    """TRL 1.16's CPO, ORPO (trl.experimental) and KTO trainer classes, whose loss methods the tests call as
    unbound functions on SimpleNamespace stand-ins for `self` (no model, no trainer construction)."""
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning on importing trl.experimental
        from trl import KTOTrainer
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer
    return types.SimpleNamespace(CPOTrainer=CPOTrainer, ORPOTrainer=ORPOTrainer, KTOTrainer=KTOTrainer)


def _accelerator():
    return types.SimpleNamespace(device=CPU, gather_for_metrics=lambda values: values)


def _cpo_self(loss_type, beta, gamma=0.0, cpo_alpha=0.0):
    # alpha = 0: TRL's AlphaPO reward shaping off (plain log-prob rewards); label_smoothing 0 (we have none).
    return types.SimpleNamespace(loss_type=loss_type, beta=beta, simpo_gamma=gamma, alpha=0.0, label_smoothing=0.0,
                                 cpo_alpha=cpo_alpha, aux_loss_enabled=False, accelerator=_accelerator())


@pytest.mark.parametrize("loss_type", ["simpo", "sigmoid"])
def test_simpo_and_cpo_equal_trl_cpo_loss(trl_trainers, loss_type):
    """TRL CPOTrainer.cpo_loss (loss_type "simpo": its inputs are mean log-probs, get_batch_logps with
    average_log_prob=True; "sigmoid": summed log-probs). TRL's simpo_gamma is absolute, our gamma. Per-row losses,
    rewards (beta * log-prob in both) and gradients equal."""
    beta, gamma = (2.5, 1.375) if loss_type == "simpo" else (0.1, 0.0)
    scale = 1.0 if loss_type == "simpo" else 30.0  # sigmoid takes sequence sums: larger magnitudes
    ours_inputs = [(scale * _mean_logps(7, seed, torch.float32)).requires_grad_() for seed in (8, 9)]
    theirs_inputs = [x.detach().clone().requires_grad_() for x in ours_inputs]
    if loss_type == "simpo":
        ours = simpo_loss(*ours_inputs, beta=beta, gamma=gamma)
    else:
        ours = cpo_loss(*ours_inputs, beta=beta)
    theirs = trl_trainers.CPOTrainer.cpo_loss(_cpo_self(loss_type, beta, gamma), *theirs_inputs)
    for mine, trl_value in zip(ours, theirs):
        assert torch.allclose(mine, trl_value, rtol=1e-6, atol=1e-7)
    ours[0].sum().backward()
    theirs[0].sum().backward()
    for mine, trl_input in zip(ours_inputs, theirs_inputs):
        assert torch.allclose(mine.grad, trl_input.grad, rtol=1e-6, atol=1e-7)


def _forward_returning(chosen_logps, rejected_logps, nll):
    """A stand-in for TRL's concatenated_forward (the only model call of get_batch_loss_metrics): it returns the
    given log-probs and NLL, with dummy logits for TRL's logit metrics."""
    logits = torch.zeros(len(chosen_logps), 1, 1)
    return lambda model, batch: (chosen_logps, rejected_logps, logits, logits, nll)


def test_cpo_total_equals_trl_with_cpo_alpha(trl_trainers):
    """TRL returns the NLL separately (concatenated_forward) and get_batch_loss_metrics adds
    cpo_alpha * nll to cpo_loss's mean: TRL's cpo_alpha is the caller's nll_weight on our cpo_loss."""
    CPOTrainer = trl_trainers.CPOTrainer
    chosen, rejected = 30.0 * _mean_logps(4, 10, torch.float32), 30.0 * _mean_logps(4, 11, torch.float32)
    nll, cpo_alpha = torch.tensor(0.8), 0.7
    trainer = _cpo_self("sigmoid", 0.1, cpo_alpha=cpo_alpha)
    trainer.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, trainer)
    trainer.concatenated_forward = _forward_returning(chosen, rejected, nll)
    trl_total, metrics = CPOTrainer.get_batch_loss_metrics(trainer, None, {})
    ours = cpo_loss(chosen, rejected, beta=0.1)[0].mean() + cpo_alpha * nll
    assert trl_total.item() == pytest.approx(ours.item(), rel=1e-6)
    assert metrics["nll_loss"] == pytest.approx(0.8)


def _orpo_self(lam):
    # TRL's ORPOConfig beta is our lam.
    return types.SimpleNamespace(beta=lam, aux_loss_enabled=False, accelerator=_accelerator())


def test_orpo_equals_trl_odds_ratio_loss(trl_trainers):
    """TRL ORPOTrainer.odds_ratio_loss returns beta * log sigmoid(log odds ratio), the NEGATED weighted L_OR
    (its total is nll - losses.mean()); ours is lam * L_OR: ours = -theirs, per row, gradients too; rewards
    lam * mean log-prob in both. Inputs in float32 (TRL upcasts to float32). Away from p = 1: at mean log-probs
    -1e-8 and 0 TRL's gradient is NaN (its torch.where differentiates the unused log1p branch) and its log odds
    at 0 are inf, where ours clamps (test_orpo_finite_as_p_goes_to_one_and_zero)."""
    lam = 0.1
    ours_inputs = [_mean_logps(9, seed, torch.float32).requires_grad_() for seed in (12, 13)]
    theirs_inputs = [x.detach().clone().requires_grad_() for x in ours_inputs]
    losses, chosen_rewards, rejected_rewards = orpo_loss(*ours_inputs, lam=lam)
    trl_losses, trl_chosen_rewards, trl_rejected_rewards, _, _ = trl_trainers.ORPOTrainer.odds_ratio_loss(_orpo_self(lam), *theirs_inputs)
    assert torch.allclose(losses, -trl_losses, rtol=1e-5, atol=1e-8)
    assert torch.equal(chosen_rewards, trl_chosen_rewards) and torch.equal(rejected_rewards, trl_rejected_rewards)
    losses.sum().backward()
    (-trl_losses).sum().backward()
    for mine, trl_input in zip(ours_inputs, theirs_inputs):
        assert torch.allclose(mine.grad, trl_input.grad, rtol=1e-5, atol=1e-8)


def test_orpo_total_equals_trl(trl_trainers):
    """TRL's full ORPO loss, nll - mean(odds_ratio_loss), equals the chosen NLL plus the mean of ours; on the hand
    example (one pair, NLL -ln 0.5) both are 0.721915."""
    ORPOTrainer = trl_trainers.ORPOTrainer
    chosen, rejected = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    trainer = _orpo_self(0.1)
    trainer.odds_ratio_loss = types.MethodType(ORPOTrainer.odds_ratio_loss, trainer)
    trainer.concatenated_forward = _forward_returning(chosen, rejected, -chosen.mean())
    trl_total, _ = ORPOTrainer.get_batch_loss_metrics(trainer, None, {})
    ours = -chosen.mean() + orpo_loss(chosen, rejected, lam=0.1)[0].mean()
    assert trl_total.item() == pytest.approx(0.721915, abs=1e-6)
    assert ours.item() == pytest.approx(trl_total.item(), abs=1e-7)


def _trl_kto_loss(KTOTrainer, policy_logps, ref_logps, kl_policy_logps, kl_ref_logps, desirable, beta, w_d, w_u):
    """TRL KTOTrainer._compute_loss (loss_type "kto", precomputed reference log-probs), the mean over the batch.

    Its loss lines sit inside _compute_loss after the model's forward, so the model is a stand-in whose forward
    returns per-token log-probs of one completion token per row, the given log-probs: the main call gets
    policy_logps (differentiable), the KL call (under TRL's no_grad) kl_policy_logps. Each row is prompt token +
    completion token, so TRL's sums over the completion are exactly the given values.
    """
    rows, kl_rows = len(policy_logps), len(kl_policy_logps)
    main_ids, kl_ids = torch.zeros(rows, 2, dtype=torch.long), torch.ones(kl_rows, 2, dtype=torch.long)

    def model(input_ids, **kwargs):
        values = policy_logps if input_ids is main_ids else kl_policy_logps
        dummy = torch.zeros(len(values), 1)
        return types.SimpleNamespace(log_probs=values[:, None], entropy=dummy, mean_logits=dummy)

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), loss_type="kto", beta=beta, desirable_weight=w_d, undesirable_weight=w_u,
        calculate_KL=True, precompute_ref_logps=True, aux_loss_enabled=False, accelerator=_accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    completion_mask, kl_completion_mask = torch.tensor([[0, 1]] * rows), torch.tensor([[0, 1]] * kl_rows)
    batch = {
        "input_ids": main_ids, "attention_mask": torch.ones_like(main_ids), "completion_mask": completion_mask,
        "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(kl_ids), "KL_completion_mask": kl_completion_mask,
        "label": desirable, "ref_logps": ref_logps, "ref_KL_logps": kl_ref_logps,
    }
    loss = KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    return loss, trainer._metrics["train"]["kl"][-1]


def test_kto_equals_trl(trl_trainers):
    """Our per-row KTO losses equal TRL's one-row batches (with the batch's mismatched pairs, TRL's "KL" term);
    the batch mean and the gradients in the policy log-probs equal TRL's; TRL's logged kl is our z0. TRL's
    KL completions are its own "mismatched" rows; our log-ratios are policy minus reference log-probs."""
    KTOTrainer = trl_trainers.KTOTrainer
    beta, w_d, w_u = 0.2, 1.3, 0.9
    policy = torch.tensor([-12.0, -7.5, -20.0, -3.0, -9.0])
    ref = torch.tensor([-14.0, -7.0, -18.5, -6.0, -9.5])
    kl_policy, kl_ref = torch.tensor([-11.0, -8.0, -15.0, -4.0, -9.0]), torch.tensor([-12.5, -8.2, -16.0, -4.1, -8.0])
    desirable = torch.tensor([True, False, True, True, False])

    policy_ours = policy.clone().requires_grad_()
    losses, _, reference_point = kto_loss(policy_ours - ref, kl_policy - kl_ref, desirable, beta=beta,
                                          desirable_weight=w_d, undesirable_weight=w_u)
    per_row = [_trl_kto_loss(KTOTrainer, policy[i:i + 1], ref[i:i + 1], kl_policy, kl_ref, desirable[i:i + 1], beta, w_d, w_u)[0]
               for i in range(len(policy))]
    assert losses.tolist() == pytest.approx([value.item() for value in per_row], rel=1e-6)

    policy_trl = policy.clone().requires_grad_()
    trl_mean, trl_kl = _trl_kto_loss(KTOTrainer, policy_trl, ref, kl_policy, kl_ref, desirable, beta, w_d, w_u)
    assert losses.mean().item() == pytest.approx(trl_mean.item(), rel=1e-6)
    assert reference_point.item() == pytest.approx(trl_kl, rel=1e-6)
    losses.mean().backward()
    trl_mean.backward()
    assert torch.allclose(policy_ours.grad, policy_trl.grad, rtol=1e-6, atol=1e-9)
