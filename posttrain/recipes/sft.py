"""`posttrain sft`: supervised fine-tuning, masked NLL on response tokens.

The four links of an SFT run: data = a task's prompts with their gold answers written as responses
(`response_template`); reward = none (imitation); loss = token-mean NLL of the response tokens
(prompt and padding masked out, the ending EOS included); acceptance = held-out accuracy with the
task's checker, plus held-out NLL.

    posttrain sft --config presets/tiny-sft.yaml --max-steps 200
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path
from typing import Callable, ClassVar

import torch

from posttrain.config import RunFields, to_dict
from posttrain.data import TokenizedBatch, tokenize_prompt_response
from posttrain.data.examples import Task, derived_seed
from posttrain.data.stream import data_order
from posttrain.data.tasks import load_splits
from posttrain.distributed import Parallel, full_weights, is_sharded, wrap
from posttrain.errors import UserError
from posttrain.data.files import is_data_source
from posttrain.data.source import TaskSource
from posttrain.data.sft_data import LOSS_ON, is_sft_file, load_sft_rows, tokenize_sft
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, check_set_specs, evaluate_sets, heldout_checker, shifted_sets
from posttrain.models.forward import TrainingForward, batch_response_sums
from posttrain.models.loading import load_policy
from posttrain.losses.sft import sft_loss
from posttrain.losses.sft import step as loss_step
from posttrain.optim import Optimization, Trainable, make_optimizer
from posttrain.rewards import Verifier
from posttrain.runs import RunDirectory, new_card, plot_metrics
from posttrain.runs.faults import memory_guard
from posttrain.runs.plots import plot_sets
from posttrain.runs.timer import Timer
from posttrain.runs.skeleton import StepLoop, card_run_part, card_writer, closing, open_run, start, warn_if_unsafe
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Data(TaskSource):
    """Link 1, data: the task or file to imitate, how its columns map, and the held-out split (the
    shared `TaskSource`), with SFT's own loss mask, response template and training size."""

    sizes: ClassVar[tuple[str, ...]] = ("train_size", "eval_size")

    task: str = "arithmetic"
    """Task spec: arithmetic | rg:<dataset> | a data file of prompts with answers | a data file of SFT rows (messages, or prompt + completion; docs/data.md)."""
    loss_on: str = "assistant"
    """SFT rows: assistant (every assistant turn; a prompt/completion row's completion) | completion (the last assistant turn) | all (every token)."""
    response_template: str = "<answer>{answer}</answer>"
    """How a gold answer becomes the training response."""
    train_size: int = 20000
    """Training examples (procedural tasks generate this many; a file's rows are capped at it)."""

    def validate(self) -> None:
        super().validate()
        if "{answer}" not in self.response_template:
            raise UserError("data.response_template must contain {answer}")
        if self.loss_on not in LOSS_ON:
            raise UserError(f"data.loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")


@dataclasses.dataclass
class Acceptance:
    """Link 4, acceptance: held-out accuracy of a task's gold-answer form, scored by a checker written
    apart from any reward, and the held-out NLL (always; the only measure of SFT rows)."""

    eval_every: int = 0
    """Evaluate held-out accuracy every N steps (0: only at the end)."""
    max_new_tokens: int = 24
    """Generation budget of the held-out evaluation (the tiny model writes one character a token)."""
    checker: str | None = None
    """Held-out checker (a verifier name); None: the task's default checker (written apart from any reward)."""
    sets: list[dict] | None = None
    """Shifted held-out sets beside the task's own, as grpo's acceptance.sets: [{name, task?, task_options?, size?, checker?}]; None: the task's default shifts (arithmetic: one more digit, words; reasoning-gym: harder); []: none. A task's gold answers only."""

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"acceptance.max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.sets is not None:
            if not isinstance(self.sets, list):
                raise UserError(f"acceptance.sets must be a list of held-out sets, got {self.sets!r}")
            check_set_specs(self.sets)


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
    micro_batch_size: int = 32
    """Examples per forward/backward (gradient accumulation when smaller; same gradient)."""
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
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.acceptance.validate()
        if self.batch_size % self.micro_batch_size:
            raise UserError(f"batch_size {self.batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")


@dataclasses.dataclass
class SFTData:
    """What a run imitates: a task's gold answers written into `response_template` (held-out
    accuracy can then be measured), or a file's SFT rows (held-out NLL only). `encode` turns items
    (Examples or SFTRows) into a `TokenizedBatch`."""

    train: list
    held_out: list
    encode: Callable[[list], TokenizedBatch]
    task: Task | None
    """The held-out task of the gold-answer form (None for SFT rows)."""
    card: dict
    checker: Verifier | None = None
    """The held-out checker of `task` (built once, with the run's reward_options)."""
    shifted: list = dataclasses.field(default_factory=list)
    """The shifted held-out sets (`HeldOutSet`s) beside `task`."""


def load_data(data: Data, seed: int, tokenizer) -> SFTData:
    """The run's data, checked before anything is written (one UserError line on bad input)."""
    options = data.load_options()
    if is_data_source(data.task) and is_sft_file(data.task, data.format, data.columns or None, data.split):
        rows, report = load_sft_rows(data.task, data_format=data.format, columns=data.columns or None, source_split=data.split)
        order = list(range(len(rows)))  # the rows stay in the file; shuffled as positions
        random.Random(derived_seed(seed, "split")).shuffle(order)
        if data.eval_size >= len(order):
            raise UserError(f"data.task {data.task}: eval_size={data.eval_size} leaves no training rows out of {len(order)}")
        held, train = rows.take(order[: data.eval_size]), rows.take(order[data.eval_size :][: data.train_size])

        def encode(items):
            return tokenize_sft(tokenizer, items, loss_on=data.loss_on, system_prompt=data.system_prompt)

        encode([*train[:1], *held[:1]])  # a template that cannot mask fails here, before the run directory exists
        chats = sum(row.is_chat for row in train)
        card = {"task": data.task, "options": options, "kind": "SFT rows", "train_rows": len(train), "heldout_rows": len(held),
                "conversations": chats, "prompt_completion_rows": len(train) - chats, "loss_on": data.loss_on,
                "rows_bad": report.rows_bad}
        return SFTData(train, held, encode, None, card)
    train, held_out = load_splits(data.task, train_size=data.train_size, eval_size=data.eval_size, seed=seed, options=options)
    missing = [e.id for e in train.examples if e.answer is None]
    if missing:
        raise UserError(f"data.task {data.task}: example {missing[0]} has no answer to train on")
    if data.loss_on == "all":
        raise UserError("data.loss_on all applies to SFT rows (messages, prompt + completion); a task's gold answers train the response only")

    def encode(examples):
        return tokenize_prompt_response(tokenizer, [e.prompt_input for e in examples],
                                        [data.response_template.format(answer=e.answer) for e in examples],
                                        system_prompt=data.system_prompt)

    card = {"task": data.task, "options": options, "train_examples": len(train), "heldout_examples": len(held_out),
            "duplicates_removed": train.duplicates_removed, "response_template": data.response_template}
    return SFTData(train.examples, held_out.examples, encode, held_out, card)


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
    data = with_acceptance(load_data(config.data, config.seed, tokenizer), config, placement, world)
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
    with closing(run_dir, write_card), StepLoop("sft", run_dir, world, start_step, config.max_steps, config.checkpoint_every,
                                                 config.acceptance.eval_every) as loop:
        for done in loop:
            started = time.perf_counter()
            # 1. The next batch of the seeded data stream.
            items = [data.train[i] for i in data_order(len(data.train), config.seed, (done - 1) * config.batch_size, config.batch_size)]
            batch = data.encode(items).to(placement.device)  # the step's one host-to-device boundary
            # 2. Forward/backward per micro-batch, normalised by the whole batch's tokens; optimizer step.
            timer = Timer(placement.synchronize)
            placement.reset_peak_memory()
            with memory_guard(done, MEMORY_KNOBS, phase="update"), timer("train"):
                metrics = loss_step(models, batch, config.micro_batch_size, world)
            # 3. Log; evaluate and checkpoint on schedule.
            metrics.update({
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_second": int(batch.attention_mask.sum()) / (time.perf_counter() - started),
                "seconds/train": timer.seconds.get("train", 0.0),
                "tokens_per_second/training": int(batch.attention_mask.sum()) / max(1e-9, timer.seconds.get("train", 0.0)),
            })
            if placement.is_cuda:
                metrics["memory/peak_allocated_gib"] = placement.peak_memory_gib()
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


def with_acceptance(data: SFTData, config: Config, placement, world) -> SFTData:
    """`data` with its held-out checker and shifted sets (a task's gold answers only: SFT rows have
    held-out NLL alone), built before the run directory exists, a bad name one line."""
    if data.task is None:
        return data
    trained = Task(config.data.task, "train", data.train, data.task.reward_kind)
    return dataclasses.replace(
        data, checker=heldout_checker(config.acceptance.checker, data.task, config.reward_options, config.unsafe_no_sandbox,
                                      placement=placement, world=world),
        shifted=shifted_sets(config.acceptance.sets, trained, config.data.task, config.data.task_options, config.seed,
                             config.data.eval_size, config.reward_options, config.unsafe_no_sandbox))


def make_card(config: Config, data: SFTData) -> dict:
    """The run card's four links for SFT (the run's own part: `card_run_part`)."""
    card = new_card("sft", config.seed, config=to_dict(config))
    card["links"]["data"] = data.card
    card["links"]["reward"] = {"kind": "none (imitation of " + ("gold answers)" if data.task is not None else "the rows' completions)")}
    card["links"]["loss"] = {"objective": "masked NLL", "aggregation": "token_mean (global token count)", "includes_eos": True,
                             "loss_on": config.data.loss_on if data.task is None else "the response (gold answer in response_template)"}
    card["links"]["acceptance"] = ({"heldout": f"{config.data.task} eval split", "checker": config.acceptance.checker or "task default (strict)"}
                                   if data.task is not None else {"heldout": f"{len(data.held_out)} held-out rows of {config.data.task}", "metric": "token-mean NLL"})
    if data.checker is not None:
        card["links"]["acceptance"].update({
            "checker_settings": data.checker.describe(), "independent": True,
            "independence_reason": f"SFT has no reward: it imitates the gold answers, which the checker {data.checker.name} scores",
            "sets": {IN_DISTRIBUTION: {"task": config.data.task, "size": len(data.task), "checker": data.checker.name},
                     **{held.name: held.spec for held in data.shifted}}})
    return card


def evaluate_and_plot(model, tokenizer, data: SFTData, config: Config, run_dir: RunDirectory, step: int) -> dict:
    """Held-out accuracy (greedy, the task's checker) written to eval/ when the data is a task's,
    the held-out NLL always, and refreshed plots."""
    model.eval()
    if data.task is None:
        metrics = {"heldout/nll": heldout_nll(model, data.encode(data.held_out), config.micro_batch_size)}
        plot_metrics(run_dir.read_metrics() + [{"step": step, **metrics}], ["loss", "heldout/nll"], run_dir.plots)
        return metrics
    _, metrics = evaluate_sets(model, tokenizer, data.task, data.checker, data.shifted, step=step, eval_dir=run_dir.eval_dir,
                               seed=config.seed, max_new_tokens=config.acceptance.max_new_tokens, system_prompt=config.data.system_prompt)
    metrics["heldout/nll"] = heldout_nll(model, data.encode(data.held_out), config.micro_batch_size)
    rows = run_dir.read_metrics() + [{"step": step, **metrics}]
    plot_metrics(rows, ["loss", "heldout/pass@1", "heldout/nll"], run_dir.plots)
    if data.shifted:
        plot_sets(rows, [IN_DISTRIBUTION] + [held.name for held in data.shifted], run_dir.plots / "heldout_sets.png")
    return metrics


@torch.no_grad()
def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def heldout_nll(model, batch: TokenizedBatch, micro_batch_size: int) -> float:
    """Token-mean NLL of the masked (response) tokens of a held-out batch."""
    rows = batch.input_ids.shape[0]
    batch = batch.to(_device_of(model))
    global_tokens = batch.mask[:, 1:].sum()
    forward = TrainingForward(model, batch_response_sums, full_forward=is_sharded(model))  # under the caller's autocast
    return sum(
        sft_loss(forward, batch, slice(start, start + micro_batch_size), global_tokens).item()
        for start in range(0, rows, micro_batch_size)
    )
