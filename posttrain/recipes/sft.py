"""`posttrain sft`: supervised fine-tuning, masked NLL on response tokens.

The four links of an SFT run: data = a task's prompts with their gold answers written as responses
(`response_template`); reward = none (imitation); loss = token-mean NLL of the response tokens
(prompt and padding masked out, the ending EOS included); acceptance = held-out accuracy with the
task's checker, plus held-out NLL. This module orchestrates them: the data link lives in
`posttrain.data.sft_data` (Data, load_data), the loss in `posttrain.losses.sft`, the held-out
evaluation in `posttrain.evaluation.sft`; the Acceptance and Config sections are here.

    posttrain sft --config tiny-sft --max-steps 200
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import ClassVar

from posttrain.config import RunFields, to_dict
from posttrain.data.context import PromptSet, check_prompts_fit
from posttrain.data.examples import Task
from posttrain.data.sft_data import Data, SFTData, load_data  # the data link; sft.Data stays importable here
from posttrain.data.stream import data_order
from posttrain.distributed import Parallel, full_weights, wrap
from posttrain.errors import UserError
from posttrain.evaluation import settings as evaluation_settings
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, heldout_checker, shifted_sets
from posttrain.evaluation.sft import HeldoutSettings, acceptance_card, heldout_metrics
from posttrain.models.forward import TrainingForward, batch_response_sums
from posttrain.models.loading import load_policy
from posttrain.losses.sft import SFTSettings
from posttrain.losses.sft import step as loss_step
from posttrain.optim import Optimization, Trainable, make_optimizer
from posttrain.runs import RunDirectory, new_card, plot_metrics
from posttrain.runs.faults import memory_guard
from posttrain.runs.plots import plot_sets
from posttrain.runs.skeleton import StepLoop, card_run_part, card_writer, closing, open_run, start, warn_if_unsafe
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Acceptance(evaluation_settings.Acceptance):
    """Link 4, acceptance (`evaluation/settings.Acceptance`: checker, eval_every, max_new_tokens,
    sets): held-out accuracy of a task's gold-answer form, scored by a checker written apart from
    any reward, and the held-out NLL (always). SFT rows (a file) are scored on a task's held-out
    split too when their provenance names the task they were sampled from (`posttrain pairs --sft`),
    or `task` names one, as DPO's pairs are; shifted sets apply to a task's gold answers only."""

    max_new_tokens: int = 24
    """Generation budget of the held-out evaluation (the tiny model writes one character a token)."""
    eval_every: int = 0
    """Evaluate held-out accuracy every N steps (0: only at the end; SFT does not evaluate its start)."""
    task: str | None = None
    """SFT rows only: the task whose held-out split scores pass@1; None: the task the rows' provenance sidecar records (none: NLL only)."""
    task_options: dict | None = None
    """SFT rows only: its options (None: the provenance's)."""
    eval_size: int | None = None
    """SFT rows only: held-out problems (None: the provenance's, so the split is the one the rows' prompts avoided; else 200)."""
    split_seed: int | None = None
    """SFT rows only: the seed of the task's train/held-out split (None: the provenance's, else `seed`)."""


@dataclasses.dataclass
class Config(RunFields):
    MOVED: ClassVar[dict[str, str]] = {name: f"acceptance.{name}" for name in ("eval_every", "max_new_tokens", "checker", "sets")}
    """SFT's acceptance settings were top-level keys before they became the acceptance section."""

    model: str = "tiny"
    """Model spec: tiny | smollm2-135m | a local Hugging Face directory | a hub id."""
    data: Data = dataclasses.field(default_factory=Data)
    """What to imitate (task or file, format, columns, split, loss_on, sizes)."""
    batch_size: int = 32
    """Examples per optimizer step."""
    micro_batch_size: int | None = None
    """Examples per forward/backward (None: batch_size, one pass; smaller: gradient accumulation, the same gradient). Recorded resolved in config.yaml."""
    optim: Optimization = dataclasses.field(default_factory=lambda: Optimization(lr=1e-3, warmup_steps=20))
    """Optimizer and schedule."""
    parallel: Parallel = dataclasses.field(default_factory=Parallel)
    """Under torchrun: DDP or FSDP2 (see posttrain/distributed.py); ignored in one process."""
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
    """Link 4: held-out evaluation (cadence, generation budget, checker, shifted sets)."""
    max_steps: int = 200
    checkpoint_every: int = 100

    def validate(self) -> None:
        super().validate()
        self.optim.validate()
        self.parallel.validate()
        self.data.validate()
        if self.micro_batch_size is None:  # follows batch_size (`--batch_size 4` alone works); resolved, so config.yaml holds the number
            self.micro_batch_size = self.batch_size
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.acceptance.validate()
        if self.batch_size % self.micro_batch_size:
            raise UserError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")


MEMORY_KNOBS = {"update": ["micro_batch_size", "memory.gradient_checkpointing", "hardware.precision"],
                "evaluation": ["acceptance.max_new_tokens", "micro_batch_size", "hardware.precision"]}
"""The settings that shrink each phase's memory, for the out-of-memory message (`runs/faults.py`)."""


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Train; returns the run directory. `config` comes checked from `build_config` and is not changed.
    A resume refuses a config that changes the data order or the loss unless `resume_changed_config`;
    SIGTERM / SIGINT stop it after the step in progress, with a checkpoint (`runs/faults.py`)."""
    # 0. Everything that can fail on bad input fails here, before the run directory exists.
    placement, world = start(config)
    model, tokenizer = load_policy(config.model, placement=placement, gradient_checkpointing=config.memory.gradient_checkpointing)
    data = with_acceptance(load_data(config.data, config.seed, tokenizer), config, placement, world, model, tokenizer)
    if len(data.train) < config.batch_size:  # the data stream would repeat rows within a step
        raise UserError(f"data.task {config.data.task}: {len(data.train)} training rows, fewer than one batch of batch_size={config.batch_size}")
    warn_if_unsafe(config.unsafe_no_sandbox)
    run_dir, config, changes = open_run("sft", config, world, resume, resume_changed_config)

    # What forward/backward goes through: DDP, FSDP2 (the model sharded in place) or the wrapper itself.
    trainer = wrap(TrainingForward(model, batch_response_sums, placement, full_forward=world.active and world.strategy == "fsdp2"), world, placement)
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, config.max_steps)
    models = Trainable(trainer, optimizer, scheduler, config.optim.max_grad_norm)
    start_step = restore_training(run_dir, model, optimizer, scheduler, world=world)["step"] if resume else 0
    card = make_card(config, data)
    card_run_part(card, config, placement, world, changes)
    write_card = card_writer(run_dir, card, world)
    write_card()
    model.train()
    with closing(run_dir, card, write_card), StepLoop("sft", run_dir, world, start_step, config.max_steps, config.checkpoint_every,
                                                 config.acceptance.eval_every, placement) as loop:
        for done in loop:
            # 1. The next batch of the seeded data stream.
            items = [data.train[i] for i in data_order(len(data.train), config.seed, (done - 1) * config.batch_size, config.batch_size)]
            batch = data.encode(items).to(placement.device)  # the step's one host-to-device boundary
            # 2. Forward/backward per micro-batch, normalised by the whole batch's tokens; optimizer step.
            with memory_guard(done, MEMORY_KNOBS, phase="update"), loop.clock("train"):
                metrics = loss_step(models, batch, SFTSettings(config.micro_batch_size), world)
            # 3. Log; evaluate and checkpoint on schedule.
            tokens = int(batch.attention_mask.sum())
            metrics["lr"] = scheduler.get_last_lr()[0]
            metrics.update(loop.clock.metrics(tokens, {"training": (tokens, ("train",))}))
            if loop.evaluates(done):
                with full_weights(model), placement.autocast(), memory_guard(done, MEMORY_KNOBS, phase="evaluation"):  # rank 0 evaluates; FSDP2: the others lend shards
                    if world.main:
                        metrics.update(evaluate_and_plot(model, tokenizer, data, config, run_dir, done))
                world.barrier()
                model.train()
            loop.end_step(done, metrics, save=lambda: save_training(run_dir, done, model, tokenizer, optimizer, scheduler, world=world),
                          loss=f"{metrics['loss']:.3f}")
    del trainer, models  # DDP wrappers first, then the process group
    world.close()
    return run_dir.path


def with_acceptance(data: SFTData, config: Config, placement, world, model, tokenizer) -> SFTData:
    """`data` with its held-out checker and shifted sets (a task's gold answers only: SFT rows have
    held-out NLL alone), built before the run directory exists, a bad name one line; a
    held-out prompt that cannot fit the model's positions with acceptance.max_new_tokens is one line."""
    if data.rows_file:
        return rows_acceptance(data, config, placement, world, model, tokenizer)
    own = [name for name in ("task", "task_options", "eval_size", "split_seed") if getattr(config.acceptance, name) is not None]
    if own:
        raise UserError(f"acceptance.{own[0]} applies to SFT rows (a file); a task's gold answers are scored on its own held-out "
                        "split (data.eval_size)")
    trained = Task(config.data.task, "train", data.train, data.task.reward_kind)
    shifted = shifted_sets(config.acceptance.sets, trained, config.data.task, config.data.task_options, config.seed,
                           len(data.held_out), config.reward_options, config.unsafe_no_sandbox)
    budget = config.acceptance.max_new_tokens
    check_prompts_fit(model, tokenizer, [PromptSet("held-out", data.task.examples, budget, "acceptance.max_new_tokens"),
                                         *(PromptSet(f"held-out '{s.name}'", s.task.examples, budget, "acceptance.max_new_tokens") for s in shifted)],
                      system_prompt=config.data.system_prompt)
    return dataclasses.replace(
        data, checker=heldout_checker(config.acceptance.checker, data.task, config.reward_options, config.unsafe_no_sandbox,
                                      placement=placement, world=world), shifted=shifted)


def rows_acceptance(data: SFTData, config: Config, placement, world, model, tokenizer) -> SFTData:
    """SFT rows with a held-out task: the split `evaluation.preference.heldout_task` resolves from
    `acceptance` and the rows' provenance sidecar (the task, options, size and seed the rows were
    sampled apart from), its checker, and the training rows whose prompt is a held-out problem's
    dropped and counted (`data.card["removed_heldout_task_overlap"]`); `data` as is without a task."""
    from posttrain.data.provenance import read_provenance
    from posttrain.evaluation.preference import heldout_task

    provenance = read_provenance(config.data.task) if Path(config.data.task).is_file() else None
    held_out, spec = heldout_task(config.acceptance, provenance, config.seed)
    if held_out is None:
        return data
    held_prompts = {json.dumps(example.prompt_input, sort_keys=True) for example in held_out.examples}
    kept = [row for row in data.train if row.is_chat or json.dumps(row.prompt, sort_keys=True) not in held_prompts]
    card = {**data.card, "train_rows": len(kept), "removed_heldout_task_overlap": len(data.train) - len(kept),
            "heldout_task": {key: spec[key] for key in ("task", "options", "eval_size", "split_seed")}}
    check_prompts_fit(model, tokenizer, [PromptSet("held-out", held_out.examples, config.acceptance.max_new_tokens, "acceptance.max_new_tokens")],
                      system_prompt=config.data.system_prompt)
    checker = heldout_checker(spec["checker"] if config.acceptance.checker is None else config.acceptance.checker, held_out,
                              config.reward_options, config.unsafe_no_sandbox, placement=placement, world=world)
    return dataclasses.replace(data, train=kept, task=held_out, checker=checker, card=card)


def make_card(config: Config, data: SFTData) -> dict:
    """The run card's four links for SFT (the run's own part: `card_run_part`)."""
    card = new_card("sft", config.seed, config=to_dict(config))
    card["links"]["data"] = data.card
    card["links"]["reward"] = {"kind": "none (imitation of " + ("the rows' completions)" if data.rows_file else "gold answers)")}
    if "provenance" in data.card:
        card["links"]["reward"]["rows_from"] = data.card["provenance"]["rows_from"]
    card["links"]["loss"] = {"objective": "masked NLL", "aggregation": "token_mean (global token count)", "includes_eos": True,
                             "loss_on": config.data.loss_on if data.rows_file else "the response (gold answer in response_template)"}
    card["links"]["acceptance"] = acceptance_card(data, config.data.task, config.acceptance.checker)
    return card


def evaluate_and_plot(model, tokenizer, data: SFTData, config: Config, run_dir: RunDirectory, step: int) -> dict:
    """Held-out accuracy (greedy, the task's checker) written to eval/ when the data is a task's,
    the held-out NLL always (`evaluation/sft.py`), and refreshed plots."""
    model.eval()
    settings = HeldoutSettings(config.seed, config.acceptance.max_new_tokens, config.data.system_prompt, config.micro_batch_size)
    metrics = heldout_metrics(model, tokenizer, data, settings, run_dir.eval_dir, step)
    rows = run_dir.read_metrics() + [{"step": step, **metrics}]
    if data.task is None:
        plot_metrics(rows, ["loss", "heldout/nll"], run_dir.plots)
        return metrics
    plot_metrics(rows, ["loss", "heldout/pass@1", "heldout/nll"], run_dir.plots)
    if data.shifted:
        plot_sets(rows, [IN_DISTRIBUTION] + [held.name for held in data.shifted], run_dir.plots / "heldout_sets.png")
    return metrics
