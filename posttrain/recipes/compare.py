"""`posttrain compare` (what `make compare` runs): every online and offline method of the library
from ONE SFT start, the same budget each, scored on the same held-out problems by the independent
checker, in one table.

0. Every input before any work: --output-dir, --start and --teacher (resolved and loaded), --pairs
   (read and validated whole, as each offline row reads it); a mistake is one line and writes
   nothing (an earlier comparison in --output-dir stays).
1. The start: the demo's SFT stage (`demo.train_sft`: rounds to partial competence), or `--start`.
2. Its acceptance on the demo's held-out sets (`demo.heldout_sets`, `demo.acceptance`: greedy
   pass@1 by `integer`, written apart from the `exact` reward and labeller); the teacher's too, once,
   when --teacher names one.
3. One pairs file from the start (`posttrain pairs`, labelled by `exact`), as many sampled answers
   as each online row draws (steps x prompts per step x G): every offline row trains on it, but KTO,
   which trains on the unpaired rows of the same samples (`posttrain pairs --unpaired`, the same
   seed: every distinct scored answer, the groups pairing skips included). With a teacher row, the
   teacher sampled once into SFT rows (`posttrain pairs --sft --keep all`), as many samples as the
   distillation row scores.
4. Each row (`ROWS`: the flags of docs/algorithms.md §3d) in its own process, `sys.executable -m
   posttrain ...`, so that its wall time and peak RSS are its own and a failing row is one line of
   the table, not the end of the comparison; then its acceptance on the same sets.
5. comparison.md, comparison.json and comparison.png (gain over the start per row, paired 95%
   intervals) in the output directory: the report, evaluation/comparison_report.py.

Each row names the links it changed relative to its base (`BASE`: GRPO online, DPO offline, and
on-policy distillation for SFT on the teacher's samples): that column is the point of the table (the
seed's "which link moved?"), and its footer says what one task, one model, one seed and N steps
cannot conclude.

The teacher rows (issue 43) make three of them one experiment from the same start: on-policy
distillation vs GRPO changes the reward link (a teacher per token instead of the program), SFT on
the teacher's samples vs on-policy distillation changes the data link (the teacher's samples offline
instead of the student's own, scored by the teacher) and with it the objective. Without --teacher
they are left out of the default selection (a logged note) and refused by --rows (one line).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.atomic import write_text_atomically
from posttrain.data.preference import load_preference_file
from posttrain.data.provenance import read_provenance
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, independence
from posttrain.evaluation.comparison_report import Measured, Outcome, cell, comparison, gain_text, markdown, paired_gain, plot
from posttrain.models import load_model
from posttrain.data.provenance import provenance_path
from posttrain.recipes import demo, stages
from posttrain.rewards import get_verifier
from posttrain.rewards.teacher import teacher_directory

logger = logging.getLogger(__name__)

PROMPTS_PER_STEP, GROUP_SIZE = 16, 8
"""Every online row's budget per step (presets/tiny-grpo.yaml's; PPO's preset draws 32 x 2, set to this)."""
PAIRS_PER_STEP = 16
"""Every offline row's pairs per step (the demo's DPO stage, docs/algorithms.md §3d)."""
REWARD = "exact"
"""The online rows' reward and the pairs' labeller; the held-out checker is `integer` (demo.acceptance)."""
SFT_BATCH_SIZE = 32
"""The SFT row's rows per step (presets/tiny-sft.yaml's, given explicitly so the step arithmetic holds whatever the preset says)."""
SFT_HELDOUT_ROWS = 8
"""Rows of the teacher's file the SFT row holds out for its own held-out NLL (at least 1: `posttrain
sft` needs a split); its acceptance is scored here on the shared sets like every row's."""
TEACHER = "TEACHER"
"""The placeholder of the teacher's model directory in a row's flags (`teacher:TEACHER`), substituted at run time."""


@dataclass(frozen=True)
class Row:
    """One method of the table: its command and flags over the family's base command, and the links
    it changed relative to the family's base row (GRPO online, DPO offline)."""

    name: str
    """Its `--rows` name, run directory and key in comparison.json."""
    label: str
    command: str
    """grpo | ppo | dpo: `posttrain <command>`, with `base_flags` (its preset, start, budget) first."""
    flags: tuple[str, ...] = ()
    """The row's own flags (docs/algorithms.md §3d's tables)."""
    changed: tuple[tuple[str, str, str], ...] = ()
    """(link, which part of it, how) relative to the family's base row: ("loss", "advantage
    estimator", "leave-one-out"); empty for the base itself."""
    data: str = "pairs"
    """An offline row's file: `pairs`, `unpaired` (the unpaired rows of the same samples; with
    --pairs, that file, which the KTO loader reads as two rows per pair) or `teacher_sft` (the
    teacher's samples as SFT rows, sampled here even with --pairs)."""
    needs_teacher: bool = False
    """Whether the row needs --teacher (its flags name `teacher:TEACHER`, or its data is the teacher's samples)."""

    @property
    def online(self) -> bool:
        return self.command in ("grpo", "ppo")


def _loss(*parts: tuple[str, str]) -> tuple[tuple[str, str, str], ...]:
    return tuple(("loss", part, detail) for part, detail in parts)


UNPAIRED = ("data", "unpaired", "every distinct scored answer of the same samples, a row each, the all-correct and "
            "all-incorrect groups included")
NO_REFERENCE = ("loss", "reference", "none")
ROWS = (
    Row("grpo", "GRPO", "grpo"),
    Row("dr_grpo", "Dr. GRPO", "grpo", ("--loss.group.scale", "none", "--loss.aggregation", "seq_mean_token_sum_norm"),
        _loss(("advantage estimator", "group mean, no std"), ("aggregation", "seq_mean_token_sum_norm"))),
    Row("rloo", "RLOO", "grpo", ("--loss.advantage", "rloo", "--loss.kl.placement", "reward", "--loss.kl.estimator", "k1",
                                 "--loss.aggregation", "seq_mean_token_sum"),
        _loss(("advantage estimator", "leave-one-out"), ("KL placement", "k1 summed into the reward"), ("aggregation", "seq_mean_token_sum"))),
    Row("reinforce_pp", "REINFORCE++", "grpo", ("--loss.advantage", "reinforce_pp", "--loss.kl.placement", "reward", "--loss.kl.estimator", "k1"),
        _loss(("advantage estimator", "batch-whitened returns, no group"), ("KL placement", "k1 per token in the reward"))),
    Row("reinforce_pp_baseline", "REINFORCE++-baseline", "grpo", ("--loss.advantage", "reinforce_pp_baseline"),
        _loss(("advantage estimator", "group mean, then batch-whitened"))),
    Row("gspo", "GSPO", "grpo", ("--loss.surrogate", "gspo", "--loss.aggregation", "seq_mean_token_mean"),
        _loss(("surrogate", "sequence ratio, narrow clip"), ("aggregation", "seq_mean_token_mean"))),
    Row("cispo", "CISPO", "grpo", ("--loss.surrogate", "cispo"), _loss(("surrogate", "clipped stop-gradient IS weight"))),
    Row("ppo", "PPO", "ppo", (),
        _loss(("advantage estimator", "GAE with a learned critic, trained alone for its first 5 steps: the policy moves for N - 5"),
              ("KL placement", "k1 in the reward, beta 0.02"),
              ("update", "2 epochs x 2 mini-batches"), ("optimizer", "lr 3e-5"))),
    Row("dpo", "DPO", "dpo", ("--loss.nll_weight", "0")),
    Row("rpo", "RPO (DPO + NLL 1.0)", "dpo", (), _loss(("objective", "+ chosen NLL 1.0"))),
    Row("kto", "KTO", "dpo", ("--loss.type", "kto", "--loss.nll_weight", "0"), (UNPAIRED, ("loss", "objective", "KTO, reference point")),
        data="unpaired"),
    Row("simpo", "SimPO (beta 2.5, gamma/beta 0.55)", "dpo", ("--loss.type", "simpo", "--loss.beta", "2.5", "--loss.nll_weight", "0"),
        (("loss", "objective", "length-normalised margin, gamma"), NO_REFERENCE)),
    Row("cpo", "CPO (beta 0.1, NLL 1.0)", "dpo", ("--loss.type", "cpo"), (("loss", "objective", "+ chosen NLL 1.0"), NO_REFERENCE)),
    Row("orpo", "ORPO (lambda 0.1, NLL 1.0)", "dpo", ("--loss.type", "orpo"), (("loss", "objective", "odds ratio + NLL 1.0"), NO_REFERENCE)),
    Row("distill_group", "On-policy distillation, GRPO's estimator", "grpo", ("--reward", f"teacher:{TEACHER}"),
        (("reward", "reward", "a teacher per token (log p_teacher - log p_student), summed over each row before the group baseline"),),
        needs_teacher=True),
    Row("distill", "On-policy distillation", "grpo", ("--reward", f"teacher:{TEACHER}", "--loss.advantage", "distill"),
        (("reward", "reward", "a teacher per token (log p_teacher - log p_student)"),
         ("loss", "advantage estimator", "each token's own teacher reward, the preset's KL to the start kept")),
        needs_teacher=True),
    Row("sft_teacher", "SFT on the teacher's samples", "sft", (),
        (("data", "source", "the teacher's samples, offline (sampled once from the teacher), not the student's own"),
         ("loss", "objective", "NLL of the teacher's tokens")), data="teacher_sft", needs_teacher=True),
)
"""Every row, in the table's order: the online family (base GRPO), the offline one (base DPO), then
the teacher's rows (on-policy distillation, base GRPO; SFT on the teacher's samples, base distillation)."""
BASE = {"grpo": "grpo", "ppo": "grpo", "dpo": "dpo", "sft": "distill"}
"""The row each command's rows are compared with in the links column: SFT on the teacher's samples
against on-policy distillation (the data link), which is itself against GRPO (the reward link)."""
PRESET = {"grpo": "tiny-grpo", "ppo": "tiny-ppo", "dpo": "tiny-dpo", "sft": "tiny-sft"}
CANNOT = ("one task (2-digit sums), one model (the built-in tiny one), one seed and {steps} steps from one start: a row that "
          "gains more here is not shown to be the better method, only to have moved this model on this budget; rows whose "
          "intervals overlap are not told apart; wall time and peak RSS are one 2-core CPU run's (the first row's includes a cold "
          "cache), not a speed ranking; the offline rows see a fixed pairs file, the online ones fresh samples each step, so "
          "the two families differ in the data link before any loss choice.")


@dataclass
class Config:
    output_dir: str = "runs/compare"
    """The start, the pairs, every row's run directory, eval/ and the table (replaced if it holds an earlier comparison)."""
    rows: tuple[str, ...] | None = None
    """The rows to run (`ROWS` names); None: all."""
    steps: int = 12
    """Training steps of every row (each checkpoints once, at the last)."""
    sft_steps: int = 600
    """The most SFT steps of the start (demo.train_sft stops at the first round reaching `sft_target`)."""
    sft_round: int = 100
    sft_target: float = 0.5
    eval_size: int = 500
    """Held-out problems per set, never trained on (every row's data.eval_size too)."""
    seed: int = 0
    """One seed for the start, the pairs and every row."""
    start: str | None = None
    """Reuse this SFT checkpoint (a model directory, or a run directory: its newest checkpoint) instead of training one."""
    pairs: str | None = None
    """Reuse this pairs file (its .meta.json sidecar read if there) instead of sampling one from the
    start: the same offline inputs again (a rerun of one row), or a start too weak to yield pairs (the tests)."""
    threads: int = 1
    """torch threads here and OMP_NUM_THREADS of every row. 1: the table in docs/algorithms.md was
    measured at 1 (the numbers depend on the count); 2 is faster on an idle 2-core machine, as the
    demo runs (recipes/demo.py), and slower beside another busy job."""
    teacher: str | None = None
    """The teacher of the `distill` and `sft_teacher` rows: a model directory, or a run directory (its
    `final/` export, else its newest checkpoint); sharing the start's tokenizer. None: those rows are
    left out of the default selection and refused by --rows."""

    def validate(self) -> None:
        names = [row.name for row in ROWS]
        unknown = [name for name in self.rows or () if name not in names]
        if unknown:
            raise UserError(f"--rows: no row {', '.join(unknown)} (rows: {', '.join(names)})")
        if self.rows is not None and not self.rows:
            raise UserError("--rows: give at least one row")
        needing = [row.name for row in ROWS if row.needs_teacher and row.name in (self.rows or ())]
        if needing and self.teacher is None:
            raise UserError(f"--rows {', '.join(needing)}: needs --teacher DIR (a model directory, or a run directory with final/)")
        for name in ("steps", "sft_steps", "sft_round", "eval_size", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")

    def selected(self) -> tuple[Row, ...]:
        """The --rows rows in the table's order; by default every row, but those needing a teacher when there is none."""
        if self.rows is None:
            return tuple(row for row in ROWS if self.teacher is not None or not row.needs_teacher)
        return tuple(row for row in ROWS if row.name in self.rows)


def run(config: Config, rows: tuple[Row, ...] | None = None) -> Path:
    """Run the comparison; returns the output directory. `rows` (default: `config.selected()`) lets
    a caller add rows of its own (the tests: one that fails)."""
    config.validate()
    rows = config.selected() if rows is None else rows
    started = time.perf_counter()
    # 0. Every input checked before any work; on a mistake nothing is written (an earlier comparison stays).
    out = Path(config.output_dir).resolve()
    check_output_dir(out, config.start, config.pairs, config.teacher)
    given_start = check_start(config.start) if config.start else None
    given_pairs = check_pairs(config.pairs) if config.pairs else None
    teacher = check_teacher(config.teacher) if config.teacher else None
    if config.rows is None and teacher is None:
        logger.info("rows %s left out: they need --teacher DIR", ", ".join(row.name for row in ROWS if row.needs_teacher))
    torch.set_num_threads(config.threads)
    _fresh_directory(out)

    # 1. The start: the demo's SFT stage, or --start.
    sft_settings = demo.Config(output_dir=str(out), seed=config.seed, eval_size=config.eval_size, sft_steps=config.sft_steps,
                               sft_round=config.sft_round, sft_target=config.sft_target)
    held_out_size = {"data": {"eval_size": config.eval_size}}
    sft_config = demo.stage_config(demo.SFT, sft_settings, {}, held_out_size)
    clock = time.perf_counter()
    start = given_start or _start_model(demo.train_sft(sft_settings, held_out_size))
    sft_seconds = time.perf_counter() - clock
    data, budget = sft_config.data, sft_config.acceptance.max_new_tokens

    # 2. The start's acceptance on the held-out sets every row shares.
    sets = demo.heldout_sets(data.task, data.task_options, config.seed, config.eval_size)
    start_sets = demo.acceptance(start, sets, budget, config.seed, out / "eval", "start")
    logger.info("start %s: %s", start, cell(start_sets[IN_DISTRIBUTION]))
    teacher_sets = demo.acceptance(teacher, sets, budget, config.seed, out / "eval", "teacher") if teacher else {}
    if teacher:
        logger.info("teacher %s: %s", teacher, cell(teacher_sets[IN_DISTRIBUTION]))

    # 3. One pairs file from the start, as many sampled answers as each online row draws (or --pairs);
    #    the unpaired rows of the same samples (same seed) when a row trains on them.
    #    The teacher's samples as SFT rows, once, when a row trains on them (with --pairs too).
    files = {"pairs": Path(config.pairs).resolve() if config.pairs else out / "pairs.jsonl", "teacher_sft": out / "teacher_sft.jsonl"}
    files["unpaired"] = files["pairs"] if config.pairs else out / "unpaired.jsonl"
    kinds = [kind for kind in dict.fromkeys(row.data for row in rows if not row.online) if not config.pairs or kind == "teacher_sft"]
    provenance, errors = sample_offline_files(config, kinds, {"start": start, "teacher": teacher}, files, sft_config)
    if config.pairs:
        provenance["pairs"] = given_pairs

    # 4. Each row in its own process, then its acceptance on the same problems.
    outcomes = []
    for index, row in enumerate(rows, 1):
        steps = row_steps(row, config, provenance.get("teacher_sft", {}).get("rows"))
        outcome = Outcome(describe(row, config, steps))
        if not row.online and errors.get(row.data) is not None:
            outcome.error = f"no {row.data} file (posttrain pairs: {errors[row.data]})"
        else:
            outcome.seconds, outcome.peak_rss_mib, outcome.error = _child(
                row_command(row, start, str(files[row.data]), out / row.name, config, teacher or TEACHER, steps),
                out / "logs" / f"{row.name}.log", config.threads)
        if outcome.error is None:
            try:
                outcome.sets = demo.acceptance(stages.last_checkpoint(out / row.name, steps), sets, budget, config.seed, out / "eval", row.name)
            except Exception as error:  # noqa: BLE001 - a model that cannot be scored is its row's failure, not the comparison's
                outcome.error = f"acceptance: {type(error).__name__}: {error}".splitlines()[0]
        outcomes.append(outcome)
        logger.info("[%d/%d] %s: %s", index, len(rows), row.name, _progress(outcome, start_sets))

    # 5. The table, its JSON and the plot.
    measured = Measured(start, config.start is not None, start_sets, sft_seconds, provenance, config.pairs,
                        independence(get_verifier(REWARD), get_verifier("integer")), time.perf_counter() - started,
                        teacher, teacher_sets)
    table = comparison(settings(config), CANNOT.format(steps=config.steps), measured, outcomes)
    write_text_atomically(out / "comparison.json", json.dumps(table, indent=1) + "\n")
    write_text_atomically(out / "comparison.md", markdown(table) + "\n")
    plot(table, out / "comparison.png")
    return out


def sample_offline_files(config: Config, kinds: list[str], models: dict[str, str | None], files: dict[str, Path],
                         sft_config) -> tuple[dict, dict]:
    """Sample the offline rows' files (`kinds`: pairs, unpaired from `models["start"]`; teacher_sft
    from `models["teacher"]`), each with `posttrain pairs` in its own process (`sampling_arguments`);
    returns (each file's sidecar, each file's one-line error or None)."""
    out = Path(config.output_dir).resolve()
    provenance, errors = {}, {}
    for kind in kinds:
        model = models["teacher" if kind == "teacher_sft" else "start"]
        seconds, _, errors[kind] = _child(sampling_arguments(kind, model, files[kind], config, sft_config),
                                          out / "logs" / f"{kind}.log", config.threads)
        if errors[kind] is None:
            provenance[kind] = json.loads(provenance_path(files[kind]).read_text())
            logger.info("%s: %s rows from %s prompts (%.0f s)", kind, provenance[kind].get("pairs", provenance[kind].get("rows")),
                        provenance[kind].get("prompts"), seconds)
        else:
            logger.info("%s: failed: %s", kind, errors[kind])
    return provenance, errors


def sampling_arguments(kind: str, model: str, out_file: Path, config: Config, sft_config) -> list[str]:
    """`posttrain pairs` arguments of one offline file: G samples of each of steps x prompts per step
    training prompts (as many answers as each online row draws; the start's held-out split kept apart),
    labelled by `REWARD`; `unpaired`: KTO's rows of the same samples; `teacher_sft`: the teacher's
    samples as SFT rows, every one kept, exactly `teacher_samples` of them (as many as the
    distillation row scores: a quarter more prompts are offered, and --max-rows stops the sampling there)."""
    data = sft_config.data
    kind_flags = {"pairs": [], "unpaired": ["--unpaired"],
                  "teacher_sft": ["--sft", "--keep", "all", "--max-rows", str(teacher_samples(config.steps))]}[kind]
    prompts = config.steps * PROMPTS_PER_STEP
    if kind == "teacher_sft":  # a quarter more prompts than the rows need, so that --max-rows, not the prompts the held-out
        prompts += prompts // 4  # split removes from the first ones (44 of 800 at seed 0), sets the file's size exactly
    return ["pairs", "--model", model, "--out", str(out_file), "--group_size", str(GROUP_SIZE), "--verifier", REWARD,
            "--data.task", data.task, "--data.task_options", json.dumps(data.task_options),
            "--data.max_prompts", str(prompts), "--data.eval_size", str(config.eval_size),
            "--sampling.max_new_tokens", str(sft_config.acceptance.max_new_tokens), "--seed", str(config.seed), *kind_flags]


def teacher_samples(steps: int) -> int:
    """The teacher's samples the SFT row gets: as many as the distillation row scores, steps x
    prompts per step x G (12 steps: 12 x 16 x 8 = 1536)."""
    return steps * PROMPTS_PER_STEP * GROUP_SIZE


def sft_steps(rows: int) -> int:
    """The SFT row's steps: one epoch over the teacher's rows less the `SFT_HELDOUT_ROWS` held out,
    `SFT_BATCH_SIZE` a step, at least 1 (1536 rows: (1536 - 8) // 32 = 47 steps, on 47 x 32 = 1504
    rows, its data.train_size: the 24 left over would not fill a step)."""
    return max(1, (rows - SFT_HELDOUT_ROWS) // SFT_BATCH_SIZE)


def row_steps(row: Row, config: Config, teacher_rows: int | None) -> int:
    """A row's training steps: --steps, but the SFT row's `sft_steps` of the teacher's rows written
    (before they are sampled, or if none were: of the `teacher_samples` asked for)."""
    if row.command != "sft":
        return config.steps
    return sft_steps(teacher_samples(config.steps) if teacher_rows is None else teacher_rows)


def settings(config: Config) -> dict[str, Any]:
    """comparison.json's settings: the budget every row shares, the reward, the checker, the threads."""
    return {"steps": config.steps, "eval_size": config.eval_size, "seed": config.seed, "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE, "pairs_per_step": PAIRS_PER_STEP, "reward": REWARD, "checker": "integer", "threads": config.threads,
            "teacher": config.teacher, "teacher_samples": teacher_samples(config.steps), "sft_batch_size": SFT_BATCH_SIZE,
            "sft_heldout_rows": SFT_HELDOUT_ROWS}


def describe(row: Row, config: Config, steps: int | None = None) -> dict[str, Any]:
    """One row as comparison.json names it: its family and base, its command (START, PAIRS,
    UNPAIRED or TEACHER_SFT, TEACHER and DIR for the start, its file, the teacher and the output
    directory; `steps` its training steps, default --steps), its flags and links."""
    command = row_command(row, "START", row.data.upper(), Path("DIR") / row.name, config, TEACHER, steps)
    return {"name": row.name, "label": row.label, "family": "online" if row.online else "offline", "base": BASE[row.command],
            "data": None if row.online else row.data, "steps": steps or config.steps, "command": ["posttrain", *command],
            "flags": list(row.flags), "links_changed": [list(change) for change in row.changed], "links_text": links_changed(row)}


def row_command(row: Row, start: str, pairs_file: str, run_dir: Path, config: Config, teacher: str = TEACHER,
                steps: int | None = None) -> list[str]:
    """`posttrain <command>` arguments of one row: its preset, the start, the shared budget and held-out
    split, one checkpoint and evaluation at the last step, no shifted sets in the run (they are scored
    here, once, for every row alike), then the row's own flags, `teacher:TEACHER` naming `teacher`.
    `pairs_file`: an offline row's file (its `data`: the pairs, the unpaired rows or the teacher's
    SFT rows); `steps`: its training steps (default --steps; the SFT row's: `row_steps`)."""
    steps_text = str(steps or config.steps)
    common = ["--config", PRESET[row.command], "--model", start, "--max-steps", steps_text, "--checkpoint-every", steps_text,
              "--acceptance.eval_every", steps_text, "--acceptance.sets", "[]", "--seed", str(config.seed), "--output-dir", str(run_dir)]
    flags = [flag.replace(f"teacher:{TEACHER}", f"teacher:{teacher}") for flag in row.flags]
    if row.online:
        family = ["--reward", REWARD] if "--reward" not in flags else []
        family += ["--data.eval_size", str(config.eval_size), "--data.prompts_per_step", str(PROMPTS_PER_STEP),
                   "--data.group_size", str(GROUP_SIZE)]
    elif row.command == "sft":
        family = ["--data.task", pairs_file, "--data.eval_size", str(SFT_HELDOUT_ROWS),
                  "--data.train_size", str((steps or config.steps) * SFT_BATCH_SIZE),  # each trained row once (the preset's is 20000)
                  "--batch_size", str(SFT_BATCH_SIZE), "--micro_batch_size", str(SFT_BATCH_SIZE)]
    else:
        family = ["--data.pairs", pairs_file, "--data.heldout_pairs", "0", "--batch_size", str(PAIRS_PER_STEP),
                  "--micro_batch_size", str(PAIRS_PER_STEP)]
    return [row.command, *common, *family, *flags]


def links_changed(row: Row) -> str:
    """The links column, grouped by link: 'loss: advantage estimator (leave-one-out), aggregation
    (seq_mean_token_sum)'; the base's own note for the base."""
    if not row.changed:
        return f"(the {'online' if row.online else 'offline'} base)"
    links = dict.fromkeys(link for link, _, _ in row.changed)
    base = BASE[row.command]
    versus = "" if base in ("grpo", "dpo") else f"vs {next(other.label for other in ROWS if other.name == base)}: "
    return versus + "; ".join(f"{link}: " + ", ".join(f"{part} ({how})" for name, part, how in row.changed if name == link) for link in links)


def _child(arguments: list[str], log: Path, threads: int) -> tuple[float, float | None, str | None]:
    """Run `python -m posttrain ARGUMENTS` with its output in `log`; returns (wall seconds, its peak
    RSS in MiB, its one-line error or None). os.wait4 reads the child's own resource usage."""
    log.parent.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    with log.open("w") as stream:
        stream.write("$ posttrain " + " ".join(arguments) + "\n")
        stream.flush()
        child = subprocess.Popen([sys.executable, "-m", "posttrain", *arguments], stdout=stream, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - clock
    peak = usage.ru_maxrss / 1024  # KiB on Linux
    return seconds, peak, None if child.returncode == 0 else _error_line(log, child.returncode)


def _error_line(log: Path, code: int) -> str:
    """A failed child's one line: its `posttrain: error:` line, else its last line (a traceback's exception)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("posttrain: ")]
    line = errors[-1].removeprefix("posttrain: error: ").removeprefix("posttrain: ") if errors else (lines[-1] if len(lines) > 1 else "no output")
    return f"{line} (exit {code}; {log.name})"


def check_teacher(teacher: str) -> str:
    """`--teacher`'s model directory (a run directory's `final/` export, else its newest checkpoint, or a
    model directory), loaded once to prove it loads; a UserError line naming the flag otherwise."""
    path = Path(teacher).expanduser()
    if not path.is_dir():
        raise UserError(f"--teacher {teacher}: no such directory (give a model directory, or a run directory with final/)")
    final = teacher_directory(str(path))
    model = str(Path(final).resolve()) if final != str(path) else _start_model(path, "--teacher")
    try:
        load_model(model)
    except UserError as error:
        raise UserError(f"--teacher {teacher}: {error}") from None
    return model


def check_start(start: str) -> str:
    """`--start`'s model directory (`_start_model`), loaded once to prove it loads; a UserError line naming the flag otherwise."""
    path = Path(start).expanduser()
    if not path.is_dir():
        raise UserError(f"--start {start}: no such directory (give an SFT run directory or a model directory)")
    model = _start_model(path)
    try:
        load_model(model)
    except UserError as error:
        raise UserError(f"--start {start}: {error}") from None
    return model


def check_pairs(pairs_file: str) -> dict[str, Any]:
    """`--pairs`: a file of preference pairs every offline row can read (read and validated whole, as each row's
    `posttrain dpo` reads it); returns its provenance sidecar ({} without one). A UserError line naming the flag otherwise."""
    path = Path(pairs_file).expanduser()
    if not path.is_file():
        raise UserError(f"--pairs {pairs_file}: no such file")
    try:
        load_preference_file(path, unpaired_advice="--pairs takes preference pairs (every offline row trains on them; KTO reads "
                                                   "each pair as a desirable and an undesirable row): make them with posttrain pairs")
        return read_provenance(path) or {}
    except UserError as error:  # the reader's bad-row report in one line: its first bad row and the count (compare has no data.* flags)
        lines = str(error).splitlines()
        counts = re.search(r"\d+ rows read, \d+ bad", lines[0])
        detail = f"{lines[1]} ({counts.group(0)}; each offline row reads the file as posttrain dpo does)" if counts and len(lines) > 1 else lines[0]
        raise UserError(f"--pairs {pairs_file}: {detail}") from None


def _start_model(path: Path, flag: str = "--start") -> str:
    """The start's (or `flag`'s) model directory: `path` itself, or a run directory's newest checkpoint."""
    if (path / "checkpoints").is_dir():
        return stages.last_checkpoint(path, stages.newest_step(path))
    if not (path / "config.json").is_file():
        raise UserError(f"{flag} {path}: neither a model directory (config.json) nor a run directory (checkpoints/step-N/model)")
    return str(path.resolve())


def check_output_dir(out: Path, start: str | None, pairs: str | None, teacher: str | None = None) -> None:
    """`out` may hold only an earlier comparison (comparison.json), which a new one replaces, and so may not hold
    --start, --pairs or --teacher (the replacement would delete them): else one UserError line."""
    for flag, given in (("--start", start), ("--pairs", pairs), ("--teacher", teacher)):
        if given is not None and out in Path(given).resolve().parents:
            raise UserError(f"{flag} {given} lies inside --output-dir {out}, which a new comparison replaces; choose another --output-dir")
    if out.exists() and (not out.is_dir() or (not (out / "comparison.json").exists() and any(out.iterdir()))):
        raise UserError(f"--output-dir {out}: holds something other than a finished comparison; choose another")


def _fresh_directory(out: Path) -> Path:
    """`out` (`check_output_dir` passed), created empty: an earlier comparison there is replaced."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def _progress(outcome: Outcome, start_sets: dict) -> str:
    if outcome.error:
        return f"failed: {outcome.error}"
    held = outcome.sets[IN_DISTRIBUTION]
    return (f"{cell(held)}, gain {gain_text(paired_gain(start_sets[IN_DISTRIBUTION], held))}, "
            f"{outcome.seconds:.0f} s, {outcome.peak_rss_mib:.0f} MiB")
