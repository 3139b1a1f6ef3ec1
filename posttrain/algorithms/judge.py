"""An LLM judge's scores as numbers: the expected pointwise score and the position-debiased pairwise
preference (pure tensor math; the judge itself is posttrain/rewards/judge.py).

Pointwise, logit-scored (G-Eval, arXiv:2303.16634 section 2.3: the score is the probability-weighted
sum over the score tokens, not the sampled one): the judge's next-token distribution after "Score:"
restricted to the tokens "1".."K" and renormalised, p_k, gives

    E[k] = sum_k k p_k        reward = (E[k] - 1) / (K - 1) in [0, 1]

Pairwise (both orders, to cancel the judge's position bias; Zheng et al., "Judging LLM-as-a-judge",
arXiv:2306.05685 section 3.4): with P_AB the probability that the FIRST-shown answer wins when A is
shown first, and P_BA the same probability when B is shown first,

    P(A > B)      = 1/2 [P_AB + (1 - P_BA)]
    position_bias = 1/2 [P_AB + P_BA] - 1/2    (how much more often the first-shown answer wins)

An unbiased judge has P_BA = 1 - P_AB, hence position_bias 0 and P(A > B) = P_AB.
"""

from __future__ import annotations

import torch


def score_probabilities(score_logits: torch.Tensor) -> torch.Tensor:
    """The judge's distribution over its K score tokens, renormalised.

    Args:
        score_logits: (N, K) the next-token logits of the score tokens "1".."K" (any dtype).

    Returns:
        (N, K) float32 probabilities, each row summing to 1. A softmax over the K logits equals the
        full-vocabulary softmax restricted to those K tokens and renormalised (the shared normaliser
        cancels), and is unchanged by adding a constant to a row's logits.
    """
    return torch.softmax(score_logits.float(), dim=-1)


def expected_score(score_logits: torch.Tensor) -> torch.Tensor:
    """The reward of a logit-scored pointwise judge: (E[k] - 1) / (K - 1), in [0, 1].

    Args:
        score_logits: (N, K) next-token logits of the score tokens "1".."K", K >= 2.

    Returns:
        (N,) float32 rewards: 0 when all mass is on "1", 1 when all of it is on "K".

    Example (the issue's): probabilities [0.1, 0.2, 0.4, 0.2, 0.1] over "1".."5" give
    E[k] = 0.1 + 0.4 + 1.2 + 0.8 + 0.5 = 3.0, reward (3 - 1) / 4 = 0.5.
    """
    K = score_logits.shape[-1]
    if K < 2:
        raise ValueError(f"a score scale needs at least 2 points, got {K}")
    scores = torch.arange(1, K + 1, dtype=torch.float32, device=score_logits.device)  # (K,)
    expected = score_probabilities(score_logits) @ scores  # (N,)
    return (expected - 1.0) / (K - 1)


def pairwise_preference(p_ab: torch.Tensor, p_ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P(A > B) from both presentation orders, and the judge's position bias.

    Args:
        p_ab: (N,) probability that the first-shown answer wins when A is shown first (= P(A wins)).
        p_ba: (N,) probability that the first-shown answer wins when B is shown first (= P(B wins)).

    Returns:
        p: (N,) P(A > B) = 1/2 [p_ab + 1 - p_ba], in [0, 1].
        position_bias: (N,) 1/2 [p_ab + p_ba] - 1/2, in [-1/2, 1/2]: the average probability that
            the first-shown answer wins, minus 1/2 (> 0: the judge favours the first position).

    Example (the issue's): p_ab = 0.8, p_ba = 0.4 give p = 1/2 [0.8 + 0.6] = 0.7 and
    position_bias = 1/2 [0.8 + 0.4] - 0.5 = 0.1.
    """
    p_ab, p_ba = p_ab.float(), p_ba.float()
    return 0.5 * (p_ab + 1.0 - p_ba), 0.5 * (p_ab + p_ba) - 0.5


def last_position_logits(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's logits at its last attended position (where the next token is predicted), found
    from the attention mask (never from token ids: a pad id may equal a real token's), so left or
    right padding both work.

    Args:
        logits: (N, L, V) logits of the LAST L of the T positions (L = T: all of them; L = 1: what
            `logits_to_keep=1` returns, which holds each row's last attended position only when
            the rows are left-padded).
        attention_mask: (N, T) 1 / True = a real token; every row has at least one.

    Returns:
        (N, V) logits, in `logits`' dtype.

    Example: T = 4, masks [0, 1, 1, 1] (left-padded) and [1, 1, 0, 0] (right-padded): last attended
    positions 3 and 1; with L = 4 rows take logits[0, 3] and logits[1, 1].
    """
    N, L, V = logits.shape
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device)  # (T,)
    last = torch.where(attention_mask.bool(), positions, -1).amax(dim=-1)  # (N,)
    index = (last - (T - L)).to(logits.device)  # (N,) within the kept window
    # gather, not indexing: a position outside the window (negative) is an error, never a wrap-around.
    return logits.gather(1, index.view(N, 1, 1).expand(N, 1, V)).squeeze(1)
