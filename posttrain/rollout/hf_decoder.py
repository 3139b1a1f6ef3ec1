"""The generic decoder: any Hugging Face causal LM, driven through its own forward and KV cache.

It is the fallback for architectures the fast decoder does not know (and for PEFT-wrapped models),
and the independent reference the fast decoder is tested against.

A decoder holds the KV cache of the rows still being generated. The engine calls, in order:
``prefill`` (the B distinct prompts, once), ``select`` (expand each prompt's cache to its G rows,
later drop finished rows), then ``decode`` once per new token. It has no ``export`` / ``resume``:
the turns of an episode re-prefill their whole context on it (``engine.Session`` falls back).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


class HFDecoder:
    """Decoding through ``model.forward`` with a ``DynamicCache`` (left-padded rows)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes kwargs on
        parameters = inspect.signature(inner.forward).parameters
        self.accepts_logits_to_keep = "logits_to_keep" in parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5
        self.cache = None
        self.attention_mask = None  # (n, S) long, 1 = real token
        self.positions = None  # (n,) long, position id of the next token

    def _forward(self, input_ids, attention_mask, position_ids):
        kwargs = {"logits_to_keep": 1} if self.accepts_logits_to_keep else {}
        kwargs[self.cache_argument] = self.cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **kwargs)
        return out.logits[:, -1].float()  # (n, V)

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, capacity: int,
                max_rows: int = 0) -> torch.Tensor:
        """Run the prompts through the model and keep their KV cache.

        Args:
            prompt_ids: (B, P) long, left-padded. prompt_mask: (B, P) bool, True = real token.
            capacity: total length P + max_new_tokens; max_rows: rows after ``select`` (B * G).
                Both unused here: the cache grows as needed.

        Returns:
            (B, V) float32 logits for each prompt's next token.
        """
        self.cache = DynamicCache(config=self.model.config)
        self.attention_mask = prompt_mask.long()
        position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        self.positions = position_ids[:, -1] + 1
        return self._forward(prompt_ids, self.attention_mask, position_ids)

    def select(self, rows: torch.Tensor) -> None:
        """Keep (and reorder, or repeat) cache rows: new row i is old row ``rows[i]``. rows: (n,) long."""
        rows = rows.to(self.attention_mask.device)
        self.cache.reorder_cache(rows)
        self.attention_mask = self.attention_mask.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row and return the next-token logits.

        Args:
            tokens: (n,) long, the token each current row just sampled.

        Returns:
            (n, V) float32 logits.
        """
        ones = torch.ones(tokens.shape[0], 1, dtype=self.attention_mask.dtype, device=tokens.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        logits = self._forward(tokens.unsqueeze(1), self.attention_mask, self.positions.unsqueeze(1))
        self.positions = self.positions + 1
        return logits
