"""Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv:2505.22617): surrogates that hold the policy's entropy up by restricting the
update of the tokens whose covariance between log-prob and advantage is high. Under a policy-gradient
step the entropy changes by about -Cov(log pi, A) over the batch's tokens, so a confident token with a
high advantage is the one that collapses the entropy; these two leave such tokens' ratios out of the
update (Clip-Cov) or pull them back with a |log-ratio| penalty (KL-Cov).

Each token's covariance term is its share of the sample covariance over the tokens passed in:

    cov_t = (A_t - mean(A)) * (log pi_t - mean(log pi))     (means over the counted tokens, detached)

The statistics are over the tokens of the call: the loss step calls a surrogate once per
micro-batch, as verl does (`policy_loss.loss_mode: clip_cov | kl_cov`), so these two, unlike the
other surrogates, depend on how the mini-batch is split (docs/algorithms.md). Pure tensor math.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.policy import MAX_LOG_RATIO, clipped_surrogate


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n, T) detached per-token covariance terms (A_t - mean A)(log pi_t - mean log pi), the means
    over the counted tokens (`mask` (n, T) bool); 0 on the tokens that do not count.
    `advantages` (n,) or (n, T).

    Example: log pi [-1, -2, -3], A [1, 0, -1] (one row, all counted) -> means -2 and 0, cov [1, 0, 1].
    """
    logprobs = logprobs.detach()
    advantages = (advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages).expand_as(logprobs)
    counted = mask.to(logprobs.dtype)
    tokens = counted.sum().clamp(min=1)
    centred_advantages = advantages.to(logprobs.dtype) - (advantages * counted).sum() / tokens
    centred_logprobs = logprobs - (logprobs * counted).sum() / tokens
    return centred_advantages * centred_logprobs * counted


def _top(candidates: torch.Tensor, scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(n, T) bool: the `count` candidates with the highest scores (fewer when fewer are candidates);
    ties go to the earlier position. `count` is a 0-d tensor, so nothing waits on the device."""
    flat = scores.masked_fill(~candidates, float("-inf")).reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return (rank.reshape(candidates.shape) < count) & candidates


def _selected_count(mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """max(1, floor(fraction x the counted tokens)), as a 0-d tensor (verl: max(int(ratio * tokens), 1))."""
    return torch.floor(mask.sum() * fraction).clamp(min=1)


def clip_cov_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    fraction: float = 2e-4,
    lower: float = 1.0,
    upper: float = 5.0,
    seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (arXiv:2505.22617, section "Clip-Cov"): the PPO clipped surrogate, except that a
    random `fraction` of the counted tokens whose covariance term lies in (lower, upper) and whose
    ratio the PPO clip has not already stopped lose their gradient (their loss is 0, as in verl's
    `compute_policy_loss_clip_cov`):

        loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)   if t not in I_clip
               = 0                                                        if t in I_clip
        I_clip = max(1, floor(fraction x tokens)) tokens drawn uniformly from
                 {t counted, not PPO-clipped, lower < cov_t < upper}

    The draw is seeded: the same `seed` and tensors select the same tokens (on one device kind).

    Args:
        logprobs, old_logprobs: (n, T) current (with grad) and old log-probs.
        advantages: (n,) or (n, T).
        mask: (n, T) bool, the counted tokens (the covariance's support).
        clip_low, clip_high: the PPO clip range [1 - clip_low, 1 + clip_high].
        fraction: the share of counted tokens detached (verl's clip_cov_ratio, default 2e-4).
        lower, upper: the covariance band (verl's clip_cov_lb 1, clip_cov_ub 5).
        seed: seeds the draw.

    Returns:
        loss (n, T) per token, and detached per-token stats: `ratio`, `clipped_low`, `clipped_high`
        (the PPO clip, as in `clipped_surrogate`), `cov_clipped` (t in I_clip).
    """
    loss, stats = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    covariance = token_covariance(logprobs, advantages, mask)
    candidates = mask & ~stats["clipped_low"] & ~stats["clipped_high"] & (covariance > lower) & (covariance < upper)
    generator = torch.Generator(device=logprobs.device).manual_seed(seed)
    priorities = torch.rand(mask.shape, generator=generator, device=logprobs.device)  # a uniform draw without replacement
    selected = _top(candidates, priorities, _selected_count(mask, fraction))
    stats["cov_clipped"] = selected
    del stats["dual_clipped"]
    return loss.masked_fill(selected, 0.0), stats


def kl_cov_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    fraction: float = 2e-4,
    coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (arXiv:2505.22617, section "KL-Cov"): the unclipped ratio objective, plus a penalty
    coef x |log r_t| on the top `fraction` of the counted tokens by covariance term:

        loss_t = -r_t A_t + coef |log r_t| [t in I_KL],   r_t = exp(log pi_t - log pi_old_t)
        I_KL   = the max(1, floor(fraction x tokens)) counted tokens with the largest cov_t

    (verl's `compute_policy_loss_kl_cov`: kl_cov_ratio 2e-4, ppo_kl_coef 1 by default). No clip: the
    penalty is the trust region, and only on the tokens that drive the entropy down. The log-ratio
    is clamped to +-MAX_LOG_RATIO like every ratio here.

    Args:
        logprobs, old_logprobs: (n, T) current (with grad) and old log-probs.
        advantages: (n,) or (n, T).
        mask: (n, T) bool, the counted tokens.
        fraction: the share of counted tokens penalised (k).
        coef: the penalty's weight (beta).

    Returns:
        loss (n, T) per token, and detached per-token stats: `ratio`, `cov_penalised` (t in I_KL).

    Example: one row, log pi [-1, -2, -3], old = log pi - [0.1, 0, 0], A [1, 0, -1], fraction 1/3,
    coef 1 -> cov [1, 0, 1], I_KL = {0} (the tie goes to the first), loss [-e^0.1 + 0.1, 0, 1].
    """
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    selected = _top(mask, token_covariance(logprobs, advantages, mask), _selected_count(mask, fraction))
    loss = -advantages * ratio + coef * log_ratio.abs() * selected
    return loss, {"ratio": ratio.detach(), "cov_penalised": selected}
