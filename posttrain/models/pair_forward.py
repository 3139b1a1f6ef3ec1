"""Summed response log-probs of preference pairs: the chosen and rejected rows of a batch through a
model in one forward, each pair's prompt computed once for both responses (a shared KV cache).

Built on `posttrain.models.forward` (the one model-forward layer): `response_sums` is the per-row
pass, `shared_prefix_logits` the shared-prompt one. Checked against the plain forward (sums and
parameter gradients, both paddings, LoRA) in tests/test_dpo.py. `precomputed_reference` is the
reference's log-probs of every pair of a run, computed once and cached in a file.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from posttrain.data import PreferenceBatch, PreferencePair, position_ids_from_attention_mask
from posttrain.atomic import write_atomically
from posttrain.distributed import World, full_weights
from posttrain.errors import UserError
from posttrain.models.adapters import ReferenceModel
from posttrain.models.forward import response_head_logprobs, response_sums, scaled_logits, shared_prefix_logits
from posttrain.models.packing import PackedPairs, real_tokens_first, use_packed_attention

logger = logging.getLogger(__name__)


@dataclass
class PairLogprobs:
    """Summed response log-probs of M pairs (the policy's, or the reference's when detached)."""

    chosen: torch.Tensor
    """(M,) sum of the chosen response's token log-probs (prompt, padding masked; ending EOS counted)."""
    rejected: torch.Tensor
    """(M,) the same for the rejected response."""
    chosen_lengths: torch.Tensor
    """(M,) chosen response tokens (mask sums)."""
    rejected_lengths: torch.Tensor
    """(M,) rejected response tokens."""


def pair_logprobs(model, batch: PreferenceBatch, rows: slice = slice(None), full_forward: bool = False) -> PairLogprobs:
    """Chosen and rejected rows of `batch` through `model` in ONE forward of (2n, L).

    Position ids count real tokens only, so left- and right-padded batches give the same sums.
    `model` may be a `ReferenceModel` (then no gradient is taken, adapters off for a LoRA base).
    Each pair's common prefix is computed once for both rows where the model allows
    (`shared_pair_sums`: the pairs packed in one row, else the prompt through a shared KV cache).
    `full_forward`: one plain `model(...)` call (FSDP2 needs the model's own forward to gather its
    root's shards) instead of the decoder + LM head on the response positions only.
    """
    chosen, rejected = batch.chosen, batch.rejected
    input_ids = torch.cat([chosen.input_ids[rows], rejected.input_ids[rows]])  # (2n, L)
    attention_mask = torch.cat([chosen.attention_mask[rows], rejected.attention_mask[rows]])
    mask = torch.cat([chosen.mask[rows], rejected.mask[rows]])
    if isinstance(model, ReferenceModel):
        with torch.no_grad(), (model.model.disable_adapter() if model.adapter_disabled else contextlib.nullcontext()):
            was_training = model.model.training
            model.model.eval()
            result = None if full_forward else shared_pair_sums(model.model, input_ids, attention_mask, mask)
            sums, lengths = result or response_sums(model.model, input_ids, attention_mask, mask)
            model.model.train(was_training)
    else:
        result = None if full_forward else shared_pair_sums(model, input_ids, attention_mask, mask)
        sums, lengths = result or response_sums(model, input_ids, attention_mask, mask, full_forward)
    n = input_ids.shape[0] // 2
    return PairLogprobs(sums[:n], sums[n:], lengths[:n], lengths[n:])


def shared_pair_sums(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`response_sums` of (2n, L) rows, n chosen then n rejected, with each pair's common prefix
    computed once: `packed_pair_sums` where the model allows, else `shared_prompt_sums`; None when
    neither applies (the caller runs `response_sums`)."""
    n = input_ids.shape[0] // 2
    packed = packed_pair_sums(model, input_ids[:n], attention_mask[:n], mask[:n], input_ids[n:], attention_mask[n:], mask[n:])
    return packed if packed is not None else shared_prompt_sums(model, input_ids, attention_mask, mask)


def packed_pair_sums(model, chosen_ids: torch.Tensor, chosen_attention: torch.Tensor, chosen_mask: torch.Tensor,
                     rejected_ids: torch.Tensor, rejected_attention: torch.Tensor,
                     rejected_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(2n,) summed response log-probs (chosen rows, then rejected) and (2n,) response lengths of n
    pairs ((n, L) ids, attention masks and response masks a side, either padding side), in one
    decoder pass over the pairs packed in one row without padding (`models.packing.PackedPairs`:
    each pair's common prefix, the prompt and the answer tokens both begin with, once; every
    matmul on real tokens; attention per pair). The LM head then runs on the positions that predict
    a response token, as in `response_sums` (position j - 1 predicts token j; a response token in
    the common prefix counts in both sums). Equal to `response_sums` in value and gradient (tested).
    None for a model that is not a Llama-type decoder under SDPA with an unscaled LM head."""
    from posttrain.models.forward import SUPPORTED_MODEL_TYPES  # read when called (the tests narrow it)

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = getattr(model, "config", None)
    if (decoder is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES or scaled_logits(model)
            or model.get_output_embeddings() is None or not use_packed_attention(decoder)):
        return None
    pairs = PackedPairs.of(chosen_ids, chosen_attention, rejected_ids, rejected_attention)
    hidden = decoder(input_ids=pairs.ids[None], attention_mask=pairs.layout.masks, position_ids=pairs.positions[None],
                     packed_layout=pairs.layout).last_hidden_state[0]  # (R, H)
    width = max(chosen_ids.shape[1], rejected_ids.shape[1])
    predictors, targets, owners, lengths = [], [], [], []
    for side, (ids, attention, mask) in enumerate(((chosen_ids, chosen_attention, chosen_mask),
                                                    (rejected_ids, rejected_attention, rejected_mask))):
        laid_ids, _ = real_tokens_first(ids, attention, width)  # (n, width)
        laid_mask, _ = real_tokens_first(mask.long(), attention, width)
        scored = laid_mask.bool()
        scored[:, 0] = False  # nothing predicts a row's first token (as `response_sums`' shifted mask)
        rows, columns = scored.nonzero(as_tuple=True)
        predictors.append(pairs.at(side, rows, columns - 1))
        targets.append(laid_ids[rows, columns])
        owners.append(rows + side * ids.shape[0])
        lengths.append(scored.sum(-1))
    logprobs = response_head_logprobs(model, hidden[torch.cat(predictors)], torch.cat(targets))  # (K,)
    sums = torch.zeros(2 * chosen_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, torch.cat(owners), logprobs)
    return sums, torch.cat(lengths)


def shared_prompt_sums(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`response_sums` with each distinct prompt computed once: the chosen and rejected rows of a
    pair share theirs, so its KV cache serves both responses (what this saves is measured in
    bench/RESULTS.md).

    The (N, L) rows (left- or right-padded) are re-laid as [left-padded prompt | right-padded
    response], width P + T (longest prompt, longest response): the rollout layout of
    `shared_prefix_logits`, whose hidden states at position t of a row predict its response token t.
    The LM head then runs on the K response positions only. Returns None (the caller runs
    `response_sums`) for a model `shared_prefix_logits` does not support, a row without a prompt
    token (nothing predicts its first response token) or a batch without response tokens.
    """
    real = attention_mask.bool()  # (N, L): prompt then response, contiguous, in every row
    prompt_lengths, response_lengths = (real & ~mask).sum(-1), mask.sum(-1)  # (N,)
    if int(prompt_lengths.min()) < 1 or int(response_lengths.max()) < 1:
        return None
    P, T = int(prompt_lengths.max()), int(response_lengths.max())
    rows, columns = real.nonzero(as_tuple=True)
    # The j-th real token of row i goes to column P - prompt_length_i + j: its prompt ends at P - 1.
    targets = P - prompt_lengths[rows] + (real.long().cumsum(-1) - 1)[rows, columns]
    laid_ids = input_ids.new_zeros(input_ids.shape[0], P + T)
    laid_ids[rows, targets] = input_ids[rows, columns]
    laid_mask = torch.zeros_like(laid_ids)
    laid_mask[rows, targets] = 1
    inputs = {"input_ids": laid_ids, "attention_mask": laid_mask, "position_ids": position_ids_from_attention_mask(laid_mask)}
    hidden = shared_prefix_logits(model, inputs, slice(None), P, T, hidden_states=True)  # (N, T, H)
    if hidden is None:
        return None
    response_mask = laid_mask[:, P:].bool()  # (N, T)
    rows, columns = response_mask.nonzero(as_tuple=True)
    logprobs = response_head_logprobs(model, hidden[rows, columns], laid_ids[rows, P + columns])  # (K,)
    sums = torch.zeros(input_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)
    return sums, response_lengths


def reference_sums(reference: ReferenceModel | None, batch: PreferenceBatch, rows, forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) chosen and (n,) rejected summed log-probs of the reference on `rows` of `batch`: the
    batch's precomputed (M, 2) `reference` columns when it has them, else a forward of `reference`
    under the policy's precision (`forward`: the policy's `TrainingForward`, for its placement and
    options) through the same LM-head path as the policy's, so policy == reference gives rewards of
    exactly 0."""
    if batch.reference is not None:
        return batch.reference[rows, 0], batch.reference[rows, 1]
    with forward.placement.autocast():
        sums = pair_logprobs(reference, batch, rows, full_forward=forward.options.get("full_forward", False))
    return sums.chosen, sums.rejected


@torch.no_grad()
def reference_logprobs(model, batches: Iterable[PreferenceBatch]) -> torch.Tensor:
    """(M, 2) summed log-probs [chosen, rejected] of every pair of `batches`, in order, under
    `model` (no grad, eval mode; a precomputed reference)."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    pieces = []
    for batch in batches:
        sums = pair_logprobs(model, batch)
        pieces.append(torch.stack([sums.chosen, sums.rejected], dim=1))
    if hasattr(model, "train"):
        model.train(was_training)
    return torch.cat(pieces)


def precomputed_reference(path: Path, model, pairs: dict[str, list[PreferencePair]], encode: Callable[[list[PreferencePair]], PreferenceBatch],
                          micro_batch_size: int, fingerprint: str, world: World | None = None) -> dict[str, torch.Tensor]:
    """A (M, 2) `reference_logprobs` table of each named list of `pairs` (tokenised by `encode`,
    `micro_batch_size` pairs at a time), plus `fingerprint`, cached atomically at `path`. If `path`
    exists (a resumed run) it is read instead and must carry the same fingerprint (else UserError).
    Under torchrun each rank computes its block of each list and every rank gets the whole table;
    rank 0 writes the file. `model` may be a `ReferenceModel` (the LoRA base); a sharded model is
    made whole for the pass."""
    world = world or World()
    if path.is_file():
        cache = torch.load(path, weights_only=True, map_location="cpu")
        if cache.get("fingerprint") == fingerprint:
            return cache
        raise UserError(f"{path}: cached reference log-probs belong to other pairs or settings; delete it to recompute")
    root = model.model if isinstance(model, ReferenceModel) else model

    def table(rows: list[PreferencePair]) -> torch.Tensor:
        if not rows:  # the same on every rank: no collective
            return torch.zeros(0, 2)
        mine = world.block(len(rows))
        block, m = rows[mine.start : mine.stop], micro_batch_size
        with full_weights(root):
            part = reference_logprobs(model, (encode(block[s : s + m]) for s in range(0, len(block), m))) if block else torch.zeros(0, 2)
        return torch.cat(world.gather(part.cpu()))  # the table lives on the CPU (the cache file too)

    cache = {name: table(rows) for name, rows in pairs.items()}
    cache["fingerprint"] = fingerprint
    if not world.main:
        return cache
    write_atomically(path, lambda handle: torch.save(cache, handle))
    logger.info("reference log-probs of %s pairs cached in %s", " + ".join(str(len(rows)) for rows in pairs.values()), path)
    return cache
