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
Only dpo_loss, conservative_dpo_loss and robust_dpo_loss take a label-noise rate; the others refuse a
non-zero one rather than ignore it. Which `loss.type` names which function is the objective table,
`posttrain/losses/objectives.py`.

Against TRL's DPOTrainer `loss_type` of the same name (TRL 1.16): `sigmoid` with label_smoothing e > 0
is cDPO here, while TRL's `sigmoid` ignores label_smoothing (plain DPO); our `ipo` uses summed
log-ratios (the paper's eq. 17), TRL's `ipo` divides each by its response's length, which is our
`length_normalized_ipo`; our `length_normalized` is TRL's `sigmoid_norm`.

The reference-free losses (SimPO, CPO, ORPO) and KTO are in `posttrain.algorithms.reference_free`.
"""

from __future__ import annotations

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


PAIR_METRICS = (
    "loss/preference", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "rewards/ties",
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
    chosen reward is strictly higher: TRL's convention, a tie counts as wrong, so policy == reference
    (every reward 0) gives 0; the ties are the fraction of pairs whose two rewards are equal, reported
    apart so that 0 reads as "no preference yet", not "every pair wrong".
    Example: rewards chosen [0.2, -0.1, 0], rejected [-0.2, 0.3, 0]: margins mean(0.4, -0.4, 0) = 0,
    accuracy 1/3, ties 1/3.
    """
    losses, chosen_rewards, rejected_rewards, chosen, rejected, chosen_ratio, rejected_ratio = columns
    values = (
        losses.mean(), chosen_rewards.mean(), rejected_rewards.mean(), (chosen_rewards - rejected_rewards).mean(),
        (chosen_rewards > rejected_rewards).float().mean(), (chosen_rewards == rejected_rewards).float().mean(),
        chosen.mean(), rejected.mean(), chosen_ratio.mean(), rejected_ratio.mean(),
    )
    return dict(zip(PAIR_METRICS, values))
