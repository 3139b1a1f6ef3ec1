"""`posttrain compare` (what `make compare` runs): every online and offline method of the library
from ONE SFT start, the same budget each, scored on the same held-out problems by the independent
checker, in one table.

0. Every input before any work: --output-dir, --start and --teacher (resolved and loaded), --pairs
   (read and validated whole, as each offline row reads it); a mistake is one line and writes
   nothing (an earlier comparison in --output-dir stays): compare_inputs.py.
1. The start: the demo's SFT stage (`demo.train_sft`: rounds to partial competence), or `--start`.
2. Its acceptance on the demo's held-out sets (`demo.heldout_sets`, `demo.acceptance`: greedy
   pass@1 by `integer`, written apart from the `exact` reward and labeller); the teacher's too, once,
   when --teacher names one.
3. One pairs file from the start (`posttrain pairs`, labelled by `exact`), as many sampled answers
   as each online row draws (steps x prompts per step x G): every offline row trains on it, but KTO,
   which trains on the unpaired rows of the same samples (`posttrain pairs --unpaired`, the same
   seed: every distinct scored answer, the groups pairing skips included). With a teacher row, the
   teacher sampled once into SFT rows (`posttrain pairs --sft --keep all`), as many samples as the
   distillation row scores: compare_samples.py, with the budget every row shares.
4. Each row (`ROWS`: the flags of docs/algorithms.md §3d) in its own process, `sys.executable -m
   posttrain ...` (compare_process.py), so that its wall time and peak RSS are its own and a failing
   row is one line of the table, not the end of the comparison; then its acceptance on the same sets.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.atomic import write_text_atomically
from posttrain.data.examples import Task
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, independence
from posttrain.evaluation.comparison_report import Measured, Outcome, cell, comparison, gain_text, markdown, paired_gain, plot
from posttrain.recipes import demo, stages
from posttrain.recipes.compare_inputs import Inputs, check_inputs, fresh_directory, start_model
from posttrain.recipes.compare_process import run_child
from posttrain.recipes.compare_samples import (GROUP_SIZE, PAIRS_PER_STEP, PROMPTS_PER_STEP, REWARD, SFT_BATCH_SIZE,
                                               SFT_HELDOUT_ROWS, OfflineFiles, Sampling, offline_paths, sample_offline_files,
                                               sft_steps, teacher_samples)
from posttrain.rewards import get_verifier

logger = logging.getLogger(__name__)

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
    inputs = check_inputs(config.output_dir, config.start, config.pairs, config.teacher)
    if config.rows is None and inputs.teacher is None:
        logger.info("rows %s left out: they need --teacher DIR", ", ".join(row.name for row in ROWS if row.needs_teacher))
    torch.set_num_threads(config.threads)
    out = fresh_directory(inputs.output_dir)

    # 1. The start: the demo's SFT stage, or --start.
    start = _start(config, out, inputs.start)

    # 2. The start's acceptance on the held-out sets every row shares; the teacher's too, once.
    held_out = _held_out(config, start, out)
    start_sets = held_out.score(start.model, "start")
    logger.info("start %s: %s", start.model, cell(start_sets[IN_DISTRIBUTION]))
    teacher_sets = held_out.score(inputs.teacher, "teacher") if inputs.teacher else {}
    if inputs.teacher:
        logger.info("teacher %s: %s", inputs.teacher, cell(teacher_sets[IN_DISTRIBUTION]))

    # 3. The offline rows' files: the pairs (or --pairs), the unpaired rows, the teacher's samples.
    offline = _offline_files(rows, config, out, start, inputs)

    # 4. Each row in its own process, then its acceptance on the same problems.
    outcomes = _run_rows(rows, config, RowInputs(out, start.model, inputs.teacher or TEACHER, offline), held_out, start_sets)

    # 5. The table, its JSON and the plot.
    measured = Measured(start.model, config.start is not None, start_sets, start.seconds, offline.provenance, config.pairs,
                        independence(get_verifier(REWARD), get_verifier("integer")), time.perf_counter() - started,
                        inputs.teacher, teacher_sets)
    table = comparison(settings(config), CANNOT.format(steps=config.steps), measured, outcomes)
    write_text_atomically(out / "comparison.json", json.dumps(table, indent=1) + "\n")
    write_text_atomically(out / "comparison.md", markdown(table) + "\n")
    plot(table, out / "comparison.png")
    return out


@dataclass(frozen=True)
class Start:
    """Step 1's start, and the SFT stage whose task and answer budget every row shares."""

    model: str
    """Its model directory: --start's, or the demo's SFT stage's newest checkpoint."""
    seconds: float
    """The SFT stage's wall time (about 0 with --start)."""
    sft: Any
    """That stage's config (`demo.stage_config`, with --start too): its data section and acceptance.max_new_tokens."""


def _start(config: Config, out: Path, given: str | None) -> Start:
    """The start: `given` (--start's model directory), else the demo's SFT stage trained in `out`
    (`demo.train_sft`: rounds to partial competence)."""
    sft_settings = demo.Config(output_dir=str(out), seed=config.seed, eval_size=config.eval_size, sft_steps=config.sft_steps,
                               sft_round=config.sft_round, sft_target=config.sft_target)
    held_out_size = {"data": {"eval_size": config.eval_size}}
    sft_config = demo.stage_config(demo.SFT, sft_settings, {}, held_out_size)
    clock = time.perf_counter()
    model = given or start_model(demo.train_sft(sft_settings, held_out_size))
    return Start(model, time.perf_counter() - clock, sft_config)


@dataclass(frozen=True)
class HeldOut:
    """The held-out sets the start, the teacher and every row are scored on alike (`demo.acceptance`:
    greedy pass@1 by `integer`), each model's eval files in `directory` under its name."""

    sets: dict[str, Task]
    max_new_tokens: int
    seed: int
    directory: Path

    def score(self, model: str, name: str) -> dict[str, dict[str, Any]]:
        return demo.acceptance(model, self.sets, self.max_new_tokens, self.seed, self.directory, name)


def _held_out(config: Config, start: Start, out: Path) -> HeldOut:
    """The demo's held-out sets (`demo.heldout_sets`) of the start's task, scored with its answer budget into out/eval."""
    data = start.sft.data
    return HeldOut(demo.heldout_sets(data.task, data.task_options, config.seed, config.eval_size),
                   start.sft.acceptance.max_new_tokens, config.seed, out / "eval")


def _offline_files(rows: tuple[Row, ...], config: Config, out: Path, start: Start, inputs: Inputs) -> OfflineFiles:
    """The files the offline `rows` train on (their `data`), each sampled once (`sample_offline_files`):
    the pairs and the unpaired rows from the start, as many sampled answers as each online row draws;
    the teacher's samples as SFT rows, as many as the distillation row scores. With --pairs, that file
    (its sidecar the pairs' provenance) serves as both of the start's, and only the teacher's are sampled."""
    kinds = [kind for kind in dict.fromkeys(row.data for row in rows if not row.online) if not config.pairs or kind == "teacher_sft"]
    sampling = Sampling(config.steps, config.eval_size, config.seed, start.sft.data.task, start.sft.data.task_options,
                        start.sft.acceptance.max_new_tokens)
    offline = sample_offline_files(kinds, {"start": start.model, "teacher": inputs.teacher}, offline_paths(out, config.pairs),
                                   sampling, out / "logs", config.threads)
    if config.pairs:
        offline.provenance["pairs"] = inputs.pairs
    return offline


@dataclass(frozen=True)
class RowInputs:
    """What every row's process starts from: the comparison's directory (each row's run directory and
    log in it), the start model, the teacher (the rows that read one) and the offline rows' files."""

    out: Path
    start: str
    teacher: str
    offline: OfflineFiles


def _run_rows(rows: tuple[Row, ...], config: Config, inputs: RowInputs, held_out: HeldOut, start_sets: dict) -> list[Outcome]:
    """Each row in its own process (`row_command` from the start, `run_child`), its run directory and log
    in `inputs.out`, then its acceptance on `held_out`; a row whose file was not sampled, whose process failed or
    whose model cannot be scored is its outcome's one-line error, and the next row runs."""
    out, offline = inputs.out, inputs.offline
    outcomes = []
    for index, row in enumerate(rows, 1):
        steps = row_steps(row, config, offline.provenance.get("teacher_sft", {}).get("rows"))
        outcome = Outcome(describe(row, config, steps))
        if not row.online and offline.errors.get(row.data) is not None:
            outcome.error = f"no {row.data} file (posttrain pairs: {offline.errors[row.data]})"
        else:
            outcome.seconds, outcome.peak_rss_mib, outcome.error = run_child(
                row_command(row, inputs.start, str(offline.paths[row.data]), out / row.name, config, inputs.teacher, steps),
                out / "logs" / f"{row.name}.log", config.threads)
        if outcome.error is None:
            try:
                outcome.sets = held_out.score(stages.last_checkpoint(out / row.name, steps), row.name)
            except Exception as error:  # noqa: BLE001 - a model that cannot be scored is its row's failure, not the comparison's
                outcome.error = f"acceptance: {type(error).__name__}: {error}".splitlines()[0]
        outcomes.append(outcome)
        logger.info("[%d/%d] %s: %s", index, len(rows), row.name, _progress(outcome, start_sets))
    return outcomes


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



def _progress(outcome: Outcome, start_sets: dict) -> str:
    if outcome.error:
        return f"failed: {outcome.error}"
    held = outcome.sets[IN_DISTRIBUTION]
    return (f"{cell(held)}, gain {gain_text(paired_gain(start_sets[IN_DISTRIBUTION], held))}, "
            f"{outcome.seconds:.0f} s, {outcome.peak_rss_mib:.0f} MiB")
