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

`PackedPairs` is the layout of preference pairs: each pair's common prefix once, then the chosen and
the rejected answer, each seeing the prefix and itself (the reward model's `packed_pair_rewards`).
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


def real_tokens_first(ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, width) `ids` with each row's real tokens moved to columns 0 .. length - 1 (either padding
    side in, zeros after), and the (n,) lengths."""
    real = attention_mask.bool()
    rows, columns = real.nonzero(as_tuple=True)
    laid = ids.new_zeros(ids.shape[0], width)
    laid[rows, real.long().cumsum(-1)[rows, columns] - 1] = ids[rows, columns]
    return laid, real.sum(-1)


def common_prefix_lengths(ids: torch.Tensor, attention_mask: torch.Tensor, other_ids: torch.Tensor,
                          other_attention_mask: torch.Tensor) -> torch.Tensor:
    """(n,) how many leading real tokens row i of (n, L) `ids` shares with row i of (n, L')
    `other_ids` (either padding side), capped so that both rows keep at least one token of their
    own: the pooled EOS is each row's own. A causal model's hidden states over that prefix are the
    same in both rows, so a pair's chosen and rejected rows need it computed once.
    Example: [q, q, a, b, EOS] and [q, q, a, c, d, EOS] -> 3; [q, EOS] and [q, EOS, x, EOS] -> 1."""
    width = max(ids.shape[1], other_ids.shape[1])
    (first, lengths), (second, other_lengths) = real_tokens_first(ids, attention_mask, width), \
        real_tokens_first(other_ids, other_attention_mask, width)
    both = torch.arange(width, device=ids.device) < torch.minimum(lengths, other_lengths)[:, None]  # (n, width)
    shared = ((first == second) & both).long().cumprod(-1).sum(-1)
    return torch.minimum(shared, torch.minimum(lengths, other_lengths) - 1).clamp(min=0)


@dataclass
class PackedPairs:
    """n preference pairs (a chosen and a rejected row each) packed in one row of R positions. Pair
    i is laid as

        [common prefix (c_i tokens) | chosen's own tokens | rejected's own tokens]

    the common prefix being the prompt and the answer tokens both rows begin with
    (`common_prefix_lengths`), with position ids as in the separate rows (the rejected tokens'
    count on from c_i) and a mask in which each token sees the prefix and the earlier tokens of its
    own answer, never the other answer's. A row's column j (its real tokens counted from 0, either
    padding side in) sits at `at(side, i, j)` of the packed row."""

    ids: torch.Tensor
    """(R,) token ids."""
    positions: torch.Tensor
    """(R,) position ids."""
    layout: PackedLayout
    starts: torch.Tensor
    """(n,) each pair's first packed position."""
    shared: torch.Tensor
    """(n,) c_i, the common prefix's length."""
    chosen_lengths: torch.Tensor
    """(n,) real tokens of each chosen row (its prefix included)."""
    rejected_lengths: torch.Tensor
    """(n,) real tokens of each rejected row (its prefix included)."""

    @classmethod
    def of(cls, chosen_ids: torch.Tensor, chosen_mask: torch.Tensor, rejected_ids: torch.Tensor,
           rejected_mask: torch.Tensor) -> "PackedPairs":
        """The packing of n pairs: (n, L) ids and attention masks a side (either padding side)."""
        n, width = chosen_ids.shape[0], max(chosen_ids.shape[1], rejected_ids.shape[1])
        chosen, chosen_lengths = real_tokens_first(chosen_ids, chosen_mask, width)
        rejected, rejected_lengths = real_tokens_first(rejected_ids, rejected_mask, width)
        shared = common_prefix_lengths(chosen_ids, chosen_mask, rejected_ids, rejected_mask)  # (n,)
        chosen_end, end = chosen_lengths[:, None], (chosen_lengths + rejected_lengths - shared)[:, None]  # (n, 1)
        columns = torch.arange(int(end.max()), device=chosen_ids.device)[None, :]  # (1, W)
        source = columns - chosen_end + shared[:, None]  # (n, W): the rejected row's column of a rejected token
        segment = (columns >= shared[:, None]).long() + (columns >= chosen_end).long() + (columns >= end).long()  # 0 prefix, 1 chosen, 2 rejected, 3 past the pair
        ids = torch.where(segment < 2, chosen.gather(1, columns.clamp(max=width - 1).expand(n, -1)),
                          rejected.gather(1, source.clamp(0, width - 1)))  # (n, W); past the pair is dropped below
        positions = torch.where(segment == 2, source, columns)  # (n, W)
        query, key = segment[:, :, None], segment[:, None, :]  # (n, W, 1), (n, 1, W)
        causal = columns[0][:, None] >= columns[0][None, :]  # (W, W)
        layout = PackedLayout.of(end[:, 0], causal & ((key == 0) | (key == query)))  # the prefix and its own answer
        real = layout.scatter  # (R,)
        return cls(ids.flatten()[real], positions.flatten()[real], layout, end[:, 0].cumsum(0) - end[:, 0], shared,
                   chosen_lengths, rejected_lengths)

    def at(self, side: int, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """(K,) packed positions of column `columns[k]` (real tokens counted from 0) of pair
        `rows[k]`'s chosen row (`side` 0) or rejected row (1): a rejected token past the common
        prefix sits after the chosen answer."""
        within = columns
        if side == 1:
            shared = self.shared[rows]
            within = torch.where(columns < shared, columns, columns - shared + self.chosen_lengths[rows])
        return self.starts[rows] + within


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
