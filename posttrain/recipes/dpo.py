"""`posttrain dpo`: offline preference optimisation (DPO and its family) on a file of pairs.

The four links of a DPO run: data = a fixed file of (prompt, chosen, rejected) pairs (offline);
reward = whoever labelled the pairs (recorded: for `posttrain pairs` files, "verifier V on samples
of model M"); loss = a pairwise loss on summed response log-probs against a frozen reference
(DPO, arXiv:2305.18290 eq. 7, or a named variant); acceptance = held-out pairs (preference accuracy)
and, when the pairs come from a task, held-out task accuracy with a separately configured checker.

Each step: 1. the next batch of pairs, 2. reference log-probs (live forward, or the cache),
3. policy log-probs of chosen and rejected in ONE concatenated forward, loss, backward (micro-batches
share the batch's normalisers), 4. log, alarm, refresh the reference, evaluate, checkpoint.

    posttrain dpo --config presets/tiny-dpo.yaml --data.pairs pairs.jsonl --max-steps 50
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from posttrain.algorithms import PREFERENCE_LOSSES, length_normalized_dpo_loss, response_logprobs, sequence_logprobs, token_logprobs
from posttrain.config import save_yaml, to_dict
from posttrain.data import (
    Example, PreferenceBatch, PreferencePair, TruncationPolicy, load_preference_file,
    position_ids_from_attention_mask, tokenize_preference_pairs,
)
from posttrain.data.examples import derived_seed
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import DEFAULT_CHECKERS, evaluate_task, heldout_split
from posttrain.models import LoraSettings, ReferenceModel, apply_lora, load_model, make_reference
from posttrain.recipes.common import (
    Optimization, Timer, clip_and_step, default_output_dir, make_optimizer, restore_training, save_training, seed_everything,
)
from posttrain.recipes.sft import data_order
from posttrain.runs import RunDirectory, new_card, plot_metrics, write_run_card

logger = logging.getLogger(__name__)

LOSS_TYPES = ("sigmoid", "conservative", "robust", "ipo", "hinge", "length_normalized")
SMOOTHED = ("sigmoid", "conservative", "robust")  # the losses that take a label-noise rate
OBJECTIVES = {
    "sigmoid": "DPO sigmoid loss (arXiv:2305.18290 eq. 7)",
    "conservative": "conservative DPO, label smoothing (Mitchell 2023)",
    "robust": "robust DPO, unbiased under label noise (arXiv:2403.00409 eq. 8)",
    "ipo": "IPO squared loss (arXiv:2310.12036 eq. 17) on summed log-ratios",
    "hinge": "hinge / SLiC (arXiv:2305.10425 eq. 3)",
    "length_normalized": "length-normalised DPO: sigmoid loss on per-token MEAN log-probs (a different objective)",
}
REFERENCE_CACHE = "reference_logprobs.pt"
PLOTTED = ["loss", "rewards/accuracy", "rewards/margins", "logratio/chosen", "logratio/rejected",
           "heldout/preference_accuracy", "heldout/pass@1"]


@dataclass
class Data:
    """Link 1, data: the pairs, the held-out pairs, and how over-long rows are handled."""

    pairs: str = ""
    """Preference JSONL (TRL standard or conversational format) to train on."""
    heldout_file: str | None = None
    """Held-out pairs file; None: split `heldout_pairs` off `pairs` (by prompt, seeded)."""
    heldout_pairs: int = 32
    """Pairs split off `pairs` for held-out preference accuracy when no heldout_file (0: none)."""
    strict: bool = True
    """A bad row stops the run (false: bad rows are dropped and counted)."""
    system_prompt: str | None = None
    """System prompt given to every pair."""
    use_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (None: when it has one)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (None: no limit)."""
    max_response_tokens: int | None = None
    """Longest chosen/rejected response in tokens, EOS included (None: no limit)."""
    prompt_truncation: Literal["error", "left", "drop"] = "error"
    """Over-long prompt: error (named by file line), keep its last tokens, or drop the pair."""
    response_truncation: Literal["right", "drop", "error"] = "right"
    """Over-long response: keep its first tokens, drop the pair, or error."""

    def truncation(self) -> TruncationPolicy:
        return TruncationPolicy(self.max_prompt_tokens, self.max_response_tokens, self.prompt_truncation, self.response_truncation)


@dataclass
class Loss:
    """Link 3, loss: the objective, beta, length handling, reference handling."""

    type: Literal["sigmoid", "conservative", "robust", "ipo", "hinge", "length_normalized"] = "sigmoid"
    """sigmoid (DPO) | conservative (cDPO) | robust | ipo | hinge | length_normalized (token-mean objective)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * (log pi - log pi_ref)."""
    label_smoothing: float = 0.0
    """Assumed label-flip rate (sigmoid, conservative: > 0, robust)."""
    nll_weight: float = 0.0
    """RPO (arXiv:2404.19733): add weight * token-mean NLL of the chosen responses (0: off)."""
    reference: Literal["live", "precomputed"] = "live"
    """live: a frozen copy (or, with LoRA, the base with adapters off); precomputed: one pass at start, cached."""
    reference_refresh_every: int = 0
    """TR-DPO hard update (arXiv:2404.09656): copy the policy into the reference every N steps (0: never)."""


@dataclass
class Acceptance:
    """Link 4, acceptance: held-out pairs, and held-out task accuracy with an independent checker."""

    task: str | None = None
    """Held-out task; None: the task recorded in the pairs' provenance (none: no task evaluation)."""
    task_options: dict | None = None
    """Task options (None: from the provenance)."""
    eval_size: int | None = None
    """Held-out task problems (None: the provenance's, so the split is the one the pairs avoided; else 200)."""
    split_seed: int | None = None
    """Seed of the task's train/held-out split (None: the provenance's, else `seed`)."""
    checker: str | None = None
    """Held-out checker (a verifier name); None: the task's strict default."""
    max_new_tokens: int = 32
    """Generation budget of the task evaluation."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the start and the end)."""
    displacement_threshold: float = 5.0
    """Likelihood-displacement alarm: mean chosen log-ratio below -threshold (nats) while accuracy rises."""
    alarm_window: int = 5
    """Steps averaged by the displacement alarm."""


@dataclass
class Config:
    model: str = "tiny"
    """Model spec: tiny | smollm2-135m | a local Hugging Face directory | a hub id."""
    lora_rank: int = 0
    """LoRA rank (0: train all weights)."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    data: Data = field(default_factory=Data)
    """Link 1: the pairs."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: the objective."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out evaluation."""
    batch_size: int = 8
    """Pairs per optimizer step."""
    micro_batch_size: int = 8
    """Pairs per forward/backward (2x rows: chosen and rejected together); same gradient when smaller."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=5e-6))
    """Optimizer and schedule."""
    max_steps: int = 100
    """Optimizer steps."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps (and at the end)."""
    seed: int = 0
    """Seeds data order, the held-out split of the pairs and initialisation."""
    output_dir: str | None = None
    """Run directory (default runs/dpo-<time>)."""

    def validate(self) -> None:
        self.optim.validate()
        loss = self.loss
        if not self.data.pairs:
            raise UserError("data.pairs: give the preference JSONL to train on (--data.pairs FILE)")
        if loss.beta <= 0:
            raise UserError(f"loss.beta must be > 0, got {loss.beta}")
        if loss.type not in SMOOTHED and loss.label_smoothing:
            raise UserError(f"loss.label_smoothing applies to {', '.join(SMOOTHED)}, not {loss.type}")
        low = 0.0 if loss.type != "conservative" else 1e-12
        if not low <= loss.label_smoothing < 0.5:
            raise UserError(f"loss.label_smoothing must be in {'(0' if low else '[0'}, 0.5) for {loss.type}, got {loss.label_smoothing}")
        if loss.nll_weight < 0 or loss.reference_refresh_every < 0:
            raise UserError("loss.nll_weight and loss.reference_refresh_every must be >= 0")
        if loss.reference_refresh_every and loss.reference == "precomputed":
            raise UserError("loss.reference_refresh_every needs a live reference (loss.reference: live)")
        if loss.reference_refresh_every and self.lora_rank:
            raise UserError("loss.reference_refresh_every: a LoRA reference is the base model and cannot be refreshed")
        for name in ("batch_size", "micro_batch_size", "max_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.data.heldout_pairs < 0 or self.acceptance.alarm_window < 1 or self.acceptance.max_new_tokens < 1:
            raise UserError("data.heldout_pairs must be >= 0; acceptance.alarm_window and max_new_tokens >= 1")


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


def pair_logprobs(model, batch: PreferenceBatch, rows: slice = slice(None)) -> PairLogprobs:
    """Chosen and rejected rows of `batch` through `model` in ONE forward of (2n, L).

    Position ids count real tokens only, so left- and right-padded batches give the same sums.
    `model` may be a `ReferenceModel` (then no gradient is taken, adapters off for a LoRA base).
    """
    chosen, rejected = batch.chosen, batch.rejected
    input_ids = torch.cat([chosen.input_ids[rows], rejected.input_ids[rows]])  # (2n, L)
    attention_mask = torch.cat([chosen.attention_mask[rows], rejected.attention_mask[rows]])
    mask = torch.cat([chosen.mask[rows], rejected.mask[rows]])
    if isinstance(model, ReferenceModel):
        with torch.no_grad(), (model.model.disable_adapter() if model.adapter_disabled else contextlib.nullcontext()):
            was_training = model.model.training
            model.model.eval()
            sums, lengths = response_sums(model.model, input_ids, attention_mask, mask)
            model.model.train(was_training)
    else:
        sums, lengths = response_sums(model, input_ids, attention_mask, mask)
    n = input_ids.shape[0] // 2
    return PairLogprobs(sums[:n], sums[n:], lengths[:n], lengths[n:])


def response_sums(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) summed response log-probs and (N,) response lengths of (N, L) rows.

    The LM head runs only on the K positions that predict a response token (hidden (K, H) ->
    logits (K, V)), never on prompt or padding positions: for a 49k-token vocabulary the full
    (N, L, V) logits are most of a step's time and memory. Models whose head does more than a
    linear map (logit soft-capping or scaling) take the plain full forward.
    """
    position_ids = position_ids_from_attention_mask(attention_mask)
    config = getattr(model, "config", None)
    plain_head = not any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if not plain_head or model.get_output_embeddings() is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # (N, L, V)
        logprobs, shifted_mask = response_logprobs(logits, input_ids, mask)
        return sequence_logprobs(logprobs, shifted_mask), shifted_mask.sum(-1)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    shifted_mask = mask[:, 1:]  # position t predicts token t + 1
    rows, columns = shifted_mask.nonzero(as_tuple=True)
    logits = model.get_output_embeddings()(hidden[rows, columns])  # (K, V)
    logprobs = token_logprobs(logits, input_ids[rows, columns + 1])  # (K,)
    sums = torch.zeros(input_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)
    return sums, shifted_mask.sum(-1)


def preference_losses(loss: Loss, policy: PairLogprobs, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor):
    """Per-pair losses and implicit rewards of the configured objective; each (P,)."""
    if loss.type == "length_normalized":
        return length_normalized_dpo_loss(
            policy.chosen, policy.rejected, ref_chosen, ref_rejected, policy.chosen_lengths, policy.rejected_lengths, beta=loss.beta,
        )
    options = {"label_smoothing": loss.label_smoothing} if loss.type in SMOOTHED else {}
    return PREFERENCE_LOSSES[loss.type](policy.chosen, policy.rejected, ref_chosen, ref_rejected, beta=loss.beta, **options)


def tokenize(tokenizer, pairs: list[PreferencePair], data: Data) -> PreferenceBatch:
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


class DisplacementAlarm:
    """Likelihood displacement (the seed: DPO can win by pushing both answers down): rings when the
    chosen log-ratio log pi(chosen) - log pi_ref(chosen), averaged over the last `window` steps, is
    below -threshold while the preference accuracy over those steps is above that of the run's first
    `window` steps. Rings once; `history` is saved in checkpoints so a resumed run rings the same."""

    def __init__(self, threshold: float, window: int, history: list | None = None, rings: list | None = None):
        self.threshold, self.window = threshold, window
        self.history: list[tuple[int, float, float]] = [tuple(h) for h in history or []]
        self.rings: list[str] = list(rings or [])

    def observe(self, step: int, chosen_logratio: float, accuracy: float) -> str | None:
        self.history.append((step, chosen_logratio, accuracy))
        if self.rings or len(self.history) < 2:
            return None
        recent, first = self.history[-self.window :], self.history[: self.window]
        drop = sum(h[1] for h in recent) / len(recent)
        accuracy_now, accuracy_start = sum(h[2] for h in recent) / len(recent), sum(h[2] for h in first) / len(first)
        if drop < -self.threshold and accuracy_now > accuracy_start:
            self.rings.append(
                f"likelihood displacement at step {step}: the chosen responses' log-prob is {drop:.3f} nats below the "
                f"reference's (threshold {self.threshold}) while preference accuracy rose {accuracy_start:.3f} -> "
                f"{accuracy_now:.3f}: DPO is winning by pushing both answers down"
            )
            return self.rings[-1]
        return None


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


def run(config: Config, resume: bool = False) -> Path:
    """Train; returns the run directory."""
    # 0. Everything that can fail on bad input fails here, before the run directory exists.
    config.validate()
    seed_everything(config.seed)
    policy, tokenizer = load_model(config.model)
    if config.lora_rank:
        policy = apply_lora(policy, LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha))
    train, held_pairs, data_stats = load_pairs(tokenizer, config)
    provenance = provenance_of(config.data.pairs)
    held_task, task_spec = heldout_task(config, provenance)
    if held_task is not None:  # a training prompt that is also a held-out problem would leak the answer
        held_keys = {e.prompt_key() for e in held_task.examples}
        before = len(train)
        train = [p for p in train if prompt_key(p.prompt) not in held_keys]
        data_stats["removed_heldout_task_overlap"] = before - len(train)
        if not train:
            raise UserError(f"{config.data.pairs}: every pair's prompt is in the held-out split of task {task_spec['task']}")
    run_dir = RunDirectory(config.output_dir or default_output_dir("dpo"), resume=resume)
    config.output_dir = str(run_dir.path)
    save_yaml(config, run_dir.path / "config.yaml")

    # 0b. The reference: live (a frozen copy / the LoRA base), or precomputed once and cached.
    reference, cached = None, None
    if config.loss.reference == "precomputed":
        cached = cached_reference(run_dir, policy, tokenizer, train, held_pairs, config)
    else:
        reference = make_reference(policy)
    optimizer, scheduler = make_optimizer(policy.parameters(), config.optim, config.max_steps)
    refreshing = bool(config.loss.reference_refresh_every)
    extra_models = {"reference": reference.model} if refreshing else None  # a refreshed reference is state
    state = restore_training(run_dir, policy, optimizer, scheduler, extra_models) if resume else {"step": 0}
    alarm = DisplacementAlarm(config.acceptance.displacement_threshold, config.acceptance.alarm_window,
                              state.get("alarm_history"), state.get("alarm_rings"))
    card = make_card(config, train, held_pairs, data_stats, provenance, task_spec, reference)
    card["run"]["reference_refreshed_at"] = state.get("reference_refreshed_at", [])
    card["alarms"] = list(alarm.rings)
    write_run_card(run_dir.path, card)

    if state["step"] == 0:
        run_dir.log_metrics(0, evaluate(policy, reference, cached, tokenizer, held_pairs, held_task, config, run_dir, 0))
    policy.train()
    progress = tqdm(range(state["step"], config.max_steps), desc="dpo", initial=state["step"], total=config.max_steps)
    for step in progress:
        done, timer, started = step + 1, Timer(), time.perf_counter()
        # 1. The next batch of the seeded pair stream.
        indices = data_order(len(train), config.seed, step * config.batch_size, config.batch_size)
        batch = tokenize(tokenizer, [train[i] for i in indices], config.data)
        # 2-3. Reference log-probs, policy log-probs (one forward per micro-batch), loss, backward.
        with timer("train"):
            ref = cached["train"][indices] if cached is not None else None
            metrics = train_step(policy, reference, ref, batch, config)
            metrics["grad_norm"] = clip_and_step(policy.parameters(), optimizer, scheduler, config.optim.max_grad_norm)
        # 4. Log, alarm, refresh, evaluate, checkpoint.
        message = alarm.observe(done, metrics["logratio/chosen"], metrics["rewards/accuracy"])
        if message:
            logger.warning(message)
            card["alarms"] = list(alarm.rings)
            write_run_card(run_dir.path, card)
        if refreshing and done % config.loss.reference_refresh_every == 0:
            reference.refresh(policy)
            card["run"]["reference_refreshed_at"].append(done)
            write_run_card(run_dir.path, card)
        tokens = int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum())
        metrics.update({
            "lr": scheduler.get_last_lr()[0], **{f"seconds/{k}": v for k, v in timer.seconds.items()},
            "tokens_per_second": tokens / (time.perf_counter() - started),
        })
        if (config.acceptance.eval_every and done % config.acceptance.eval_every == 0) or done == config.max_steps:
            metrics.update(evaluate(policy, reference, cached, tokenizer, held_pairs, held_task, config, run_dir, done))
        run_dir.log_metrics(done, metrics)
        if any(key.startswith("heldout/") for key in metrics):
            plot_metrics(run_dir.read_metrics(), PLOTTED, run_dir.plots)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", accuracy=f"{metrics['rewards/accuracy']:.2f}")
        if done % config.checkpoint_every == 0 or done == config.max_steps:
            save_training(run_dir, done, policy, tokenizer, optimizer, scheduler, extra_models=extra_models, extra_state={
                "alarm_history": alarm.history, "alarm_rings": alarm.rings,
                "reference_refreshed_at": card["run"]["reference_refreshed_at"],
            })
    write_run_card(run_dir.path, card)
    return run_dir.path


def train_step(policy, reference, ref: torch.Tensor | None, batch: PreferenceBatch, config: Config) -> dict[str, float]:
    """Forward/backward over micro-batches; the loss is the batch mean of the per-pair losses plus
    nll_weight * the batch's chosen-token-mean NLL, normalised by the whole batch's counts so the
    gradient does not depend on micro_batch_size. `ref` is (P, 2) cached reference log-probs or
    None (then `reference` runs). Returns the step's metrics (gradients are left in the policy)."""
    P = batch.chosen.input_ids.shape[0]
    chosen_tokens = batch.chosen.mask[:, 1:].sum().clamp(min=1)
    parts, nll_total = [], 0.0
    for start in range(0, P, config.micro_batch_size):
        rows = slice(start, start + config.micro_batch_size)
        if ref is None:
            reference_sums = pair_logprobs(reference, batch, rows)
            ref_chosen, ref_rejected = reference_sums.chosen, reference_sums.rejected
        else:
            ref_chosen, ref_rejected = ref[rows, 0], ref[rows, 1]
        sums = pair_logprobs(policy, batch, rows)
        losses, chosen_rewards, rejected_rewards = preference_losses(config.loss, sums, ref_chosen, ref_rejected)
        nll = -sums.chosen.sum() / chosen_tokens  # RPO term: this micro-batch's share of the batch token mean
        loss = losses.sum() / P + (config.loss.nll_weight * nll if config.loss.nll_weight else 0.0)
        loss.backward()
        nll_total += float(nll.detach())
        parts.append(pair_columns(losses, chosen_rewards, rejected_rewards, sums, ref_chosen, ref_rejected))
    return pair_metrics(torch.cat(parts, dim=1), nll_total, config.loss.nll_weight)


def pair_columns(losses, chosen_rewards, rejected_rewards, sums: PairLogprobs, ref_chosen, ref_rejected) -> torch.Tensor:
    """(7, P) detached [losses, chosen rewards, rejected rewards, chosen logps, rejected logps,
    chosen log-ratio, rejected log-ratio], for `pair_metrics`."""
    chosen, rejected = sums.chosen.detach(), sums.rejected.detach()
    return torch.stack([losses.detach(), chosen_rewards, rejected_rewards, chosen, rejected, chosen - ref_chosen, rejected - ref_rejected])


def pair_metrics(columns: torch.Tensor, nll: float, nll_weight: float) -> dict[str, float]:
    """Means over pairs of the (7, P) `pair_columns`; loss = preference loss + nll_weight * nll."""
    losses, chosen_r, rejected_r, chosen, rejected, chosen_ratio, rejected_ratio = columns
    preference = float(losses.mean())
    return {
        "loss": preference + nll_weight * nll, "loss/preference": preference, "loss/nll": nll,
        "rewards/chosen": float(chosen_r.mean()), "rewards/rejected": float(rejected_r.mean()),
        "rewards/margins": float((chosen_r - rejected_r).mean()),
        "rewards/accuracy": float((chosen_r > rejected_r).float().mean()),
        "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean()),
        "logratio/chosen": float(chosen_ratio.mean()), "logratio/rejected": float(rejected_ratio.mean()),
    }


def cached_reference(run_dir: RunDirectory, policy, tokenizer, train, held, config: Config) -> dict[str, torch.Tensor]:
    """Reference log-probs of every training and held-out pair, computed once by the initial policy
    (the LoRA base with adapters off) and cached atomically in the run directory; a resumed run
    reads the cache (its fingerprint must match the pairs)."""
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
    cache = {
        "train": reference_logprobs(model, tokenizer, train, config.data, config.micro_batch_size),
        "heldout": reference_logprobs(model, tokenizer, held, config.data, config.micro_batch_size) if held else torch.zeros(0, 2),
        "fingerprint": fingerprint,
    }
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


@torch.no_grad()
def evaluate(policy, reference, cached, tokenizer, held_pairs, held_task, config: Config, run_dir: RunDirectory, step: int) -> dict:
    """Held-out preference accuracy (and loss, margins) and, with a task, held-out task accuracy
    with the configured checker (written to eval/task-step-N.json)."""
    was_training = policy.training
    policy.eval()
    metrics: dict[str, Any] = {}
    if held_pairs:
        parts, nll_sum, nll_tokens = [], 0.0, 0
        for start in range(0, len(held_pairs), config.micro_batch_size):
            batch = tokenize(tokenizer, held_pairs[start : start + config.micro_batch_size], config.data)
            if cached is not None:
                ref_chosen, ref_rejected = cached["heldout"][start : start + config.micro_batch_size].unbind(1)
            else:
                ref_sums = pair_logprobs(reference, batch)
                ref_chosen, ref_rejected = ref_sums.chosen, ref_sums.rejected
            sums = pair_logprobs(policy, batch)
            parts.append(pair_columns(*preference_losses(config.loss, sums, ref_chosen, ref_rejected), sums, ref_chosen, ref_rejected))
            nll_sum, nll_tokens = nll_sum - float(sums.chosen.sum()), nll_tokens + int(sums.chosen_lengths.sum())
        held = pair_metrics(torch.cat(parts, dim=1), nll_sum / max(1, nll_tokens), config.loss.nll_weight)
        metrics.update({
            "heldout/preference_accuracy": held["rewards/accuracy"], "heldout/loss": held["loss/preference"],
            "heldout/margins": held["rewards/margins"], "heldout/logratio/chosen": held["logratio/chosen"],
            "heldout/nll": held["loss/nll"],
        })
    if held_task is not None:
        result = evaluate_task(
            policy, tokenizer, held_task, checker=config.acceptance.checker, k=1, max_new_tokens=config.acceptance.max_new_tokens,
            seed=derived_seed(config.seed, "eval", str(step)), system_prompt=config.data.system_prompt,
            output_path=run_dir.eval_dir / f"task-step-{step:06d}.json",
        )
        metrics.update({"heldout/pass@1": result["pass@1"], "heldout/pass@1_low": result["pass@1_ci95"][0], "heldout/pass@1_high": result["pass@1_ci95"][1]})
    policy.train(was_training)
    return metrics


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
        "forward": "chosen and rejected concatenated in one forward pass", "reduction": "mean over the batch's pairs",
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
