"""The stages the demos and `posttrain compare` are made of: a recipe's config from a shipped preset
plus overrides (`Stage`, `stage_config`), the SFT start trained to partial competence in rounds
(`train_sft`), the held-out sets every stage is scored on (`heldout_sets`, the `integer` checker), and
the run-directory helpers. `demo.py` (the main demo), `tool_demo.py` (`posttrain demo --tools`) and
`compare.py` build on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from posttrain.atomic import write_text_atomically
from posttrain.config import PRESETS, build_config
from posttrain.data.examples import Task
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, default_shifts, heldout_split, shifted_sets
from posttrain.recipes import sft
from posttrain.rewards import get_verifier
from posttrain.runs import read_jsonl
from posttrain.runs.checkpoint import PREFIX, latest_checkpoint
from posttrain.runs.faults import RunStopped

logger = logging.getLogger(__name__)


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
    returns the run directory (its newest checkpoint is the start). A round an earlier, stopped demo finished is kept
    and one it was stopped in goes on from its checkpoint (`run_stage`)."""
    steps = 0
    while steps < config.sft_steps:
        steps = min(steps + config.sft_round, config.sft_steps)
        round_config = stage_config(SFT, config, {}, held_out_size, {"max_steps": steps, "checkpoint_every": config.sft_round})
        run_dir = run_stage(sft.run, round_config)
        reading = [row for row in read_jsonl(run_dir / "metrics.jsonl") if row["step"] == steps and "heldout/pass@1" in row]
        if reading and reading[-1]["heldout/pass@1"] is not None and reading[-1]["heldout/pass@1"] >= config.sft_target:
            break
    return run_dir


def run_stage(run: Callable[..., Path], config: Any) -> Path:
    """Run a stage's recipe (`run(config, resume=...)`) into `config.output_dir`, going on from what a stopped demo left
    there: a run whose newest complete checkpoint is at `config.max_steps` is finished and kept as it is; one with an
    earlier checkpoint (a stop signal writes one) is resumed from it; one without a checkpoint is started over. A stop
    signal in the stage is its `RunStopped`, with `stage` (the stage's directory name) for the demo's message."""
    out = Path(config.output_dir)
    checkpoint = latest_checkpoint(out / "checkpoints") if (out / "config.yaml").is_file() else None
    step = int(checkpoint.name.removeprefix(PREFIX)) if checkpoint is not None else None
    if step is not None and step >= config.max_steps:
        logger.info("%s: finished by an earlier run of the demo (step %d), kept", out, step)
        return out
    if step is None and out.exists():
        shutil.rmtree(out)  # stopped before its first checkpoint: nothing to go on from
    if step is not None:
        logger.info("%s: going on from step %d of an earlier, stopped run of the demo", out, step)
    try:
        return run(config, resume=step is not None)
    except RunStopped as stop:
        stop.stage = out.name
        raise


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


STATE = "demo.json"
"""A demo directory's record of its settings and its wall times so far: a directory with it and without summary.json
holds a demo that stopped before its report, which the same command goes on with."""


def demo_directory(out: Path, settings: dict[str, Any], command: str) -> tuple[Path, dict[str, Any]]:
    """`out` for a demo with `settings` (run as `command`), and the wall times ({"timings": {name: s}, "seconds": s}) an
    earlier, stopped run of the same demo spent there. A finished demo there (summary.json) is replaced; a stopped one
    with the same settings is kept, to go on from its finished stages; one with other settings, or anything else, is
    refused in one line."""
    if out.exists() and any(out.iterdir()) and not (out / "summary.json").exists():
        if not (out / STATE).is_file():
            raise UserError(f"{out}: holds something other than a demo; choose another --output-dir")
        saved = json.loads((out / STATE).read_text())
        changed = [f"{key}: {saved['settings'].get(key)!r} -> {value!r}" for key, value in settings.items() if saved["settings"].get(key) != value]
        if changed:
            raise UserError(f"{out}: holds a stopped demo with other settings ({'; '.join(changed)}); go on with it: "
                            f"{saved['command']}, or choose another --output-dir (or delete {out} to start over)")
        logger.info("%s: a stopped demo with these settings: going on from its finished stages", out)
        return out, {"timings": saved.get("timings", {}), "seconds": saved.get("seconds", 0.0)}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spent = {"timings": {}, "seconds": 0.0}
    save_state(out, settings, command, spent)
    return out, spent


def save_state(out: Path, settings: dict[str, Any], command: str, spent: dict[str, Any]) -> None:
    """demo.json: the settings, the command that goes on with this demo, and the wall times spent so far."""
    write_text_atomically(out / STATE, json.dumps({"settings": settings, "command": command, **spent}, indent=1) + "\n")


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
    """timings[name] += the wall seconds of the block, also when it raises (a stopped stage's time counts when the demo
    goes on with it)."""
    clock = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - clock
