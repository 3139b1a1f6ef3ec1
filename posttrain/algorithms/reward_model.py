"""Reward-model math: the Bradley-Terry pair loss (with the margin, centering and label-smoothing
variants peers ship), pair metrics, the reward scale a reward model stores, and the length-bias
probes. Tensors in, tensors out.

    losses = bradley_terry_loss(chosen, rejected, margin=margins, centering=0.01)   # (M,)
    metrics = reward_pair_metrics(chosen, rejected)                                   # accuracy, margin, ...
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    centering: float = 0.0,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair Bradley-Terry loss of a scalar reward model (Ouyang et al. arXiv:2203.02155 eq. 1):

        d = r_c - r_r - m                          m: the pair's margin (Llama 2 arXiv:2307.09288 §3.2.2), 0 if None
        loss = -(1 - e) log sigmoid(d) - e log sigmoid(-d)      e: label smoothing (the label is wrong with prob e)
             + eta (r_c + r_r)^2                   eta: centering (arXiv:2312.09244; TRL's center_rewards_coefficient)

    The batch loss is the mean of these (the centering term's batch mean is TRL's
    `eta * mean((r_c + r_r)^2)`), so a step can split the batch anywhere.

    Args:
        chosen, rejected: (M,) rewards of each pair's chosen and rejected response.
        margin: (M,) or None. centering: eta >= 0. label_smoothing: e in [0, 0.5).

    Returns:
        (M,) float32 losses.

    Examples: r_c 1, r_r 0 -> -log sigmoid(1) = 0.313262; with margin 0.5 -> -log sigmoid(0.5) =
    0.474077; with centering 0.01 -> 0.313262 + 0.01 x 1 = 0.323262.
    """
    chosen, rejected = chosen.float(), rejected.float()
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.float()
    losses = -F.logsigmoid(difference)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-difference)
    if centering:
        losses = losses + centering * (chosen + rejected) ** 2
    return losses


def reward_pair_columns(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(3, M) detached per-pair values (loss, chosen reward, rejected reward), so micro-batches and
    ranks concatenate along dim 1 before `reward_pair_metrics`."""
    return torch.stack([losses.detach().float(), chosen.detach().float(), rejected.detach().float()])


def reward_pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over M pairs: accuracy (r_c > r_r strictly: a tie counts as wrong), margin (r_c - r_r),
    rewards/chosen, rewards/rejected. Example: pairs (1.0, 0.0) and (0.2, 0.5) -> accuracy 0.5,
    margin 0.35."""
    chosen, rejected = chosen.float(), rejected.float()
    return {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean()}


def reward_scale(rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored scale of a reward model's rewards (N,): mean, population std (divide by N: the
    normaliser `rm:` applies) and sample std (N - 1, Bessel: what torch.std and pandas give).
    Example: [1, 2, 3, 4] -> mean 2.5, std_population 1.118034, std_sample 1.290994."""
    rewards = rewards.double()
    return {"mean": rewards.mean(), "std_population": rewards.std(correction=0),
            "std_sample": rewards.std(correction=1) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)}


def pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of two (N,) tensors; 0 when either is constant. Example: x [1, 2, 3],
    y [2, 4, 7] -> 0.993399."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    scale = (x.square().sum() * y.square().sum()).sqrt()
    return (x * y).sum() / scale if scale > 0 else torch.zeros((), dtype=torch.float64)


def length_bias(chosen: torch.Tensor, rejected: torch.Tensor, chosen_lengths: torch.Tensor,
                rejected_lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The length-bias probes of M held-out pairs: `reward_length_correlation` (Pearson of reward
    with response length over all 2M responses: a reward model that learned "longer is better"
    shows it here before a policy exploits it), `shorter_chosen_pairs` (how many pairs' chosen
    response is the shorter one) and `accuracy_shorter_chosen` (accuracy on those pairs; NaN when
    none). Lengths in tokens, (M,) each."""
    rewards = torch.cat([chosen, rejected]).float()
    lengths = torch.cat([chosen_lengths, rejected_lengths]).float()
    shorter = chosen_lengths < rejected_lengths
    accuracy = ((chosen > rejected) & shorter).sum().double() / shorter.sum() if shorter.any() else torch.tensor(float("nan"))
    return {"reward_length_correlation": pearson(rewards, lengths), "shorter_chosen_pairs": shorter.sum(),
            "accuracy_shorter_chosen": accuracy}
