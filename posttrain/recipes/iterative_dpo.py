"""`posttrain iterative-dpo`: rounds of (sample from the current policy -> label with a verifier ->
pairs -> DPO steps), all in one run directory.

The four links of an iterative DPO run: data = each round's own samples of the policy that round
starts from (on-policy between rounds, offline within one), made into pairs by `posttrain pairs`'s
`build_pairs`; reward = the labelling verifier (`pairs.verifier`: anything `posttrain pairs
--verifier` takes); loss = `posttrain dpo`'s loss section (`dpo.loss.*`), whose reference is the
round's starting policy (refreshed every round: `reference: round_start`); acceptance = held-out
task accuracy with the independent checker, one split for every round, after every round.

Each round K (1 ... rounds):
1. Sample `pairs.group_size` answers to `pairs.data.max_prompts` training prompts with the current
   policy (round 1: `model`; round K: round K-1's last checkpoint) and label them:
   rounds/round-K/pairs.jsonl and its provenance sidecar pairs.meta.json.
2. `posttrain dpo` from the current policy for `steps_per_round` steps on those pairs, in
   rounds/round-K/dpo/ (its own run directory: config, card, metrics, eval, checkpoints); its live
   (or precomputed) reference is the policy it starts from, so the reference is the round's start.
3. The parent's metrics.jsonl (one row per round end, steps counted over all rounds), eval/ (each
   round's final held-out files), plots/rounds.png and the run card with its per-round table.

    posttrain iterative-dpo --model M --pairs.data.task arithmetic --pairs.verifier exact --rounds 3 --steps-per-round 20
    posttrain iterative-dpo --resume runs/iterative-dpo    # skips the rounds whose DPO run finished

Every setting that can be checked without sampling is checked before round 1, and a fresh run that fails
before any round's pairs are written leaves no directory. A mistake found later (a round's pairs too few
for `dpo.data.heldout_pairs`) names this recipe's key and the command that goes on with the corrected
setting, keeping the pairs: `--resume DIR --resume-changed-config --dpo.data.heldout_pairs N`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.atomic import write_text_atomically
from posttrain.config import save_yaml, to_dict
from posttrain.data import load_splits
from posttrain.data.examples import derived_seed
from posttrain.data.provenance import provenance_path, read_provenance
from posttrain.data.tasks import is_generated
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import heldout_checker
from posttrain.evaluation.preference import heldout_task
from posttrain.hardware import resolve
from posttrain.losses.objectives import PREFERENCE_OBJECTIVES, objective
from posttrain.recipes import dpo, dpo_config, pairs
from posttrain.rewards.defaults import default_reward
from posttrain.rewards.registry import as_verifier
from posttrain.runs.card import new_card, render_markdown, value_text, write_run_card
from posttrain.runs.checkpoint import PREFIX, latest_checkpoint
from posttrain.runs.directory import check_new_run, default_output_dir, read_jsonl
from posttrain.runs.faults import RunStopped, check_resumed_config
from posttrain.runs.plots import plt, save_figure
from posttrain.runs.results import results

logger = logging.getLogger(__name__)

REFERENCES = {"round_start": "each round's DPO reference is the policy that round starts from (round 1: the start model; round K: "
                             "round K-1's last checkpoint): the reference is refreshed every round"}
"""`reference`'s choices and their card text. `initial` (every round against the start model) would need `posttrain
dpo` to take a reference model apart from its start (a `loss.reference_model` setting), which it does not yet."""


def _pair_defaults() -> pairs.PairSettings:
    return pairs.PairSettings(data=pairs.PairData(max_prompts=64))


@dataclass
class Config:
    model: str = "tiny"
    """The start policy (round 1 samples from it and starts DPO from it): tiny | smollm2-135m | a Hugging Face directory | a hub id."""
    rounds: int = 2
    """Rounds of sample -> label -> pairs -> DPO."""
    steps_per_round: int = 20
    """DPO steps of each round (each round's DPO run starts a fresh optimizer and schedule)."""
    fresh_prompts: bool = True
    """Each round samples new prompts: round K draws the training split of (task, eval_size, a seed derived from `seed` and K);
    round 1 and, when false, every round the one of (task, eval_size, `seed`). Pairs whose prompt is in the held-out
    split are never trained on (`posttrain dpo` removes and counts them)."""
    reference: Literal["round_start"] = "round_start"
    """The DPO reference of each round: round_start, the policy the round starts from (refreshed every round)."""
    pairs: pairs.PairSettings = field(default_factory=_pair_defaults)
    """How each round's pairs are made: any `posttrain pairs` setting but model, out, overwrite and seed (set by the round):
    pairs.data.task (required), pairs.data.max_prompts (prompts per round), pairs.data.eval_size, pairs.group_size,
    pairs.verifier (the labeller: any reward `posttrain pairs --verifier` takes), pairs.sampling.*, ..."""
    dpo: dpo_config.Config = field(default_factory=dpo_config.Config)
    """Each round's DPO: any `posttrain dpo` setting but model, output_dir, data.pairs, max_steps and seed (set by the
    round): dpo.loss.type, dpo.loss.beta, dpo.optim.lr, dpo.batch_size, dpo.acceptance.*, ... The held-out task split
    (dpo.acceptance.task, task_options, split_seed) defaults to pairs.data's task with `seed`: one split for every round."""
    seed: int = 0
    """Seeds the task split, the sampling and each round's DPO."""
    output_dir: str | None = None
    """Run directory (default runs/iterative-dpo-<time>)."""

    OWNED = {"pairs.model": "the round's sampling model is the current policy: give the start model as --model",
             "pairs.out": "each round writes rounds/round-K/pairs.jsonl in the run directory",
             "pairs.overwrite": "each round writes its own pairs file", "pairs.seed": "give --seed",
             "dpo.model": "each round starts from the current policy: give the start model as --model",
             "dpo.output_dir": "each round's DPO run is rounds/round-K/dpo in the run directory",
             "dpo.data.pairs": "each round trains on its own pairs", "dpo.max_steps": "give --steps-per-round",
             "dpo.seed": "give --seed"}
    """The settings of the two sections that each round sets, each with what to give instead."""

    @property
    def max_steps(self) -> int:
        """All rounds' DPO steps (the command line's --max-steps is not a setting here: give --rounds and --steps-per-round)."""
        return self.rounds * self.steps_per_round

    def validate(self) -> None:
        for name in ("rounds", "steps_per_round"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        defaults = {"pairs": to_dict(_pair_defaults()), "dpo": to_dict(dpo_config.Config())}
        given = {"pairs": to_dict(self.pairs), "dpo": to_dict(self.dpo)}
        for key, instead in self.OWNED.items():
            section, *path = key.split(".")
            if _get(given[section], path) != _get(defaults[section], path):
                raise UserError(f"{key} is set by each round ({instead})")
        if self.dpo.lora_rank:
            raise UserError("dpo.lora_rank: iterative DPO needs full fine-tuning (with LoRA the reference would be the base "
                            "model in every round, not the round's start)")
        if self.pairs.unpaired and objective(self.dpo.loss.type, "dpo.loss.type").paired:
            unpaired = " or ".join(name for name, entry in PREFERENCE_OBJECTIVES.items() if not entry.paired)
            raise UserError(f"pairs.unpaired writes KTO's unpaired rows, which only dpo.loss.type {unpaired} trains on (this run: {self.dpo.loss.type})")
        if not self.pairs.data.task:
            raise UserError("pairs.data.task: required, the task whose training split each round samples (--pairs.data.task arithmetic)")
        # Each section checked as a round will run it (the round's own values filled in), its errors named by the section.
        try:
            round_pairs(self, 1, Path("round-1"), self.model).validate()
        except UserError as error:
            raise UserError(f"pairs.{str(error).removeprefix('--')}") from None
        try:
            round_dpo(self, Path("round-1"), self.model, "round-1/pairs.jsonl").validate()
        except UserError as error:
            raise UserError(f"dpo.{error}") from None


def _get(tree: dict, path: list[str]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def round_seed(config: Config, number: int) -> int:
    """The seed of round `number`'s task split and sampling: `seed` for round 1 (and every round without fresh prompts)."""
    return config.seed if number == 1 or not config.fresh_prompts else derived_seed(config.seed, "iterative-dpo", "round", str(number))


def round_pairs(config: Config, number: int, round_dir: Path, model: str) -> pairs.PairSettings:
    """Round `number`'s `posttrain pairs` settings: the pairs section, sampled by `model` into round_dir/pairs.jsonl."""
    out = round_dir / "pairs.jsonl"
    return dataclasses.replace(config.pairs, model=model, out=str(out), seed=round_seed(config, number),
                               overwrite=out.exists() and not provenance_path(out).exists())  # a crash between the two writes


def round_dpo(config: Config, round_dir: Path, model: str, pairs_file: str) -> dpo_config.Config:
    """Round's `posttrain dpo` config: the dpo section from `model` on `pairs_file`, into round_dir/dpo, with the held-out
    task split of every round (the pairs section's task, its eval_size, split seed `seed`) unless dpo.acceptance names one."""
    acceptance = config.dpo.acceptance
    if acceptance.task is None:
        data = config.pairs.data
        acceptance = dataclasses.replace(acceptance, task=data.task, task_options=data.load_options() if acceptance.task_options is None
                                         else acceptance.task_options, eval_size=acceptance.eval_size or data.eval_size,
                                         split_seed=config.seed if acceptance.split_seed is None else acceptance.split_seed)
    return dataclasses.replace(config.dpo, model=model, output_dir=str(round_dir / "dpo"), max_steps=config.steps_per_round,
                               seed=config.seed, data=dataclasses.replace(config.dpo.data, pairs=pairs_file), acceptance=acceptance)


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Every round not yet complete; returns the run directory. `config` comes checked from `build_config`."""
    # 0. Everything that can fail on bad input fails here, before anything is written.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("iterative-dpo runs in one process (each round's sampling and DPO); run it without torchrun")
    out = Path(config.output_dir or default_output_dir("iterative-dpo"))
    if resume:
        if not (out / "config.yaml").is_file():
            raise UserError(f"{out}: not a run directory (no config.yaml) - nothing to resume")
        changes = check_resumed_config(out, config, resume_changed_config)
        if all(round_complete(config, out, number) for number in range(1, config.rounds + 1)):
            raise UserError(f"{out}: finished: all {config.rounds} rounds are complete, nothing to resume (more rounds: "
                            f"--resume {out} --resume-changed-config --rounds {config.rounds + 1})")
    else:
        check_new_run(out)
        changes = []
    preflight(config)
    config = dataclasses.replace(config, output_dir=str(out))
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    save_yaml(config, out / "config.yaml")
    card = make_card(config, [], changes)
    write_card(out, card)
    try:
        _run_rounds(config, out, changes, resume_changed_config)
    except RunStopped as stop:  # a round's DPO run stopped by a signal: the parent is what goes on
        raise RunStopped(stop.signum, stop.step, f"posttrain iterative-dpo --resume {out}") from None
    except UserError as error:
        if not resume and not any((out / "rounds").glob("round-*/pairs.meta.json")):
            _remove_attempt(out, created)  # nothing kept: the corrected command must find no run there
        elif "--resume" not in str(error):
            raise UserError(f"{error}; the rounds' finished work is kept in {out}: go on with {continue_command(out, error)}",
                            exit_code=error.exit_code) from None
        raise
    return out


def _run_rounds(config: Config, out: Path, changes: list[str], resume_changed_config: bool) -> None:
    """Every round in turn: a complete round is read back, the others run (`run_round`); the parent's files after each."""
    current = config.model
    done: list[dict[str, Any]] = []
    for number in range(1, config.rounds + 1):
        round_dir = out / "rounds" / f"round-{number}"
        if round_complete(config, out, number):
            logger.info("round %d/%d: complete (its DPO run finished), skipped", number, config.rounds)
        else:
            run_round(config, number, round_dir, current, resume_changed_config)
        done.append(round_record(config, number, round_dir, current))
        current = done[-1]["end_model"]
        write_parent(out, config, done, changes)
        logger.info("round %d/%d: %d pairs; held-out pass@1 %s -> %s", number, config.rounds, done[-1]["pairs"],
                    value_text(done[-1]["start"]["pass@1"]), value_text(done[-1]["end"]["pass@1"]))


def _remove_attempt(out: Path, created: bool) -> None:
    """Undo a fresh attempt that kept no round's work: the run directory if this attempt made it, else (it was empty)
    what the attempt wrote in it."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir():
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def continue_command(out: Path, error: UserError | str) -> str:
    """The command that goes on with the run in `out` once the setting `error` names is corrected: a resume that accepts
    the change (each round's finished work is kept; the change is recorded in the card)."""
    key = re.search(r"(?<![\w./-])((?:pairs|dpo)\.[a-z_]+(?:\.[a-z_]+)*)", str(error))
    return f"posttrain iterative-dpo --resume {out} --resume-changed-config --{key.group(1) if key else 'KEY'} VALUE"


def preflight(config: Config) -> None:
    """The checks that read the task and build the verifiers: the start model's directory, the pairs' task splits (every round's seed), the labelling
    verifier and the held-out checker, each a one-line UserError before the run directory is written."""
    data, placement = config.pairs.data, resolve(config.pairs.hardware)
    model = Path(config.model).expanduser()
    if not model.exists() and (config.model.startswith((".", "/", "~")) or config.model.count("/") > 1):  # as load_model reads a spec
        raise UserError(f"model {config.model!r}: no such directory")
    prompts = []  # each round's training prompts: the most it samples
    for seed in sorted({round_seed(config, number) for number in range(2, config.rounds + 1)} - {config.seed}):
        other, _ = load_splits(data.task, train_size=data.max_prompts if is_generated(data.task) else None, eval_size=data.eval_size,
                               seed=seed, options=data.load_options())
        prompts.append(len(other.examples[: data.max_prompts]))
    train, held = load_splits(data.task, train_size=data.max_prompts if is_generated(data.task) else None, eval_size=data.eval_size,
                              seed=config.seed, options=data.load_options())
    check_heldout_pairs(config, min([len(train.examples[: data.max_prompts]), *prompts]))
    name = config.pairs.verifier or default_reward(train.reward_kind)
    if name is None:
        raise UserError(f"pairs.data.task {data.task}: no default verifier for kind {train.reward_kind!r}; pass --pairs.verifier")
    as_verifier(None, name, config.pairs.reward_options, config.pairs.unsafe_no_sandbox, setting="pairs.verifier", placement=placement)
    acceptance = round_dpo(config, Path("round-1"), config.model, "").acceptance
    if config.dpo.acceptance.task is None:  # the split each round's DPO rebuilds from the pairs' provenance
        acceptance = dataclasses.replace(acceptance, eval_size=acceptance.eval_size or len(held.examples))
    held_out, spec = heldout_task(acceptance, None, config.seed)
    heldout_checker(spec["checker"], held_out, config.dpo.reward_options, config.dpo.unsafe_no_sandbox, setting="dpo.acceptance.checker")


def check_heldout_pairs(config: Config, prompts: int) -> None:
    """Refuse a `dpo.data.heldout_pairs` that holds out every pair a round can make, before any round samples: a round of
    `prompts` prompts makes at most `per_prompt` rows of each (pairs.pairs_per_prompt pairs, or with pairs.unpaired every
    distinct answer of pairs.group_size), and `data.preference.split_pairs` holds out whole prompts until it has the count,
    so a count above (prompts - 1) x per_prompt leaves no training row whatever was sampled."""
    held = config.dpo.data
    if held.heldout_file or not held.heldout_pairs:
        return
    per_prompt, why = ((config.pairs.group_size, f"pairs.group_size {config.pairs.group_size} unpaired rows") if config.pairs.unpaired
                       else (config.pairs.pairs_per_prompt, f"pairs.pairs_per_prompt {config.pairs.pairs_per_prompt}"))
    most = (prompts - 1) * per_prompt
    if held.heldout_pairs > most:
        raise UserError(f"dpo.data.heldout_pairs={held.heldout_pairs} would hold out every pair of a round: a round makes at most "
                        f"{prompts * per_prompt} ({prompts} prompts x {why}), held out by whole prompts; give at most {most} "
                        "(0: none, each round is still judged by held-out task accuracy) or dpo.data.heldout_file")


def round_complete(config: Config, out: Path, number: int) -> bool:
    """Whether round `number`'s DPO run finished: its newest complete checkpoint is at steps_per_round."""
    checkpoint = latest_checkpoint(out / "rounds" / f"round-{number}" / "dpo" / "checkpoints")
    return checkpoint is not None and int(checkpoint.name.removeprefix(PREFIX)) >= config.steps_per_round


def run_round(config: Config, number: int, round_dir: Path, current: str, resume_changed_config: bool) -> None:
    """1-2. Round `number`: the current policy's pairs (kept when an earlier attempt wrote them whole), then its DPO run
    (resumed when an earlier attempt started it)."""
    settings = round_pairs(config, number, round_dir, current)
    if provenance_path(settings.out).is_file():
        logger.info("round %d/%d: pairs already written (%s), kept", number, config.rounds, settings.out)
    else:
        logger.info("round %d/%d: sampling %d prompts x %d answers from %s (seed %d), labelled by %s", number, config.rounds,
                    settings.data.max_prompts, settings.group_size, current, settings.seed, settings.verifier or "the task's default reward")
        round_dir.mkdir(parents=True, exist_ok=True)
        try:
            pairs.build_pairs(settings)
        except UserError as error:
            raise UserError(f"round {number}: {own_keys(error, 'pairs', pairs.PairSettings)}", exit_code=error.exit_code) from None
    dpo_run = round_dir / "dpo"
    started = (dpo_run / "config.yaml").is_file()
    logger.info("round %d/%d: DPO %s %d steps from %s (reference: that same policy)", number, config.rounds,
                "resumed for its" if started else "for", config.steps_per_round, current)
    try:
        dpo.run(round_dpo(config, round_dir, current, settings.out), resume=started, resume_changed_config=resume_changed_config)
    except RunStopped as stop:  # its step counted over all rounds, as the parent's metrics count them
        raise RunStopped(stop.signum, (number - 1) * config.steps_per_round + stop.step, "") from None
    except UserError as error:
        raise UserError(f"round {number}: {own_keys(error, 'dpo', dpo_config.Config)}", exit_code=error.exit_code) from None


def own_keys(error: UserError | str, section: str, settings: type) -> str:
    """`error`'s message with the keys of a section's own config (`data.heldout_pairs`, `--loss.beta`) named as this recipe's
    user types them (`dpo.data.heldout_pairs`, `--dpo.loss.beta`)."""
    names = "|".join(field.name for field in dataclasses.fields(settings) if dataclasses.is_dataclass(field.type)
                     or (isinstance(field.type, str) and field.default_factory is not dataclasses.MISSING))
    return re.sub(rf"(?<![\w./-])(-{{0,2}})({names})\.", rf"\1{section}.\2.", str(error)) if names else str(error)


def round_record(config: Config, number: int, round_dir: Path, start_model: str) -> dict[str, Any]:
    """What round `number` did, read back from its files: its pairs' provenance, its DPO run's card, and its held-out
    task metrics at its first and last step (the rows of its metrics.jsonl)."""
    provenance = read_provenance(round_dir / "pairs.jsonl") or {}
    card = json.loads((round_dir / "dpo" / "run_card.json").read_text())
    rows = read_jsonl(round_dir / "dpo" / "metrics.jsonl")
    first = next(row for row in rows if row["step"] == 0)
    last = next(row for row in reversed(rows) if row["step"] == config.steps_per_round and "heldout/pass@1" in row)
    link = card["links"]["data"]
    return {
        "round": number, "sampled_from": start_model, "end_model": str(round_dir / "dpo" / "checkpoints" / f"{PREFIX}{config.steps_per_round:06d}" / "model"),
        "pairs_file": str(round_dir / "pairs.jsonl"), "sampling_seed": provenance.get("seed"), "prompts": provenance.get("prompts"),
        "pairs": provenance.get("pairs", provenance.get("rows")), "prompts_paired": provenance.get("prompts_paired"),
        "prompts_skipped_all_correct": provenance.get("prompts_skipped_all_correct"),
        "prompts_skipped_all_incorrect": provenance.get("prompts_skipped_all_incorrect"),
        "train_pairs": link.get("train_pairs"), "heldout_pairs": link.get("heldout_pairs"),
        "removed_heldout_task_overlap": link.get("removed_heldout_task_overlap"), "labeller": provenance.get("verifier"),
        "provenance_file_matches": provenance.get("file_matches"), "dpo_run": str(round_dir / "dpo"),
        "reference": start_model, "start": _heldout(first, round_dir, 0), "end": _heldout(last, round_dir, number * config.steps_per_round),
        "loss": last.get("loss"),
        "heldout_accuracy": _heldout_accuracy(last), "rows": (first, last), "card": card,
    }


def _heldout_accuracy(row: dict[str, Any]) -> dict[str, Any] | None:
    """A round's last held-out pair (or, for KTO, label-side) accuracy with its interval and ties."""
    name = next((key for key in ("heldout/preference_accuracy", "heldout/label_side_accuracy") if row.get(key) is not None), None)
    if name is None:
        return None
    return {"metric": name, "value": row[name], "ci95": [row.get(f"{name}_low"), row.get(f"{name}_high")], "ties": row.get(f"{name}_ties")}


def _heldout(row: dict[str, Any], round_dir: Path, step: int) -> dict[str, Any]:
    """Held-out pass@1 of one evaluation of a round's DPO run: its value and interval, the step counted over all rounds
    (the parent's metrics.jsonl and eval/) and the round's own eval file it comes from."""
    return {"step": step, "pass@1": row.get("heldout/pass@1"), "ci95": [row.get("heldout/pass@1_low"), row.get("heldout/pass@1_high")],
            "eval_file": str(round_dir / "dpo" / "eval" / f"task-step-{row['step']:06d}.json")}


def write_parent(out: Path, config: Config, done: list[dict[str, Any]], changes: list[str]) -> None:
    """3. The parent's metrics.jsonl (the start, then each round's end, at steps counted over all rounds), eval/ (the
    matching held-out files, renamed to those steps, so that its results pair the start with the end), the plot and the
    card; each rewritten whole from the rounds' files."""
    (out / "eval").mkdir(exist_ok=True)
    points = [(0, done[0], done[0]["rows"][0], done[0]["start"]["step"])] + [(r["round"], r, r["rows"][1], r["end"]["step"]) for r in done]
    lines = []
    for number, record, row, step in points:
        lines.append(json.dumps({"step": step, "round": number, **{k: v for k, v in row.items() if k.startswith("heldout/")},
                                 **({"loss": row["loss"], "pairs": record["pairs"]} if number else {})}))
        source = Path(record["dpo_run"]) / "eval"
        for path in source.glob(f"*-{row['step']:06d}.json"):
            write_text_atomically(out / "eval" / path.name.replace(f"-{row['step']:06d}", f"-{step:06d}"), path.read_text())
    write_text_atomically(out / "metrics.jsonl", "".join(line + "\n" for line in lines))
    plot_rounds(done, out / "plots" / "rounds.png")
    card = make_card(config, done, changes)
    card["results"] = results(out)
    write_card(out, card)


def plot_rounds(done: list[dict[str, Any]], path: Path) -> None:
    """Held-out pass@1 (95% band) after each round (round 0: the start) and the pairs each round trained on."""
    figure, (accuracy, counts) = plt.subplots(1, 2, figsize=(9, 3.5))
    points = [done[0]["start"]] + [record["end"] for record in done]
    if all(point["pass@1"] is not None for point in points):
        rounds = list(range(len(points)))
        accuracy.plot(rounds, [p["pass@1"] for p in points], marker="o")
        if all(None not in p["ci95"] for p in points):
            accuracy.fill_between(rounds, [p["ci95"][0] for p in points], [p["ci95"][1] for p in points], alpha=0.15)
    accuracy.set(xlabel="round (0: start)", ylabel="held-out pass@1", title="held-out task accuracy (95% CI)", ylim=(-0.02, 1.02))
    counts.bar([r["round"] for r in done], [r["pairs"] or 0 for r in done])
    counts.set(xlabel="round", ylabel="pairs", title="pairs per round")
    for axis in (accuracy, counts):
        axis.grid(alpha=0.3)
        axis.set_xticks(range(0 if axis is accuracy else 1, len(done) + 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(figure, path)


def make_card(config: Config, done: list[dict[str, Any]], changes: list[str]) -> dict[str, Any]:
    """The parent's run card: the four links (data: every round's pairs and provenance; reward: the labeller; loss: the dpo
    loss section and the reference of each round; acceptance: held-out accuracy after every round), the per-round table."""
    card = new_card("iterative-dpo", config.seed, model=config.model, rounds=config.rounds, steps_per_round=config.steps_per_round,
                    config=to_dict(config))
    data = config.pairs.data
    first = done[0]["card"]["links"] if done else {}
    card["links"]["data"] = {
        "source": "on-policy between rounds: each round's pairs are the round's starting policy's own samples, labelled "
                  "(posttrain pairs' build_pairs), then trained on offline for the round's steps",
        "task": data.task, "task_options": data.load_options(), "prompts_per_round": data.max_prompts, "group_size": config.pairs.group_size,
        "fresh_prompts": (f"yes: round K samples the training split of ({data.task}, eval_size, a seed derived from {config.seed} and K)"
                          if config.fresh_prompts else f"no: every round samples the same prompts (training split, seed {config.seed})"),
        "rounds": [{key: record[key] for key in ("round", "pairs_file", "sampled_from", "sampling_seed", "prompts", "pairs", "prompts_paired",
                                                  "prompts_skipped_all_correct", "prompts_skipped_all_incorrect", "train_pairs",
                                                  "heldout_pairs", "removed_heldout_task_overlap", "provenance_file_matches")}
                   for record in done],
    }
    card["links"]["reward"] = {"labeller": config.pairs.verifier or "the task's default reward",
                               **{key: value for key, value in first.get("reward", {}).items() if key not in ("labels", "pairs_seed")},
                               "labels": [record["card"]["links"]["reward"].get("labels") for record in done]}
    loss = first.get("loss") or to_dict(config.dpo.loss)
    card["links"]["loss"] = {**loss, "reference": f"{config.reference}: {REFERENCES[config.reference]}",
                             "reference_in_each_dpo_run": loss.get("reference"), "steps_per_round": config.steps_per_round,
                             "optimizer_each_round": "a fresh optimizer and schedule (dpo.optim) each round, from the round's starting policy"}
    card["links"]["acceptance"] = {**first.get("acceptance", {}),
                                   "after_every_round": [{"round": 0, **done[0]["start"]}] + [{"round": r["round"], **r["end"]} for r in done]
                                   if done else []}
    card["rounds"] = [{key: record[key] for key in ("round", "sampled_from", "reference", "pairs", "train_pairs", "loss", "heldout_accuracy",
                                                     "dpo_run")} | {"heldout_start": record["start"], "heldout_end": record["end"]}
                      for record in done]
    if first.get("acceptance", {}).get("independent") is False:
        card["notes"].append(f"acceptance is not independent of the labels: {first['acceptance'].get('independence_reason')}")
    if changes:
        card["run"]["resumed_with_changes"] = changes
    if config.pairs.unsafe_no_sandbox or config.dpo.unsafe_no_sandbox:
        card["notes"].insert(0, "UNSAFE: model-written code ran WITHOUT the bubblewrap sandbox (unsafe_no_sandbox: true)")
    return card


def write_card(out: Path, card: dict[str, Any]) -> None:
    """run_card.json and run_card.md, the markdown with the per-round table after the four links."""
    write_run_card(out, card)
    table = ["## Rounds", "", "| round | sampled from | pairs (trained) | held-out pass@1 at its start | at its end | loss | DPO run |",
             "|---|---|---|---|---|---|---|"]
    for row in card.get("rounds", []):
        table.append(f"| {row['round']} | {row['sampled_from']} | {row['pairs']} ({row['train_pairs']}) | {_point_text(row['heldout_start'])} | "
                     f"{_point_text(row['heldout_end'])} | {value_text(row['loss'])} | {row['dpo_run']} |")
    markdown = render_markdown(card)
    where = min(markdown.index(title) for title in ("## Results", "## Alarms", "## Notes", "## Versions") if title in markdown)
    write_text_atomically(out / "run_card.md", markdown[:where] + "\n".join(table) + "\n\n" + markdown[where:])


def _point_text(point: dict[str, Any]) -> str:
    low, high = point["ci95"]
    return value_text(point["pass@1"]) + (f" [{low:.3f}, {high:.3f}]" if None not in (low, high) else "")
