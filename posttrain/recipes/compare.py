"""`posttrain compare` (what `make compare` runs): every online and offline method of the library
from ONE SFT start, the same budget each, scored on the same held-out problems by the independent
checker, in one table.

0. Every input before any work: --output-dir, --start (resolved and loaded), --pairs (read and
   validated whole, as each offline row reads it); a mistake is one line and writes nothing (an
   earlier comparison in --output-dir stays).
1. The start: the demo's SFT stage (`demo.train_sft`: rounds to partial competence), or `--start`.
2. Its acceptance on the demo's held-out sets (`demo.heldout_sets`, `demo.acceptance`: greedy
   pass@1 by `integer`, written apart from the `exact` reward and labeller).
3. One pairs file from the start (`posttrain pairs`, labelled by `exact`), as many sampled answers
   as each online row draws (steps x prompts per step x G): every offline row trains on it, but KTO,
   which trains on the unpaired rows of the same samples (`posttrain pairs --unpaired`, the same
   seed: every distinct scored answer, the groups pairing skips included).
4. Each row (`ROWS`: the flags of docs/algorithms.md §3d) in its own process, `sys.executable -m
   posttrain ...`, so that its wall time and peak RSS are its own and a failing row is one line of
   the table, not the end of the comparison; then its acceptance on the same sets.
5. comparison.md, comparison.json and comparison.png (gain over the start per row, paired 95%
   intervals) in the output directory: the report, evaluation/comparison_report.py.

Each row names the links it changed relative to its family's base (GRPO online, DPO offline):
that column is the point of the table (the seed's "which link moved?"), and its footer says what one
task, one model, one seed and N steps cannot conclude.
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
from posttrain.recipes import demo, stages
from posttrain.rewards import get_verifier

logger = logging.getLogger(__name__)

PROMPTS_PER_STEP, GROUP_SIZE = 16, 8
"""Every online row's budget per step (presets/tiny-grpo.yaml's; PPO's preset draws 32 x 2, set to this)."""
PAIRS_PER_STEP = 16
"""Every offline row's pairs per step (the demo's DPO stage, docs/algorithms.md §3d)."""
REWARD = "exact"
"""The online rows' reward and the pairs' labeller; the held-out checker is `integer` (demo.acceptance)."""


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
    """An offline row's file: `pairs`, or `unpaired` (the unpaired rows of the same samples; with
    --pairs, that file, which the KTO loader reads as two rows per pair)."""

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
)
"""Every row, in the table's order: the online family (base GRPO), then the offline one (base DPO)."""
BASE = {"grpo": "grpo", "ppo": "grpo", "dpo": "dpo"}
"""The row each command's rows are compared with in the links column."""
PRESET = {"grpo": "tiny-grpo", "ppo": "tiny-ppo", "dpo": "tiny-dpo"}
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

    def validate(self) -> None:
        names = [row.name for row in ROWS]
        unknown = [name for name in self.rows or () if name not in names]
        if unknown:
            raise UserError(f"--rows: no row {', '.join(unknown)} (rows: {', '.join(names)})")
        if self.rows is not None and not self.rows:
            raise UserError("--rows: give at least one row")
        for name in ("steps", "sft_steps", "sft_round", "eval_size", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")

    def selected(self) -> tuple[Row, ...]:
        return tuple(row for row in ROWS if self.rows is None or row.name in self.rows)


def run(config: Config, rows: tuple[Row, ...] | None = None) -> Path:
    """Run the comparison; returns the output directory. `rows` (default: `config.selected()`) lets
    a caller add rows of its own (the tests: one that fails)."""
    config.validate()
    rows = config.selected() if rows is None else rows
    started = time.perf_counter()
    # 0. Every input checked before any work; on a mistake nothing is written (an earlier comparison stays).
    out = Path(config.output_dir).resolve()
    check_output_dir(out, config.start, config.pairs)
    given_start = check_start(config.start) if config.start else None
    given_pairs = check_pairs(config.pairs) if config.pairs else None
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

    # 3. One pairs file from the start, as many sampled answers as each online row draws (or --pairs);
    #    the unpaired rows of the same samples (same seed) when a row trains on them.
    files = {"pairs": Path(config.pairs).resolve() if config.pairs else out / "pairs.jsonl"}
    files["unpaired"] = files["pairs"] if config.pairs else out / "unpaired.jsonl"
    if config.pairs:
        provenance, errors = {"pairs": given_pairs}, {}
    else:
        provenance, errors = sample_offline_files(config, list(dict.fromkeys(row.data for row in rows if not row.online)), start, files,
                                                  sft_config)

    # 4. Each row in its own process, then its acceptance on the same problems.
    outcomes = []
    for index, row in enumerate(rows, 1):
        outcome = Outcome(describe(row, config))
        if not row.online and errors.get(row.data) is not None:
            outcome.error = f"no {row.data} file (posttrain pairs: {errors[row.data]})"
        else:
            outcome.seconds, outcome.peak_rss_mib, outcome.error = _child(
                row_command(row, start, str(files[row.data]), out / row.name, config), out / "logs" / f"{row.name}.log", config.threads)
        if outcome.error is None:
            try:
                outcome.sets = demo.acceptance(stages.last_checkpoint(out / row.name, config.steps), sets, budget, config.seed, out / "eval", row.name)
            except Exception as error:  # noqa: BLE001 - a model that cannot be scored is its row's failure, not the comparison's
                outcome.error = f"acceptance: {type(error).__name__}: {error}".splitlines()[0]
        outcomes.append(outcome)
        logger.info("[%d/%d] %s: %s", index, len(rows), row.name, _progress(outcome, start_sets))

    # 5. The table, its JSON and the plot.
    measured = Measured(start, config.start is not None, start_sets, sft_seconds, provenance, config.pairs,
                        independence(get_verifier(REWARD), get_verifier("integer")), time.perf_counter() - started)
    table = comparison(settings(config), CANNOT.format(steps=config.steps), measured, outcomes)
    write_text_atomically(out / "comparison.json", json.dumps(table, indent=1) + "\n")
    write_text_atomically(out / "comparison.md", markdown(table) + "\n")
    plot(table, out / "comparison.png")
    return out


def sample_offline_files(config: Config, kinds: list[str], start: str, files: dict[str, Path], sft_config) -> tuple[dict, dict]:
    """Sample the offline rows' files (`kinds`: pairs, unpaired) from the start, each with `posttrain
    pairs` in its own process (labelled by `REWARD`, as many answers as each online row draws, the
    start's held-out split kept apart); returns (each file's sidecar, each file's one-line error or
    None)."""
    data, out = sft_config.data, Path(config.output_dir).resolve()
    provenance, errors = {}, {}
    for kind in kinds:
        arguments = ["pairs", "--model", start, "--out", str(files[kind]), "--group_size", str(GROUP_SIZE), "--verifier", REWARD,
                     "--data.task", data.task, "--data.task_options", json.dumps(data.task_options),
                     "--data.max_prompts", str(config.steps * PROMPTS_PER_STEP), "--data.eval_size", str(config.eval_size),
                     "--sampling.max_new_tokens", str(sft_config.acceptance.max_new_tokens), "--seed", str(config.seed),
                     *(["--unpaired"] if kind == "unpaired" else [])]
        seconds, _, errors[kind] = _child(arguments, out / "logs" / f"{kind}.log", config.threads)
        if errors[kind] is None:
            provenance[kind] = json.loads(files[kind].with_name(f"{kind}.meta.json").read_text())
            logger.info("%s: %s rows from %s prompts (%.0f s)", kind, provenance[kind].get("pairs", provenance[kind].get("rows")),
                        provenance[kind].get("prompts"), seconds)
        else:
            logger.info("%s: failed: %s", kind, errors[kind])
    return provenance, errors


def settings(config: Config) -> dict[str, Any]:
    """comparison.json's settings: the budget every row shares, the reward, the checker, the threads."""
    return {"steps": config.steps, "eval_size": config.eval_size, "seed": config.seed, "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE, "pairs_per_step": PAIRS_PER_STEP, "reward": REWARD, "checker": "integer", "threads": config.threads}


def describe(row: Row, config: Config) -> dict[str, Any]:
    """One row as comparison.json names it: its family and base, its command (START, PAIRS or
    UNPAIRED and DIR for the start, its file and the output directory), its flags and links."""
    return {"name": row.name, "label": row.label, "family": "online" if row.online else "offline", "base": BASE[row.command],
            "command": ["posttrain", *row_command(row, "START", row.data.upper(), Path("DIR") / row.name, config)],
            "flags": list(row.flags), "links_changed": [list(change) for change in row.changed], "links_text": links_changed(row)}


def row_command(row: Row, start: str, pairs_file: str, run_dir: Path, config: Config) -> list[str]:
    """`posttrain <command>` arguments of one row: its preset, the start, the shared budget and held-out
    split, one checkpoint and evaluation at the last step, no shifted sets in the run (they are scored
    here, once, for every row alike), then the row's own flags. `pairs_file`: an offline row's file
    (its `data`: the pairs or the unpaired rows)."""
    steps = str(config.steps)
    common = ["--config", PRESET[row.command], "--model", start, "--max-steps", steps, "--checkpoint-every", steps,
              "--acceptance.eval_every", steps, "--acceptance.sets", "[]", "--seed", str(config.seed), "--output-dir", str(run_dir)]
    if row.online:
        family = ["--reward", REWARD, "--data.eval_size", str(config.eval_size),
                  "--data.prompts_per_step", str(PROMPTS_PER_STEP), "--data.group_size", str(GROUP_SIZE)]
    else:
        family = ["--data.pairs", pairs_file, "--data.heldout_pairs", "0", "--batch_size", str(PAIRS_PER_STEP),
                  "--micro_batch_size", str(PAIRS_PER_STEP)]
    return [row.command, *common, *family, *row.flags]


def links_changed(row: Row) -> str:
    """The links column, grouped by link: 'loss: advantage estimator (leave-one-out), aggregation
    (seq_mean_token_sum)'; the base's own note for the base."""
    if not row.changed:
        return f"(the {'online' if row.online else 'offline'} base)"
    links = dict.fromkeys(link for link, _, _ in row.changed)
    return "; ".join(f"{link}: " + ", ".join(f"{part} ({how})" for name, part, how in row.changed if name == link) for link in links)


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


def _start_model(path: Path) -> str:
    """The start's model directory: `path` itself, or a run directory's newest checkpoint."""
    if (path / "checkpoints").is_dir():
        return stages.last_checkpoint(path, stages.newest_step(path))
    if not (path / "config.json").is_file():
        raise UserError(f"--start {path}: neither a model directory (config.json) nor a run directory (checkpoints/step-N/model)")
    return str(path.resolve())


def check_output_dir(out: Path, start: str | None, pairs: str | None) -> None:
    """`out` may hold only an earlier comparison (comparison.json), which a new one replaces, and so may not hold
    --start or --pairs (the replacement would delete them): else one UserError line."""
    for flag, given in (("--start", start), ("--pairs", pairs)):
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
