"""Preference losses (DPO family) over sequence log-probs of chosen and rejected responses, and
the per-pair metrics a DPO step logs.

Every loss has one signature,

    loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
         chosen_lengths=None, rejected_lengths=None, *, beta, label_smoothing) -> (losses, chosen_rewards, rejected_rewards)

with the summed response log-probs of the policy and of the frozen reference, all (M,) for M pairs
(lengths: response tokens per row; only the length-normalised losses use them, the others ignore
them). The implicit rewards are beta * (log pi - log pi_ref) per response (DPO, arXiv:2305.18290
section 5), detached, for metrics. With

    h = (chosen - ref_chosen) - (rejected - ref_rejected)

the losses differ only in what they do with beta * h. A sequence log-prob is the *sum* of the
response tokens' log-probs; the length-normalised objectives (token means) are different
objectives and have their own names, `length_normalized_dpo_loss` and `length_normalized_ipo_loss`.
Only the losses in `LABEL_SMOOTHED` take a label-noise rate; the others refuse a non-zero one rather
than ignore it.

Against TRL's DPOTrainer `loss_type` of the same name (TRL 1.16): `sigmoid` with label_smoothing e > 0
is cDPO here, while TRL's `sigmoid` ignores label_smoothing (plain DPO); our `ipo` uses summed
log-ratios (the paper's eq. 17), TRL's `ipo` divides each by its response's length, which is our
`length_normalized_ipo`; our `length_normalized` is TRL's `sigmoid_norm`.

The reference-free losses take no reference log-probs and so have their own signatures, outside
`PREFERENCE_LOSSES`: `simpo_loss` and `orpo_loss` on per-token mean log-probs, `cpo_loss` on summed
ones, each returning (losses, chosen_rewards, rejected_rewards) as above; an NLL term on the chosen
(CPO's, ORPO's SFT term) is the caller's, as RPO's is. `kto_loss` scores unpaired, labelled
completions against a reference point estimated from mismatched pairs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

PreferenceOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _log_ratios(chosen, rejected, ref_chosen, ref_rejected):
    return chosen - ref_chosen, rejected - ref_rejected


def _no_label_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing:
        raise ValueError(f"{name} takes no label smoothing, got {label_smoothing}")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """DPO's sigmoid loss (arXiv:2305.18290 eq. 7): -log sigmoid(beta * h).

    With `label_smoothing = e > 0` this is conservative DPO (cDPO; Mitchell 2023, "A note on DPO
    with noisy preferences"): -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h), the expected
    loss when each label is flipped with probability e. Computed with logsigmoid, so stable for
    any |beta h|. TRL's `sigmoid` ignores label_smoothing (TRL 1.16 applies it only to `robust`,
    `exo_pair` and `aot*`): a TRL config with label_smoothing > 0 ported as-is gives a different loss
    here; for TRL's numbers use e = 0.

    Args:
        chosen_logps, rejected_logps: (M,) policy sequence log-probs (summed over response tokens).
        ref_chosen_logps, ref_rejected_logps: (M,) the reference's.
        chosen_lengths, rejected_lengths: unused here (every loss takes them; see the module docstring).
        beta: inverse temperature of the implicit reward.
        label_smoothing: e in [0, 0.5).

    Returns:
        losses (M,), chosen_rewards (M,), rejected_rewards (M,).

    Example (the seed): chosen -2, rejected -4, references -3, -3, beta 0.2:
    h = 1 - (-1) = 2, beta h = 0.4, loss = log(1 + e^-0.4) ~ 0.5130; chosen reward 0.2,
    rejected reward -0.2. If the policy equals the reference, h = 0 and loss = ln 2 ~ 0.6931.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def conservative_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> PreferenceOutput:
    """Conservative DPO (cDPO): `dpo_loss` with label smoothing e > 0 (default 0.1), the expected
    DPO loss when each preference label is wrong with probability e.

    Args: as `dpo_loss`; `label_smoothing` in (0, 0.5).
    Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,).
    """
    if not 0.0 < label_smoothing < 0.5:
        raise ValueError(f"conservative DPO needs label_smoothing in (0, 0.5), got {label_smoothing}")
    return dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta, label_smoothing=label_smoothing)


def robust_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> PreferenceOutput:
    """Robust DPO (Chowdhury et al., arXiv:2403.00409 eq. 8), unbiased under label noise rate e:

        loss = (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2 e)

    Args: as `dpo_loss`; `label_smoothing` is the assumed flip rate e in [0, 0.5).
    Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,).
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (chosen_ratio - rejected_ratio)
    e = label_smoothing
    losses = (-(1 - e) * F.logsigmoid(logits) + e * F.logsigmoid(-logits)) / (1 - 2 * e)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """IPO (Azar et al., arXiv:2310.12036 eq. 17): (h - 1 / (2 beta))^2, beta playing tau.

    It regresses the log-ratio gap to a finite target instead of pushing it to infinity. h is
    built from summed log-probs, as in the paper; TRL's `ipo` length-averages them, which is
    `length_normalized_ipo_loss` here.

    Args: as `dpo_loss`. Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,).
    Example: h = 2, beta = 0.2 -> (2 - 2.5)^2 = 0.25.
    """
    _no_label_smoothing("ipo", label_smoothing)
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = (chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def hinge_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """Hinge loss on the implicit-reward margin (SLiC, Zhao et al., arXiv:2305.10425 eq. 3;
    RSO, arXiv:2309.06657): max(0, 1 - beta h).

    Args: as `dpo_loss`. Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,).
    Example: h = 2, beta = 0.2 -> max(0, 1 - 0.4) = 0.6.
    """
    _no_label_smoothing("hinge", label_smoothing)
    chosen_ratio, rejected_ratio = _log_ratios(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = torch.relu(1.0 - beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def length_normalized_dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """Length-normalised DPO: the sigmoid loss on per-token *mean* log-probs (Tulu 3's `dpo_norm`,
    arXiv:2411.15124 section 5.1; SimPO's length normalisation, arXiv:2405.14734 eq. 4).

    This is not DPO with a different reduction: it is a different objective (it prefers the
    response with the better average token, not the likelier sequence), so it has its own name.

    Args:
        chosen_logps ... ref_rejected_logps: (M,) summed sequence log-probs, as in `dpo_loss`.
        chosen_lengths, rejected_lengths: (M,) number of response tokens (mask sums), >= 1.
        beta: usually much larger than for DPO, since the log-ratios are per token.

    Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,) (per-token implicit rewards).
    """
    return _per_token("length_normalized", dpo_loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                      chosen_lengths, rejected_lengths, beta, label_smoothing)


def length_normalized_ipo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """Length-normalised IPO: `ipo_loss` on per-token *mean* log-ratios, TRL's `ipo` (which length-
    averages the IPO gap, a choice its code says the IPO authors confirmed; arXiv:2310.12036 eq. 17
    itself is on sequence log-probs):

        h_mean = (chosen - ref_chosen) / chosen_length - (rejected - ref_rejected) / rejected_length
        loss   = (h_mean - 1 / (2 beta))^2

    Args: as `length_normalized_dpo_loss` (lengths required, each clamped to >= 1).
    Returns: losses (M,), chosen_rewards (M,), rejected_rewards (M,) (per-token implicit rewards).
    Example: chosen -2 over 4 tokens, rejected -4 over 2, references -3, -3, beta 0.2:
    h_mean = 1/4 - (-1/2) = 0.75, loss = (0.75 - 2.5)^2 = 3.0625.
    """
    return _per_token("length_normalized_ipo", ipo_loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                      chosen_lengths, rejected_lengths, beta, label_smoothing)


def _per_token(name, loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths,
               beta, label_smoothing) -> PreferenceOutput:
    """`loss` (dpo_loss / ipo_loss) on per-token mean log-probs: each (M,) sum divided by its
    response's length (clamped to >= 1); lengths are required and label smoothing is refused."""
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError(f"{name} needs chosen_lengths and rejected_lengths")
    _no_label_smoothing(name, label_smoothing)
    chosen_lengths = chosen_lengths.to(chosen_logps.dtype).clamp(min=1)
    rejected_lengths = rejected_lengths.to(rejected_logps.dtype).clamp(min=1)
    return loss(chosen_logps / chosen_lengths, rejected_logps / rejected_lengths,
                ref_chosen_logps / chosen_lengths, ref_rejected_logps / rejected_lengths, beta=beta)


# Every loss by name, each with the one signature of the module docstring.
PREFERENCE_LOSSES: dict[str, Callable[..., PreferenceOutput]] = {
    "sigmoid": dpo_loss,
    "conservative": conservative_dpo_loss,
    "robust": robust_dpo_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "length_normalized": length_normalized_dpo_loss,
    "length_normalized_ipo": length_normalized_ipo_loss,
}
LABEL_SMOOTHED = ("sigmoid", "conservative", "robust")
"""The losses that take a label-noise rate (`label_smoothing`)."""

PAIR_METRICS = (
    "loss/preference", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy",
    "logps/chosen", "logps/rejected", "logratio/chosen", "logratio/rejected",
)
"""What `pair_metrics` returns, in order."""


def pair_columns(
    losses: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
) -> torch.Tensor:
    """(7, M) detached per-pair values [losses, chosen rewards, rejected rewards, chosen logps,
    rejected logps, chosen log-ratio, rejected log-ratio]: one tensor, so the columns of several
    micro-batches (or ranks) concatenate along dim 1 before `pair_metrics` averages them.

    Args: a loss's (M,) outputs, then the (M,) policy and reference sequence log-probs.
    """
    chosen, rejected = chosen_logps.detach(), rejected_logps.detach()
    return torch.stack([
        losses.detach(), chosen_rewards, rejected_rewards, chosen, rejected, chosen - ref_chosen_logps, rejected - ref_rejected_logps,
    ])


def pair_metrics(columns: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over the M pairs of (7, M) `pair_columns`, as 0-dim tensors named by `PAIR_METRICS`.

    The margin is the mean of chosen - rejected reward; the accuracy the fraction of pairs whose
    chosen reward is strictly higher (a tie counts as wrong, so policy == reference gives 0).
    Example: rewards chosen [0.2, -0.1], rejected [-0.2, 0.3]: margins mean(0.4, -0.4) = 0, accuracy 0.5.
    """
    losses, chosen_rewards, rejected_rewards, chosen, rejected, chosen_ratio, rejected_ratio = columns
    values = (
        losses.mean(), chosen_rewards.mean(), rejected_rewards.mean(), (chosen_rewards - rejected_rewards).mean(),
        (chosen_rewards > rejected_rewards).float().mean(), chosen.mean(), rejected.mean(), chosen_ratio.mean(), rejected_ratio.mean(),
    )
    return dict(zip(PAIR_METRICS, values))


# Reference-free pairwise losses (SimPO, CPO, ORPO) and KTO. They take no reference log-probs, so they
# are not in PREFERENCE_LOSSES (whose one signature has them); each states its own below.


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
    each chosen response's token-mean NLL; TRL's ORPOTrainer takes the token mean over the batch's
    chosen tokens; the two agree when the chosen lengths are equal.) TRL's ORPOConfig `beta` is our
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
