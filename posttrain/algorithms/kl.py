"""KL(policy || reference): sampled per-token estimators, the exact value, and its two placements.

KL compares two conditional distributions over the vocabulary at the same prefix (the seed's
example: policy [0.8, 0.2] vs reference [0.5, 0.5] gives 0.8 ln 1.6 + 0.2 ln 0.4 ~ 0.1927), not
generated text against a dataset. With tokens sampled from the policy p and r = q(x) / p(x) for the
reference q, the estimators of Schulman's "Approximating KL divergence" (2020) are

    k1 = -log r               unbiased, can be negative, high variance
    k2 = (log r)^2 / 2        biased (second order), >= 0, low variance
    k3 = (r - 1) - log r      unbiased, >= 0, low variance (GRPO, arXiv:2402.03300 eq. 4)

Placement is the recipe's choice, both supported here: as a term in the loss (GRPO: add
beta * aggregate(k) to the policy loss), or folded into the rewards as a per-token penalty before
advantages are computed (PPO-RLHF: `kl_penalized_rewards`).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from posttrain.algorithms.policy import MAX_LOG_RATIO

Estimator = Literal["k1", "k2", "k3"]

# The largest `clamp` that the log-ratio clamp leaves unchanged: the smallest |estimate| at a
# log-ratio of +-MAX_LOG_RATIO is k3's, k3(20) = 19 + e^-20 (see `kl_estimate`).
MAX_KL_CLAMP = MAX_LOG_RATIO - 1.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio**2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # r = q/p = exp(-log_ratio); (r - 1) - log r. expm1 keeps precision when p ~ q.
    return torch.expm1(-log_ratio) + log_ratio


ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: Estimator = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token sampled estimate of KL(policy || reference) at each sampled token.

    Args:
        logprobs: (N, T) log p(x_t) of the sampled tokens under the policy.
        ref_logprobs: (N, T) log q(x_t) of the same tokens under the frozen reference.
        estimator: "k1" | "k2" | "k3" (see the module docstring).
        clamp: optional bound c on |estimate|, 0 < c <= 19 (`MAX_KL_CLAMP`), for stability with
            far-apart models (None = off).

    Returns:
        (N, T) per-token estimates (not masked).

    With a clamp, the log-ratio x = logprobs - ref_logprobs is first clamped to +-20
    (`MAX_LOG_RATIO`): otherwise k3's exp(-x) overflows float32 for x below about -88.7, and the
    clamp's zero gradient times the infinite derivative is a NaN gradient. This changes no value:
    each estimator is monotone on each side of x = 0, and at x = +-20 each is already at or beyond
    any c <= 19 (k1: +-20; k2: 200; k3: e^20 - 21 ~ 4.9e8 at -20 and 19 + e^-20 at +20, the
    smallest, hence the bound 19). So a token with |x| > 20 gets the value +-c and gradient 0, as it
    would without overflow.

    Example: p = 0.8, q = 0.5: log r = ln 0.625 ~ -0.4700; k1 ~ 0.4700, k2 ~ 0.1105,
    k3 = 0.625 - 1 + 0.4700 ~ 0.0950.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose from k1, k2, k3")
    log_ratio = logprobs - ref_logprobs
    if clamp is None:
        return ESTIMATORS[estimator](log_ratio)
    if not 0.0 < clamp <= MAX_KL_CLAMP:
        raise ValueError(f"KL clamp must be in (0, {MAX_KL_CLAMP:g}] (the log-ratio is clamped to +-{MAX_LOG_RATIO:g} first), got {clamp}")
    estimate = ESTIMATORS[estimator](log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return estimate.clamp(-clamp, clamp)


def exact_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Exact KL(p || q) = sum_v p(v) (log p(v) - log q(v)) at every position, over the vocabulary.

    Computed over chunks of positions so that only `chunk_size * V` floats of softmax are alive at
    once, not `N * T * V`.

    Args:
        logits: (..., V) policy logits (with or without grad).
        ref_logits: (..., V) reference logits at the same positions.
        temperature: both distributions are softmax(logits / temperature).
        chunk_size: positions per chunk.

    Returns:
        (...) KL per position, >= 0, in float32 (float64 for float64 logits).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ")
    vocab = logits.shape[-1]
    flat, ref_flat = logits.reshape(-1, vocab), ref_logits.reshape(-1, vocab)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        log_p = torch.log_softmax(flat[start : start + chunk_size].to(dtype) / temperature, dim=-1)
        log_q = torch.log_softmax(ref_flat[start : start + chunk_size].to(dtype) / temperature, dim=-1)
        pieces.append((log_p.exp() * (log_p - log_q)).sum(dim=-1))
    result = torch.cat(pieces) if pieces else flat.new_zeros(0)
    return result.reshape(logits.shape[:-1])


def kl_penalized_rewards(
    rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Fold a KL penalty into per-token rewards (the in-reward placement; Ouyang et al.,
    arXiv:2203.02155 eq. 2): every response token gets -beta * kl_t, and the last response token
    also gets the sequence's reward.

    Args:
        rewards: (N,) sequence rewards (from the verifier or reward model).
        kl: (N, T) per-token KL estimates (detached here: the penalty is a reward, not a loss).
        mask: (N, T) bool, True = response token.
        beta: KL coefficient.

    Returns:
        (N, T) token rewards, 0 where mask is False. A row with no response token keeps only 0s.
    """
    kl = kl.detach()
    mask_float = mask.to(kl.dtype)
    token_rewards = -beta * kl * mask_float
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values  # (N,)
    has_response = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_response]
    token_rewards[rows, last[has_response]] += rewards[has_response].to(kl.dtype)
    return token_rewards


def kl_in_reward(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float, per_token: bool) -> torch.Tensor:
    """The KL-in-reward placement, the one function both online advantage estimators use:

    * `per_token` False (group-relative advantages: one advantage per sequence): each sequence pays
      beta times the sum of its per-token estimates, `rewards - beta * sum_t kl_t` -> (N,);
    * `per_token` True (GAE over tokens): every token gets -beta * kl_t and the last counted token
      also the sequence's reward (`kl_penalized_rewards`, Ouyang et al., arXiv:2203.02155 eq. 2) -> (N, T).

    Args:
        rewards: (N,) sequence rewards (NaN rows stay NaN in the per-sequence form).
        kl: (N, T) per-token KL estimates (detached: the penalty is a reward, not a loss).
        mask: (N, T) bool, True = the token counts (for the per-sequence sum: every sampled token).
        beta: KL coefficient.
    """
    if per_token:
        return kl_penalized_rewards(rewards, kl, mask, beta)
    return rewards - beta * (kl.detach() * mask).sum(-1)
