"""Preference pairs from verified samples: `posttrain pairs`.

Sample G answers per training prompt with the rollout engine, score them with a verifier, and pair
a correct answer (chosen) with an incorrect one (rejected). Prompts whose G answers are all correct
or all incorrect give no pair and are counted. The output is a standard-format preference JSONL
(`{"id", "prompt", "chosen", "rejected", "metadata"}`) plus a sidecar `<name>.meta.json` recording
where the labels came from (model, verifier, task, seed, sampling, file hash); the DPO run card
reads it ("labels came from verifier V on samples of model M").

With `--unpaired`, the file holds KTO's unpaired rows instead (`{"id", "prompt", "completion",
"label", "metadata"}`, TRL's unpaired layout): every distinct scored answer of every prompt, labelled
desirable when correct, the groups that pairing skips (all correct, all incorrect) included and
counted; `posttrain dpo --loss.type kto` trains on it.

With `--sft`, the file holds SFT rows of the model's samples instead (`{"id", "prompt", "completion",
"metadata"}`): `--model` is a teacher, `--keep all` writes every non-empty sample (plain
distillation) and `--keep correct` only those the verifier accepts (rejection sampling, RFT);
`--max-rows` / `--max-tokens` cap the file (whole rows in sampling order) so that a comparison run can
match a token budget; the sidecar counts the completion tokens written (`data/teacher_sft.py`).
`posttrain sft --data.task FILE` trains on it, and its run card says where the rows came from.

With `--labeller judge:MODEL`, a judge labels instead of the verifier: each prompt's distinct
answers are paired in sampling order ((0, 1), (2, 3), ...: each answer once), the judge compares each
pair in both orders (P(A > B) = 1/2 [P_AB + 1 - P_BA], `algorithms.judge.pairwise_preference`), the
preferred answer is chosen. A pair within `preference_margin` of 1/2 is a tie (the judge has no clear
preference) and one the judge cannot compare is a failure: both are skipped and counted apart, as are
the prompts whose G answers are one text. The sidecar records the judge as the labeller, these counts
and its mean position bias.

The prompts come from the *training* split of `load_splits(data.task, eval_size=E, seed=S)`, so a DPO run
that evaluates on the held-out split with the same (task, E, S) never trained on its problems.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, ClassVar

from posttrain.atomic import check_output_file
from posttrain.data import load_splits, render_prompt
from posttrain.data.context import PromptSet, check_prompts_fit
from posttrain.data.examples import derived_seed, verifier_input
from posttrain.data.pairing import label_all, pair_up
from posttrain.data.provenance import provenance_path, write_with_provenance
from posttrain.data.source import TaskSource
from posttrain.data.teacher_sft import KEEP, Budget, TeacherRows
from posttrain.data.tasks import is_generated
from posttrain.errors import UserError
from posttrain.hardware import Hardware, resolve
from posttrain.rewards.defaults import default_reward
from posttrain.rewards.registry import RewardOptions, as_verifier
from posttrain.rollout import SamplingConfig
from posttrain.rollout.engines import RolloutSettings, make_engine
from posttrain.runs.skeleton import warn_if_unsafe

logger = logging.getLogger(__name__)


@dataclass
class PairData(TaskSource):
    """Which prompts are sampled: the task (or file) and its training split (the shared
    `TaskSource`; its held-out split is reserved, never sampled), and how many."""

    sizes: ClassVar[tuple[str, ...]] = ("max_prompts", "eval_size")

    task: str = ""
    """Task spec whose training split gives the prompts: arithmetic | rg:<dataset> | humaneval | a data file (.jsonl, .parquet, .csv, .json, .arrow) | a save_to_disk directory | a cached owner/name (required)."""
    max_prompts: int = 256
    """Training prompts to sample (the first of the seeded training split)."""


@dataclass
class PairSettings:
    """Everything that decides which pairs `build_pairs` writes (recorded in the sidecar). Build it
    with `posttrain.config.build_config`, which checks it (`validate`)."""

    model: str = ""
    """Model to sample from: tiny | smollm2-135m | a Hugging Face directory | a hub id (required)."""
    data: PairData = field(default_factory=PairData)
    """The prompts: data.task (required), format, columns, split, max_prompts, eval_size."""
    out: str = ""
    """Output pairs file (.jsonl, required); the sidecar is <name>.meta.json next to it."""
    overwrite: bool = False
    """Replace an existing `out` and its sidecar (`--overwrite`); without it an existing one is refused before any work."""
    group_size: int = 8
    """G answers sampled per prompt."""
    verifier: str | None = None
    """Labelling verifier; None: the task's default reward (arithmetic: exact, code: its sandboxed judge)."""
    reward_options: RewardOptions = field(default_factory=RewardOptions)
    """The labelling verifier's settings: timeout_s, memory_mb (code), partial_credit, extraction."""
    unsafe_no_sandbox: bool = False
    """Run model-written code WITHOUT the bubblewrap sandbox (resource limits only): a machine you can lose."""
    pairs_per_prompt: int = 1
    """At most this many (correct, incorrect) pairs per prompt, from distinct answers."""
    labeller: str | None = None
    """A judge that labels pairs instead of the verifier: judge:MODEL (both presentation orders, its position bias recorded); None: the verifier's correctness."""
    preference_margin: float = 0.1
    """With a labeller: a pair is kept when |P(A > B) - 1/2| >= this (the judge prefers one answer clearly)."""
    unpaired: bool = False
    """Write KTO's unpaired rows (prompt, completion, label) instead of pairs: every distinct scored answer, desirable when correct,
    the all-correct and all-incorrect groups included (`posttrain dpo --loss.type kto` reads the file)."""
    sft: bool = False
    """Write SFT rows (prompt, completion) of the model's samples instead of pairs: `--model` is a teacher, `posttrain sft --data.task OUT` trains on them."""
    keep: str | None = None
    """--sft: all (every non-empty sample: plain distillation) | correct (only samples the verifier accepts: rejection sampling, RFT); None: all."""
    distinct: bool = False
    """--sft: one row per distinct completion of a prompt (repeats dropped); default every sample, repeats included as the teacher sampled them (counted either way)."""
    max_rows: int | None = None
    """--sft: write at most this many rows (whole rows in sampling order; sampling stops once reached). None: no cap."""
    max_tokens: int | None = None
    """--sft: write at most this many completion tokens (the teacher's tokenizer, EOS excluded), to match a comparison run's budget. None: no cap."""
    correct_threshold: float = 1.0
    """A verdict is correct when its reward is >= this, incorrect below."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=32))
    """How the G answers are sampled (temperature, top_p, top_k, max_new_tokens, stop_strings, ...)."""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """The engine that samples them (`rollout/engines.py`): builtin, or vllm (--rollout.engine vllm)."""
    batch_size: int = 16
    """Prompts per generation call."""
    seed: int = 0
    """Seeds the task split and the sampling."""
    hardware: Hardware = field(default_factory=Hardware)
    """Device and precision of the sampling (--hardware.device cuda --hardware.precision bf16-mixed)."""

    def validate(self) -> None:
        for name, value in (("model", self.model), ("data.task", self.data.task), ("out", self.out)):
            if not value:
                raise UserError(f"--{name}: required (posttrain pairs --model M --data.task T --out FILE.jsonl)")
        if self.sft and self.group_size < 1:
            raise UserError(f"--group-size must be at least 1 (samples per prompt), got {self.group_size}")
        if not self.sft and self.group_size < 2:
            raise UserError(f"--group-size must be at least 2 (a pair needs two answers), got {self.group_size}")
        self.data.validate(prefix="--data.")
        for name, value in (("pairs_per_prompt", self.pairs_per_prompt), ("batch_size", self.batch_size)):
            if value < 1:
                raise UserError(f"--{name} must be at least 1, got {value}")
        if not self.out.endswith(".jsonl"):
            raise UserError(f"--out {self.out}: the pairs file must end in .jsonl")
        if self.labeller is not None and not self.labeller.strip().startswith("judge:"):
            raise UserError(f"--labeller {self.labeller}: a labeller compares two answers: give judge:MODEL (or leave it unset to label by --verifier)")
        if self.labeller is not None and self.unpaired:
            raise UserError("--labeller does not apply with --unpaired (unpaired rows are labelled by the verifier's correctness)")
        if not 0 <= self.preference_margin < 0.5:
            raise UserError(f"--preference-margin must be in [0, 0.5), got {self.preference_margin}")
        self.rollout.validate(self.sampling, prefix="--rollout.")
        if self.unpaired and self.pairs_per_prompt != 1:
            raise UserError("--pairs-per-prompt does not apply with --unpaired (every distinct scored answer is a row); leave it unset")
        self._validate_sft()

    def _validate_sft(self) -> None:
        sft_only = {"keep": self.keep is not None, "distinct": self.distinct, "max_rows": self.max_rows is not None,
                    "max_tokens": self.max_tokens is not None}
        if not self.sft:
            given = [name for name, set_ in sft_only.items() if set_]
            if given:
                raise UserError(f"--{given[0].replace('_', '-')} applies to SFT rows only: add --sft (posttrain pairs --sft --keep all|correct ...)")
            return
        for other, value in (("--unpaired", self.unpaired), ("--labeller", self.labeller is not None), ("--pairs-per-prompt", self.pairs_per_prompt != 1)):
            if value:
                raise UserError(f"{other} does not apply with --sft (SFT rows are the teacher's samples, kept by --keep); leave it unset")
        if self.keep is not None and self.keep not in KEEP:
            raise UserError(f"--keep must be one of {', '.join(KEEP)}, got {self.keep!r}")
        for name in ("max_rows", "max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


def build_pairs(settings: PairSettings, model=None, tokenizer=None) -> dict[str, Any]:
    """Sample, score, pair, and write `settings.out` and its sidecar atomically; returns the
    provenance dict (with counts). Raises UserError before writing anything when no pair results,
    and before any work when `out` cannot be written or exists (unless `overwrite`)."""
    from posttrain.models import load_model

    out = check_output_file(settings.out, "--out", settings.overwrite)
    if provenance_path(out).exists() and not settings.overwrite:
        raise UserError(f"--out {out}: its sidecar {provenance_path(out)} already exists; pass --overwrite to replace both, or choose another --out")
    placement = resolve(settings.hardware)
    # The prompts and the verifier before the model: a bad file or verifier fails before any work.
    train, held_out, examples = _training_prompts(settings.data, settings.seed)
    verifier, judge = _labellers(settings, train.reward_kind, placement)
    if model is None:
        model, tokenizer = load_model(settings.model, dtype=placement.param_dtype, device=placement.device)
    check_prompts_fit(model, tokenizer, [PromptSet("training", examples, settings.sampling.max_new_tokens, "sampling.max_new_tokens")],
                      system_prompt=settings.data.system_prompt)
    model.eval()
    labelled = Labelled(dict.fromkeys(JUDGE_OUTCOMES if judge else ("paired", "all_correct", "all_incorrect", "unscored"), 0),
                        {"labelled_by": judge.name if judge else verifier.name, "sampled_from": settings.model})
    teacher = (TeacherRows(settings.keep or "all", settings.correct_threshold, settings.distinct,
                           Budget(settings.max_rows, settings.max_tokens), tokenizer) if settings.sft else None)
    engine = make_engine(settings.rollout)
    sampled = 0
    for start in range(0, len(examples), settings.batch_size):
        chunk = examples[start : start + settings.batch_size]
        prompts = [render_prompt(tokenizer, e.prompt_input, system_prompt=settings.data.system_prompt) for e in chunk]
        with placement.autocast():
            rollout = engine(model, tokenizer, prompts, group_size=settings.group_size, sampling=settings.sampling,
                             seed=derived_seed(settings.seed, "pairs", str(start)))
        verdicts = verifier.batch(rollout.texts, [verifier_input(chunk[b], prompts[b]) for b in rollout.prompt_index.tolist()])
        labelled.count_errors(verdicts)
        G, truncated = settings.group_size, rollout.truncated.tolist()
        for b, example in enumerate(chunk):
            texts, group_verdicts = rollout.texts[b * G : (b + 1) * G], verdicts[b * G : (b + 1) * G]
            if teacher is not None:
                labelled.rows += teacher.add(example, texts, group_verdicts, truncated[b * G : (b + 1) * G], labelled.origin)
            else:
                label_group(settings, judge, example, prompts[b], texts, group_verdicts, labelled)
        sampled += len(chunk)
        if teacher is not None and teacher.budget.full:
            logger.info("--max-rows/--max-tokens reached after %d of %d prompts: sampling stops", sampled, len(examples))
            break
    if not labelled.rows:
        raise UserError(teacher.explain(sampled, settings.group_size) if teacher else _no_rows(settings, judge, labelled, len(examples)))
    provenance = _provenance(settings, verifier, judge, labelled, {"train": train, "held_out": held_out, "prompts": sampled},
                             placement)
    if teacher is not None:
        provenance.update({"kind": "SFT rows from a teacher's samples", **teacher.provenance()})
    write_with_provenance(settings.out, labelled.rows, provenance)
    return provenance


def pair_rows(example, texts: list[str], verdicts: list, pairs: list[tuple[int, int]], origin: dict[str, str]) -> list[dict]:
    """The pairs file's rows of one prompt's `pairs` (indices into its G `texts` and `verdicts`):
    id, prompt, chosen, rejected, and metadata naming the rewards, the rejected answer's reason and
    `origin` (who labelled, which model sampled)."""
    return [{"id": f"{example.id}/{number}", "prompt": example.prompt_input, "chosen": texts[chosen], "rejected": texts[rejected],
             "metadata": {"example": example.id, "chosen_reward": verdicts[chosen].reward, "rejected_reward": verdicts[rejected].reward,
                          "rejected_reason": verdicts[rejected].reason, **origin}}
            for number, (chosen, rejected) in enumerate(pairs)]


JUDGE_OUTCOMES = ("paired", "tied", "judge_failed", "one_answer")
"""A prompt's outcome under a judge: a decided pair written | every compared pair a tie | the judge
could not compare (and no tie) | its G answers are one text (nothing to compare)."""


@dataclass
class JudgeTally:
    """What a judge made of the candidate pairs of every prompt: `decided` (kept), `tied`
    (|P(A > B) - 1/2| < preference_margin: no clear preference, skipped), `failed` (the judge could
    not compare them, `failure_reasons` counted), each decided pair's position bias, and the largest
    |P - 1/2| among the ties (what `--preference-margin` would have to be below to keep one)."""

    decided: int = 0
    tied: int = 0
    failed: int = 0
    failure_reasons: Counter = field(default_factory=Counter)
    position_bias: list[float] = field(default_factory=list)
    largest_tie_distance: float | None = None

    def explain(self, judge: str, margin: float, outcomes: dict[str, int], prompts: int, group_size: int) -> str:
        """Why no pair was written, in one line: ties (naming `--preference-margin`) apart from the
        judge's failures and the prompts with nothing to compare."""
        parts = [f"the labeller {judge} decided none of the {self.decided + self.tied + self.failed} pairs it compared from {prompts} prompts (G={group_size})"]
        if self.tied:
            parts.append(f"{self.tied} were ties, no clear preference: |P(A > B) - 1/2| below --preference-margin {margin:g} "
                         f"(the clearest was {self.largest_tie_distance:.3g}; a lower --preference-margin keeps closer calls)")
        if self.failed:
            reasons = ", ".join(f"{reason} ({count})" for reason, count in self.failure_reasons.most_common(3))
            parts.append(f"{self.failed} the judge could not compare: {reasons}")
        if outcomes["one_answer"]:
            parts.append(f"{outcomes['one_answer']} prompts had one distinct answer (nothing to compare)")
        return "; ".join(parts)


def judged_pairs(judge, example, rendered: str, texts: list[str], settings: PairSettings, tally: JudgeTally,
                 origin: dict[str, str]) -> tuple[list[dict], str]:
    """The pairs file's rows of one prompt labelled by `judge`, and the prompt's outcome (one of
    `JUDGE_OUTCOMES`): its distinct answers paired in order ((0, 1), (2, 3), ...; at most
    `pairs_per_prompt`), each compared in both orders, the preferred one chosen. A pair within
    `preference_margin` of 1/2 is a tie and one the judge cannot render a failure: both skipped,
    counted apart in `tally`."""
    distinct = list(dict.fromkeys(texts))
    candidates = [(distinct[i], distinct[i + 1]) for i in range(0, len(distinct) - 1, 2)][: settings.pairs_per_prompt]
    if not candidates:
        return [], "one_answer"
    row = verifier_input(example, rendered)
    labels = judge.prefer([row] * len(candidates), [a for a, _ in candidates], [b for _, b in candidates])
    out, tied = [], False
    for number, ((a, b), label) in enumerate(zip(candidates, labels)):
        if label["p"] is None:
            tally.failed += 1
            tally.failure_reasons[label.get("reason") or "no reason given"] += 1
            continue
        distance = abs(label["p"] - 0.5)
        if distance < settings.preference_margin:
            tally.tied, tied = tally.tied + 1, True
            tally.largest_tie_distance = max(distance, tally.largest_tie_distance or 0.0)
            continue
        tally.decided += 1
        tally.position_bias.append(label["position_bias"])
        chosen, rejected = (a, b) if label["p"] > 0.5 else (b, a)
        out.append({"id": f"{example.id}/{number}", "prompt": example.prompt_input, "chosen": chosen, "rejected": rejected,
                    "metadata": {"example": example.id, "p_chosen": max(label["p"], 1 - label["p"]), "p_ab": label["p_ab"],
                                 "p_ba": label["p_ba"], "position_bias": label["position_bias"], **origin}})
    return out, "paired" if out else "tied" if tied else "judge_failed"


def unpaired_rows(example, texts: list[str], verdicts: list, labelled, origin: dict[str, str]) -> list[dict]:
    """KTO's rows of one prompt: each distinct scored answer of `labelled` (`data.pairing.label_all`),
    in sampling order, label true when correct; metadata names its reward, the verdict's reason, the
    group's outcome and `origin`."""
    desirable = set(labelled.correct)
    return [{"id": f"{example.id}/{index}", "prompt": example.prompt_input, "completion": texts[index], "label": index in desirable,
             "metadata": {"example": example.id, "reward": verdicts[index].reward, "reason": verdicts[index].reason,
                          "group": labelled.outcome, **origin}}
            for index in sorted(labelled.correct + labelled.incorrect)]


def _training_prompts(data: PairData, seed: int) -> tuple[Any, Any, list]:
    """(the training split, the held-out split, the prompts to sample): a generated task draws
    max_prompts; a file gives every row not held out, of which the first max_prompts."""
    train, held_out = load_splits(data.task, train_size=data.max_prompts if is_generated(data.task) else None, eval_size=data.eval_size,
                                  seed=seed, options=data.load_options())
    examples = train.examples[: data.max_prompts]
    if len(examples) < data.max_prompts:
        logger.info("%s: %d training prompts to sample, fewer than data.max_prompts=%d", data.task, len(examples), data.max_prompts)
    return train, held_out, examples


def _labellers(settings: PairSettings, reward_kind: str, placement) -> tuple[Any, Any]:
    """(the verifier, the judge or None), built and prepared: `--verifier` else the task kind's
    default reward, and `--labeller`; a bad name is one UserError line naming its flag."""
    name = settings.verifier or default_reward(reward_kind)
    if name is None:
        raise UserError(f"data.task {settings.data.task}: no default verifier for kind {reward_kind!r}; pass --verifier")
    verifier = as_verifier(None, name, settings.reward_options, settings.unsafe_no_sandbox, setting="--verifier", placement=placement)
    judge = (as_verifier(None, settings.labeller, settings.reward_options, setting="--labeller", placement=placement)
             if settings.labeller else None)
    warn_if_unsafe(settings.unsafe_no_sandbox)
    verifier.prepare()
    return verifier, judge


@dataclass
class Labelled:
    """What labelling every prompt's G answers gave: the file's rows and what the sidecar counts
    (each prompt's outcome, the verdict errors, an unpaired file's rows by their group's outcome
    and the duplicate answers dropped, a judge's tally)."""

    outcomes: dict[str, int]
    origin: dict[str, str]
    """Who labelled, which model sampled: every row's metadata."""
    rows: list[dict] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=lambda: {"infra_error": 0, "data_error": 0})
    from_group: dict[str, int] = field(default_factory=lambda: {"paired": 0, "all_correct": 0, "all_incorrect": 0})
    duplicates: int = 0
    judged: JudgeTally = field(default_factory=JudgeTally)

    def count_errors(self, verdicts: list) -> None:
        for verdict in verdicts:
            if verdict.status in self.errors:
                self.errors[verdict.status] += 1


def label_group(settings: PairSettings, judge, example, rendered: str, texts: list[str], verdicts: list, labelled: Labelled) -> None:
    """Add one prompt's rows to `labelled` and count its outcome: its unpaired rows (`--unpaired`),
    its judged pairs (`--labeller`), else its pairs of a correct and an incorrect answer."""
    if settings.unpaired:
        group = label_all(texts, verdicts, settings.correct_threshold)
        labelled.outcomes[group.outcome] += 1
        labelled.duplicates += group.duplicates
        new = unpaired_rows(example, texts, verdicts, group, labelled.origin)
        if group.outcome in labelled.from_group:
            labelled.from_group[group.outcome] += len(new)
    elif judge is not None:
        new, outcome = judged_pairs(judge, example, rendered, texts, settings, labelled.judged, labelled.origin)
        labelled.outcomes[outcome] += 1
    else:
        pairs, outcome = pair_up(texts, verdicts, settings.correct_threshold, settings.pairs_per_prompt)
        labelled.outcomes[outcome] += 1
        new = pair_rows(example, texts, verdicts, pairs, labelled.origin)
    labelled.rows += new


def _no_rows(settings: PairSettings, judge, labelled: Labelled, prompts: int) -> str:
    """Why no row was written, in one line."""
    G, outcomes = settings.group_size, labelled.outcomes
    if judge is not None:
        return f"no pairs: {labelled.judged.explain(judge.name, settings.preference_margin, outcomes, prompts, G)}; nothing written"
    if settings.unpaired:
        return (f"no unpaired rows: none of the {prompts * G} answers to {prompts} prompts could be scored "
                f"(verdict errors: {labelled.errors}); nothing written")
    return (f"no pairs: of {prompts} prompts, {outcomes['all_correct']} had only correct answers, "
            f"{outcomes['all_incorrect']} only incorrect, {outcomes['unscored']} could not be scored (G={G}); nothing written")


def _provenance(settings: PairSettings, verifier, judge, labelled: Labelled, splits: dict[str, Any], placement) -> dict[str, Any]:
    """The sidecar: where the labels came from (model, verifier or judge, task, seed, sampling,
    hardware, version) and the counts of the file's kind. `splits`: the training and held-out
    splits and the number of prompts sampled."""
    data, outcomes, rows = settings.data, labelled.outcomes, labelled.rows
    provenance = {
        "kind": "unpaired rows from verified samples" if settings.unpaired else "pairs from verified samples",
        "model": settings.model, "verifier": verifier.name,
        "verifier_settings": verifier.describe(), "task": data.task, "task_options": data.load_options(),
        "eval_size": len(splits["held_out"]), "seed": settings.seed, "group_size": settings.group_size, "prompts": splits["prompts"],
        "verdict_errors": labelled.errors, "correct_threshold": settings.correct_threshold, "system_prompt": data.system_prompt,
        "task_rows_bad": splits["train"].rows_bad, "task_rows_bad_reasons": splits["train"].rows_bad_reasons,
        "unsafe_no_sandbox": settings.unsafe_no_sandbox,
        "sampling": asdict(settings.sampling), "hardware": placement.describe(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "posttrain": _version(),
    }
    if judge is not None:
        judged = labelled.judged
        bias = judged.position_bias
        provenance.update({
            "verifier": judge.name, "verifier_settings": judge.describe(), "labeller": "judge, pairwise, both presentation orders",
            "preference_margin": settings.preference_margin, "pairs": len(rows), "pairs_per_prompt": settings.pairs_per_prompt,
            "pairs_compared": judged.decided + judged.tied + judged.failed, "pairs_tied": judged.tied,
            "pairs_judge_failed": judged.failed, "judge_failure_reasons": dict(judged.failure_reasons),
            "largest_tie_distance": judged.largest_tie_distance,
            "prompts_paired": outcomes["paired"], "prompts_skipped_tied": outcomes["tied"],
            "prompts_skipped_judge_failed": outcomes["judge_failed"], "prompts_skipped_one_answer": outcomes["one_answer"],
            "position_bias_mean": sum(bias) / len(bias) if bias else None,
        })
    if settings.unpaired:
        desirable = sum(row["label"] for row in rows)
        provenance.update({
            "unpaired": True, "rows": len(rows), "desirable": desirable, "undesirable": len(rows) - desirable,
            "rows_from_mixed_groups": labelled.from_group["paired"], "rows_from_all_correct_groups": labelled.from_group["all_correct"],
            "rows_from_all_incorrect_groups": labelled.from_group["all_incorrect"], "prompts_mixed": outcomes["paired"],
            "prompts_all_correct": outcomes["all_correct"], "prompts_all_incorrect": outcomes["all_incorrect"],
            "prompts_unscored": outcomes["unscored"], "duplicates_dropped": labelled.duplicates,
        })
    elif judge is None and not settings.sft:
        provenance.update({
            "pairs": len(rows), "prompts_paired": outcomes["paired"], "prompts_skipped_all_correct": outcomes["all_correct"],
            "prompts_skipped_all_incorrect": outcomes["all_incorrect"], "prompts_skipped_unscored": outcomes["unscored"],
            "pairs_per_prompt": settings.pairs_per_prompt,
        })
    return provenance


def _version() -> str:
    try:
        return metadata.version("posttrain")
    except metadata.PackageNotFoundError:
        return "unknown"
