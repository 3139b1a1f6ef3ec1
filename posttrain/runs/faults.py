"""What ends a run early and how it ends: a stop asked by a signal, memory that ran out, a resume
whose config changed.

    SIGTERM / SIGINT  the run finishes the step in progress, writes a checkpoint and raises
                      `RunStopped` ("stopped by SIGTERM at step N; resume with: posttrain grpo
                      --resume DIR"), exit status 128 + the signal's number (143, 130); a second
                      signal stops at once. Under torchrun the ranks agree on the step (`StopSignals.agreed`).
    out of memory     torch's `OutOfMemoryError`, CPU `MemoryError` or an allocator's "not enough
                      memory" become `OutOfMemory`: one line with the step, the phase and the
                      settings that shrink that phase (the newest checkpoint is untouched: resume from it).
    changed config    `config_changes` lists the fields of a resumed run's config that differ from its
                      config.yaml and would change its data order or its loss; the recipe refuses them
                      unless `--resume-changed-config` accepts them (then the run card lists them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from posttrain.config import load_yaml, to_dict
from posttrain.distributed import World
from posttrain.errors import UserError

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(UserError):
    """The run stopped at the end of step `step` because of signal `signum`, after checkpointing."""

    def __init__(self, signum: int, step: int, resume_command: str):
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at step {step}; resume with: {resume_command}", exit_code=128 + signum)
        self.signum, self.step = signum, step


class OutOfMemory(UserError):
    """Memory ran out in `phase` of step `step`; the message names the settings that reduce it."""

    def __init__(self, step: int, phase: str, knobs: list[str], device: str):
        hint = ", ".join(knobs) if knobs else "a smaller model or batch"
        super().__init__(f"out of {device} memory at step {step}, during {phase}; reduce it with {hint} "
                         "(the newest checkpoint is intact: --resume from it)", exit_code=3)
        self.step, self.phase = step, phase


def is_out_of_memory(error: BaseException) -> str | None:
    """"GPU" or "CPU" if `error` is memory running out (torch's OutOfMemoryError, MemoryError, or
    an allocator RuntimeError saying so), else None."""
    if isinstance(error, torch.OutOfMemoryError):
        return "GPU"
    if isinstance(error, MemoryError):
        return "CPU"
    text = str(error)
    if isinstance(error, RuntimeError) and ("not enough memory" in text or "out of memory" in text.lower()):
        return "GPU" if "CUDA" in text or "HIP" in text else "CPU"
    return None


PHASES = {"generation": "generation", "scoring": "scoring", "logprobs": "reference", "update": "update",
          "train": "update", "evaluation": "evaluation"}
"""A step's timer phase (`runs/timer.py`) as the out-of-memory message names it."""


def out_of_memory(error: BaseException, step: int, phase: str | None, knobs: dict[str, list[str]]) -> OutOfMemory | None:
    """The one-line `OutOfMemory` for `error` raised in timer phase `phase` of step `step` (None if
    it is not memory running out); `knobs` maps each named phase to the settings that shrink it."""
    device = is_out_of_memory(error)
    if device is None:
        return None
    named = PHASES.get(phase or "", phase or "the step")
    if device == "GPU" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return OutOfMemory(step, named, knobs.get(named, knobs.get("update", [])), device)


@contextmanager
def memory_guard(step: int, knobs: dict[str, list[str]], timer=None, phase: str | None = None):
    """Turn memory running out inside the block into `OutOfMemory` (the phase: `phase`, else the
    phase `timer` was in); any other exception passes through. The traceback is logged at debug level."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unless it is memory
        failure = out_of_memory(error, step, phase or (timer.current if timer is not None else None), knobs)
        if failure is None:
            raise
        logger.debug("out of memory", exc_info=error)
        raise failure from None


class StopSignals:
    """SIGTERM and SIGINT, caught while a run trains: the first asks it to stop after the step in
    progress (`requested`); a second one stops the process at once (the default action). A
    context manager; it installs nothing outside the main thread.

        with StopSignals(world) as stop:
            for step in ...:
                ...one step...
                if stop.agreed() is not None: checkpoint, then raise RunStopped
    """

    def __init__(self, world: World | None = None):
        self.world = world or World()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: stop now, as if we had never caught it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        logger.warning("%s received: stopping after the step in progress and checkpointing (send it again to stop at once)",
                       signal.Signals(signum).name)

    @property
    def requested(self) -> int | None:
        """The signal this process received, if any."""
        return self.signum

    def agreed(self) -> int | None:
        """The signal any rank received (every rank gets the same answer, so they stop at the same step)."""
        if not self.world.active:
            return self.signum
        device = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
        flag = self.world.reduce(torch.tensor([float(self.signum or 0)], device=device), op="max")
        return int(flag.item()) or None


# Fields that may change when a run is resumed: they do not touch its data order or its loss.
SAFE_ON_RESUME = ("max_steps", "output_dir", "checkpoint_every", "samples_per_step", "report_to", "tensorboard",
                  "hardware.device", "memory.gradient_checkpointing", "update.micro_batch_size", "micro_batch_size",
                  "parallel.", "acceptance.")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat = {}
        for key, value in tree.items():
            flat.update(_flat(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): tree}


def config_changes(saved: dict, resumed: dict, defaults: dict | None = None) -> list[str]:
    """`key: saved -> resumed` for every field of a resumed config (a dict as config.yaml holds it)
    that differs from the run's saved config.yaml and is not `SAFE_ON_RESUME`. A field the saved
    config lacks (added to posttrain after the run was written) is no change while it keeps its value
    in `defaults` (the config class's defaults: the behaviour the run had without it)."""
    before, after = _flat(yaml.safe_load(yaml.safe_dump(saved))), _flat(yaml.safe_load(yaml.safe_dump(resumed)))
    default = _flat(yaml.safe_load(yaml.safe_dump(defaults))) if defaults is not None else {}
    changes = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key) or any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_ON_RESUME):
            continue
        if key not in before and key in default and after.get(key) == default[key]:
            continue
        changes.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    return changes


def check_resumed_config(run_dir: Path, config: Any, accept: bool) -> list[str]:
    """The changes (`config_changes`) of `config` (a recipe's config dataclass) from the config.yaml
    of the run it resumes in `run_dir`: a UserError listing them unless `accept`
    (`--resume-changed-config`), else logged and returned for the run card. Call it before the
    resumed run writes its config.yaml."""
    saved = load_yaml(Path(run_dir) / "config.yaml")
    changes = config_changes(saved, to_dict(dataclasses.replace(config, output_dir=saved.get("output_dir"))), to_dict(type(config)()))
    if changes and not accept:
        raise UserError(f"--resume with a config that differs from the run's config.yaml in {len(changes)} field(s) that change "
                        f"its data order or loss: {'; '.join(changes)} (pass --resume-changed-config to accept them)")
    for change in changes:
        logger.warning("resumed with a changed config: %s", change)
    return changes
