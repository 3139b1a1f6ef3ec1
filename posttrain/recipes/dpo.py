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
The pieces live where their concept does, each with its link of the run card: the data section
(`PairSource`), loading and splitting the pairs and the data link in `posttrain/data/preference.py`,
their provenance and the reward link (who labelled them) in `posttrain/data/provenance.py`, the pair
forward in `posttrain/models/pair_forward.py`, the objectives and pair metrics in
`posttrain/algorithms/preference.py`, what each `loss.type` needs and does (its rows, its reference,
its step, its plots, its held-out evaluation, its alarm) in `posttrain/losses/objectives.py`, the loss section, its step (steps 2-3 and the optimizer step)
and the loss link in `posttrain/losses/preference.py`, the held-out pair metrics, the held-out task
split and the acceptance link in `posttrain/evaluation/preference.py`, the alarm in
`posttrain/evaluation/alarms.py`; the other settings in `dpo_config.py`. This file is
orchestration: `setup(config, world, placement)` -> State (everything that can fail on bad input,
before the run directory exists), `build_trainer` (the reference and the trainer, once it does),
`step(state, done, ...)` (steps 1-4 up to the evaluation), `evaluate`, the run card (`make_card`,
from the links' homes), and `run()` looping over them.

    posttrain dpo --config tiny-dpo --data.pairs pairs.jsonl --max-steps 50
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import to_dict
from posttrain.data import PreferenceBatch, PreferencePair
from posttrain.data.context import PromptSet, check_prompts_fit
from posttrain.data.examples import Example, Task
from posttrain.data.stream import data_order
from posttrain.data.preference import PairSplits, preference_data_card, prompt_key
from posttrain.data.unpaired import labels, load_unpaired
from posttrain.data.provenance import reward_card
from posttrain.distributed import World, full_weights, wrap
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, HeldOutSet, evaluate_sets, heldout_checker, shifted_sets
from posttrain.evaluation.alarms import DisplacementAlarm
from posttrain.evaluation.preference import HELDOUT_METRICS, HeldoutPairs, heldout_task, preference_acceptance_card
from posttrain.hardware import Placement
from posttrain.models import ReferenceModel, make_reference
from posttrain.models.forward import TrainingForward
from posttrain.models.loading import load_policy
from posttrain.models.pair_forward import precomputed_reference
from posttrain.losses.objectives import PreferenceObjective
from posttrain.losses.preference import REFERENCE_CACHE, PreferenceModels, PreferenceSettings, loss_card
from posttrain.losses.preference import step as loss_step
from posttrain.optim import Trainable, make_optimizer
from posttrain.recipes.dpo_config import Config
from posttrain.rewards import Verifier
from posttrain.runs import RunDirectory, new_card, plot_metrics
from posttrain.runs.plots import plot_sets
from posttrain.runs.faults import memory_guard
from posttrain.runs.timer import StepClock
from posttrain.runs.skeleton import StepLoop, card_run_part, card_writer, closing, open_run, start, warn_if_unsafe
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)

MEMORY_KNOBS = {"reference": ["micro_batch_size", "hardware.precision", "data.max_response_tokens"],
                "update": ["micro_batch_size", "memory.gradient_checkpointing", "hardware.precision", "data.max_response_tokens"],
                "evaluation": ["acceptance.max_new_tokens", "micro_batch_size", "hardware.precision"]}
"""The settings that shrink each phase's memory, for the out-of-memory message (`runs/faults.py`)."""


@dataclass
class State:
    """Everything a DPO step, its evaluation and the run card read. `setup` builds it before the run
    directory exists, `build_trainer` adds the reference and the trainer, `restore` the step and
    the alarm; `step` advances `step`."""

    config: Config
    """The config as this run resolved it: data.system_prompt from the pairs' provenance when unset;
    after `open_run`, its output_dir."""
    world: World
    placement: Placement
    policy: Any
    tokenizer: Any
    encode: Callable[[list[PreferencePair]], PreferenceBatch]
    """Pairs -> a tokenised batch on the run's device: the one boundary."""
    train: list[PreferencePair]
    """The training pairs; for KTO its unpaired rows (chosen = the completion, rejected = a mismatched one, `data.unpaired`)."""
    held_pairs: list[PreferencePair]
    data_stats: dict
    """What loading and splitting the pairs counted (the card's data link)."""
    provenance: dict | None
    """The pairs file's sidecar (`posttrain pairs`: model, verifier, task...); None: none."""
    held_task: Task | None
    """The held-out task split (None: the pairs come from no known task)."""
    task_spec: dict | None
    """What `held_task` was built from (`heldout_task`), its checker's name included."""
    checker: Verifier | None
    shifted: list[HeldOutSet]
    reference: ReferenceModel | None = None
    """The live reference (a frozen copy, or the LoRA base); None when precomputed."""
    cached: dict[str, torch.Tensor] | None = None
    """The precomputed reference's sums, {"train": (M, 2), "heldout": (M', 2)}; None when live."""
    trainer: torch.nn.Module | None = None
    """What forward/backward goes through: a `TrainingForward` of pair log-probs (in DDP / FSDP2 under torchrun)."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    models: PreferenceModels | None = None
    """What the loss link's step moves (the trainer, its optimizer and schedule) and the live reference."""
    alarm: DisplacementAlarm | None = None
    step: int = 0
    reference_refreshed_at: list[int] = field(default_factory=list)

    @property
    def objective(self) -> PreferenceObjective:
        """The objective's entry (`losses.objectives`): its rows, its reference, its step, its plots."""
        return self.config.loss.objective

    @property
    def frozen(self):
        """The frozen copy (sharded like the policy, made whole around each use); None for the LoRA
        base or a precomputed reference."""
        return self.reference.model if self.reference is not None and not self.reference.adapter_disabled else None

    @property
    def extra_models(self) -> dict | None:
        """The models checkpointed beside the policy: a refreshed reference is state."""
        return {"reference": self.reference.model} if self.config.loss.reference_refresh_every else None


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Train; returns the run directory. `config` comes checked from `build_config` and is not changed.
    A resume refuses a config that changes the data order or the loss unless `resume_changed_config`;
    SIGTERM / SIGINT stop it after the step in progress, with a checkpoint (`runs/faults.py`)."""
    # 0. Everything that can fail on bad input fails here, before the run directory exists.
    placement, world = start(config)
    state = setup(config, world, placement)
    # The config as this run resolved it (a copy; the caller's is untouched): config.yaml, the card and a resume read it.
    run_dir, state.config, changes = open_run("dpo", state.config, world, resume, resume_changed_config)
    # 0b. The reference (live, or precomputed once and cached in the run directory), the trainer, the optimizer.
    build_trainer(state, run_dir)
    restore(state, run_dir, resume)
    card = make_card(state, changes)
    write_card = card_writer(run_dir, card, world)
    write_card()
    with closing(run_dir, card, write_card), StepLoop("dpo", run_dir, world, state.step, config.max_steps, config.checkpoint_every,
                                                 config.acceptance.eval_every, placement) as loop:
        _train(state, run_dir, loop, card, write_card)
    del state.trainer, state.models  # DDP wrappers first, then the process group
    world.close()
    return run_dir.path


def setup(config: Config, world: World, placement: Placement) -> State:
    """The policy on the run's device, the pairs (rendered with the provenance's system prompt when
    none is set) split into training and held-out pairs, the held-out task with its checker and
    shifted sets: every check of the input, before anything is written."""
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha, placement,
                                    gradient_checkpointing=config.memory.gradient_checkpointing)
    objective = config.loss.objective
    loaded = config.data.load(tokenizer, placement.device, config.seed, loader=None if objective.paired else load_unpaired)
    data, provenance, splits = loaded.data, loaded.provenance, loaded.splits
    held_task, task_spec = heldout_task(config.acceptance, provenance, config.seed)
    checker = None
    if held_task is not None:
        checker = heldout_checker(task_spec["checker"], held_task, config.reward_options, config.unsafe_no_sandbox,
                                  placement=placement, world=world)
    warn_if_unsafe(config.unsafe_no_sandbox)
    train, shifted = splits.train, []
    if held_task is not None:
        train = outside_task(train, held_task, splits.stats, f"{data.pairs}: every pair's prompt is in the held-out split of task {task_spec['task']}")
        shifted = task_shifted_sets(config, train, task_spec)
        budget = config.acceptance.max_new_tokens
        check_prompts_fit(policy, tokenizer, [PromptSet("held-out", held_task.examples, budget, "acceptance.max_new_tokens"),
                                              *(PromptSet(f"held-out '{s.name}'", s.task.examples, budget, "acceptance.max_new_tokens") for s in shifted)],
                          system_prompt=data.system_prompt)
    if objective.class_balance is not None:
        desirable = int(labels(train).sum())
        splits.stats["class_balance"] = balance = objective.class_balance(desirable, len(train) - desirable, config.loss)
        if "warning" in balance:
            logger.warning(balance["warning"])
    return State(config=dataclasses.replace(config, data=data), world=world, placement=placement, policy=policy, tokenizer=tokenizer,
                 encode=loaded.encode, train=train, held_pairs=splits.heldout, data_stats=splits.stats, provenance=provenance,
                 held_task=held_task, task_spec=task_spec, checker=checker, shifted=shifted)


def outside_task(train: list[PreferencePair], held_task: Task, stats: dict, none_left: str) -> list[PreferencePair]:
    """`train` without the pairs whose prompt is a held-out problem of the task (training on it would
    leak the answer), counted in `stats`; `none_left` is the error when no pair is left."""
    held_keys = {e.prompt_key() for e in held_task.examples}
    kept = [p for p in train if prompt_key(p.prompt) not in held_keys]
    stats["removed_heldout_task_overlap"] = len(train) - len(kept)
    if not kept:
        raise UserError(none_left)
    return kept


def task_shifted_sets(config: Config, train: list[PreferencePair], task_spec: dict) -> list[HeldOutSet]:
    """acceptance.sets of the held-out task (`acceptance.shifted_sets`), none of them a training prompt."""
    trained = Task("pairs", "train", [Example(id=p.id, prompt=p.prompt if isinstance(p.prompt, str) else None,
                                              messages=None if isinstance(p.prompt, str) else p.prompt) for p in train], "preference")
    return shifted_sets(config.acceptance.sets, trained, task_spec["task"], task_spec["options"], task_spec["split_seed"],
                        task_spec["eval_size"], config.reward_options, config.unsafe_no_sandbox)


def build_trainer(state: State, run_dir: RunDirectory) -> None:
    """The reference (live: a frozen copy or the LoRA base; precomputed: by the initial policy,
    before any wrapping, into the run directory; none for a reference-free objective, whose
    reference log-probs are zeros), then the trainer, its optimizer and schedule."""
    config, world, placement = state.config, state.world, state.placement
    if not state.objective.needs_reference:  # no reference model: its log-probs are zeros, never computed
        state.cached = {"train": torch.zeros(len(state.train), 2), "heldout": torch.zeros(len(state.held_pairs), 2)}
    elif config.loss.reference == "precomputed":
        with placement.autocast(), memory_guard(0, MEMORY_KNOBS, phase="reference"):
            state.cached = cached_reference(state, run_dir)
    else:
        state.reference = make_reference(state.policy)
    sharded = world.active and world.strategy == "fsdp2"
    if state.frozen is not None and sharded:
        wrap(state.frozen, world, placement)
    # One call = pair log-probs of some rows (DDP, FSDP2 or the policy itself); FSDP2 takes the
    # plain forward so the root's shards are gathered.
    state.trainer = wrap(TrainingForward(state.policy, state.objective.forward, placement, full_forward=sharded),
                         world, placement)
    state.optimizer, state.scheduler = make_optimizer(state.trainer.parameters(), config.optim, config.max_steps)
    state.models = PreferenceModels(Trainable(state.trainer, state.optimizer, state.scheduler, config.optim.max_grad_norm),
                                    state.reference)


def restore(state: State, run_dir: RunDirectory, resume: bool) -> None:
    """On resume, the newest checkpoint into the models, optimizer and schedule (`restore_training`),
    then the step, the alarm's history and the reference's refreshes from it; else step 0."""
    saved = restore_training(run_dir, state.policy, state.optimizer, state.scheduler, state.extra_models,
                             world=state.world) if resume else {"step": 0}
    acceptance = state.config.acceptance
    state.step, state.reference_refreshed_at = saved["step"], saved.get("reference_refreshed_at", [])
    state.alarm = DisplacementAlarm(acceptance.displacement_threshold, acceptance.alarm_window,
                                    saved.get("alarm_history", []), saved.get("alarm_rings", []))


def _train(state: State, run_dir: RunDirectory, loop: StepLoop, card: dict, write_card: Callable[[], None]) -> None:
    """`run`'s loop: step 0's evaluation, then step, evaluate, log, checkpoint until max_steps or a
    stop signal (a checkpoint at that step, then `RunStopped`)."""
    if state.step == 0:
        run_dir.log_metrics(0, evaluate(state, run_dir))
    state.policy.train()

    def plot() -> None:
        plot_metrics(run_dir.read_metrics(), list(state.objective.plotted), run_dir.plots)
        if state.shifted:
            plot_sets(run_dir.read_metrics(), [IN_DISTRIBUTION] + [held.name for held in state.shifted], run_dir.plots / "heldout_sets.png")

    for done in loop:
        metrics = step(state, done, card, write_card, loop.clock)  # 1-4
        if loop.evaluates(done):
            metrics.update(evaluate(state, run_dir))
        loop.end_step(done, metrics, save=lambda: save(state, run_dir),
                      after_log=plot if any(key.startswith("heldout/") for key in metrics) and state.world.main else None,
                      loss=f"{metrics['loss']:.4f}", accuracy=f"{metrics['rewards/accuracy']:.2f}")


def step(state: State, done: int, card: dict, write_card: Callable[[], None], clock: StepClock | None = None) -> dict[str, Any]:
    """Step `done` up to its evaluation: 1. the next batch of the seeded pair stream, 2-3. the loss
    link's step (reference log-probs live or cached, policy log-probs, loss, backward, clip,
    optimizer step), 4. the displacement alarm and the reference refresh (each into the card) and
    the step's timings on `clock` (the loop's; a new one when None). Advances `state.step`; returns
    the step's metrics."""
    config, placement = state.config, state.placement
    clock = clock or StepClock(placement)
    # 1. The next batch of the seeded pair stream.
    indices = data_order(len(state.train), config.seed, (done - 1) * config.batch_size, config.batch_size)
    rows = [state.train[i] for i in indices]
    # With the per-row inputs: the cached reference's sums (None: the live reference) and unpaired rows' labels.
    cached = state.cached["train"][indices].to(placement.device) if state.cached is not None else None
    batch = dataclasses.replace(state.encode(rows), reference=cached, desirable=None if state.objective.paired else labels(rows))
    # 2-3. Reference log-probs, policy log-probs (one forward per micro-batch), loss, backward.
    with memory_guard(done, MEMORY_KNOBS, phase="update"), clock("train"), full_weights(state.frozen):
        metrics = loss_step(state.models, batch, PreferenceSettings(config.loss, config.micro_batch_size), state.world)
    state.step = done
    # 4. Alarm, refresh (then `_train`: evaluate, log, checkpoint). The alarm watches the objective's
    # log-ratio (KTO: its desirable rows', a batch without one skipping it); none without a reference.
    watched = metrics.get(state.objective.watched) if state.objective.watched else None
    message = state.alarm.observe(done, watched, metrics["rewards/accuracy"]) if watched is not None else None
    if message:
        logger.warning(message)
        card["alarms"] = list(state.alarm.rings)
        write_card()
    if config.loss.reference_refresh_every and done % config.loss.reference_refresh_every == 0:
        state.reference.refresh(state.policy)
        state.reference_refreshed_at.append(done)
        card["run"]["reference_refreshed_at"] = list(state.reference_refreshed_at)
        write_card()
    tokens = int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum())
    metrics["lr"] = state.scheduler.get_last_lr()[0]
    metrics.update(clock.metrics(tokens, {"training": (tokens, ("train",))}))
    return metrics


def save(state: State, run_dir: RunDirectory) -> None:
    """The checkpoint of `state.step`: everything a resume needs, the alarm and the refreshes included."""
    save_training(run_dir, state.step, state.policy, state.tokenizer, state.optimizer, state.scheduler,
                  extra_models=state.extra_models, world=state.world, extra_state={
                      "alarm_history": state.alarm.history, "alarm_rings": state.alarm.rings,
                      "reference_refreshed_at": state.reference_refreshed_at})


def evaluate(state: State, run_dir: RunDirectory) -> dict[str, Any]:
    """Held-out acceptance at `state.step` on rank 0 (the other ranks wait; under FSDP2 every rank
    lends its shards): the held-out pairs' preference metrics (`evaluation.preference`) and, with a
    task, its accuracy with the configured checker (eval/task-step-N.json) and the shifted sets'."""
    with (full_weights(state.policy), full_weights(state.frozen), state.placement.autocast(),
          memory_guard(state.step, MEMORY_KNOBS, phase="evaluation")):
        metrics = _evaluate_main(state, run_dir) if state.world.main else {}
    state.world.barrier()
    return metrics


@torch.no_grad()
def _evaluate_main(state: State, run_dir: RunDirectory) -> dict[str, Any]:
    """`evaluate`'s part on rank 0, the policy in eval mode."""
    config, policy = state.config, state.policy
    was_training = policy.training
    policy.eval()
    cached = state.cached["heldout"] if state.cached is not None else None
    heldout = HeldoutPairs(state.held_pairs, state.encode, config.loss, config.micro_batch_size, state.reference, cached)
    metrics = HELDOUT_METRICS[state.objective.heldout](policy, heldout)
    if state.held_task is not None:
        metrics.update(evaluate_sets(policy, state.tokenizer, state.held_task, state.checker, state.shifted, step=state.step,
                                     eval_dir=run_dir.eval_dir, seed=config.seed, max_new_tokens=config.acceptance.max_new_tokens,
                                     system_prompt=config.data.system_prompt, in_distribution_file="task-step")[1])
    policy.train(was_training)
    return metrics


def cached_reference(state: State, run_dir: RunDirectory) -> dict[str, torch.Tensor]:
    """Reference log-probs of every training and held-out pair by the initial policy (the LoRA base
    with adapters off), computed once and cached in the run directory, keyed by everything that
    decides them: the pairs, the data settings and the model."""
    config, train, held = state.config, state.train, state.held_pairs
    fingerprint = hashlib.sha256(json.dumps(
        [[p.id, p.prompt, p.chosen, p.rejected] for p in train + held] + [to_dict(config.data), config.model], default=str,
    ).encode()).hexdigest()
    model = make_reference(state.policy) if config.lora_rank else state.policy
    return precomputed_reference(run_dir.path / REFERENCE_CACHE, model, {"train": train, "heldout": held}, state.encode,
                                 config.micro_batch_size, fingerprint, state.world)


def make_card(state: State, changes: list[str]) -> dict[str, Any]:
    """The run card: the four links, each written by its link's home, and the run's own part
    (`changes`: what a resume accepted)."""
    config = state.config
    card = new_card("dpo", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = preference_data_card(config.data, PairSplits(state.train, state.held_pairs, state.data_stats), state.provenance,
                                                 seed=config.seed, batch_size=config.batch_size, micro_batch_size=config.micro_batch_size)
    card["links"]["reward"] = reward_card(config.data.pairs, state.provenance)
    card["links"]["loss"] = loss_card(config.loss, state.reference, config.lora_rank, config.optim)
    if "class_balance" in state.data_stats:
        balance = card["links"]["loss"]["class_balance"] = state.data_stats["class_balance"]
        if "warning" in balance:
            card["notes"].append(balance["warning"])
    acceptance = card["links"]["acceptance"] = preference_acceptance_card(config.acceptance, len(state.held_pairs), state.task_spec,
                                                                          state.checker, state.provenance, state.shifted, unpaired=not state.objective.paired)
    if acceptance.get("independent") is False:
        card["notes"].append(f"acceptance is not independent of the labels: {acceptance['independence_reason']}")
    if not state.objective.needs_reference:
        acceptance["displacement_alarm"] = (f"off: loss.type {config.loss.type} uses no reference, so there is no chosen log-ratio "
                                            "to watch (logratio/* metrics are the policy's own summed log-probs)")
    card["run"]["reference_refreshed_at"] = list(state.reference_refreshed_at)
    card["alarms"] = list(state.alarm.rings)
    card_run_part(card, config, state.placement, state.world, changes)
    return card
