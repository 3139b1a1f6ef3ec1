"""The DPO recipe's pairs and what is said about them: loading and validating the pairs, the held-out
split (by prompt), the provenance sidecar of `posttrain pairs` files, tokenising, summed response
log-probs of a batch of pairs under a model (each pair's prompt once, then both responses on its
KV cache; `full_forward` for one plain call), the precomputed reference
cache, the held-out task, and the run card. `posttrain/recipes/dpo.py` is the recipe that uses them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.config import to_dict
from posttrain.data import (
    Example, PreferenceBatch, PreferencePair, load_preference_file, position_ids_from_attention_mask, tokenize_preference_pairs,
)
from posttrain.data.examples import derived_seed
from posttrain.distributed import World, full_weights
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import DEFAULT_CHECKERS, heldout_split
from posttrain.models import ReferenceModel, make_reference
from posttrain.models.forward import response_head_logprobs, response_sums, shared_prefix_logits
from posttrain.runs import RunDirectory, new_card

if TYPE_CHECKING:  # the recipe's config; dpo.py imports this module
    from posttrain.recipes.dpo import Config, Data

logger = logging.getLogger(__name__)

OBJECTIVES = {
    "sigmoid": "DPO sigmoid loss (arXiv:2305.18290 eq. 7)",
    "conservative": "conservative DPO, label smoothing (Mitchell 2023)",
    "robust": "robust DPO, unbiased under label noise (arXiv:2403.00409 eq. 8)",
    "ipo": "IPO squared loss (arXiv:2310.12036 eq. 17) on summed log-ratios",
    "hinge": "hinge / SLiC (arXiv:2305.10425 eq. 3)",
    "length_normalized": "length-normalised DPO: sigmoid loss on per-token MEAN log-probs (a different objective)",
}
REFERENCE_CACHE = "reference_logprobs.pt"


@dataclass
class PairLogprobs:
    """Summed response log-probs of P pairs (the policy's, or the reference's when detached)."""

    chosen: torch.Tensor
    """(P,) sum of the chosen response's token log-probs (prompt, padding masked; ending EOS counted)."""
    rejected: torch.Tensor
    """(P,) the same for the rejected response."""
    chosen_lengths: torch.Tensor
    """(P,) chosen response tokens (mask sums)."""
    rejected_lengths: torch.Tensor
    """(P,) rejected response tokens."""


def pair_logprobs(model, batch: PreferenceBatch, rows: slice = slice(None), full_forward: bool = False) -> PairLogprobs:
    """Chosen and rejected rows of `batch` through `model` in ONE forward of (2n, L).

    Position ids count real tokens only, so left- and right-padded batches give the same sums.
    `model` may be a `ReferenceModel` (then no gradient is taken, adapters off for a LoRA base).
    Each pair's prompt is computed once for both rows (`shared_prompt_sums`) where the model allows.
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
            result = None if full_forward else shared_prompt_sums(model.model, input_ids, attention_mask, mask)
            sums, lengths = result or response_sums(model.model, input_ids, attention_mask, mask)
            model.model.train(was_training)
    else:
        result = None if full_forward else shared_prompt_sums(model, input_ids, attention_mask, mask)
        sums, lengths = result or response_sums(model, input_ids, attention_mask, mask, full_forward)
    n = input_ids.shape[0] // 2
    return PairLogprobs(sums[:n], sums[n:], lengths[:n], lengths[n:])


def shared_prompt_sums(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`response_sums` with each distinct prompt computed once: the chosen and rejected rows of a
    pair share theirs (~1/3 of a row's tokens in bench/dpo.py), so its KV cache serves both responses.

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


def tokenize(tokenizer, pairs: list[PreferencePair], data: Data) -> PreferenceBatch:
    """`pairs` as a padded batch with canonical masks, under `data`'s truncation and prompt settings."""
    return tokenize_preference_pairs(
        tokenizer, pairs, truncation=data.truncation(), system_prompt=data.system_prompt, use_chat_template=data.use_chat_template,
    )


@torch.no_grad()
def reference_logprobs(model, tokenizer, pairs: list[PreferencePair], data: Data, micro_batch_size: int) -> torch.Tensor:
    """(P, 2) summed log-probs [chosen, rejected] of every pair under `model` (no grad, eval mode)."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    pieces = []
    for start in range(0, len(pairs), micro_batch_size):
        sums = pair_logprobs(model, tokenize(tokenizer, pairs[start : start + micro_batch_size], data))
        pieces.append(torch.stack([sums.chosen, sums.rejected], dim=1))
    if hasattr(model, "train"):
        model.train(was_training)
    return torch.cat(pieces)



def provenance_of(pairs_path: str) -> dict[str, Any] | None:
    """The sidecar `posttrain pairs` wrote next to a pairs file (None if there is none), with
    `file_matches` telling whether the file is still the one it describes."""
    from posttrain.recipes.pairs import file_sha256, provenance_path

    sidecar = provenance_path(pairs_path)
    if not sidecar.is_file():
        return None
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{sidecar}: not valid JSON (the provenance of {pairs_path}); fix or delete it") from None
    meta["file_matches"] = meta.get("sha256") == file_sha256(pairs_path)
    if not meta["file_matches"]:
        logger.warning("%s: the pairs file changed after %s was written; its provenance may not apply", pairs_path, sidecar)
    return meta


def prompt_key(prompt) -> str:
    """The key that identifies a pair's prompt (a string or a message list) across files and tasks."""
    return (Example("", messages=prompt) if isinstance(prompt, list) else Example("", prompt=prompt)).prompt_key()


def split_pairs(pairs: list[PreferencePair], count: int, seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held_out): whole prompts go to the held-out side (seeded order) until it has `count` pairs."""
    keys = sorted({prompt_key(p.prompt) for p in pairs}, key=lambda k: derived_seed(seed, "heldout-pairs", k))
    held_keys, held = set(), 0
    sizes = {}
    for pair in pairs:
        sizes[prompt_key(pair.prompt)] = sizes.get(prompt_key(pair.prompt), 0) + 1
    for key in keys:
        if held >= count:
            break
        held_keys.add(key)
        held += sizes[key]
    train = [p for p in pairs if prompt_key(p.prompt) not in held_keys]
    if not train:
        raise UserError(f"data.heldout_pairs={count} leaves no training pairs out of {len(pairs)}; lower it or give data.heldout_file")
    return train, [p for p in pairs if prompt_key(p.prompt) in held_keys]


def load_pairs(tokenizer, config: Config) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, Any]]:
    """Step 0a: validated training and held-out pairs, with the truncation policy applied once to
    all of them (so a step never drops a pair) and the counts for the run card."""
    data = config.data
    checks = dict(system_prompt=data.system_prompt, tokenizer=tokenizer, use_chat_template=data.use_chat_template,
                  max_prompt_tokens=data.max_prompt_tokens if data.prompt_truncation == "error" else None)
    loaded = load_preference_file(data.pairs, strict=data.strict, **checks)
    if data.heldout_file:
        train, held = loaded.pairs, load_preference_file(data.heldout_file, strict=data.strict, **checks).pairs
    elif data.heldout_pairs:
        train, held = split_pairs(loaded.pairs, data.heldout_pairs, config.seed)
    else:
        train, held = loaded.pairs, []
    stats = {"rows_bad": loaded.rows_bad}
    for name, pairs in (("train", train), ("heldout", held)):
        kept, counts = [], [0, 0, 0]
        for start in range(0, len(pairs), 256):
            batch = tokenize(tokenizer, pairs[start : start + 256], data)
            kept += [pairs[start + i] for i in batch.kept]
            counts = [a + b for a, b in zip(counts, (batch.counts.prompts_truncated, batch.counts.responses_truncated, batch.counts.dropped))]
        if name == "train":
            train = kept
        else:
            held = kept
        stats[name] = {"pairs": len(kept), "prompts_truncated": counts[0], "responses_truncated": counts[1], "dropped": counts[2]}
    return train, held, stats


def cached_reference(run_dir: RunDirectory, policy, tokenizer, train, held, config: Config, world: World | None = None) -> dict[str, torch.Tensor]:
    """Reference log-probs of every training and held-out pair, computed once by the initial policy
    (the LoRA base with adapters off) and cached atomically in the run directory; a resumed run
    reads the cache (its fingerprint must match the pairs). Under torchrun each rank computes its
    block of the pairs, every rank gets the whole table, rank 0 writes it."""
    world = world or World()
    fingerprint = hashlib.sha256(json.dumps(
        [[p.id, p.prompt, p.chosen, p.rejected] for p in train + held] + [to_dict(config.data), config.model], default=str,
    ).encode()).hexdigest()
    path = run_dir.path / REFERENCE_CACHE
    if path.is_file():
        cache = torch.load(path, weights_only=True)
        if cache.get("fingerprint") == fingerprint:
            return cache
        raise UserError(f"{path}: cached reference log-probs belong to other pairs or settings; delete it to recompute")
    model = make_reference(policy) if config.lora_rank else policy

    def table(pairs):
        mine = world.block(len(pairs))
        with full_weights(policy):
            part = reference_logprobs(model, tokenizer, pairs[mine.start:mine.stop], config.data, config.micro_batch_size) if len(mine) else torch.zeros(0, 2)
        return torch.cat(world.gather(part))

    cache = {"train": table(train), "heldout": table(held) if held else torch.zeros(0, 2), "fingerprint": fingerprint}
    if not world.main:
        return cache
    temporary = path.with_suffix(".tmp")
    torch.save(cache, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    logger.info("reference log-probs of %d + %d pairs cached in %s", len(train), len(held), path)
    return cache


def heldout_task(config: Config, provenance: dict | None):
    """The held-out task split for acceptance (None when the pairs come from no known task), and
    the spec it was built from."""
    acceptance, origin = config.acceptance, provenance or {}
    task = acceptance.task or origin.get("task")
    if task is None:
        return None, None
    spec = {
        "task": task,
        "options": acceptance.task_options if acceptance.task_options is not None else origin.get("task_options", {}),
        "eval_size": acceptance.eval_size or origin.get("eval_size") or 200,
        "split_seed": acceptance.split_seed if acceptance.split_seed is not None else origin.get("seed", config.seed),
    }
    held_out = heldout_split(task, spec["eval_size"], spec["split_seed"], spec["options"])
    spec["checker"] = acceptance.checker or DEFAULT_CHECKERS.get(held_out.reward_kind)
    return held_out, spec


def make_card(config: Config, train, held_pairs, data_stats, provenance, task_spec, reference) -> dict[str, Any]:
    """The run card: the four links and every loss setting."""
    card = new_card("dpo", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = {
        "source": f"offline: preference pairs from {config.data.pairs}", "train_pairs": len(train),
        "heldout_pairs": len(held_pairs),
        "heldout_pairs_from": config.data.heldout_file or f"split off the training file by prompt (seed {config.seed})",
        **data_stats, "truncation": {key: getattr(config.data, key) for key in ("max_prompt_tokens", "max_response_tokens", "prompt_truncation", "response_truncation")},
        "system_prompt": config.data.system_prompt, "batch_size": config.batch_size, "micro_batch_size": config.micro_batch_size,
    }
    if provenance:
        card["links"]["data"].update({"sampled_from": provenance.get("model"), "task": provenance.get("task"),
                                      "group_size": provenance.get("group_size"), "sampling": provenance.get("sampling")})
        card["links"]["reward"] = {
            "labels": f"labels came from verifier {provenance.get('verifier')} on samples of model {provenance.get('model')}",
            "verifier": provenance.get("verifier"), "verifier_settings": provenance.get("verifier_settings"),
            "correct_threshold": provenance.get("correct_threshold"), "pairs_seed": provenance.get("seed"),
            "provenance_file_matches": provenance["file_matches"],
        }
    else:
        card["links"]["reward"] = {"labels": f"as given in {config.data.pairs} (who labelled them is not recorded)"}
    loss = config.loss
    if reference is None:
        reference_text = "precomputed once at the start from the initial policy" + (" (LoRA base)" if config.lora_rank else "") + f", cached in {REFERENCE_CACHE}; no reference model in memory"
    elif reference.adapter_disabled:
        reference_text = "LoRA base (the policy with adapters disabled; no copy)"
    else:
        reference_text = "frozen copy of the initial policy"
    card["links"]["loss"] = {
        "objective": OBJECTIVES[loss.type], "type": loss.type, "beta": loss.beta, "label_smoothing": loss.label_smoothing,
        "sequence_logprob": "sum over response tokens (prompt and padding masked, the ending EOS counted)",
        "length_handling": "per-token mean log-probs (length-normalised objective)" if loss.type == "length_normalized" else "none: summed log-probs",
        "nll_weight": loss.nll_weight,
        "nll_term": "RPO: weight * token-mean NLL of the chosen responses (arXiv:2404.19733)" if loss.nll_weight else "off",
        "reference": reference_text, "reference_refresh_every": loss.reference_refresh_every,
        "reference_refresh": "TR-DPO hard update: the reference becomes the current policy (arXiv:2404.09656)" if loss.reference_refresh_every else "never",
        "forward": "chosen and rejected concatenated in one forward pass, each prompt computed once for both (a shared KV cache) where the model allows",
        "reduction": "mean over the batch's pairs",
        "optimizer": to_dict(config.optim),
    }
    card["links"]["acceptance"] = {
        "heldout_pairs": f"{len(held_pairs)} pairs: preference accuracy (chosen reward > rejected reward)",
        "heldout_task": (f"{task_spec['task']} held-out split ({task_spec['eval_size']} problems, split seed {task_spec['split_seed']}, "
                         "disjoint from the pairs' prompts)") if task_spec else "none (the pairs come from no known task)",
        "checker": task_spec["checker"] if task_spec else None, "displacement_threshold": config.acceptance.displacement_threshold,
        "alarm_window": config.acceptance.alarm_window,
    }
    labeller = (provenance or {}).get("verifier")
    if task_spec and labeller is not None:
        card["links"]["acceptance"]["checker_is_labeller"] = task_spec["checker"] == labeller
        if task_spec["checker"] == labeller:
            card["notes"].append(f"the held-out checker {labeller!r} is the verifier that labelled the pairs: "
                                 "held-out problems are new, but the checking logic is not independent")
    return card
