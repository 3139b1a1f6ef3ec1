"""`posttrain dpo`: offline preference optimisation (DPO and its family) on a file of pairs.

The four links of a DPO run: data = a fixed file of (prompt, chosen, rejected) pairs (offline);
reward = whoever labelled the pairs (recorded: for `posttrain pairs` files, "verifier V on samples
of model M"); loss = a pairwise loss on summed response log-probs against a frozen reference
(DPO, arXiv:2305.18290 eq. 7, or a named variant); acceptance = held-out pairs (preference accuracy)
and, when the pairs come from a task, held-out task accuracy with a separately configured checker.

Each step: 1. the next batch of pairs, 2. reference log-probs (live forward, or the cache),
3. policy log-probs of chosen and rejected in one forward per micro-batch, each pair's prompt
computed once for both responses (a shared KV cache), loss, backward (micro-batches share the
batch's normalisers), 4. log, alarm, refresh the reference, evaluate, checkpoint.
The pieces live where their concept does: loading and splitting the pairs in `posttrain/data/preference.py`,
their provenance in `posttrain/data/provenance.py`, the pair forward in `posttrain/models/pair_forward.py`,
the objectives and pair metrics in `posttrain/algorithms/preference.py`, the loss section and its
step (steps 2-3 and the optimizer step) in `posttrain/losses/preference.py`, the alarm in
`posttrain/evaluation/alarms.py`; the other settings in `dpo_config.py`; this file is the loop and
the run card.

    posttrain dpo --config presets/tiny-dpo.yaml --data.pairs pairs.jsonl --max-steps 50
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.algorithms import pair_columns
from posttrain.config import to_dict
from posttrain.data import PreferenceBatch, PreferencePair, tokenize_preference_pairs
from posttrain.data.examples import Example, Task
from posttrain.data.stream import data_order
from posttrain.data.preference import load_pairs, prompt_key
from posttrain.data.provenance import read_provenance
from posttrain.distributed import World, full_weights, wrap
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, default_checker, evaluate_sets, heldout_split, independence, shifted_sets
from posttrain.evaluation.alarms import DisplacementAlarm
from posttrain.models import make_reference
from posttrain.models.forward import TrainingForward
from posttrain.models.loading import load_policy
from posttrain.models.pair_forward import pair_logprobs, precomputed_reference
from posttrain.losses.preference import PreferenceModels, preference_losses, step_metrics
from posttrain.losses.preference import step as loss_step
from posttrain.optim import Trainable, make_optimizer
from posttrain.recipes.dpo_config import OBJECTIVES, Acceptance, Config
from posttrain.rewards import as_verifier, get_verifier
from posttrain.runs import RunDirectory, new_card, plot_metrics
from posttrain.runs.plots import plot_sets
from posttrain.runs.faults import memory_guard
from posttrain.runs.timer import Timer
from posttrain.runs.skeleton import StepLoop, card_run_part, card_writer, closing, open_run, start, warn_if_unsafe
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)

REFERENCE_CACHE = "reference_logprobs.pt"
"""The precomputed reference's file in the run directory."""
PLOTTED = ["loss", "rewards/accuracy", "rewards/margins", "logratio/chosen", "logratio/rejected",
           "heldout/preference_accuracy", "heldout/pass@1"]


MEMORY_KNOBS = {"reference": ["micro_batch_size", "hardware.precision", "data.max_response_tokens"],
                "update": ["micro_batch_size", "memory.gradient_checkpointing", "hardware.precision", "data.max_response_tokens"],
                "evaluation": ["acceptance.max_new_tokens", "micro_batch_size", "hardware.precision"]}
"""The settings that shrink each phase's memory, for the out-of-memory message (`runs/faults.py`)."""


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Train; returns the run directory. `config` comes checked from `build_config` and is not changed.
    A resume refuses a config that changes the data order or the loss unless `resume_changed_config`;
    SIGTERM / SIGINT stop it after the step in progress, with a checkpoint (`runs/faults.py`)."""
    # 0. Everything that can fail on bad input fails here, before the run directory exists.
    placement, world = start(config)
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha, placement,
                                    gradient_checkpointing=config.memory.gradient_checkpointing)
    data = config.data
    provenance = read_provenance(data.pairs) if os.path.isfile(data.pairs) else None  # else load_pairs says so
    if data.system_prompt is None and (provenance or {}).get("system_prompt"):
        data = dataclasses.replace(data, system_prompt=provenance["system_prompt"])  # the prompts as the pairs were sampled
        logger.info("system prompt from the pairs' provenance: %r", data.system_prompt)
    rendering = dict(truncation=data.truncation(), system_prompt=data.system_prompt, use_chat_template=data.use_chat_template)
    def encode(pairs: list[PreferencePair]) -> PreferenceBatch:  # tokenised, on the run's device: the one boundary
        return tokenize_preference_pairs(tokenizer, pairs, **rendering).to(placement.device)

    splits = load_pairs(data.pairs, tokenizer, heldout_file=data.heldout_file, heldout_pairs=data.heldout_pairs,
                        split_seed=config.seed, strict=data.strict, data_format=data.format, columns=data.columns,
                        source_split=data.split, **rendering)
    train, held_pairs, data_stats = splits.train, splits.heldout, splits.stats
    held_task, task_spec = heldout_task(config.acceptance, provenance, config.seed)
    checker = None
    if held_task is not None:
        checker = as_verifier(None, task_spec["checker"], config.reward_options, config.unsafe_no_sandbox, for_checker=True,
                              setting="acceptance.checker", placement=placement, world=world)
        checker.prepare()
    warn_if_unsafe(config.unsafe_no_sandbox)
    if held_task is not None:  # a training prompt that is also a held-out problem would leak the answer
        held_keys = {e.prompt_key() for e in held_task.examples}
        before = len(train)
        train = [p for p in train if prompt_key(p.prompt) not in held_keys]
        data_stats["removed_heldout_task_overlap"] = before - len(train)
        if not train:
            raise UserError(f"{data.pairs}: every pair's prompt is in the held-out split of task {task_spec['task']}")
    shifted = []
    if held_task is not None:
        trained = Task("pairs", "train", [Example(id=p.id, prompt=p.prompt if isinstance(p.prompt, str) else None,
                                                  messages=None if isinstance(p.prompt, str) else p.prompt) for p in train], "preference")

        shifted = shifted_sets(config.acceptance.sets, trained, task_spec["task"], task_spec["options"], task_spec["split_seed"],
                               task_spec["eval_size"], config.reward_options, config.unsafe_no_sandbox)
    # The config as this run resolved it (a copy; the caller's is untouched): config.yaml, the card and a resume read it.
    run_dir, config, changes = open_run("dpo", dataclasses.replace(config, data=data), world, resume, resume_changed_config)

    # 0b. The reference: live (a frozen copy / the LoRA base), or precomputed once and cached.
    reference, cached = None, None
    if config.loss.reference == "precomputed":
        with placement.autocast(), memory_guard(0, MEMORY_KNOBS, phase="reference"):
            cached = cached_reference(run_dir, policy, encode, train, held_pairs, config, world)
    else:
        reference = make_reference(policy)
    sharded = world.active and world.strategy == "fsdp2"
    # The frozen copy sharded like the policy; made whole (by every rank) around each use.
    frozen = reference.model if reference is not None and not reference.adapter_disabled else None
    if frozen is not None and sharded:
        wrap(frozen, world, placement)
    # What forward/backward goes through: one call = pair log-probs of some rows (DDP, FSDP2 or the
    # policy itself); FSDP2 takes the plain forward so the root's shards are gathered.
    trainer = wrap(TrainingForward(policy, pair_logprobs, placement, full_forward=sharded), world, placement)
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, config.max_steps)
    models = PreferenceModels(Trainable(trainer, optimizer, scheduler, config.optim.max_grad_norm), reference)
    refreshing = bool(config.loss.reference_refresh_every)
    extra_models = {"reference": reference.model} if refreshing else None  # a refreshed reference is state
    state = restore_training(run_dir, policy, optimizer, scheduler, extra_models, world=world) if resume else {"step": 0}
    alarm = DisplacementAlarm(config.acceptance.displacement_threshold, config.acceptance.alarm_window,
                              state.get("alarm_history", []), state.get("alarm_rings", []))
    card = make_card(config, train, held_pairs, data_stats, provenance, task_spec, reference, checker)
    if shifted:
        card["links"]["acceptance"]["sets"] = {held.name: held.spec for held in shifted}
    card["run"]["reference_refreshed_at"] = state.get("reference_refreshed_at", [])
    card["alarms"] = list(alarm.rings)
    card_run_part(card, config, placement, world, changes)

    write_card = card_writer(run_dir, card, world)

    def evaluate_on_rank0(step: int) -> dict:
        with full_weights(policy), full_weights(frozen), placement.autocast(), memory_guard(step, MEMORY_KNOBS, phase="evaluation"):
            metrics = evaluate(policy, reference, cached, tokenizer, encode, held_pairs, held_task, checker, config, run_dir, step,
                               shifted) if world.main else {}
        world.barrier()
        return metrics

    write_card()
    if state["step"] == 0:
        run_dir.log_metrics(0, evaluate_on_rank0(0))
    policy.train()

    def plot() -> None:
        plot_metrics(run_dir.read_metrics(), PLOTTED, run_dir.plots)
        if shifted:
            plot_sets(run_dir.read_metrics(), [IN_DISTRIBUTION] + [held.name for held in shifted], run_dir.plots / "heldout_sets.png")

    with closing(run_dir, write_card), StepLoop("dpo", run_dir, world, state["step"], config.max_steps, config.checkpoint_every,
                                                 config.acceptance.eval_every) as loop:
        for done in loop:
            timer, started = Timer(placement.synchronize), time.perf_counter()
            placement.reset_peak_memory()
            # 1. The next batch of the seeded pair stream.
            indices = data_order(len(train), config.seed, (done - 1) * config.batch_size, config.batch_size)
            batch = encode([train[i] for i in indices])
            # 2-3. Reference log-probs, policy log-probs (one forward per micro-batch), loss, backward.
            with memory_guard(done, MEMORY_KNOBS, phase="update"), timer("train"):
                ref = cached["train"][indices].to(placement.device) if cached is not None else None
                with full_weights(frozen):
                    metrics = loss_step(models, batch, config.loss, config.micro_batch_size, world, cached_reference=ref)
            # 4. Log, alarm, refresh, evaluate, checkpoint.
            message = alarm.observe(done, metrics["logratio/chosen"], metrics["rewards/accuracy"])
            if message:
                logger.warning(message)
                card["alarms"] = list(alarm.rings)
                write_card()
            if refreshing and done % config.loss.reference_refresh_every == 0:
                reference.refresh(policy)
                card["run"]["reference_refreshed_at"].append(done)
                write_card()
            tokens = int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum())
            metrics.update({
                "lr": scheduler.get_last_lr()[0], **{f"seconds/{k}": v for k, v in timer.seconds.items()},
                "tokens_per_second": tokens / (time.perf_counter() - started),
                "tokens_per_second/training": tokens / max(1e-9, timer.seconds.get("train", 0.0)),
            })
            if placement.is_cuda:
                metrics["memory/peak_allocated_gib"] = placement.peak_memory_gib()
            if loop.evaluates(done):
                metrics.update(evaluate_on_rank0(done))
            loop.end_step(done, metrics, save=lambda: save_training(
                run_dir, done, policy, tokenizer, optimizer, scheduler, extra_models=extra_models, world=world, extra_state={
                    "alarm_history": alarm.history, "alarm_rings": alarm.rings,
                    "reference_refreshed_at": card["run"]["reference_refreshed_at"]}),
                after_log=plot if any(key.startswith("heldout/") for key in metrics) and world.main else None,
                loss=f"{metrics['loss']:.4f}", accuracy=f"{metrics['rewards/accuracy']:.2f}")
    del trainer, models  # DDP wrappers first, then the process group
    world.close()
    return run_dir.path


@torch.no_grad()
def evaluate(policy, reference, cached, tokenizer, encode: Callable[[list[PreferencePair]], PreferenceBatch], held_pairs, held_task,
             checker, config: Config, run_dir: RunDirectory, step: int, shifted=()) -> dict:
    """Held-out preference accuracy (and loss, margins) and, with a task, held-out task accuracy
    with the configured checker (written to eval/task-step-N.json)."""
    was_training = policy.training
    policy.eval()
    metrics: dict[str, Any] = {}
    if held_pairs:
        parts, nll_sum, nll_tokens = [], 0.0, 0
        for start in range(0, len(held_pairs), config.micro_batch_size):
            batch = encode(held_pairs[start : start + config.micro_batch_size])
            if cached is not None:
                ref_chosen, ref_rejected = cached["heldout"][start : start + config.micro_batch_size].to(batch.chosen.input_ids.device).unbind(1)
            else:
                ref_sums = pair_logprobs(reference, batch)
                ref_chosen, ref_rejected = ref_sums.chosen, ref_sums.rejected
            sums = pair_logprobs(policy, batch)
            losses, chosen_rewards, rejected_rewards = preference_losses(config.loss, sums, ref_chosen, ref_rejected)
            parts.append(pair_columns(losses, chosen_rewards, rejected_rewards, sums.chosen, sums.rejected, ref_chosen, ref_rejected))
            nll_sum, nll_tokens = nll_sum - float(sums.chosen.sum()), nll_tokens + int(sums.chosen_lengths.sum())
        held = step_metrics(torch.cat(parts, dim=1), nll_sum / max(1, nll_tokens), config.loss.nll_weight)
        metrics.update({
            "heldout/preference_accuracy": held["rewards/accuracy"], "heldout/loss": held["loss/preference"],
            "heldout/margins": held["rewards/margins"], "heldout/logratio/chosen": held["logratio/chosen"],
            "heldout/nll": held["loss/nll"],
        })
    if held_task is not None:
        metrics.update(evaluate_sets(policy, tokenizer, held_task, checker, shifted, step=step, eval_dir=run_dir.eval_dir,
                                     seed=config.seed, max_new_tokens=config.acceptance.max_new_tokens,
                                     system_prompt=config.data.system_prompt, in_distribution_file="task-step")[1])
    policy.train(was_training)
    return metrics


def cached_reference(run_dir: RunDirectory, policy, encode: Callable[[list[PreferencePair]], PreferenceBatch], train, held,
                     config: Config, world: World | None = None) -> dict[str, torch.Tensor]:
    """Reference log-probs of every training and held-out pair by the initial policy (the LoRA base
    with adapters off), computed once and cached in the run directory, keyed by everything that
    decides them: the pairs, the data settings and the model."""
    fingerprint = hashlib.sha256(json.dumps(
        [[p.id, p.prompt, p.chosen, p.rejected] for p in train + held] + [to_dict(config.data), config.model], default=str,
    ).encode()).hexdigest()
    model = make_reference(policy) if config.lora_rank else policy
    return precomputed_reference(run_dir.path / REFERENCE_CACHE, model, {"train": train, "heldout": held}, encode,
                                 config.micro_batch_size, fingerprint, world)


def heldout_task(acceptance: Acceptance, provenance: dict | None, seed: int):
    """The held-out task split for acceptance (None when the pairs come from no known task), and
    the spec it was built from: each setting from `acceptance`, else from the pairs' provenance."""
    origin = provenance or {}
    task = acceptance.task or origin.get("task")
    if task is None:
        return None, None
    spec = {
        "task": task,
        "options": acceptance.task_options if acceptance.task_options is not None else origin.get("task_options", {}),
        "eval_size": acceptance.eval_size or origin.get("eval_size") or 200,
        "split_seed": acceptance.split_seed if acceptance.split_seed is not None else origin.get("seed", seed),
    }
    held_out = heldout_split(task, spec["eval_size"], spec["split_seed"], spec["options"])
    spec["checker"] = acceptance.checker or default_checker(held_out)
    return held_out, spec


def labeller_independence(labeller: str | None, checker) -> tuple[bool, str]:
    """`independence` of the held-out checker from the verifier that labelled the pairs (named in
    their provenance); pairs labelled by no recorded verifier are checked independently of it."""
    if labeller is None:
        return True, f"the pairs name no labelling verifier; the checker {checker.name} is the only verifier of this run"
    try:
        return independence(get_verifier(labeller), checker)
    except ValueError:  # a python:<function> labeller cannot be rebuilt by name
        same = labeller == checker.name
        return not same, (f"the checker {checker.name} is the labeller itself" if same
                          else f"the labeller {labeller} cannot be rebuilt to compare; the checker {checker.name} is another verifier")


def make_card(config: Config, train, held_pairs, data_stats, provenance, task_spec, reference, checker=None) -> dict[str, Any]:
    """The run card: the four links and every loss setting."""
    card = new_card("dpo", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = {
        "source": f"offline: preference pairs from {config.data.pairs}", "train_pairs": len(train),
        "heldout_pairs": len(held_pairs),
        "heldout_pairs_from": config.data.heldout_file or f"split off the training file by prompt (seed {config.seed})",
        "format": config.data.format, "columns": config.data.columns, "split": config.data.split,
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
        "length_handling": "per-token mean log-probs (length-normalised objective)" if loss.type.startswith("length_normalized") else "none: summed log-probs",
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
    if checker is not None:
        independent, why = labeller_independence(labeller, checker)
        card["links"]["acceptance"].update({"independent": independent, "independence_reason": why,
                                            "checker_settings": checker.describe()})
        if not independent:
            card["notes"].append(f"acceptance is not independent of the labels: {why}")
    return card
