"""Log-probs of target tokens from logits, without materialising a full (N, T, V) log-softmax.

log p(x) = logit(x) / tau - logsumexp(logits / tau). Computing that over chunks of positions keeps
one chunk's (chunk, V) temporaries alive instead of a whole log-softmax tensor; logsumexp's backward
recomputes the softmax per chunk from the logits autograd already holds. The temperature tau must be
the one the samples were drawn at (DESIGN.md, "Log-probs").
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Log-prob of each target token under softmax(logits / temperature).

    Args:
        logits: (..., V), aligned with `targets` (logits[..., t, :] scores targets[..., t]).
        targets: (...) long token ids.
        temperature: > 0; the sampling temperature.
        chunk_size: positions per chunk (bounds peak memory to about chunk_size * V floats).

    Returns:
        (...) float32 log-probs (float64 if the logits are float64), differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not align with targets {tuple(targets.shape)}")
    vocab = logits.shape[-1]
    flat_logits, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        chunk = flat_logits[start : start + chunk_size].to(dtype)  # (chunk, V)
        if temperature != 1.0:  # x / 1.0 is x: skip the (chunk, V) copy and its gradient's
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_targets[start : start + chunk_size, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return flat_logits.new_zeros(targets.shape, dtype=dtype)
    return torch.cat(pieces).reshape(targets.shape)


def response_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of a causal LM over a full sequence, shifted and masked.

    Position t's logits predict token t + 1, so the result is aligned with `input_ids[:, 1:]`.

    Args:
        logits: (N, L, V) from model(input_ids).
        input_ids: (N, L) prompt + response (+ padding).
        mask: (N, L) bool, True = response token (incl. its ending EOS), aligned with input_ids.
        temperature, chunk_size: as in `token_logprobs`.

    Returns:
        logprobs (N, L - 1) with 0 where the shifted mask is False, and that mask (N, L - 1).
    """
    targets = input_ids[:, 1:]
    shifted_mask = mask[:, 1:]
    logprobs = token_logprobs(logits[:, :-1], targets, temperature, chunk_size)
    return logprobs.masked_fill(~shifted_mask, 0.0), shifted_mask


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence log-prob: the sum of the response tokens' log-probs (the seed's DPO convention).

    Args:
        logprobs: (N, T) per-token log-probs.
        mask: (N, T) bool, True = response token (prompt and padding False, ending EOS True).

    Returns:
        (N,) sums.
    """
    return (logprobs * mask.to(logprobs.dtype)).sum(dim=-1)
