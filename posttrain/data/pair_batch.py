"""A batch of preference pairs as the loss link reads it: the chosen and rejected rows tokenised with
the canonical masks and padded to one length (one (2N, L) forward covers both sides), plus the
per-row inputs a family's step reads (the precomputed reference's sums, KTO's labels, a reward
model's margins). Reading and validating pair files is `data/preference.py`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.tokenize import (
    TokenizedBatch,
    TruncationCounts,
    TruncationPolicy,
    apply_truncation,
    collate_token_ids,
    encode_prompt,
    encode_response,
)
from posttrain.errors import UserError


@dataclass
class PreferenceBatch:
    """Chosen and rejected rows for the same prompts, padded to the same length L, so
    `torch.cat([batch.chosen.input_ids, batch.rejected.input_ids])` is one (2N, L) forward."""

    chosen: TokenizedBatch
    rejected: TokenizedBatch
    kept: list[int]
    counts: TruncationCounts
    reference: torch.Tensor | None = None
    """(M, 2) the reference's summed log-probs of each row's two sides, precomputed (`loss.reference:
    precomputed`, or zeros for an objective without a reference); None: the step forwards the live reference."""
    desirable: torch.Tensor | None = None
    """(M,) bool, each unpaired row's label (True: desirable); None for pairs."""
    margins: torch.Tensor | None = None
    """(M,) each pair's margin (a reward model's `loss.margin`); None: no margin."""

    def to(self, device: torch.device | str) -> PreferenceBatch:
        """The same pairs with both sides' tensors (and the per-row reference, labels and margins) on `device`."""
        return dataclasses.replace(self, chosen=self.chosen.to(device), rejected=self.rejected.to(device),
                                   reference=None if self.reference is None else self.reference.to(device),
                                   desirable=None if self.desirable is None else self.desirable.to(device),
                                   margins=None if self.margins is None else self.margins.to(device))


def tokenize_preference_pairs(
    tokenizer,
    pairs: Sequence[Any],
    *,
    truncation: TruncationPolicy | None = None,
    padding_side: str = "right",
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
) -> PreferenceBatch:
    """Tokenise pairs (rows with `prompt`, `chosen`, `rejected`: `data.preference.PreferencePair`)
    with the canonical masks (see `tokenize_prompt_response`). A pair is dropped
    whole when the policy drops its chosen or its rejected row; counts cover both rows."""
    truncation = truncation or TruncationPolicy()
    prompt_ids = [
        encode_prompt(tokenizer, p.prompt, system_prompt=system_prompt, use_chat_template=use_chat_template)
        for p in pairs
    ]
    sides = {}
    for name in ("chosen", "rejected"):
        responses = [encode_response(tokenizer, getattr(p, name)) for p in pairs]
        prompts, responses, kept, counts = apply_truncation(prompt_ids, responses, truncation)
        sides[name] = (dict(zip(kept, zip(prompts, responses))), counts)
    kept = [i for i in range(len(pairs)) if i in sides["chosen"][0] and i in sides["rejected"][0]]
    if not kept:
        raise UserError(f"all {len(pairs)} preference pairs were dropped by the truncation policy {truncation}")
    rows = [sides["chosen"][0][i] for i in kept] + [sides["rejected"][0][i] for i in kept]
    both = collate_token_ids(
        [p for p, _ in rows], [r for _, r in rows], pad_token_id=tokenizer.pad_token_id, padding_side=padding_side
    )
    chosen_counts, rejected_counts = sides["chosen"][1], sides["rejected"][1]
    counts = TruncationCounts(
        prompts_truncated=chosen_counts.prompts_truncated,
        responses_truncated=chosen_counts.responses_truncated + rejected_counts.responses_truncated,
        dropped=len(pairs) - len(kept),
    )
    n = len(kept)
    halves = [
        TokenizedBatch(
            both.input_ids[part], both.attention_mask[part], both.mask[part],
            both.prompt_lengths[part], both.response_lengths[part], kept=list(kept), counts=counts,
        )
        for part in (slice(0, n), slice(n, 2 * n))
    ]
    return PreferenceBatch(chosen=halves[0], rejected=halves[1], kept=kept, counts=counts)
