"""`posttrain rm`: train a scalar reward model on preference pairs (Bradley-Terry), then export it as
a directory that `--reward rm:DIR` scores with and transformers' `AutoModelForSequenceClassification`
loads.

The four links: data = the pairs (the same sources, formats and provenance as `posttrain dpo`, plus
an optional `margin` column); reward = whoever labelled them (the pairs' sidecar); loss =
Bradley-Terry (`losses/reward_model.py`); acceptance = held-out pair accuracy with its interval, and
the length-bias probes (`evaluation/reward_model.py`).

1. `setup`: the backbone (any policy spec, LoRA included) with a fresh scalar head
   (`models.reward_model.RewardModel`), the pairs and their held-out split, every input check
   before the run directory exists.
2. Each step: the next `batch_size` pairs of the seeded stream, the loss link's `step`.
3. Evaluation at step 0, every `acceptance.eval_every` steps and at the end; checkpoints (the
   backbone as a model directory, the head as score.pt) as every recipe; at the end the export,
   `final/`, with reward_model.json (the stored reward scale, held-out accuracy, provenance).

    posttrain rm --model tiny --data.pairs pairs.jsonl --max-steps 100
    posttrain grpo --reward rm:runs/rm/final ...
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config import PolicyFields, to_dict
from posttrain.data import PreferencePair
from posttrain.data.preference import PairSource, PairSplits, preference_data_card
from posttrain.data.provenance import reward_card
from posttrain.data.stream import data_order
from posttrain.distributed import Parallel, World, wrap
from posttrain.errors import UserError
from posttrain.evaluation.reward_model import evaluate_reward_pairs
from posttrain.hardware import Placement, keep_freed_memory
from posttrain.losses.reward_model import Loss, RewardModelSettings, loss_card, pair_margins
from posttrain.losses.reward_model import step as loss_step
from posttrain.models.forward import TrainingForward
from posttrain.models.loading import load_policy
from posttrain.models.reward_model import RewardModel, batch_rewards, export, weights_hash
from posttrain.optim import Optimization, Trainable, make_optimizer
from posttrain.runs import RunDirectory, new_card, plot_metrics
from posttrain.runs.faults import memory_guard
from posttrain.runs.skeleton import StepLoop, card_run_part, card_writer, closing, open_run, start
from posttrain.runs.timer import StepClock
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)

PLOTTED = ["loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "heldout/preference_accuracy",
           "heldout/reward_length_correlation"]
MEMORY_KNOBS = "micro_batch_size, data.max_prompt_tokens / data.max_response_tokens, memory.gradient_checkpointing, lora_rank"
FINAL = "final"
"""The export's directory in the run directory: what `--reward rm:RUN/final` names."""
SCALE_ROWS = 256
"""Without held-out pairs, the stored reward scale comes from this many training pairs."""


@dataclass
class Acceptance:
    """Link 4, acceptance: the held-out pairs (data.heldout_pairs / data.heldout_file): accuracy
    (a tie is wrong) with its Wilson 95% interval, margins, and the length-bias probes."""

    eval_every: int = 0
    """Evaluate every N steps (0: only at the start and the end)."""

    def validate(self, prefix: str = "acceptance.") -> None:
        if self.eval_every < 0:
            raise UserError(f"{prefix}eval_every must be at least 0, got {self.eval_every}")


@dataclass
class Config(PolicyFields):
    data: PairSource = field(default_factory=PairSource)
    """Link 1: the pairs (as `posttrain dpo`'s; a `margin` column is read with loss.margin)."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: Bradley-Terry and its options."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out pairs."""
    batch_size: int = 16
    """Pairs per optimizer step."""
    micro_batch_size: int = 16
    """Pairs per forward/backward (2x rows); the same gradient when smaller."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=1e-4))
    """Optimizer and schedule."""
    parallel: Parallel = field(default_factory=Parallel)
    """Under torchrun: DDP (FSDP2 is refused: not yet supported for reward models)."""
    max_steps: int = 100

    def validate(self) -> None:
        super().validate()
        self.optim.validate()
        self.parallel.validate()
        if self.parallel.strategy == "fsdp2":
            raise UserError("parallel.strategy fsdp2: posttrain rm supports ddp under torchrun, not yet fsdp2")
        self.data.validate()  # pairs given, format and columns known, heldout_pairs >= 0 (data/preference.PairSource)
        self.loss.validate()
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.acceptance.validate()


@dataclass
class State:
    """What a step, the evaluation, the export and the run card read; `setup` builds it before the
    run directory exists, `build_trainer` adds the trainer, `restore` the step."""

    config: Config
    world: World
    placement: Placement
    model: RewardModel
    tokenizer: Any
    encode: Any
    train: list[PreferencePair]
    held_pairs: list[PreferencePair]
    margins: dict[str, torch.Tensor | None]
    data_stats: dict
    provenance: dict | None
    trainer: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    trainable: Trainable | None = None
    step: int = 0
    last_heldout: dict = field(default_factory=dict)


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Train and export; returns the run directory (the export is its final/)."""
    placement, world = start(config)
    state = setup(config, world, placement)
    run_dir, state.config, changes = open_run("rm", state.config, world, resume, resume_changed_config)
    build_trainer(state)
    saved = restore_training(run_dir, state.model.backbone, state.optimizer, state.scheduler, {"score": state.model.score},
                             world=world) if resume else {"step": 0}
    state.step = saved["step"]
    card = make_card(state, changes)
    write_card = card_writer(run_dir, card, world)
    write_card()
    with closing(run_dir, card, write_card), StepLoop("rm", run_dir, world, state.step, config.max_steps, config.checkpoint_every,
                                                     config.acceptance.eval_every, state.placement) as loop:
        if state.step == 0:
            run_dir.log_metrics(0, evaluate(state))
        state.model.train()
        for done in loop:
            metrics = step(state, done, loop.clock)
            if loop.evaluates(done):
                metrics.update(evaluate(state))
            plot = world.main and (loop.evaluates(done) or done % config.checkpoint_every == 0)  # matplotlib at every step cost more than the steps
            loop.end_step(done, metrics, save=lambda: save(state, run_dir),
                          after_log=(lambda: plot_metrics(run_dir.read_metrics(), PLOTTED, run_dir.plots)) if plot else None,
                          loss=f"{metrics['loss']:.4f}", accuracy=f"{metrics['accuracy']:.2f}")
        if world.main:
            card["export"] = export_final(state, run_dir)
    del state.trainer, state.trainable
    world.close()
    return run_dir.path


def setup(config: Config, world: World, placement: Placement) -> State:
    """The reward model on the run's device (the backbone of `config.model` with a fresh head), the
    pairs split into training and held-out pairs, their margins: every check of the input."""
    keep_freed_memory()  # each CPU step reuses the memory the last one freed instead of faulting in fresh pages
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha, placement,
                                    gradient_checkpointing=config.memory.gradient_checkpointing)
    model = RewardModel.from_policy(policy, seed=config.seed)
    loaded = config.data.load(tokenizer, placement.device, config.seed,
                              unpaired_advice="a reward model is trained on pairs (Bradley-Terry): make them with posttrain pairs "
                                              "(without --unpaired), or train on these rows with posttrain dpo --loss.type kto")
    data, splits = loaded.data, loaded.splits
    margins = {"train": pair_margins(splits.train, config.loss, data.pairs),
               "heldout": pair_margins(splits.heldout, config.loss, data.heldout_file or data.pairs)}
    return State(config=dataclasses.replace(config, data=data), world=world, placement=placement, model=model, tokenizer=tokenizer,
                 encode=loaded.encode, train=splits.train, held_pairs=splits.heldout, margins=margins, data_stats=splits.stats,
                 provenance=loaded.provenance)


def build_trainer(state: State) -> None:
    """The trainer (one call = the chosen and rejected rewards of some rows; DDP under torchrun),
    its optimizer (backbone and head) and schedule."""
    config = state.config
    state.trainer = wrap(TrainingForward(state.model, batch_rewards, state.placement), state.world, state.placement)
    state.optimizer, state.scheduler = make_optimizer(state.trainer.parameters(), config.optim, config.max_steps)
    state.trainable = Trainable(state.trainer, state.optimizer, state.scheduler, config.optim.max_grad_norm)


def step(state: State, done: int, clock: StepClock | None = None) -> dict[str, Any]:
    """Step `done`: the next batch of the seeded pair stream, then the loss link's step, its timings
    on `clock` (the loop's; a new one when None)."""
    config, placement = state.config, state.placement
    clock = clock or StepClock(placement)
    indices = data_order(len(state.train), config.seed, (done - 1) * config.batch_size, config.batch_size)
    batch = state.encode([state.train[i] for i in indices])
    batch.margins = state.margins["train"][indices] if state.margins["train"] is not None else None  # the step moves it to the batch's device
    with memory_guard(done, MEMORY_KNOBS, phase="update"), clock("train"):
        metrics = loss_step(state.trainable, batch, RewardModelSettings(config.loss, config.micro_batch_size), state.world)
    state.step = done
    tokens = int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum())
    metrics["lr"] = state.scheduler.get_last_lr()[0]
    metrics.update(clock.metrics(tokens, {"training": (tokens, ("train",))}))
    return metrics


def evaluate(state: State) -> dict[str, Any]:
    """The held-out pairs' metrics on rank 0 (the others wait)."""
    metrics: dict[str, Any] = {}
    if state.world.main:
        was_training = state.model.training
        state.model.eval()
        with state.placement.autocast(), memory_guard(state.step, MEMORY_KNOBS, phase="evaluation"):
            metrics, _ = evaluate_reward_pairs(state.model, state.held_pairs, state.encode, state.config.micro_batch_size,
                                               state.config.loss, state.margins["heldout"])
        state.model.train(was_training)
        state.last_heldout = metrics
        if metrics:
            logger.info("held-out pairs at step %d: accuracy %.3f [%.3f, %.3f] (n=%d), reward-length correlation %+.3f",
                        state.step, metrics["heldout/preference_accuracy"], metrics["heldout/preference_accuracy_low"],
                        metrics["heldout/preference_accuracy_high"], len(state.held_pairs), metrics["heldout/reward_length_correlation"])
    state.world.barrier()
    return metrics


def save(state: State, run_dir: RunDirectory) -> None:
    """The checkpoint of `state.step`: the backbone as a model directory (or its LoRA adapter), the head as score.pt."""
    save_training(run_dir, state.step, state.model.backbone, state.tokenizer, state.optimizer, state.scheduler,
                  extra_models={"score": state.model.score}, world=state.world)


def export_final(state: State, run_dir: RunDirectory) -> dict[str, Any]:
    """final/: the export with reward_model.json (the stored reward scale, from the held-out pairs
    or, without any, from up to `SCALE_ROWS` training pairs; held-out accuracy; the pairs'
    provenance); returns the card's export entry."""
    config = state.config
    state.model.eval()
    scale_pairs, source = (state.held_pairs, "held-out pairs") if state.held_pairs else (state.train[:SCALE_ROWS], "training pairs")
    with torch.no_grad(), state.placement.autocast():
        heldout, scale = evaluate_reward_pairs(state.model, scale_pairs, state.encode, config.micro_batch_size, config.loss)
    meta = {
        "reward_mean": scale["mean"], "reward_std_population": scale["std_population"], "reward_std_sample": scale["std_sample"],
        "scale_from": f"{len(scale_pairs)} {source} ({2 * len(scale_pairs)} responses) at step {state.step}",
        "normalisation": "stored: (r - reward_mean) / reward_std_population",
        "heldout_accuracy": heldout.get("heldout/preference_accuracy") if state.held_pairs else None,
        "heldout_accuracy_ci95": [heldout.get("heldout/preference_accuracy_low"), heldout.get("heldout/preference_accuracy_high")]
        if state.held_pairs else None,
        "heldout_pairs": len(state.held_pairs), "steps": state.step, "base_model": config.model, "lora_rank": config.lora_rank,
        "system_prompt": config.data.system_prompt, "use_chat_template": config.data.use_chat_template,
        "pairs": config.data.pairs, "pairs_provenance": state.provenance, "loss": to_dict(config.loss),
    }
    directory = export(state.model, state.tokenizer, run_dir.path / FINAL, meta)
    meta["weights_sha256"] = weights_hash(state.model)
    logger.info("reward model exported to %s (rewards mean %.3f, std %.3f over %s)", directory, scale["mean"], scale["std_population"],
                meta["scale_from"])
    return {"directory": str(directory), "reward_mean": meta["reward_mean"], "reward_std_population": meta["reward_std_population"],
            "reward_std_sample": meta["reward_std_sample"], "scale_from": meta["scale_from"],
            "use_as": f"--reward rm:{directory}"}


def make_card(state: State, changes: list[str]) -> dict[str, Any]:
    """The run card: the four links of a reward-model run."""
    config = state.config
    card = new_card("rm", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = preference_data_card(config.data, PairSplits(state.train, state.held_pairs, state.data_stats), state.provenance,
                                                 seed=config.seed, batch_size=config.batch_size, micro_batch_size=config.micro_batch_size)
    card["links"]["data"]["margins"] = "each pair's `margin` column" if config.loss.margin else "not used"
    card["links"]["reward"] = reward_card(config.data.pairs, state.provenance)
    hidden = state.model.config.hidden_size
    card["links"]["loss"] = loss_card(config.loss, config.lora_rank, config.optim, (hidden + 1) ** -0.5)
    card["links"]["acceptance"] = {
        "heldout_pairs": len(state.held_pairs),
        "measure": "held-out pair accuracy (r_c > r_r; a tie is wrong) with its Wilson 95% interval; margins; the correlation of reward "
                   "with response length and the accuracy on pairs whose chosen response is the shorter (length-bias probes)",
        "eval_every": config.acceptance.eval_every,
        "note": None if state.held_pairs else "no held-out pairs (data.heldout_pairs 0 and no data.heldout_file): nothing measures this model",
    }
    if not state.held_pairs:
        card["notes"].append("no held-out pairs: the reward model's accuracy is not measured")
    card_run_part(card, config, state.placement, state.world, changes)
    return card
