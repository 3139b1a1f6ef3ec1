"""Advantages: how a reward becomes a per-sample (or per-token) training signal.

Notation: `B` prompts, `G` samples per prompt, `N = B*G` rows, group-contiguous (row `b*G + g`),
`T` response tokens. Rewards that could not be computed (an infrastructure error: the verifier or
its sandbox failed) arrive as NaN. They are excluded from their group's statistics and get advantage
0, so a broken sandbox never looks like a wrong answer.
"""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def _unanimous(grouped: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) True where a group's valid rewards are all equal. Their advantages must be exactly 0,
    but a float mean of e.g. [0.1, 0.1, 0.1] is one rounding step off 0.1, leaving residues of
    ~1e-17 that a ~1e-17 std would blow up to +-1."""
    infinity = torch.full_like(grouped, float("inf"))
    return torch.where(valid, grouped, -infinity).amax(1) <= torch.where(valid, grouped, infinity).amin(1)


def group_statistics(
    rewards: torch.Tensor, group_size: int, unbiased_std: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, standard deviation and count of the valid (non-NaN) rewards of each group.

    Args:
        rewards: (N,) with N = B * G, group-contiguous; NaN marks an unscorable sample.
        group_size: G.
        unbiased_std: False (default, as in the seed's worked example; DeepSeekMath writes std(r)
            without naming the denominator) divides the variance by the number of valid rewards n
            (population std); True divides by n - 1 (torch.std's default, used by TRL).

    Returns:
        mean (B,), std (B,), count (B,) (a float tensor). A group with no valid reward has mean 0
        and std 0; with `unbiased_std` a group with one valid reward has std 0.

    Example (the seed's group): rewards [0, 1, 0, 0] -> mean 0.25,
    std = sqrt((3 * 0.25**2 + 0.75**2) / 4) = sqrt(0.1875) = sqrt(3)/4 ~ 0.4330.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be (B*G,) with G={group_size}, got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)  # (B, G)
    valid = ~torch.isnan(grouped)
    count = valid.sum(dim=1).to(rewards.dtype)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    mean = filled.sum(dim=1) / count.clamp(min=1)
    squared = torch.where(valid, (grouped - mean[:, None]) ** 2, torch.zeros_like(grouped))
    denominator = (count - 1) if unbiased_std else count
    std = (squared.sum(dim=1) / denominator.clamp(min=1)).sqrt()
    std = torch.where(_unanimous(grouped, valid), torch.zeros_like(std), std)
    return mean, std, count


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: Scale = "group",
    eps: float = 1e-6,
    unbiased_std: bool = False,
) -> torch.Tensor:
    """Group-relative advantages (GRPO, DeepSeekMath arXiv:2402.03300 section 4.1.2).

        A_i = (r_i - mean(group)) / (s + eps)

    where s depends on `scale`:
      * "group": the std of the sample's own group (GRPO as published);
      * "batch": the std of all valid rewards in the batch (group mean, batch std; "Tricks or
        Traps" arXiv:2508.08221 section 4.1), which does not inflate near-unanimous groups;
      * "none": no division (Dr. GRPO, arXiv:2503.20783 section 3.1): A_i = r_i - mean(group).

    Args:
        rewards: (N,) float, group-contiguous; NaN = unscorable (advantage 0, excluded from stats).
        group_size: G, at least 2 (a group of one has no relative signal).
        scale: "group" | "batch" | "none".
        eps: added to the std; with eps = 0 a zero-std group (all equal) gets advantage 0.
        unbiased_std: see `group_statistics` (default False: population std, denominator G).

    Returns:
        advantages (N,), same dtype as rewards; they sum to 0 within each group.

    Example (the seed): rewards [0, 1, 0, 0], scale "group", eps 0 ->
    [-1/sqrt(3), sqrt(3), -1/sqrt(3), -1/sqrt(3)] ~ [-0.5774, 1.7321, -0.5774, -0.5774].
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    mean, group_std, _ = group_statistics(rewards, group_size, unbiased_std)
    grouped = rewards.view(-1, group_size)
    valid = ~torch.isnan(grouped)
    unanimous = _unanimous(grouped, valid)
    centered = torch.where(valid & ~unanimous[:, None], grouped - mean[:, None], torch.zeros_like(grouped))
    if scale == "none":
        return centered.reshape(-1)
    if scale == "group":
        std = group_std[:, None]
    else:
        batch = rewards[~torch.isnan(rewards)]
        if batch.numel() < 2 or bool(batch.amax() == batch.amin()):
            return centered.reshape(-1)  # every group is unanimous, so centered is all 0
        std = batch.std(correction=1 if unbiased_std else 0)
    denominator = std + eps
    # A zero denominator only happens with eps = 0 and identical rewards, where centered is 0 too.
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    advantages = torch.where(denominator > 0, centered / safe, torch.zeros_like(centered))
    return advantages.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al., arXiv:2402.14740 eq. 6).

        A_i = r_i - mean_{j != i} r_j   (over the valid rewards of the group)

    Args:
        rewards: (N,) with N = B * G, group-contiguous; NaN = unscorable (advantage 0).
        group_size: G, at least 2.

    Returns:
        advantages (N,). A sample with no other valid sample in its group gets 0.

    Example: rewards [0, 1, 0, 0] -> [0 - 1/3, 1 - 0, 0 - 1/3, 0 - 1/3] = [-1/3, 1, -1/3, -1/3].
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2, got {group_size}")
    grouped = rewards.view(-1, group_size)
    valid = ~torch.isnan(grouped)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    others = valid.sum(dim=1, keepdim=True) - valid.to(torch.long)  # (B, G)
    baseline = (filled.sum(dim=1, keepdim=True) - filled) / others.clamp(min=1)
    advantages = torch.where(valid & (others > 0), filled - baseline, torch.zeros_like(filled))
    return advantages.reshape(-1)


def reinforce_returns(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted returns to go (REINFORCE++, Hu et al. arXiv:2501.03262 section 3, gamma = 1):

        G_t = sum_{i >= t} r_i   over the counted tokens of each row

    With the sequence reward R on the last counted token and -beta * KL_i on every token
    (`kl.kl_in_reward(..., per_token=True)`), G_t = R - beta * sum_{i >= t} KL_i.

    Args:
        token_rewards: (N, T) per-token rewards.
        mask: (N, T) bool, True = the token counts (others contribute nothing and get 0).

    Returns:
        (N, T) returns, 0 where mask is False.

    Example: R = 1 on the last of three tokens, k1 KL [0.1, 0.2, 0.3], beta = 0.5 -> token rewards
    [-0.05, -0.1, 0.85] -> returns [0.70, 0.75, 0.85].
    """
    counted = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))
    returns = counted.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, returns, torch.zeros_like(returns))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns over each row's counted tokens, the uncounted ones (tool observations,
    padding) skipped:

        G_t = r_t + gamma * G_t'   (t' the next counted token of the row; 0 after the last)

    gamma = 1 is `reinforce_returns` (the reward to go); gamma = 0 leaves each token its own
    reward (on-policy distillation's usual choice: each token answers for its own KL only).

    Args:
        token_rewards: (N, T) per-token rewards.
        mask: (N, T) bool, True = the token counts.
        gamma: discount in [0, 1].

    Returns:
        (N, T) returns, 0 where mask is False.

    Example: rewards [0.3, -0.6, 0.4] on three counted tokens, gamma 0.5 -> [0.1, -0.4, 0.4].
    """
    counted = torch.where(mask, token_rewards, torch.zeros_like(token_rewards))
    if gamma == 0:
        return counted
    if gamma == 1:
        return reinforce_returns(token_rewards, mask)
    returns = torch.zeros_like(counted)
    running = torch.zeros_like(counted[:, 0])
    for t in range(counted.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], counted[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(mask, returns, torch.zeros_like(returns))


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438 eq. 16) over tokens.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        return_t = A_t + V_t

    The response ends after its last True token (V after it is 0: the episode terminates). Positions
    where `mask` is False are skipped: they carry the next valid position's value and advantage
    through unchanged and get advantage and return 0 themselves.

    Args:
        token_rewards: (N, T) per-token rewards (e.g. the verifier reward on the last token plus
            a per-token KL penalty; see `kl.kl_penalized_rewards`).
        values: (N, T) critic values V(s_t), detached.
        mask: (N, T) bool, True = response token.
        gamma: discount; lam: GAE lambda.

    Returns:
        advantages (N, T), returns (N, T), both 0 where mask is False.
    """
    token_rewards, values = token_rewards.detach(), values.detach()
    mask_float = mask.to(values.dtype)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        valid = mask_float[:, t]
        advantages[:, t] = advantage_t * valid
        next_value = valid * values[:, t] + (1 - valid) * next_value
        next_advantage = valid * advantage_t + (1 - valid) * next_advantage
    returns = (advantages + values) * mask_float
    return advantages, returns


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is True (over all elements, or along `dim`); 0 if none."""
    mask_float = mask.to(values.dtype)
    total = (values * mask_float).sum() if dim is None else (values * mask_float).sum(dim)
    count = mask_float.sum() if dim is None else mask_float.sum(dim)
    return total / count.clamp(min=1)


def whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `values` to zero mean and unit (population) variance over the masked elements.

    Args:
        values: any shape, e.g. (N, T) advantages.
        mask: same shape, bool, True = counts.
        shift_mean: False adds the mean back after scaling, (v - mean) / std + mean, as PPO
            implementations do when whitening rewards (the spread is normalised, the mean kept).
        eps: added to the variance before the square root.

    Returns:
        whitened values, same shape; masked-out elements are set to 0.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def informative_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose valid (non-NaN) raw rewards are not all equal: at least two valid
    and some spread. Only these carry a policy-gradient signal under group-relative advantages
    (DAPO dynamic sampling, arXiv:2503.14476 eq. 11).

    Args:
        rewards: (B * G,) group-contiguous rewards, NaN where a row could not be scored.
        group_size: G.
    """
    grouped = rewards.view(-1, group_size)
    keep = []
    for index, group in enumerate(grouped):
        valid = group[~torch.isnan(group)]
        if valid.numel() >= 2 and bool(valid.max() > valid.min()):
            keep.append(index)
    return keep


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the counted tokens: how much of the returns'
    variance the critic explains (1: all, 0: no better than their mean, < 0: worse).

    Args:
        values: (N, T) critic values; returns: (N, T) GAE returns; mask: (N, T) bool, True = counts.
    Returns:
        0-dim float tensor; NaN when no token counts or the returns do not vary.
    """
    if not mask.any():
        return torch.tensor(float("nan"))
    variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    residual_variance = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return 1 - residual_variance / variance if variance > 0 else torch.tensor(float("nan"))
