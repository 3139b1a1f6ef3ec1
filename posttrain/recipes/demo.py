"""`posttrain demo` (what `make demo` runs): the whole product on the built-in tiny model, for real.

1. SFT trains the tiny model from scratch on 2-digit addition, just to partial competence: in
   rounds of `sft_round` steps, stopping at the first whose held-out pass@1 reaches `sft_target`
   (where that happens moves with the processor's float rounding: a fixed step count left one
   machine at 0.38 and another at 0.97, with nothing for the later stages to show).
2. Baseline acceptance: held-out accuracy with the independent checker.
3. GRPO from that start, rewarded by a program (RLVR).
4. `pairs` from the SFT model (verifier-labelled) and DPO on them, from the same start, with a
   comparable budget (as many sampled answers as GRPO generated): RPO (DPO plus the chosen answers'
   NLL), and plain DPO beside it, whose fall the report explains (likelihood displacement).
5. Only the reward link changed: a reward model (`posttrain rm`, presets/tiny-rm.yaml) trained on
   those same pairs from the SFT start, then GRPO from the same start against it (`rm:`) instead of
   the program: where a learned reward and the real goal come apart, this run shows it.
6. Acceptance again for each, on the same held-out sets (in distribution, one more digit, the sums
   in words, asked as a question; paired confidence intervals), with the `integer` checker written apart from the
   `exact` reward.
7. A report (`report.md`, `summary.json`, plots) next to the stages' run directories.

A demo stopped part-way (SIGTERM or Ctrl-C in a stage: the stage checkpoints its step; or killed) goes on
when the same command runs again: finished stages are kept, a stopped one resumes from its checkpoint,
the pairs are kept once written whole (`stages.run_stage`, `stages.demo_directory`: demo.json records the
settings and wall times); a stop signal's line names that command.

Each training stage is a preset (presets/tiny-sft.yaml, tiny-grpo.yaml, tiny-dpo.yaml, tiny-rm.yaml) plus the few
overrides written below: the demo's numbers are the presets' numbers.

The seed's point, made concrete: GRPO and DPO changed different links (online vs offline data, the
same program as reward), and only held-out problems with a separate checker say what improved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.config import build_config
from posttrain.data.examples import Task
from posttrain.data.provenance import provenance_path, read_provenance
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, evaluate_task, independence
from posttrain.evaluation.reuse import reuse_evaluations
from posttrain.models import load_model
from posttrain.recipes import dpo, dpo_config, online, online_config, pairs, rm
from posttrain.recipes.stages import SFT, Stage, heldout_sets, preset, stage_config, train_sft  # noqa: F401 (demo.preset: the tests)
from posttrain.recipes.stages import checker as _checker
from posttrain.recipes.stages import demo_directory, last_checkpoint, newest_step, run_stage, save_state
from posttrain.recipes.stages import timed as _timed
from posttrain.evaluation.demo_report import DemoResult, write_report
from posttrain.rewards import get_verifier
from posttrain.runs.faults import RunStopped


DPO_STAGE = {"batch_size": 16, "micro_batch_size": 16, "data": {"heldout_pairs": 0}}
"""The demo's DPO stage is tiny-dpo.yaml, RPO (DPO plus the chosen answers' NLL, arXiv:2404.19733),
on every pair with as many steps as GRPO: "same reward link, different data link"."""
PLAIN_DPO = {"loss": {"nll_weight": 0.0}}
"""The comparison the report explains: the same stage without the NLL term (plain DPO)."""


TOOL_DEMO_DIR = "runs/demo-tools"
"""`posttrain demo --tools`'s default output directory."""


@dataclass
class Config:
    output_dir: str = "runs/demo"
    """Where the stages and the report go (replaced if it holds a finished demo; a demo stopped there with the same
    settings goes on from its finished stages)."""
    seed: int = 0
    """One seed for every stage."""
    eval_size: int = 500
    """Held-out problems, never trained on, scored by the `integer` checker (written apart from the
    `exact` training reward and labeller: posttrain/rewards/checkers.py)."""
    sft_steps: int = 600
    """The most SFT steps (presets/tiny-sft.yaml); SFT stops earlier at partial competence (`sft_target`)."""
    sft_round: int = 100
    """SFT runs in rounds of this many steps (each a resume of the one run: the same trajectory, its
    schedule being constant after warm-up), evaluated on the held-out split after each."""
    sft_target: float = 0.5
    """SFT stops after the first round whose held-out pass@1 reaches this: partial competence, some
    groups right and some wrong, room for GRPO and DPO to gain. Chosen on the held-out split the
    stages are compared on, the start's own score is if anything flattered, so gains are understated."""
    grpo_steps: int = 50
    """GRPO steps (presets/tiny-grpo.yaml), and DPO steps, and the steps of GRPO on the reward model."""
    rm_steps: int = 50
    """Reward-model steps (presets/tiny-rm.yaml) on the DPO stage's pairs, a quarter of them (at most 64) held out by prompt."""
    samples_shown: int = 6
    """Completions quoted in the report."""
    threads: int = 2
    """torch intra-op threads of every stage (the process's count is restored at the end). 2, this
    machine's cores: measured alone on the 2-core AMD EPYC VM (2026-12-03), an SFT step took 0.28 s
    against 0.45 s at 1 thread and a GRPO step 1.43 s against 1.89 s. Beside another busy job, 1 is
    faster (two threads then wait on each other); the numbers depend on the count (float sums are
    grouped by thread), so the README's are for 2."""
    sft_run: str | None = None
    """Reuse this finished SFT run directory (its newest checkpoint) instead of training one."""
    max_steps: int | None = None
    """Unused (the stages have their own step counts); accepted for the common flags."""
    tools: bool = False
    """Run the tool demo instead (`posttrain demo --tools`, recipes/tool_demo.py): SFT on tool transcripts, then GRPO with the `add` tool, against the start without it; default output runs/demo-tools."""
    tool_transcripts: int = 2000
    """The tool demo's SFT transcripts (half 2-digit, half 3-digit sums); as many GRPO prompts again. Fewer (400) taught the calls but not to copy the tool's result: the model went on adding by itself."""
    tool_sft_steps: int = 500
    """The tool demo's SFT steps on the transcripts (16 per step, lr 1e-3 constant). Copying the tool's result into the answer takes over in a sharp transition whose step moves with the data order: on other orders of the same kind of transcripts, held-out 3-digit sums with the tool were 0.04 at step 300, 0.59 at 400 and 0.61 at 500; at lr 2e-3, 0.04 at 500; with 1- to 4-digit sums, 0.06 at 500; 700 cosine steps gave 0.365 (2026-12-03)."""
    tool_grpo_steps: int = 15
    """The tool demo's GRPO steps with the tool (8 prompts x 8 episodes each, tiny-grpo.yaml's learning rate: 3e-4 collapsed the policy in 10)."""
    tool_eval_size: int = 200
    """The tool demo's held-out problems per set (the first of the main demo's sets)."""
    tool_threads: int = 2
    """torch threads of the tool demo's SFT, GRPO and evaluations: its sequences are four times the main demo's, where two threads pay off."""

    def validate(self) -> None:
        for name in ("eval_size", "sft_steps", "sft_round", "grpo_steps", "rm_steps", "tool_transcripts", "tool_sft_steps",
                     "tool_grpo_steps", "tool_eval_size", "tool_threads"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tool_transcripts < 32:
            raise UserError(f"tool_transcripts must be at least 32 (an eighth is held out, and a tool SFT step takes 16), got {self.tool_transcripts}")
        if not 0 <= self.sft_target <= 1:
            raise UserError(f"sft_target is a held-out pass@1, in [0, 1]; got {self.sft_target}")


GRPO = Stage("grpo", online_config.grpo_config, "tiny-grpo", "grpo_steps", starts_from="sft")
DPO = Stage("dpo", dpo_config.Config, "tiny-dpo", "grpo_steps", starts_from="sft", overrides=DPO_STAGE)
DPO_PLAIN = Stage("dpo_plain", dpo_config.Config, "tiny-dpo", "grpo_steps", starts_from="sft", overrides={**DPO_STAGE, **PLAIN_DPO})
RM = Stage("rm", rm.Config, "tiny-rm", "rm_steps", starts_from="sft")
"""presets/tiny-rm.yaml on the DPO stage's pairs; a quarter of them, at most 64, held out by prompt (given where it is built)."""
GRPO_RM = Stage("grpo_rm", online_config.grpo_config, "tiny-grpo", "grpo_steps", starts_from="sft")
"""GRPO as the GRPO stage, from the same start, its reward the reward model (`reward: rm:<rm>/final`, given where it is built)."""
STAGES = (SFT, GRPO, DPO, DPO_PLAIN, RM, GRPO_RM)
"""The training stages, in the order they run (the report's order)."""


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Run every stage; returns the demo directory (with report.md and summary.json). A finished demo
    in the directory is replaced; a stopped one (demo.json, no summary.json) with the same settings
    goes on from its finished stages (`stages.run_stage`), so the command that goes on is the demo's
    own, which a stop signal's message says (`demo_command`); `resume` is refused."""
    if resume or resume_changed_config:
        raise UserError(f"the demo has no --resume: run the same command again ({demo_command(config)}): it replaces a finished "
                        "demo and goes on with a stopped one from its finished stages")
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with reuse_evaluations():  # the stages share their start: each repeat of one evaluation is done once (evaluation/reuse.py)
            return _run(config, started)
    except RunStopped as stop:  # a stage's own resume command would leave the demo behind: the demo's goes on with both
        stage = getattr(stop, "stage", "stopped")
        raise RunStopped(stop.signum, stop.step, f"{demo_command(config)} (it keeps the finished stages; the {stage} stage "
                                                 f"goes on from its step {stop.step})") from None
    finally:
        torch.set_num_threads(threads)


def demo_command(config: Config) -> str:
    """The `posttrain demo` command line of `config`: each setting that differs from its default."""
    defaults, flags = Config(), ["posttrain", "demo"]
    for field in dataclasses.fields(Config):
        value = getattr(config, field.name)
        if field.name in ("max_steps",) or value == getattr(defaults, field.name):
            continue
        if field.name == "tools":
            flags.append("--tools")
        elif field.name in ("output_dir", "seed"):
            flags += [f"--{field.name.replace('_', '-')}", str(value)]
        else:
            flags += [f"--{field.name}", str(value)]
    return shlex.join(flags)


def _run(config: Config, started: float) -> Path:
    command = demo_command(config)
    settings = {key: value for key, value in dataclasses.asdict(config).items() if key not in ("max_steps", "samples_shown")}
    if config.tools:
        from posttrain.recipes import tool_demo

        if config.output_dir == Config.output_dir:  # never over the main demo's directory
            config = dataclasses.replace(config, output_dir=TOOL_DEMO_DIR)
        out, spent = demo_directory(Path(config.output_dir), settings, command)
        with _saving(out, settings, command, spent, started):
            return tool_demo.run(config, out, started - spent["seconds"], spent["timings"])
    out, spent = demo_directory(Path(config.output_dir), settings, command)
    with _saving(out, settings, command, spent, started):
        return _stages(config, out, started - spent["seconds"], spent["timings"])


@contextlib.contextmanager
def _saving(out: Path, settings: dict[str, Any], command: str, spent: dict[str, Any], started: float):
    """demo.json rewritten when the demo ends, however it ends: the wall times of every attempt so far."""
    before = spent["seconds"]
    try:
        yield
    finally:
        save_state(out, settings, command, {"timings": spent["timings"], "seconds": before + time.perf_counter() - started})


def _stages(config: Config, out: Path, started: float, timings: dict[str, float]) -> Path:
    held_out_size = {"data": {"eval_size": config.eval_size}}

    # 1. SFT from scratch to partial competence (rounds, each evaluated at its end).
    with _timed(timings, "sft"):
        sft_config = stage_config(SFT, config, {}, held_out_size)
        run_dirs = {"sft": Path(config.sft_run) if config.sft_run else train_sft(config, held_out_size)}
        sft_steps = newest_step(run_dirs["sft"])
        starts = {"sft": last_checkpoint(run_dirs["sft"], sft_steps)}
    data, budget = sft_config.data, sft_config.acceptance.max_new_tokens

    # 2. Baseline acceptance on the held-out sets every stage shares.
    sets = heldout_sets(data.task, data.task_options, config.seed, config.eval_size)
    results = {"sft": acceptance(starts["sft"], sets, budget, config.seed, out, "sft")}

    # 3. GRPO with the programmatic verifier: presets/tiny-grpo.yaml from the SFT start.
    with _timed(timings, "grpo"):
        grpo_config = stage_config(GRPO, config, starts, held_out_size, {"acceptance": {"eval_every": max(1, config.grpo_steps // 4)}})
        run_dirs["grpo"] = run_stage(online.run, grpo_config)

    # 4. Pairs from the SFT model's own samples, as many as GRPO drew (kept when a stopped demo wrote them whole), then
    #    DPO on them (RPO and plain).
    pairs_file = out / "pairs.jsonl"
    with _timed(timings, "pairs"):
        provenance = read_provenance(pairs_file) if provenance_path(pairs_file).is_file() else None
        if not (provenance and provenance["file_matches"]):
            provenance = pairs.build_pairs(build_config(pairs.PairSettings, None, {
                "model": starts["sft"], "out": str(pairs_file), "group_size": grpo_config.data.group_size, "verifier": "exact",
                "data": {"task": data.task, "task_options": data.task_options,
                         "max_prompts": config.grpo_steps * grpo_config.data.prompts_per_step, "eval_size": config.eval_size},
                "sampling": {"max_new_tokens": budget}, "seed": config.seed, "overwrite": pairs_file.exists(),
            }))
    with _timed(timings, "dpo"):
        for stage in (DPO, DPO_PLAIN):
            run_dirs[stage.name] = run_stage(dpo.run, stage_config(stage, config, starts, {"data": {"pairs": str(pairs_file)}},
                                                                   {"acceptance": {"max_new_tokens": budget}}))

    # 5. Only the reward link changes: a reward model on the same pairs, then GRPO against it.
    with _timed(timings, "rm"):
        held_pairs = min(64, max(1, provenance["pairs"] // 4))
        run_dirs["rm"] = run_stage(rm.run, stage_config(RM, config, starts, {"data": {"pairs": str(pairs_file), "heldout_pairs": held_pairs}}))
    with _timed(timings, "grpo_rm"):
        run_dirs["grpo_rm"] = run_stage(online.run, stage_config(GRPO_RM, config, starts, held_out_size, {
            "reward": f"rm:{run_dirs['rm'] / rm.FINAL}", "acceptance": {"eval_every": max(1, config.grpo_steps // 4)}}))

    # 6. Acceptance for each on the same problems.
    for stage in (GRPO, DPO, DPO_PLAIN, GRPO_RM):
        results[stage.name] = acceptance(last_checkpoint(run_dirs[stage.name], config.grpo_steps), sets, budget, config.seed, out, stage.name)

    # 7. Report: summary.json, report.md, plots.
    checked = independence(get_verifier(provenance["verifier"]), _checker(None, sets[IN_DISTRIBUTION]))
    write_report(DemoResult(
        out=out, seed=config.seed, sft_steps=sft_steps, sft_target=config.sft_target, grpo_steps=config.grpo_steps, rm_steps=config.rm_steps,
        samples_per_step=grpo_config.data.prompts_per_step * grpo_config.data.group_size, samples_shown=config.samples_shown,
        results=results, run_dirs=run_dirs, provenance=provenance, independence=checked, timings=timings,
        seconds=time.perf_counter() - started))
    return out


def acceptance(model_dir: str, sets: dict[str, Task], budget: int, seed: int, out: Path, stage: str) -> dict[str, dict[str, Any]]:
    """Greedy pass@1 of one stage's model on every held-out set (eval_<stage>.json for the
    in-distribution set, eval_<stage>_<set>.json for the others)."""
    model, tokenizer = load_model(model_dir)
    return {name: evaluate_task(model, tokenizer, task, checker=_checker(None, task), max_new_tokens=budget, seed=seed,
                                output_path=out / (f"eval_{stage}.json" if name == IN_DISTRIBUTION else f"eval_{stage}_{name}.json"))
            for name, task in sets.items()}


