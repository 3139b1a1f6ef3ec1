"""The run skeleton every recipe shares, so that a recipe reads as: build the four links, then its
numbered loop.

    placement, world = start(config)                       # device, precision, torchrun, seed
    ...                                                    # the links: what fails on bad input fails here
    run_dir, config, changes = open_run("sft", config, world, resume, resume_changed_config)
    card_run_part(card, config, placement, world, changes)
    write_card = card_writer(run_dir, card, world)
    with closing(run_dir, write_card), StepLoop("sft", run_dir, world, first, max_steps, checkpoint_every, eval_every) as loop:
        for done in loop:
            ...                                            # sample / score / step
            if loop.evaluates(done): ...
            loop.end_step(done, metrics, save=lambda: save_training(...), loss="0.123")
    del trainer                                            # DDP wrappers first, then the process group
    world.close()

`closing` always closes the run directory (and so its trackers, W&B / MLflow runs included), also
when the run fails; it writes the card at the end and when a stop signal ends the run early.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from posttrain.config import save_yaml
from posttrain.distributed import World, init_world
from posttrain.evaluation.checklist import card_section
from posttrain.hardware import Placement, resolve
from posttrain.runs.card import write_run_card
from posttrain.runs.checkpoint import seed_everything
from posttrain.runs.directory import RunDirectory, default_output_dir
from posttrain.runs.faults import RunStopped, StopSignals, check_resumed_config
from posttrain.runs.results import results
from posttrain.runs.timer import StepClock
from posttrain.runs.training_state import check_unfinished

logger = logging.getLogger(__name__)

UNSAFE_WARNING = ("UNSAFE: unsafe_no_sandbox is set: model-written code runs WITHOUT the bubblewrap sandbox "
                  "(resource limits only). Use this only on a machine you can lose.")
UNSAFE_NOTE = "UNSAFE: model-written code ran WITHOUT the bubblewrap sandbox (unsafe_no_sandbox: true)"


def warn_if_unsafe(unsafe_no_sandbox: bool) -> None:
    """The one warning a run without the sandbox logs at its start."""
    if unsafe_no_sandbox:
        logger.warning(UNSAFE_WARNING)


def start(config) -> tuple[Placement, World]:
    """The run's device and precision (`config.hardware`), its place under torchrun
    (`config.parallel`), and every RNG seeded with `config.seed`."""
    placement = resolve(config.hardware)
    world = init_world(config.parallel, placement)
    seed_everything(config.seed)
    return placement, world


def open_run(recipe: str, config, world: World, resume: bool, resume_changed_config: bool):
    """The run directory (`config.output_dir`, or runs/<recipe>-<time>), the resume checks (a
    finished run is refused, `training_state.check_unfinished`; a config that changes the data order
    or the loss unless `resume_changed_config`) and config.yaml, written only when they pass.
    Returns (run_dir, the config with its resolved output_dir: a copy, the caller's is untouched,
    changes accepted on resume)."""
    run_dir = RunDirectory(config.output_dir or default_output_dir(recipe, world), resume=resume, writer=world.main,
                           trackers=config.trackers())
    if resume:
        check_unfinished(run_dir.path, config.max_steps)
    changes = check_resumed_config(run_dir.path, config, resume_changed_config) if resume else []
    config = dataclasses.replace(config, output_dir=str(run_dir.path))
    if world.main:
        save_yaml(config, run_dir.path / "config.yaml")
    return run_dir, config, changes


def card_run_part(card: dict[str, Any], config, placement: Placement, world: World, changes: list[str]) -> None:
    """What every run card says of the run itself: world size, hardware, the changes a resume
    accepted, and the UNSAFE note first when the sandbox was off."""
    card["run"]["world_size"] = world.size
    card["run"]["hardware"] = {**placement.describe(), "gradient_checkpointing": config.memory.gradient_checkpointing}
    if changes:
        card["run"]["resumed_with_changes"] = changes
    if config.unsafe_no_sandbox and UNSAFE_NOTE not in card["notes"]:
        card["notes"].insert(0, UNSAFE_NOTE)


def card_writer(run_dir: RunDirectory, card: dict[str, Any], world: World) -> Callable[[], None]:
    """A function that writes `card` (as it is when called) into the run directory, on rank 0 only."""
    def write() -> None:
        if world.main:
            write_run_card(run_dir.path, card)
    return write


@contextlib.contextmanager
def closing(run_dir: RunDirectory, card: dict[str, Any], write_card: Callable[[], None]) -> Iterator[None]:
    """The epilogue: the card, with its results section (`runs.results`: each held-out set from
    its first evaluation to its last) and its checklist (`evaluation.checklist`: the seed's
    questions answered from the run's own files, and the verdict), written when the loop ends (at max_steps, or early by a stop
    signal), and the run directory closed whatever happens. The world is the caller's to close after
    its wrapped models are gone (DDP's destructors talk to the process group), and only on success:
    on a failure a barrier would pair with another rank's pending collective, and torchrun ends the job."""
    def finish() -> None:
        if run_dir.writer:
            card["results"] = results(run_dir.path)
            try:  # a run that trained is never failed by its epilogue: a checklist that cannot be read is said, not raised
                card["checklist"] = card_section(run_dir.path, card)
                logger.info("checklist: %s", card["checklist"]["verdict"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                logger.warning("the run card's checklist was not written: %s", error)
        write_card()

    try:
        yield
        finish()
    except RunStopped:
        finish()
        raise
    finally:
        run_dir.close()


class StepLoop:
    """The step loop's cadence: the progress bar, stop signals (SIGTERM / SIGINT finish the step,
    checkpoint it, then `RunStopped`), the evaluation and checkpoint schedule, and each step's clock
    (`clock`: its phases' seconds, wall time, throughput and peak memory on `placement`'s device).
    Iterating yields `done`, the number of the step being run (first_step + 1 ... max_steps)."""

    def __init__(self, recipe: str, run_dir: RunDirectory, world: World, first_step: int, max_steps: int,
                 checkpoint_every: int, eval_every: int, placement: Placement | None = None):
        self.recipe, self.run_dir, self.world, self.placement = recipe, run_dir, world, placement
        self.first_step, self.max_steps = first_step, max_steps
        self.checkpoint_every, self.eval_every = checkpoint_every, eval_every
        self.stop = StopSignals(world)
        self.progress: tqdm | None = None
        self.clock = StepClock(placement)
        """The clock of the step being run: a new one starts as each step does."""

    def __enter__(self) -> "StepLoop":
        self.stop.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.close()
        self.stop.__exit__(*exc)

    def __iter__(self) -> Iterator[int]:
        self.progress = tqdm(range(self.first_step, self.max_steps), desc=self.recipe, initial=self.first_step,
                             total=self.max_steps, disable=not self.world.main)
        for step in self.progress:
            self.clock = StepClock(self.placement)
            yield step + 1

    def evaluates(self, done: int) -> bool:
        """Whether step `done` ends with a held-out evaluation: every `eval_every` steps and the last."""
        return bool(self.eval_every and done % self.eval_every == 0) or done == self.max_steps

    def end_step(self, done: int, metrics: dict[str, Any], save: Callable[[], None],
                 after_log: Callable[[], None] | None = None, **postfix: str) -> None:
        """Log the step's metrics, then `after_log` (plots), the progress bar's numbers; checkpoint
        with `save` every `checkpoint_every` steps, at the last and when a stop signal came (all
        ranks agree on it); then end the run early with `RunStopped` if one did."""
        self.run_dir.log_metrics(done, metrics)
        if after_log is not None:
            after_log()
        if self.progress is not None:
            self.progress.set_postfix(**postfix)
        stopping = self.stop.agreed()
        if done % self.checkpoint_every == 0 or done == self.max_steps or stopping:
            save()
        if stopping and done < self.max_steps:
            raise RunStopped(stopping, done, f"posttrain {self.recipe} --resume {self.run_dir.path}")
