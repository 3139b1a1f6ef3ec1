"""The ``Rollout``: what the engine returns, and the inputs of the training forward pass over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.rollout.sampling import SamplingConfig


@dataclass
class Rollout:
    """N = B * G sampled completions, group-contiguous: row ``b * G + g`` is sample g of prompt b.

    P is the longest prompt, T the longest completion (<= ``sampling.max_new_tokens``).
    """

    prompt_ids: torch.Tensor
    """(N, P) long: each row's prompt, left-padded with ``pad_token_id``."""
    prompt_attention_mask: torch.Tensor
    """(N, P) bool: True = a real prompt token (not a loss mask: the prompt never counts)."""
    completion_ids: torch.Tensor
    """(N, T) long: sampled tokens, right-padded with ``pad_token_id`` (which may equal EOS)."""
    mask: torch.Tensor
    """(N, T) bool: True = this completion token counts, including the EOS that ends it."""
    sampler_logprobs: torch.Tensor
    """(N, T) float32: log-prob of each sampled token under the distribution it was drawn from
    (temperature, then top-k / top-p / min-length EOS ban, renormalised); 0 for greedy; 0 at padding."""
    logprobs: torch.Tensor
    """(N, T) float32: log-prob of each sampled token under ``softmax(logits / temperature)`` over the
    whole vocabulary, which is what a training step recomputes; equals ``sampler_logprobs`` when
    nothing truncates the distribution. 0 at padding."""
    finished: torch.Tensor
    """(N,) bool: the completion ended with an EOS / stop token or a stop string."""
    truncated: torch.Tensor
    """(N,) bool: the completion hit ``max_new_tokens`` first (exactly one of finished / truncated)."""
    texts: list[str]
    """N decoded completions (special tokens skipped; cut just after a stop string that ended one)."""
    prompt_index: torch.Tensor
    """(N,) long: which prompt (0..B-1) each row answers."""
    group_size: int
    """G, samples per prompt."""
    sampling: SamplingConfig
    """The settings the rows were sampled with."""
    pad_token_id: int
    """The id used for padding in ``prompt_ids`` and ``completion_ids``."""

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) long: number of completion tokens that count (``mask.sum(-1)``)."""
        return self.mask.sum(-1)

    def forward_inputs(self) -> dict[str, torch.Tensor]:
        """Inputs of a no-cache training forward pass over prompt + completion: ``model(**inputs)``.

        Layout of a row: ``[left padding][prompt][completion][right padding]``, width P + T. Position
        ids count real tokens only, exactly as during generation, so the logits reproduce the sampler's.
        Completion token t is predicted by the logits at column ``P - 1 + t``:
        ``logits[:, P - 1 : P - 1 + T]`` (N, T, V) lines up with ``completion_ids`` and ``mask``.

        Returns:
            ``input_ids`` (N, P + T) long, ``attention_mask`` (N, P + T) long (1 = real token),
            ``position_ids`` (N, P + T) long.
        """
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_attention_mask, self.mask], dim=1).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
