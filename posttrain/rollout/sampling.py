"""Sampling settings and the per-step sampling math: pure tensor functions, no model.

Two distributions are named here and they are different things:

* the *temperature* distribution, ``softmax(logits / temperature)`` over the whole vocabulary: what a
  training recipe recomputes from the policy's logits; its log-probs are ``logprobs``;
* the *sampler* distribution: the temperature distribution after top-k, top-p and the minimum-length
  EOS ban, renormalised over the tokens that survive: what tokens are actually drawn from; its
  log-probs are ``sampler_logprobs``. With no truncation the two are equal.

Tokens are drawn by inverting the sampler's CDF with one uniform number per (sequence, step), taken
from a table the caller makes from the seed. Each sequence owns its row of that table, so a
sequence's tokens do not depend on which other sequences share its batch (chunking, compaction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.errors import UserError
from posttrain.rollout import kernels


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. The defaults sample from the model's plain distribution."""

    temperature: float = 1.0
    """Logits are divided by this before softmax. Must be > 0 (use ``greedy`` for argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest most-likely set whose probability reaches top_p; 1.0 keeps all."""
    max_new_tokens: int = 64
    """Completion length cap; a sequence that reaches it without stopping is ``truncated``."""
    min_new_tokens: int = 0
    """EOS (and ``stop_token_ids``) cannot be sampled before this many tokens (as in HF ``generate``)."""
    stop_strings: tuple[str, ...] = ()
    """A completion stops (``finished``) at the first token whose text completes one of these."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a completion, besides the tokenizer's and model's EOS ids."""
    greedy: bool = False
    """Argmax decoding. The sampler distribution is then a point mass: ``sampler_logprobs`` are 0."""

    def __post_init__(self):
        if not self.temperature > 0:
            raise UserError(f"sampling.temperature must be > 0, got {self.temperature} (use greedy=True)")
        if self.top_k < 0:
            raise UserError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise UserError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise UserError(f"sampling.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if isinstance(self.stop_strings, str):
            raise UserError("sampling.stop_strings must be a list of strings, not one string")
        if any(not s for s in self.stop_strings):
            raise UserError("sampling.stop_strings must not contain an empty string")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """True when the sampler distribution can differ from the temperature distribution."""
        return self.top_k > 0 or self.top_p < 1.0


def sampler_logits(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask temperature-scaled logits down to the sampler's support.

    Args:
        scaled: (n, V) float logits already divided by the temperature.
        top_k: keep the k largest (0 = all). Ties at the k-th value are all kept.
        top_p: keep the most likely tokens, in descending order, while the probability mass
            *before* a token is < top_p (so the token that crosses top_p is kept, and the most
            likely token always is).

    Returns:
        (n, V) logits with removed tokens set to -inf; log_softmax of this is the sampler's
        renormalised log-distribution.
    """
    masked = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (n, 1)
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)  # (n, V)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False
        remove = torch.empty_like(remove_sorted).scatter_(-1, order, remove_sorted)
        masked = masked.masked_fill(remove, float("-inf"))
    return masked


CDF_BLOCK = 128  # tokens per block of the two-level inverse CDF


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """(n,) index of the last entry > 0 in each row of (n, m) weights."""
    return weights.shape[-1] - 1 - (weights.flip(-1) > 0).to(torch.int8).argmax(-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting the CDF of ``probs`` in vocabulary order.

    Token v is drawn iff cdf[v - 1] <= u * total < cdf[v]. Two levels, so that only block sums
    and one block per row are accumulated (in float64): the block whose cumulative mass passes
    ``u * total``, then the token inside it. Same tokens as a full float64 cumsum up to rounding
    at block edges (tested against it).

    Args:
        probs: (n, V) float, non-negative, at least one positive per row (need not sum to 1).
        uniforms: (n,) float in [0, 1), one per row.

    Returns:
        tokens (n,) long, token v drawn with probability probs[v] / probs.sum(); and that sum
        (n,) float64 (for renormalising).
    """
    if probs.is_contiguous() and kernels.usable(probs):  # CPU float32, kernels built
        return kernels.sample_cdf(probs, uniforms, CDF_BLOCK)  # same draw, one pass per row in C
    n, vocab = probs.shape
    pad = (-vocab) % CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, CDF_BLOCK)  # (n, nb, 128)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (n, nb)
    target = uniforms.to(torch.float64) * block_cdf[:, -1]  # (n,)
    block = torch.searchsorted(block_cdf, target.unsqueeze(-1), right=True).squeeze(-1)  # first cdf > target
    # Rounding can put the target at the very total (block = nb) or past a block's own sum: then the
    # last block / token with mass. Applied unconditionally: a data-dependent branch would cost a
    # host synchronisation per decode step on a GPU.
    overflow = block >= block_cdf.shape[-1]
    block = torch.where(overflow, _last_positive(blocks.sum(-1)), block)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    inside = blocks[torch.arange(n, device=block.device), block]  # (n, 128)
    offset = torch.searchsorted(inside.to(torch.float64).cumsum(-1), (target - before).unsqueeze(-1),
                                right=True).squeeze(-1)
    overflow = offset >= CDF_BLOCK
    offset = torch.where(overflow, _last_positive(inside), offset)
    return block * CDF_BLOCK + offset, block_cdf[:, -1]


def sample_from_logits(masked: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from ``softmax(masked)``; -inf logits are never drawn. (n, V) -> (n,) long."""
    return sample_from_probs(torch.softmax(masked, dim=-1), uniforms)[0]


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, tokens[row]] without materialising the whole log_softmax.

    Args:
        logits: (n, V) float. tokens: (n,) long.

    Returns:
        (n,) float32 log-probs.
    """
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)).float()


def sample_step(logits: torch.Tensor, config: SamplingConfig, uniforms: torch.Tensor,
                banned_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step: choose a token per row and report both log-probs of it.

    Args:
        logits: (n, V) raw next-token logits (temperature not applied).
        config: the sampling settings.
        uniforms: (n,) float in [0, 1); ignored when greedy.
        banned_ids: optional (k,) long token ids that may not be drawn this step (EOS before
            ``min_new_tokens``). They are removed from the sampler distribution only.

    Returns:
        tokens (n,) long; sampler_logprobs (n,) float32, log-prob under the distribution drawn from
        (0 for greedy); logprobs (n,) float32, log-prob under softmax(logits / temperature).
    """
    scaled = logits.float() / config.temperature if config.temperature != 1.0 else logits.float()
    banned = banned_ids is not None and banned_ids.numel() > 0
    if config.greedy:
        tokens = (scaled.index_fill(-1, banned_ids, float("-inf")) if banned else scaled).argmax(-1)
        return tokens, torch.zeros(tokens.shape, device=tokens.device), gather_logprobs(scaled, tokens)
    if config.truncates:
        masked = scaled.index_fill(-1, banned_ids, float("-inf")) if banned else scaled
        weights = torch.softmax(sampler_logits(masked, config.top_k, config.top_p), dim=-1)
        tokens, _ = sample_from_probs(weights, uniforms)
        sampler = weights.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
        return tokens, sampler, gather_logprobs(scaled, tokens)
    # No truncation: one softmax serves both distributions (the sampler's is the same, or the same
    # with the banned ids zeroed and renormalised by the kept mass, summed in float64).
    probs = torch.softmax(scaled, dim=-1)  # (n, V)
    weights = probs.index_fill(-1, banned_ids, 0.0) if banned else probs
    tokens, kept = sample_from_probs(weights, uniforms)
    logprobs = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()  # > 0: it was drawn
    sampler = (logprobs - kept.log()).float() if banned else logprobs
    return tokens, sampler, logprobs
