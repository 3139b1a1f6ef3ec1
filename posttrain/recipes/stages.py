"""The stages the demos and `posttrain compare` are made of: a recipe's config from a shipped preset
plus overrides (`Stage`, `stage_config`), the SFT start trained to partial competence in rounds
(`train_sft`), the held-out sets every stage is scored on (`heldout_sets`, the `integer` checker), and
the run-directory helpers. `demo.py` (the main demo), `tool_demo.py` (`posttrain demo --tools`) and
`compare.py` build on it.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from posttrain.config import PRESETS, build_config
from posttrain.data.examples import Task
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, default_shifts, heldout_split, shifted_sets
from posttrain.recipes import sft
from posttrain.rewards import get_verifier
from posttrain.runs import read_jsonl


@dataclass(frozen=True)
class Stage:
    """One training stage: a recipe's config from a preset plus the demo's overrides."""

    name: str
    """Its run directory under the demo's, and its key in summary.json and the report."""
    settings: Callable[[], Any]
    """The recipe's config class (or defaults function)."""
    preset: str
    """presets/<preset>.yaml."""
    steps: str
    """The demo Config field with its step count (it checkpoints once, at the last step)."""
    starts_from: str | None = None
    """The stage whose last checkpoint it starts from (None: from scratch)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Its fixed overrides; those that depend on the run are passed where it is built (`stage_config`)."""


SFT = Stage("sft", sft.Config, "tiny-sft", "sft_steps",
            overrides={"acceptance": {"eval_every": 0, "sets": []}})  # every stage's sets are evaluated below, once
def preset(name: str) -> Path:
    """The shipped preset <name>.yaml (`config.PRESETS`): each demo stage is one of them plus the overrides below."""
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"{path}: the demo's preset is missing (posttrain installed without its package data?)")
    return path


def train_sft(config: Any, held_out_size: dict[str, Any]) -> Path:
    """`config`: a demo's settings (seed, output_dir, sft_steps, sft_round, sft_target). SFT from scratch in rounds of `sft_round` steps, each a resume of the one run (checkpointed
    and evaluated at its end), until held-out pass@1 reaches `sft_target` or `sft_steps` are done;
    returns the run directory (its newest checkpoint is the start)."""
    steps = 0
    while steps < config.sft_steps:
        steps = min(steps + config.sft_round, config.sft_steps)
        round_config = stage_config(SFT, config, {}, held_out_size, {"max_steps": steps, "checkpoint_every": config.sft_round})
        run_dir = sft.run(round_config, resume=steps > config.sft_round)
        reading = [row for row in read_jsonl(run_dir / "metrics.jsonl") if row["step"] == steps and "heldout/pass@1" in row]
        if reading and reading[-1]["heldout/pass@1"] is not None and reading[-1]["heldout/pass@1"] >= config.sft_target:
            break
    return run_dir


def stage_config(stage: Stage, config: Any, starts: dict[str, str], *overrides: dict[str, Any]) -> Any:
    """`stage`'s recipe config: its preset < the demo's seed, the stage's run directory, step count
    and single checkpoint, its start (`starts[stage.starts_from]`) < its own overrides < `overrides`
    (merged section by section)."""
    steps = getattr(config, stage.steps)
    merged: dict[str, Any] = {"seed": config.seed, "output_dir": str(Path(config.output_dir) / stage.name),
                              "max_steps": steps, "checkpoint_every": steps}
    if stage.starts_from is not None:
        merged["model"] = starts[stage.starts_from]
    for extra in (stage.overrides, *overrides):
        for key, value in extra.items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
    return build_config(stage.settings, preset(stage.preset), merged)


def heldout_sets(task: str, options: dict, seed: int, size: int) -> dict[str, Task]:
    """The held-out sets every stage is scored on: the in-distribution split and the shifted ones
    (the task's defaults: one more digit, the sums in words; and the sums asked as a question, a
    shift the tiny model partly manages), all scored by the independent checker."""
    held_out = heldout_split(task, size, seed, options)
    shifts = default_shifts(task, options) + [{"name": "question", "task": task, "task_options": {**options, "phrasing": "question"}}]
    return {IN_DISTRIBUTION: held_out, **{held.name: held.task for held in shifted_sets(
        shifts, Task("demo", "train", [], held_out.reward_kind), task, options, seed, size)}}


def checker(name: str | None, task: Task):
    """Every held-out set's checker: `integer`, written apart from the `exact` reward and labeller."""
    return get_verifier(name or "integer")


def fresh_directory(out: Path) -> Path:
    """`out`, created empty; an earlier demo there (it has summary.json) is replaced, anything else refused."""
    if out.exists():
        if not (out / "summary.json").exists() and any(out.iterdir()):
            raise UserError(f"{out}: holds something other than a finished demo; choose another --output-dir")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def newest_step(run_dir: Path) -> int:
    """The step of the newest checkpoint in a run directory (one line when there is none)."""
    steps = sorted(int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoints").glob("step-*") if (path / "model").is_dir())
    if not steps:
        raise UserError(f"{run_dir}: no SFT checkpoint with a model (checkpoints/step-N/model)")
    return steps[-1]


def last_checkpoint(run_dir: Path, steps: int) -> str:
    """The model directory a stage of `steps` steps saved at its last step."""
    return str(run_dir / "checkpoints" / f"step-{steps:06d}" / "model")


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str):
    """timings[name]: the wall seconds of the block."""
    clock = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - clock
