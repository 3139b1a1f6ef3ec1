"""Sequences packed into one row without padding: every linear layer of the decoder runs on the real
tokens only, and attention runs on a padded view of them, one row a sequence, under each sequence's
own 4D mask.

    layout = PackedLayout.of(lengths, masks)          # n sequences of lengths[i] <= W tokens
    if use_packed_attention(decoder):                 # its attention under `sdpa`: now this module's
        hidden = decoder(input_ids=ids, position_ids=positions, attention_mask=layout.masks,
                         packed_layout=layout).last_hidden_state   # (1, R, H), R = lengths.sum()

A padded (n, W) batch spends every weight's matmuls on its padding too; a plain packed row would
make attention quadratic in R instead of in each W. Here the queries, keys and values of the R real
positions are gathered into (n, heads, W, head_dim) for one `scaled_dot_product_attention` call
(transformers' own `sdpa` function, its GQA handling included) and the output gathered back to R.
The padded slots hold copies of position 0, which the mask hides from every real query; a padded
query sees only itself (no empty softmax row) and its output is dropped, so its gradient is zero.

The layout travels as a forward keyword, as transformers' own packed flash-attention does with its
sequence offsets; the attention function is looked up by name on every call, gradient
checkpointing's recomputation in backward included. So `use_packed_attention` sets the decoder's
implementation to this module's once, for good: registered for attention and for mask creation,
it is exactly `sdpa` for every call without a `packed_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "posttrain_packed"


@dataclass
class PackedLayout:
    """Where n packed sequences sit in a row of R real positions and in the (n, W) padded view."""

    gather: torch.Tensor
    """(n * W,) long: the packed position each padded slot reads (0 for a padding slot)."""
    scatter: torch.Tensor
    """(R,) long: the padded slot (i * W + column) of each packed position."""
    masks: torch.Tensor
    """(n, 1, W, W) bool: which keys each query of sequence i sees (True: attend)."""

    @classmethod
    def of(cls, lengths: torch.Tensor, masks: torch.Tensor) -> "PackedLayout":
        """The layout of n sequences of (n,) `lengths`, laid one after another in one row, under
        (n, W, W) bool `masks` (row i's keys seen by each query; columns >= lengths[i] are padding and
        may hold anything: they are hidden here, and each padding query sees itself only)."""
        W = masks.shape[-1]
        columns = torch.arange(W, device=lengths.device)
        real = columns[None, :] < lengths[:, None]  # (n, W)
        starts = lengths.cumsum(0) - lengths  # (n,)
        gather = torch.where(real, starts[:, None] + columns[None, :], 0).reshape(-1)
        scatter = real.reshape(-1).nonzero().squeeze(-1)
        seen = masks.bool() & real[:, None, :] & real[:, :, None]
        seen = seen | (~real[:, :, None] & torch.eye(W, dtype=torch.bool, device=masks.device))
        return cls(gather, scatter, seen[:, None])


def _padded(states: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """(1, heads, R, d) -> (n, heads, W, d)."""
    n, W = layout.masks.shape[0], layout.masks.shape[-1]
    return states[0].transpose(0, 1).index_select(0, layout.gather).unflatten(0, (n, W)).transpose(1, 2)


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, packed_layout: PackedLayout | None = None, **kwargs):
    """transformers' attention-function signature: (1, heads, R, d) query, (1, kv_heads, R, d) key and
    value of a packed row -> ((1, R, heads, d) output, None). Without `packed_layout`, plain `sdpa`."""
    if packed_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    output, _ = sdpa_attention_forward(module, _padded(query, packed_layout), _padded(key, packed_layout),
                                       _padded(value, packed_layout), packed_layout.masks, is_causal=False, **kwargs)  # (n, W, heads, d)
    return output.flatten(0, 1).index_select(0, packed_layout.scatter)[None], None


AttentionInterface.register(NAME, packed_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_packed_attention(decoder: torch.nn.Module) -> bool:
    """Whether `decoder` (a transformers model) can take a `packed_layout`: True when its attention
    is `sdpa`, which this switches to `packed_sdpa` (the same function for every other call), or is
    already that; False for any other implementation (eager, flash, flex: nothing changed)."""
    config = getattr(decoder, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == "sdpa":
        config._attn_implementation = NAME
    return implementation in ("sdpa", NAME)
