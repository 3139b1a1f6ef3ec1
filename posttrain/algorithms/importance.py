"""Importance weights between the policy that sampled a batch (the behaviour policy) and the one the
loss corrects towards, as one rule: `importance_weights`. It serves the sampler-trainer mismatch
(`loss.sampler_correction tis`: `truncated_importance_weights`, token level, truncated) and stale
batches (`loss.off_policy`: the decoupled objective's pi_prox / pi_behav), at the token or the
sequence level, truncated or masked. `effective_sample_size` measures how many samples the weights
leave. Pure tensor math like the rest of `algorithms/`.

The peers' names for the same rule (verl `algorithm.rollout_is_*`, TRL `vllm_importance_sampling_*`,
AReaL `actor.behav_imp_weight_cap`) are given with each setting in
`losses/policy_gradient_config.py: OffPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.policy import MAX_LOG_RATIO

IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""token: w_t = pi(y_t) / pi_behav(y_t) per token; sequence: w = prod_t w_t = exp(sum_t log w_t), the
sequence's likelihood ratio (unbiased, high variance); geometric: exp(mean_t log w_t), the
per-token geometric mean of the sequence (verl's `geometric`; a narrow quantity, like GSPO's ratio)."""
IMPORTANCE_MODES: tuple[str, ...] = ("truncate", "mask")
"""truncate: min(w, cap) (TIS); mask: w where lower <= w <= upper, else 0 (MIS / IcePop-style masking)."""


@dataclass(frozen=True)
class ImportanceWeights:
    """What `importance_weights` returns, all (N, T) and detached; at the sequence levels every
    token of a row carries its row's value."""

    weights: torch.Tensor
    """float32 (float64 from float64 log-probs): the weight that multiplies each token's surrogate (truncated or masked)."""
    raw: torch.Tensor
    """w before truncation or masking (its log only clamped to +-MAX_LOG_RATIO against overflow)."""
    truncated: torch.Tensor
    """bool: the truncation changed w (w > cap; mode truncate)."""
    masked: torch.Tensor
    """bool: w left [lower, upper] and the weight is 0 (mode mask)."""
    level: str = "token"
    """The level they were taken at (`IMPORTANCE_LEVELS`)."""

    def units(self, mask: torch.Tensor) -> torch.Tensor:
        """(n,) the raw weights of the counted units: one per counted token at the token level,
        one per row with a counted token at the sequence levels (the n of `effective_sample_size`)."""
        if self.level == "token":
            return self.raw[mask]
        return self.raw[:, 0][mask.any(-1)] if self.raw.shape[-1] else self.raw.new_zeros(0)


def importance_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    lower: float = 0.5,
    upper: float = 2.0,
) -> ImportanceWeights:
    """The importance weight of each token between the policy the loss corrects towards (`target`)
    and the one that drew the tokens (`behaviour`), at a level, truncated or masked:

        log w_t = target_t - behaviour_t                              (token)
        log w   = sum_t mask_t (target_t - behaviour_t)               (sequence: the likelihood ratio)
        log w   = sum_t mask_t (target_t - behaviour_t) / sum_t mask_t (geometric)
        truncate: min(w, cap)          (TIS: Yao et al. 2025, "Your efficient RL framework secretly
                                        brings you off-policy RL training")
        mask:     w if lower <= w <= upper else 0   (MIS, masked importance sampling: Liu, Li et al.
                                        2025, "When speed kills stability"; IcePop masks the same band)

    A masked token keeps its place in the aggregation's normaliser (its weight is 0): verl's `mask`
    mode instead drops it from the response mask, which shrinks token_mean's denominator.

    Args:
        target_logprobs: (N, T) log-probs under the policy corrected towards (detached here): the
            trainer's old / proximal log-probs.
        behaviour_logprobs: (N, T) log-probs under the distribution the tokens were drawn from
            (`Rollout.sampler_logprobs`).
        mask: (N, T) bool, the tokens that count (the sequence levels sum over them; the token level
            ignores it).
        level: one of `IMPORTANCE_LEVELS`.
        mode: one of `IMPORTANCE_MODES`.
        cap: C > 0, the truncation (mode truncate).
        lower, upper: the band kept (mode mask), 0 <= lower < upper.

    Returns:
        `ImportanceWeights` (weights, raw, truncated, masked: each (N, T); the level).

    Example (the 2 x 3 of tests/test_off_policy_loss.py): log w = [[0.5, 1.3, -1.0], [0.2, -0.9, 0.0]],
    all counted. Token, truncate, cap 2: [[1.6487, 2, 0.3679], [1.2214, 0.4066, 1]]; token, mask
    [0.5, 2]: [[1.6487, 0, 0], [1.2214, 0, 1]]. Sequence: log w = [0.8, -0.7] -> w = [2.2255,
    0.4966]; truncate cap 2: [2, 0.4966]; mask [0.5, 2]: [0, 0].
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"level must be one of {', '.join(IMPORTANCE_LEVELS)}, got {level!r}")
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"mode must be one of {', '.join(IMPORTANCE_MODES)}, got {mode!r}")
    dtype = torch.promote_types(torch.promote_types(target_logprobs.dtype, behaviour_logprobs.dtype), torch.float32)
    log_ratio = target_logprobs.detach().to(dtype) - behaviour_logprobs.to(dtype)  # (N, T), float32 at least
    if level != "token":
        counted = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(-1)  # (N,)
        if level == "geometric":
            counted = counted / mask.sum(-1).clamp(min=1)
        log_ratio = counted[:, None].expand_as(log_ratio)
    # Clamped, not the ratio: within +-MAX_LOG_RATIO the clamp is the identity, bit for bit.
    raw = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    nothing = torch.zeros_like(raw, dtype=torch.bool)
    if mode == "truncate":
        return ImportanceWeights(raw.clamp(max=cap), raw, raw > cap, nothing, level)
    outside = (raw < lower) | (raw > upper)
    return ImportanceWeights(raw.masked_fill(outside, 0.0), raw, nothing, outside, level)


def truncated_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Per-token truncated importance sampling (TIS) weights between the distribution the tokens were
    drawn from and the one the trainer computes for the old policy: `importance_weights` at the
    token level, truncated:

        w = min(exp(old_logprobs - sampler_logprobs), cap)

    The rollout engine and the training forward compute the same policy with different kernels
    (and, under bf16, different rounding), top-p / top-k sampling draws from a truncated
    distribution, and a stale batch was drawn by an older policy; multiplying each token's surrogate
    loss by w corrects the gradient towards the trainer's (Yao et al., "Your efficient RL framework
    secretly brings you off-policy RL training", 2025), the cap bounding its variance.

    Args:
        old_logprobs: (N, T) the trainer's log-probs of the sampled tokens before the update.
        sampler_logprobs: (N, T) the rollout engine's log-probs under the distribution it sampled.
        cap: C > 0, the truncation.

    Returns:
        (N, T) detached weights in (0, cap].

    Example: old -1.0, sampler -1.5 -> exp(0.5) = 1.6487; old -0.2, sampler -1.5 -> exp(1.3) = 3.669,
    capped at 2.
    """
    everything = torch.ones_like(old_logprobs, dtype=torch.bool)  # the token level reads no mask
    return importance_weights(old_logprobs, sampler_logprobs, everything, "token", "truncate", cap=cap).weights


def effective_sample_size(weight_sum: float, square_sum: float, count: float) -> float:
    """The effective sample size of n importance weights, as a fraction of n (Kong 1992; verl's
    `rollout_is_eff_sample_size`):

        ESS / n = (sum_i w_i)^2 / (n sum_i w_i^2)      in (0, 1]; 1 when every weight is equal

    Takes the sums (so that they can be added over micro-batches and ranks first). Returns 1 for
    n = 0 (no weights: nothing lost).

    Example: w = [2, 0.5, 1, 1] -> 4.5^2 / (4 x 6.25) = 0.81.
    """
    return weight_sum ** 2 / (count * square_sum) if count and square_sum else 1.0
