"""Policy and value losses, and how per-token losses become one number.

Three independent choices, each an argument: the clip range (symmetric PPO, or DAPO's clip-higher
with a larger upper bound), the optional dual clip for negative advantages, and the aggregation mode.
Losses are to be minimised (the negative of the clipped objective).
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

# exp() of a log-ratio beyond this overflows float32 long before it means anything; clamping the
# log-ratio (not the ratio) keeps the loss finite and leaves every clipped region unchanged.
MAX_LOG_RATIO = 20.0


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate loss (Schulman et al., arXiv:1707.06347 eq. 7).

        ratio = exp(logprobs - old_logprobs)
        loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    `clip_high > clip_low` is DAPO's clip-higher (arXiv:2503.14476 eq. 10). With `dual_clip = c > 1`
    the loss of a negative-advantage token is also capped at -c * A (Ye et al., arXiv:1912.09729
    eq. 5), so a huge ratio on a bad token cannot dominate the batch.

    Args:
        logprobs: (N, T) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (N, T) the same under the behaviour policy that sampled them (no grad).
        advantages: (N, T), or (N,) broadcast over tokens.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        dual_clip: None, or c > 1.

    Returns:
        loss (N, T) per token (not yet masked or aggregated), and detached per-token stats:
        `ratio`, `clipped_low` (the lower clip is active: ratio < 1 - clip_low with A < 0),
        `clipped_high` (ratio > 1 + clip_high with A > 0), `dual_clipped` (bool tensors).

    Example (the seed): old prob 0.20, new 0.26, A = sqrt(3), clip 0.2/0.2 -> ratio 1.3,
    objective min(1.3 A, 1.2 A) = 1.2 * sqrt(3) ~ 2.078, loss ~ -2.078, clipped_high True.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    loss, stats = _clipped_objective(torch.exp(log_ratio), advantages, clip_low, clip_high)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    stats["dual_clipped"] = dual_clipped.detach()
    return loss, stats


def _clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float):
    """-min(r A, clip(r, 1 - low, 1 + high) A) per token, and the detached `ratio`, `clipped_low`
    (r < 1 - low with A < 0) and `clipped_high` (r > 1 + high with A > 0); r, A (N, T)."""
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped_loss, clipped_loss)
    shown = ratio.detach()
    stats = {
        "ratio": shown,
        "clipped_low": ((shown < 1.0 - clip_low) & (advantages < 0)).detach(),
        "clipped_high": ((shown > 1.0 + clip_high) & (advantages > 0)).detach(),
    }
    return loss, stats


def sequence_clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped surrogate, in its GSPO-token form (Zheng et al.
    arXiv:2507.18071 eqs. 5-7 and section 4.3):

        s_i     = exp(mean_t (log pi_t - log pi_old_t))            (the geometric-mean ratio)
        s_{i,t} = sg[s_i] * pi_t / sg[pi_t]                         (value s_i, gradient s_i * grad log pi_t)
        loss    = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - clip_low, 1 + clip_high) A_{i,t})

    Averaged per sequence over its tokens (aggregation seq_mean_token_mean), it is GSPO's
    -min(s_i A_i, clip(s_i) A_i) in value and in gradient when the advantage is per sequence; with
    per-token advantages it is GSPO-token. The clip range applies to the geometric-mean ratio, so
    it is narrow: the paper's 3e-4 / 4e-4 are the defaults. On-policy (s = 1, unclipped) its
    gradient is GRPO's under seq_mean_token_mean.

    Args:
        logprobs, old_logprobs: (N, T) current (with grad) and behaviour-policy log-probs.
        advantages: (N,) or (N, T).
        mask: (N, T) bool, the tokens of each sequence that count (the mean's support; a row with
            none gets s = 1 and no loss once masked).
        clip_low, clip_high: s is clipped to [1 - clip_low, 1 + clip_high].

    Returns:
        loss (N, T) per token (to be aggregated per sequence), and detached per-token stats:
        `ratio` (s_i on every token of row i), `clipped_low`, `clipped_high` (as in `clipped_surrogate`).

    Example: token log-ratios [0.1, -0.3, 0.5], A = 1 -> s = exp(0.1) = 1.105171; with clip 0.2 / 0.2
    the gradient of the sequence's mean loss w.r.t. each log pi_t is -s / 3 = -0.368390; with the
    paper's 3e-4 / 4e-4, s is clipped and the gradient is 0. Log-ratios [25, -4.5 x 5], A = 1, clip
    0.2 / 0.2 -> s = exp(2.5 / 6) = 1.517, loss -1.2, gradient 0 (the mean is taken before the clamp
    to +-MAX_LOG_RATIO, as TRL's GRPOTrainer and verl's compute_policy_loss_gspo do).
    """
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    counted = mask.to(logprobs.dtype)
    # The mean of the raw masked log-ratios, clamped after: clamping each token first would let one
    # token past the bound move s_i across the clip boundary (TRL and verl average, then clamp).
    log_ratio = torch.where(mask, logprobs.detach() - old_logprobs, torch.zeros_like(logprobs))
    mean_log_ratio = (log_ratio.sum(-1) / counted.sum(-1).clamp(min=1)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (N,)
    sequence_ratio = torch.exp(mean_log_ratio.detach())[:, None]
    ratio = sequence_ratio * torch.exp(logprobs - logprobs.detach())  # value s_i, gradient s_i * grad log pi_t
    return _clipped_objective(ratio, advantages, clip_low, clip_high)


def cispo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    low: float = 0.0,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585 section 3.1, eq. 4-5): the importance weight is clipped
    and stopped, never the gradient:

        loss = -sg(clip(r, low, high)) * A * log pi,   r = exp(log pi - log pi_old)

    `low` and `high` are ABSOLUTE bounds on r (not 1 -/+ eps): low 0 leaves it unbounded below, high
    5 is TRL's recommended cap (`loss_type="cispo"`, `epsilon_high`). Unlike the PPO clip, a token
    whose ratio passed the bound keeps its gradient, scaled by the bound.

    Args:
        logprobs, old_logprobs: (N, T) current (with grad) and behaviour-policy log-probs.
        advantages: (N,) or (N, T).
        low, high: 0 <= low < high.

    Returns:
        loss (N, T) per token, and detached per-token stats: `ratio`, `clipped_low` (r < low),
        `clipped_high` (r > high).

    Example: r = 1.5, A = 2, high = 1.28 -> d loss / d log pi = -1.28 * 2 = -2.56 (the PPO clip with
    1 + 0.28 gives 0 there).
    """
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logprobs)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).detach()
    weight = ratio.clamp(low, high)
    loss = -weight * advantages * logprobs
    stats = {"ratio": ratio, "clipped_low": ratio < low, "clipped_high": ratio > high}
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip_range: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token critic loss with PPO's value clipping.

        loss = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)

    With `clip_range=None` it is the plain 0.5 * (V - R)^2.

    Args:
        values: (N, T) current critic values (with grad).
        old_values: (N, T) the critic's values at rollout time.
        returns: (N, T) GAE returns (targets).
        clip_range: c, or None.

    Returns:
        loss (N, T) per token, and `clipped` (N, T) bool: the clipped branch was the larger one.
    """
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation = "token_mean",
    global_tokens: float | torch.Tensor | None = None,
    global_sequences: float | torch.Tensor | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (N, T) to a scalar.

    Modes (their names follow verl's `loss_agg_mode`, but "seq_mean_token_sum_norm" divides by
    sequences x L like TRL's `dr_grpo`, where verl's divides by L only: verl's = N x ours;
    docs/algorithms.md §6 maps every TRL `loss_type` and verl mode):
      * "token_mean": sum over all tokens / global_tokens (DAPO, arXiv:2503.14476 eq. 8). Every
        token weighs the same, whatever its sequence's length.
      * "seq_mean_token_mean": mean over sequences of each sequence's token mean (original GRPO,
        arXiv:2402.03300 eq. 3); short sequences' tokens weigh more.
      * "seq_mean_token_sum": mean over sequences of each sequence's token sum.
      * "seq_mean_token_sum_norm": sum over all tokens / (global_sequences * max_length): Dr. GRPO's
        constant normaliser (arXiv:2503.20783 section 3.1), no length bias.

    The normalisers are passed in so that a batch split into micro-batches (or across ranks) gives
    the same total: give every micro-batch the *global* counts and sum the micro-batch results.
    Left as None they default to this call's own counts.

    Args:
        per_token: (N, T) loss per token.
        mask: (N, T) bool, True = counts.
        mode: one of `AGGREGATIONS`.
        global_tokens: total number of True mask entries in the whole batch ("token_mean").
        global_sequences: total number of sequences in the whole batch (the "seq_*" modes).
        max_length: the constant L of "seq_mean_token_sum_norm" (e.g. max_new_tokens); required.

    Returns:
        scalar tensor.
    """
    mask_float = mask.to(per_token.dtype)
    masked = per_token * mask_float
    if mode == "token_mean":
        normaliser = mask_float.sum() if global_tokens is None else torch.as_tensor(global_tokens)
        return masked.sum() / normaliser.to(per_token.dtype).clamp(min=1)
    sequences = per_token.shape[0] if global_sequences is None else global_sequences
    if mode == "seq_mean_token_mean":
        per_sequence = masked.sum(dim=-1) / mask_float.sum(dim=-1).clamp(min=1)
        return per_sequence.sum() / sequences
    if mode == "seq_mean_token_sum":
        return masked.sum() / sequences
    if mode == "seq_mean_token_sum_norm":
        if max_length is None:
            raise ValueError("seq_mean_token_sum_norm needs max_length (the constant normaliser)")
        return masked.sum() / (sequences * max_length)
    raise ValueError(f"unknown aggregation mode {mode!r}; choose from {', '.join(AGGREGATIONS)}")


def sampler_mismatch(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs of the sampled tokens are from the training forward's
    log-probs of the same tokens (both under softmax(logits / temperature), before the update).

    Args:
        trainer_logprobs, sampler_logprobs: (N, T) float.
        mask: (N, T) bool, the tokens compared.

    Returns:
        0-dim tensors: `logprob_abs_mean` and `logprob_abs_max`, the mean and max over tokens of
        |trainer - sampler|; `seq_ratio_max`, the largest sequence-level probability ratio either
        way, max over rows of exp(|sum_t (trainer - sampler)|) (1 = identical). 0, 0 and 1 when no
        token counts.
    """
    diff = (trainer_logprobs.float() - sampler_logprobs.float()).masked_fill(~mask, 0.0)
    count = mask.sum()
    absolute = diff.abs()
    return {
        "logprob_abs_mean": absolute.sum() / count.clamp(min=1),
        "logprob_abs_max": absolute.max() if diff.numel() else diff.new_zeros(()),
        "seq_ratio_max": torch.exp(diff.sum(-1).abs().max()) if diff.numel() else diff.new_ones(()),
    }
