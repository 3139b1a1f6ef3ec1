"""Preference losses without a reference model's log-probs (SimPO, CPO, ORPO) and KTO's
unpaired loss, as pure tensor functions.

They take no reference log-probs and so have their own signatures, not `preference`'s one:
`simpo_loss` and `orpo_loss` on per-token mean log-probs, `cpo_loss` on summed ones, each returning (losses, chosen_rewards, rejected_rewards) as the DPO family does; an
NLL term on the chosen (CPO's, ORPO's SFT term) is the caller's, as RPO's is. `kto_loss` scores
unpaired, labelled completions against a reference point estimated from mismatched pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.algorithms.preference import PreferenceOutput


def simpo_loss(
    chosen_mean_logps: torch.Tensor,
    rejected_mean_logps: torch.Tensor,
    *,
    beta: float = 2.5,
    gamma: float = 1.375,
) -> PreferenceOutput:
    """SimPO (Meng et al., arXiv:2405.14734 eq. 6), no reference model:

        loss = -log sigmoid(beta * mean log pi(y_w|x) - beta * mean log pi(y_l|x) - gamma)

    The implicit reward is the length-normalised likelihood beta * mean log pi(y|x) (the paper's eq. 4)
    and gamma a target margin between the two rewards. gamma is ABSOLUTE (reward units), as TRL's
    CPOConfig `simpo_gamma` is: CPOTrainer's `simpo` computes beta * (diff - simpo_gamma / beta). The
    paper's tables report the ratio gamma / beta instead (its code's `gamma_beta_ratio`): a reported
    ratio 0.55 at beta 2.5 is gamma = 1.375 here. TRL's label_smoothing has no counterpart (use 0).

    Args:
        chosen_mean_logps, rejected_mean_logps: (M,) policy log-probs averaged over each response's
            tokens (sum / length), not sums.
        beta: reward scale. gamma: absolute target margin.

    Returns:
        losses (M,), chosen_rewards (M,), rejected_rewards (M,): the rewards are beta * mean log-prob, detached.

    Example: beta 2.5, gamma 1.375, chosen mean -0.5, rejected -1.0: margin 2.5 * 0.5 - 1.375 = -0.125,
    loss = log(1 + e^0.125) ~ 0.757599.
    """
    chosen_rewards, rejected_rewards = beta * chosen_mean_logps, beta * rejected_mean_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)  # eq. 6
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceOutput:
    """CPO's preference term (Xu et al., arXiv:2401.08417 eq. 3; TRL CPOTrainer `loss_type="sigmoid"`):

        loss = -log sigmoid(beta * (log pi(y_w|x) - log pi(y_l|x)))

    This is `dpo_loss` with the reference dropped (reference log-probs 0). CPO's objective adds the
    behaviour-cloning term, the NLL of the chosen: total = losses.mean() + nll_weight * NLL. As for
    RPO, that term is the caller's and is not in `losses` (`posttrain.losses.preference` adds
    nll_weight * the token-mean NLL of the batch's chosen tokens). TRL splits it the same way: its
    `cpo_loss` returns this preference part and `get_batch_loss_metrics` adds `cpo_alpha` * the
    token-mean cross-entropy of the chosen, so TRL's cpo_alpha (default 1.0) is that nll_weight.

    Args:
        chosen_logps, rejected_logps: (M,) policy sequence log-probs (summed over response tokens).
        beta: inverse temperature.

    Returns:
        losses (M,), chosen_rewards (M,), rejected_rewards (M,): the rewards are beta * log-prob, detached (as TRL's).

    Example: beta 0.1, chosen -10, rejected -20: loss = log(1 + e^-1) ~ 0.313262; with a chosen
    NLL of 0.5 and nll_weight 1 the total is 0.813262.
    """
    losses = -F.logsigmoid(beta * (chosen_logps - rejected_logps))  # eq. 3
    return losses, beta * chosen_logps.detach(), beta * rejected_logps.detach()


def orpo_loss(
    chosen_mean_logps: torch.Tensor,
    rejected_mean_logps: torch.Tensor,
    *,
    lam: float = 0.1,
) -> PreferenceOutput:
    """ORPO's weighted odds-ratio term lam * L_OR (Hong et al., arXiv:2403.07691 eqs. 6-7), no reference:

        log odds(y) = log p - log(1 - p),  p = exp(mean log pi(y|x))   (odds of the length-normalised likelihood)
        L_OR        = -log sigmoid(log odds(y_w) - log odds(y_l))       (eq. 7)
        losses      = lam * L_OR

    ORPO's objective is L = L_SFT + lam * L_OR (eq. 6). `losses` is the second term only: the SFT
    term, the NLL of the chosen with weight 1, is the caller's, as RPO's is. (The paper's L_SFT is
    each chosen response's token-mean NLL; `posttrain orpo` takes the token mean over the batch's
    chosen RESPONSE tokens, which agrees with the paper when the chosen lengths are equal. TRL's
    ORPOTrainer, decoder-only, averages its NLL over every attended token of the chosen sequence,
    prompt AND response, so it also trains the prompt and its NLL is a different number.) TRL's ORPOConfig `beta` is our
    `lam`; its `odds_ratio_loss` returns beta * log sigmoid(...), the negated term, and its total is
    nll - losses.mean().

    log(1 - p) is computed with a stable log1mexp (log(-expm1(x)) for x > -ln 2, log1p(-exp(x))
    otherwise), each branch evaluated only on its own side so neither puts a NaN in the gradient.
    A mean log-prob at or above -tiny (exactly 0, p = 1) is clamped to -tiny (torch.finfo(dtype).tiny),
    so log(1 - p) stays finite (about -87.3 in float32) and the clamped entry gets no gradient.

    Args:
        chosen_mean_logps, rejected_mean_logps: (M,) policy log-probs averaged over each response's tokens, <= 0.
        lam: weight of the odds-ratio term (lambda).

    Returns:
        losses (M,) = lam * L_OR, chosen_rewards (M,), rejected_rewards (M,): the rewards are
        lam * mean log-prob, detached (as TRL's).

    Example: lam 0.1, chosen mean log-prob ln 0.5, rejected ln 0.25: odds 1 and 1/3, L_OR =
    -log sigmoid(ln 3) = ln(4/3) ~ 0.287682, losses = 0.0287682; with the chosen NLL -ln 0.5 ~ 0.693147
    the objective is 0.721915.
    """
    log_odds_chosen, log_odds_rejected = _log_odds(chosen_mean_logps), _log_odds(rejected_mean_logps)
    losses = -lam * F.logsigmoid(log_odds_chosen - log_odds_rejected)  # eq. 7, weighted as in eq. 6
    return losses, lam * chosen_mean_logps.detach(), lam * rejected_mean_logps.detach()


_LN2 = 0.6931471805599453


def _log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(mean_logps), with mean_logps clamped to <= -tiny (see `orpo_loss`)."""
    x = mean_logps.clamp(max=-torch.finfo(mean_logps.dtype).tiny)
    near_zero = x > -_LN2
    # log1mexp (Maechler 2012): each branch sees only inputs of its own side, so the unused one is finite.
    log1mexp = torch.where(near_zero, torch.log(-torch.expm1(x.clamp(min=-_LN2))),
                           torch.log1p(-torch.exp(x.clamp(max=-_LN2))))
    return x - log1mexp


def kto_loss(
    policy_logratios: torch.Tensor,
    mismatched_logratios: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al., arXiv:2402.01306 eq. 7, as TRL's KTOTrainer `loss_type="kto"`), one loss
    per unpaired completion with a binary label:

        z0 = max(0, mean(mismatched_logratios)), detached
        desirable:   w_d * (1 - sigmoid(beta * (r - z0)))
        undesirable: w_u * (1 - sigmoid(beta * (z0 - r)))

    with r = log pi(y|x) - log pi_ref(y|x) of the row's own completion. z0 is the reference point: the
    paper's estimate of KL(pi || pi_ref) from mismatched (prompt, completion) pairs of the same batch
    (TRL pairs each prompt with the previous row's completion), floored at 0 since a KL cannot be negative,
    and not differentiated (as in the paper and TRL): it moves the target, it is not a term to optimise.
    Choose the weights with `kto_class_balance`.

    Against TRL: it keeps desirable rows first, then undesirable; ours keep the rows' order (same
    mean). Under data parallelism TRL averages the per-rank means of the mismatched log-ratios; pass
    every rank's (all-gathered) for the same z0 when the ranks hold equally many.

    Args:
        policy_logratios: (B,) summed log-prob of each completion under the policy minus the reference's.
        mismatched_logratios: (K,) the same for mismatched pairs (K >= 1; usually K = B).
        desirable: (B,) bool, True = desirable (the label).
        beta: inverse temperature. desirable_weight, undesirable_weight: w_d, w_u.

    Returns:
        losses (B,), rewards (B,) = beta * r detached, reference_point () = z0.

    Example: beta 0.1, mismatched [0.8, 0.2] (z0 = 0.5), a desirable r = 2: 1 - sigmoid(0.15) ~ 0.462570;
    an undesirable r = 2: 1 - sigmoid(-0.15) ~ 0.537430.
    """
    if mismatched_logratios.numel() == 0:
        raise ValueError("kto_loss needs at least one mismatched log-ratio to estimate the reference point")
    reference_point = mismatched_logratios.detach().mean().clamp(min=0)
    logits = beta * (policy_logratios - reference_point)
    # 1 - sigmoid(u) = sigmoid(-u): the undesirable 1 - sigmoid(beta (z0 - r)) is sigmoid(logits).
    losses = torch.where(desirable, desirable_weight * torch.sigmoid(-logits), undesirable_weight * torch.sigmoid(logits))
    return losses, beta * policy_logratios.detach(), reference_point


KTO_CLASS_BALANCE_BAND = (1.0, 4.0 / 3.0)
"""The range KTO's paper (arXiv:2402.01306 eq. 8) and TRL's KTO docs recommend for `kto_class_balance`."""


def kto_class_balance(
    desirable_count: int,
    undesirable_count: int,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> float:
    """(w_d * n_d) / (w_u * n_u): the weighted share of desirable to undesirable examples.

    KTO's paper (arXiv:2402.01306 eq. 8) and TRL's KTO docs recommend weights that put this ratio in
    [1, 4/3] (`KTO_CLASS_BALANCE_BAND`): upweight the rarer class, desirable slightly ahead. TRL
    1.16's KTOTrainer warns when neither weight gives a ratio in [1, 1.33] (4/3 rounded).

    Example: 300 desirable, 100 undesirable, weights 1: ratio 3, outside the band; undesirable_weight
    in [2.25, 3] (or desirable_weight in [1/3, 4/9]) brings it into [1, 4/3].
    """
    if min(desirable_count, undesirable_count) <= 0 or min(desirable_weight, undesirable_weight) <= 0:
        raise ValueError("kto_class_balance needs positive counts and weights, got "
                         f"{desirable_count}, {undesirable_count}, {desirable_weight}, {undesirable_weight}")
    return (desirable_weight * desirable_count) / (undesirable_weight * undesirable_count)
