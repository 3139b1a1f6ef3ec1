"""The ``Rollout``: what the engine returns, and the inputs of the training forward pass over it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    """(N, T) bool, the LOSS mask: True = this completion token is trained on (counts in every loss,
    aggregation, KL, mismatch and entropy), including the EOS that ends it."""
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
    """(N,) bool: the completion hit ``max_new_tokens`` first, or, in a tool episode, the episode's token budget
    or the model's positions (exactly one of finished / truncated)."""
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
    attention: torch.Tensor | None = None
    """(N, T) bool, the ATTENTION mask of the completion: True = a real token the model sees (what
    it generated and, in a multi-turn episode, a tool's output, which is seen but never trained:
    attention True, ``mask`` False). None: the same as ``mask`` (a single-turn rollout)."""
    episodes: list[dict] | None = None
    """N records of multi-turn episodes (`rollout/transcripts.py`, `EpisodeRow.record`: turns, tool calls, failures, parse
    errors, observation tokens, infra error, the transcript with the model's and the tools' spans);
    ``texts`` then holds each row's last assistant turn. None: single-turn rows."""

    @property
    def completion_attention_mask(self) -> torch.Tensor:
        """(N, T) bool: ``attention``, or ``mask`` when the two are the same (single turn)."""
        return self.mask if self.attention is None else self.attention

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) long: number of real completion tokens (attended: generated, and tool output in an episode)."""
        return self.completion_attention_mask.sum(-1)

    def forward_inputs(self) -> dict[str, torch.Tensor]:
        """Inputs of a no-cache training forward pass over prompt + completion: ``model(**inputs)``.
        The completion's attention is ``completion_attention_mask`` (never the loss mask).

        Layout of a row: ``[left padding][prompt][completion][right padding]``, width P + T. Position
        ids count real tokens only, exactly as during generation, so the logits reproduce the sampler's.
        Completion token t is predicted by the logits at column ``P - 1 + t``:
        ``logits[:, P - 1 : P - 1 + T]`` (N, T, V) lines up with ``completion_ids`` and ``mask``.

        Returns:
            ``input_ids`` (N, P + T) long, ``attention_mask`` (N, P + T) long (1 = real token),
            ``position_ids`` (N, P + T) long.
        """
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_attention_mask, self.completion_attention_mask], dim=1).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def select(self, rows: torch.Tensor) -> Rollout:
        """The sub-rollout of ``rows`` (N',) long, whole groups in order (e.g. the rows one rank trains on).

        Every per-row field is indexed by ``rows``: (N', P), (N', T), (N',) and N' texts, with the
        widths P and T kept. ``prompt_index`` is renumbered ``0..N'/G - 1``, group j being rows
        ``j*G .. j*G + G - 1`` of the result; ``group_size``, ``sampling``, ``pad_token_id`` are kept.
        """
        G = self.group_size
        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[rows], prompt_attention_mask=self.prompt_attention_mask[rows],
            completion_ids=self.completion_ids[rows], mask=self.mask[rows],
            sampler_logprobs=self.sampler_logprobs[rows], logprobs=self.logprobs[rows],
            finished=self.finished[rows], truncated=self.truncated[rows],
            texts=[self.texts[i] for i in rows.tolist()],
            prompt_index=torch.arange(len(rows) // G, device=self.prompt_index.device).repeat_interleave(G),
            attention=None if self.attention is None else self.attention[rows],
            episodes=None if self.episodes is None else [self.episodes[i] for i in rows.tolist()],
        )

    @classmethod
    def concat(cls, parts: Sequence[tuple[Rollout, Sequence[int]]]) -> Rollout:
        """One rollout from chosen whole groups of several: ``parts`` is (rollout, group indices) pairs,
        e.g. DAPO dynamic sampling's refills. Rows come part after part, group after group.

        With M groups chosen in all: prompts re-padded on the left to the widest chosen P, completions
        (and their mask and log-probs) on the right to the widest chosen T, so fields are (M*G, P_max),
        (M*G, T_max), (M*G,). ``prompt_index`` is renumbered so group j is row block j;
        ``group_size``, ``sampling`` and ``pad_token_id`` are the first part's (a part that chooses no
        group still sets them when it comes first).
        """
        first = parts[0][0]
        G = first.group_size
        rows = [[g * G + i for g in groups for i in range(G)] for _, groups in parts]
        pick = [(rollout, torch.tensor(r, dtype=torch.long)) for (rollout, _), r in zip(parts, rows) if r]
        P = max(r.prompt_ids.shape[1] for r, _ in pick)
        T = max(r.completion_ids.shape[1] for r, _ in pick)
        total_groups = sum(len(groups) for _, groups in parts)
        return cls(
            prompt_ids=_pad([r.prompt_ids[i] for r, i in pick], P, first.pad_token_id, left=True),
            prompt_attention_mask=_pad([r.prompt_attention_mask[i] for r, i in pick], P, False, left=True),
            completion_ids=_pad([r.completion_ids[i] for r, i in pick], T, first.pad_token_id, left=False),
            mask=_pad([r.mask[i] for r, i in pick], T, False, left=False),
            sampler_logprobs=_pad([r.sampler_logprobs[i] for r, i in pick], T, 0.0, left=False),
            logprobs=_pad([r.logprobs[i] for r, i in pick], T, 0.0, left=False),
            finished=torch.cat([r.finished[i] for r, i in pick]),
            truncated=torch.cat([r.truncated[i] for r, i in pick]),
            texts=[r.texts[j] for r, i in pick for j in i.tolist()],
            prompt_index=torch.arange(total_groups, device=first.prompt_index.device).repeat_interleave(G),
            group_size=G,
            sampling=first.sampling,
            pad_token_id=first.pad_token_id,
            attention=None if all(r.attention is None for r, _ in pick)
            else _pad([r.completion_attention_mask[i] for r, i in pick], T, False, left=False),
            episodes=None if all(r.episodes is None for r, _ in pick)
            else [r.episodes[j] if r.episodes is not None else None for r, i in pick for j in i.tolist()],
        )

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor field on ``device``; shapes, dtypes, texts and settings
        unchanged (a tensor already there is the same object)."""
        moved = {field.name: getattr(self, field.name).to(device) for field in dataclasses.fields(self)
                 if isinstance(getattr(self, field.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def _pad(tensors: list[torch.Tensor], width: int, value, left: bool) -> torch.Tensor:
    """Concatenate (n_i, w_i) tensors into (sum n_i, width), filling with ``value`` on the left or right."""
    padded = []
    for tensor in tensors:
        fill = tensor.new_full((tensor.shape[0], width - tensor.shape[1]), value)
        padded.append(torch.cat([fill, tensor] if left else [tensor, fill], dim=1))
    return torch.cat(padded)
