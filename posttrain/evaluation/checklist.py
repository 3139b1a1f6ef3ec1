"""The seed's checklist before any conclusion, answered for a run and for a comparison of runs.

"The score went up: does that support the claim?" The seed asks, before any conclusion: are there
problems never used in training, is the checker independent (not "the same flawed checking logic on
new problems"), edge cases and new kinds of input, a human spot check, and, when two methods are
compared, can the four links be named for both sides. A run directory already records every
ingredient (run_card.json, metrics.jsonl, eval/); this module only reads them and answers each
question `yes`, `no` or `not measured`, with the run's own number and where it came from, then a
one-sentence verdict. `posttrain checklist` prints it (or `--json`), and every run card ends with
it (`runs.skeleton.closing`).

    heldout      held-out problems never trained on (the overlap check's count), how many
    independent  the held-out checker shares no logic with the training reward (the card's reason)
    interval     the in-distribution gain's 95% interval lies above zero (paired over the same
                 problems; else Newcombe's interval from the two Wilson intervals)
    shifted      each shifted held-out set: the gain carried, stayed flat or reversed ("no": one fell)
    audit        `posttrain audit` of the training reward, and a code dataset's weak tests excluded
    alarms       the divergence alarm (online) or likelihood-displacement alarm (preference): silent
    review       a person's marks (`posttrain review`): agreement with the checker >= MIN_AGREEMENT
    signal       the training signal: unscorable rows <= MAX_UNSCORABLE, groups without variance
                 <= MAX_ZERO_VARIANCE, no step without reward signal
    seeds        more than one seed: one seed is one sample

Comparing runs (`compare`): each run against the first, link by link (which of data, reward, loss
changed, and other settings), the same held-out sets scored by the same checker (read from the eval
files' problems and checker, not the card's words) or a refusal, and the paired difference of their
held-out gains over the same problems.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.stats import paired_difference_ci
from posttrain.runs.card import OTHER, span_text
from posttrain.runs.directory import read_jsonl
from posttrain.runs.results import IN_DISTRIBUTION_FILES, results

YES, NO, NOT_MEASURED = "yes", "no", "not measured"
QUESTIONS = {
    "heldout": "held-out problems never trained on",
    "independent": "held-out checker independent of the training reward",
    "interval": "held-out gain's 95% interval above zero",
    "shifted": "shifted held-out sets: the gain carries, none fell",
    "audit": "training reward audited (code: weak tests excluded)",
    "alarms": "divergence / displacement alarm silent",
    "review": "human spot check agrees with the checker",
    "signal": "training signal: rows scored, groups with variance",
    "seeds": "more than one seed",
}
"""A run's questions, by the name `--require` takes, in the order they are answered."""
COMPARISON_QUESTIONS = {
    "comparable": "the same held-out sets scored by the same checker",
    "attributable": "exactly one link differs",
}
"""A comparison's questions (answered for each run against the first)."""
MIN_AGREEMENT = 0.9
"""Checker-human agreement below this is a "no": a person overruled the checker on more than 1 row in 10."""
MAX_UNSCORABLE = 0.05
"""Training rows the reward could not score (infra + data errors) above this fraction are a "no"."""
MAX_ZERO_VARIANCE = 0.5
"""Groups whose rewards were all equal (no policy-gradient signal) above this mean fraction are a "no"."""
LINKS = ("data", "reward", "loss")
"""The links a comparison tells apart; the fourth, acceptance, must be the same to compare at all."""
NAMES = {"data": "data link", "reward": "reward link", "loss": "loss link", "other": "other settings", "start": "start model"}
"""What a comparison calls each row it tells apart (the three links, then what lies outside them)."""
OTHER_SETTINGS = ("max_steps", "optim", "lora_rank", "lora_alpha", "batch_size", "reward_options")
"""Top-level config sections outside the four links that change what a run learns; compared where both runs have them."""


@dataclass
class Answer:
    """One question answered: `answer` is yes / no / not measured, `detail` the run's own number
    and where it came from, `numbers` the same numbers for programs (--json)."""

    name: str
    answer: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return QUESTIONS.get(self.name) or COMPARISON_QUESTIONS[self.name]

    def record(self) -> dict[str, Any]:
        """The answer as JSON (the run card's checklist section, --json)."""
        return {"name": self.name, "question": self.question, "answer": self.answer, "detail": self.detail, "numbers": self.numbers}


@dataclass
class Run:
    """A run directory read back: its card, results section and metrics rows."""

    path: Path
    card: dict[str, Any]
    results: dict[str, Any]
    rows: list[dict[str, Any]]

    def link(self, name: str) -> dict[str, Any]:
        value = self.card.get("links", {}).get(name)
        return value if isinstance(value, dict) else {}

    @property
    def recipe(self) -> str:
        return str(self.card.get("run", {}).get("recipe", "?"))

    @property
    def seed(self) -> Any:
        return self.card.get("run", {}).get("seed")

    @property
    def start_model(self) -> Any:
        run = self.card.get("run", {})
        return run.get("model") or run.get("config", {}).get("model")


@dataclass
class Checklist:
    """A run's answers (in `QUESTIONS` order) and its verdict."""

    run: Run
    answers: dict[str, Answer]
    verdict: str

    def record(self) -> dict[str, Any]:
        """The checklist as JSON: the run card's "checklist" section and one entry of --json."""
        return {"run_dir": str(self.run.path), "recipe": self.run.recipe, "seed": self.run.seed,
                "answers": [answer.record() for answer in self.answers.values()], "verdict": self.verdict}


def read_run(run_dir: str | Path, card: dict[str, Any] | None = None) -> Run:
    """The run in `run_dir` (its run_card.json, or `card` when given: the card of a run being
    closed). A directory without a readable run card is one UserError line."""
    path = Path(run_dir)
    if card is None:
        card_path = path / "run_card.json"
        if not path.is_dir():
            raise UserError(f"{path}: no such run directory")
        if not card_path.is_file():
            raise UserError(f"{path}: not a run directory (no run_card.json)")
        try:
            card = json.loads(card_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{card_path}: unreadable ({error})") from None
        if not isinstance(card, dict) or not isinstance(card.get("run"), dict) or not isinstance(card.get("links"), dict):
            raise UserError(f"{card_path}: not a run card (no run and links sections)")
    found = card.get("results") or results(path)  # a card written before its run ended has no results yet
    return Run(path, card, found, read_jsonl(path / "metrics.jsonl"))


def eval_file(run: Run, name: str, step: int) -> dict[str, Any] | None:
    """Held-out set `name`'s eval file at `step` (summary and rows), None when absent or unreadable."""
    stems = IN_DISTRIBUTION_FILES if name == IN_DISTRIBUTION else (f"{name}-step",)
    for stem in stems:
        path = run.path / "eval" / f"{stem}-{step:06d}.json"
        if path.is_file():
            try:
                found = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return None
            return found if isinstance(found, dict) else None
    return None


def unpaired_difference_ci(start: float, start_ci: list, end: float, end_ci: list) -> tuple[float, float, float]:
    """end - start with Newcombe's hybrid score interval from the two Wilson intervals (Newcombe
    1998, Statistics in Medicine 17:873, method 10), for two evaluations of different problems.

    Example: 0.5 [0.4, 0.6] -> 0.7 [0.6, 0.78]: 0.2, [0.2 - sqrt(0.1^2 + 0.1^2), 0.2 + sqrt(0.08^2 + 0.1^2)]
    = (0.2, 0.0586, 0.3281)."""
    (start_low, start_high), (end_low, end_high) = start_ci, end_ci
    difference = end - start
    return (difference, difference - math.hypot(end - end_low, start_high - start),
            difference + math.hypot(end_high - end, start - start_low))


@dataclass
class Change:
    """A held-out set's pass@1 from its first evaluation to its last, the change's 95% interval
    and how it was computed."""

    start: dict[str, Any]
    end: dict[str, Any]
    value: float
    low: float | None
    high: float | None
    method: str  # "paired over N problems" | "unpaired (Newcombe)" | "no interval"

    @property
    def direction(self) -> str:
        """carried (interval above 0), reversed (below 0), flat (spans 0), unknown (no interval)."""
        if self.low is None:
            return "unknown"
        return "carried" if self.low > 0 else "reversed" if self.high < 0 else "flat"

    def text(self) -> str:
        """'+0.300 [+0.256, +0.344] paired over 500 problems, pass@1 0.656 (step 0) -> 0.956 (step 50)'."""
        interval = "" if self.low is None else f" [{self.low:+.3f}, {self.high:+.3f}]"
        return (f"{self.value:+.3f}{interval} {self.method}, pass@1 {self.start['pass@1']:.3f} (step {self.start['step']}) "
                f"-> {self.end['pass@1']:.3f} (step {self.end['step']})")

    def numbers(self) -> dict[str, Any]:
        """The change as JSON."""
        return {"change": self.value, "ci95": None if self.low is None else [self.low, self.high], "method": self.method,
                "start": self.start["pass@1"], "end": self.end["pass@1"], "start_step": self.start["step"], "end_step": self.end["step"]}


def set_change(run: Run, name: str) -> Change | None:
    """Set `name`'s change (None: evaluated once or never, or without a pass@1)."""
    entry = run.results.get("sets", {}).get(name)
    if not entry or "change" not in entry or entry["start"]["pass@1"] is None or entry["end"]["pass@1"] is None:
        return None
    start, end, change = entry["start"], entry["end"], entry["change"]
    if change.get("ci95") and change.get("paired"):
        return Change(start, end, change["value"], *change["ci95"], method=f"paired over {_scored_both(run, name, start, end)} problems")
    if None not in (start["ci95"] or [None]) and None not in (end["ci95"] or [None]):
        value, low, high = unpaired_difference_ci(start["pass@1"], start["ci95"], end["pass@1"], end["ci95"])
        return Change(start, end, value, low, high, method="unpaired (Newcombe; the evaluations scored different problems)")
    return Change(start, end, change["value"], None, None, method="no interval recorded")


def _scored_both(run: Run, name: str, start: dict, end: dict) -> str:
    """How many problems both evaluations scored ('?' when the eval files are gone)."""
    first, last = eval_file(run, name, start["step"]), eval_file(run, name, end["step"])
    if not first or not last:
        return "?"
    pairs = zip(first.get("summary", {}).get("correct", []), last.get("summary", {}).get("correct", []))
    return str(sum(a is not None and b is not None for a, b in pairs))


def heldout_answer(run: Run) -> Answer:
    """1. Held-out problems never trained on: how many, and the overlap check's count."""
    data, sets = run.link("data"), run.link("acceptance").get("sets") or {}
    entry = run.results.get("sets", {}).get(IN_DISTRIBUTION)
    last = eval_file(run, IN_DISTRIBUTION, entry["end"]["step"]) if entry else None
    problems = (last or {}).get("summary", {}).get("problems") or data.get("heldout_prompts") or data.get("heldout_examples")
    overlap = next((key for key in ("duplicates_removed", "removed_heldout_task_overlap") if key in data), None)
    shifted = {name: spec["training_prompts_removed"] for name, spec in sets.items()
               if isinstance(spec, dict) and "training_prompts_removed" in spec}
    shifted_text = ("; shifted sets: " + ", ".join(f"{name} {count} removed" for name, count in shifted.items())) if shifted else ""
    numbers = {"problems": problems, "overlap_removed": data.get(overlap) if overlap else None, "shifted_removed": shifted}
    if entry and problems:
        if overlap is None:
            return Answer("heldout", NOT_MEASURED, f"{problems} held-out problems, but the card records no overlap check with training",
                          numbers)
        return Answer("heldout", YES, f"{problems} held-out problems; the overlap check removed {data[overlap]} training prompts "
                                      f"equal to held-out ones (links.data.{overlap}){shifted_text}", numbers)
    pairs = data.get("heldout_pairs")
    if isinstance(pairs, int) and pairs > 0 and data.get("heldout_pairs_from"):
        return Answer("heldout", YES, f"{pairs} held-out pairs (links.data.heldout_pairs), {data['heldout_pairs_from']}; "
                                      "no held-out problem scored by a checker", {**numbers, "pairs": pairs})
    return Answer("heldout", NO, "no held-out problem was evaluated (results.sets is empty)", numbers)


def independent_answer(run: Run) -> Answer:
    """2. The held-out checker independent of the training reward (the card's reason)."""
    acceptance = run.link("acceptance")
    if "independent" not in acceptance:
        return Answer("independent", NOT_MEASURED, f"the card records no checker independence ({run.recipe}'s acceptance: "
                                                   f"{acceptance.get('measure') or acceptance.get('heldout') or 'none'})")
    dependent = sorted(name for name, spec in (acceptance.get("sets") or {}).items()
                       if isinstance(spec, dict) and spec.get("independent") is False)
    reason = acceptance.get("independence_reason", "no reason recorded")
    numbers = {"independent": acceptance["independent"], "checker": acceptance.get("checker_resolved") or acceptance.get("checker"),
               "dependent_sets": dependent}
    if not acceptance["independent"]:
        return Answer("independent", NO, f"{reason} (links.acceptance.independence_reason)", numbers)
    if dependent:
        return Answer("independent", NO, f"in-distribution: {reason}; but the checker of {', '.join(dependent)} is not independent "
                                         "(links.acceptance.sets)", numbers)
    return Answer("independent", YES, f"{reason} (links.acceptance.independence_reason)", numbers)


def interval_answer(run: Run) -> Answer:
    """3. The in-distribution gain's 95% interval lies above zero."""
    change = set_change(run, IN_DISTRIBUTION)
    if change is None:
        entry = run.results.get("sets", {}).get(IN_DISTRIBUTION)
        other = "; ".join(f"{OTHER.get(key, key)} {span_text(span)}" for key, span in run.results.get("heldout", {}).items())
        why = (f"held-out pass@1 evaluated once (step {entry['start']['step']})" if entry else "no held-out pass@1")
        return Answer("interval", NOT_MEASURED, why + (f"; other held-out measures, without a gain interval: {other}" if other else ""))
    source = f"{IN_DISTRIBUTION}: {change.text()} (results.sets.{IN_DISTRIBUTION})"
    if change.direction == "carried":
        return Answer("interval", YES, source, change.numbers())
    if change.direction == "unknown":
        return Answer("interval", NOT_MEASURED, source, change.numbers())
    said = "the held-out score fell" if change.direction == "reversed" else "no gain beyond noise"
    return Answer("interval", NO, f"{said}: {source}", change.numbers())


def shifted_answer(run: Run) -> Answer:
    """4. Shifted held-out sets: did the gain carry, stay flat or reverse (each with its interval)."""
    names = [name for name in run.results.get("sets", {}) if name != IN_DISTRIBUTION]
    if not names:
        return Answer("shifted", NOT_MEASURED, "no shifted held-out set (acceptance.sets names them)")
    changes = {name: set_change(run, name) for name in names}
    parts = [f"{name} {change.direction}: {change.text()}" if change else f"{name}: evaluated once" for name, change in changes.items()]
    numbers = {name: {"direction": change.direction, **change.numbers()} if change else None for name, change in changes.items()}
    detail = "; ".join(parts) + " (results.sets)"
    if any(change and change.direction == "reversed" for change in changes.values()):
        return Answer("shifted", NO, detail, numbers)
    if all(change is None or change.direction == "unknown" for change in changes.values()):
        return Answer("shifted", NOT_MEASURED, detail, numbers)
    return Answer("shifted", YES, detail, numbers)


def _reward_verifier(run: Run) -> str | None:
    """The training reward's name: an online run's verifier, a preference run's labeller, None for SFT."""
    reward = run.link("reward")
    return reward.get("verifier") if isinstance(reward.get("verifier"), str) else None


def audit_answer(run: Run) -> Answer:
    """5. The training reward audited, and for code data the dataset's weak tests found and excluded.
    `posttrain audit --verifier X --record RUN_DIR` leaves RUN_DIR/audit.json: yes when every case of
    the run's reward's suite passed in the sandbox, no otherwise; without it, "not measured" with the
    command that measures it."""
    from posttrain.rewards.audit import SUITES

    verifier, screening = _reward_verifier(run), run.link("data").get("screening")
    weak = (screening or {}).get("weak_tests")
    numbers = {"verifier": verifier, "weak_tests": weak}
    if screening is not None and weak is None:
        return Answer("audit", NO, "code data whose weak tests were not looked for (data.exclude_weak_tests false; "
                                   "`posttrain audit --data ...` finds them)", numbers)
    weak_text = (f"; weak tests: {weak['excluded']} of {weak['checked']} training problems accepted a trivial program and "
                 "were excluded (links.data.screening.weak_tests)") if weak else ""
    if verifier is None:
        return Answer("audit", NOT_MEASURED, f"no training reward to audit ({run.link('reward').get('kind') or run.recipe}){weak_text}",
                      numbers)
    name = verifier.split(":", 1)[0] if ":" in verifier else verifier
    record = _audit_record(run)
    if record is not None and record.get("verifier") == name:
        numbers["audit"] = {key: record.get(key) for key in ("cases", "passed", "exploit", "date", "unsafe_no_sandbox")}
        detail = (f"`posttrain audit --verifier {name}`: {record['passed']} of {record['cases']} cases passed "
                  f"({record.get('exploit', '?')} exploits; {record.get('date', '?')}; audit.json){weak_text}")
        if record["passed"] == record["cases"] and not record.get("unsafe_no_sandbox"):
            return Answer("audit", YES, detail, numbers)
        failures = ", ".join(f"{f['kind']} {f['name']!r}" for f in record.get("failures", [])[:3])
        return Answer("audit", NO, detail + (f"; failed: {failures}" if failures else "; ran without the sandbox"), numbers)
    how = (f"run `posttrain audit --verifier {name} --record {run.path}`" if name in SUITES
           else f"`posttrain audit` has no suite for {verifier} (suites: {', '.join(SUITES)})")
    return Answer("audit", NOT_MEASURED, f"the run records no audit of its reward {verifier}: {how}{weak_text}", numbers)


def _audit_record(run: Run) -> dict[str, Any] | None:
    """The run's audit.json (`posttrain audit --verifier X --record RUN_DIR`), None when absent or unreadable."""
    path = run.path / "audit.json"
    try:
        record = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "passed" in record and "cases" in record else None


def alarms_answer(run: Run) -> Answer:
    """6. The divergence alarm (online runs) or likelihood-displacement alarm (preference runs):
    silent, or rang (when, with the numbers); "not measured" when the run was too short to ring."""
    acceptance, alarms = run.link("acceptance"), [str(alarm) for alarm in run.card.get("alarms") or []]
    if "divergence_alarm_threshold" in acceptance:
        rang = [alarm for alarm in alarms if alarm.startswith("divergence")]
        window = acceptance.get("alarm_window", 0)
        seen = sum(1 for row in run.rows if row.get("heldout/pass@1") is not None and row["step"] > 0)
        kind, what = "divergence", f"divergence alarm ({acceptance['divergence_alarm_threshold']}, window {window} evaluations)"
    elif "displacement_threshold" in acceptance:
        if str(acceptance.get("displacement_alarm", "")).startswith("off"):
            return Answer("alarms", NOT_MEASURED, f"displacement alarm {acceptance['displacement_alarm']}")
        rang = [alarm for alarm in alarms if alarm.startswith("likelihood displacement")]
        window = 2  # DisplacementAlarm compares once it has two steps
        seen = sum(1 for row in run.rows if row.get("logratio/chosen") is not None)
        kind, what = "likelihood-displacement", (f"likelihood-displacement alarm (threshold {acceptance['displacement_threshold']} nats, "
                                                 f"window {acceptance.get('alarm_window')} steps)")
    else:
        return Answer("alarms", NOT_MEASURED, f"{run.recipe} has no divergence or displacement alarm (no training reward to watch)")
    numbers = {"alarm": kind, "settings": what, "observations": seen, "rang": rang}
    if rang:
        return Answer("alarms", NO, f"the {what} rang: {rang[0]} (card: alarms)", numbers)
    if seen < window:
        return Answer("alarms", NOT_MEASURED, f"the {what} saw {seen} observations, fewer than it needs to ring", numbers)
    return Answer("alarms", YES, f"the {what} stayed silent over {seen} observations (card: alarms)", numbers)


def review_answer(run: Run) -> Answer:
    """7. Human spot check: the marks' agreement with the checker and its interval, or "not done"
    with the command that does it."""
    review = run.link("acceptance").get("human_review")
    if not isinstance(review, dict) or not review.get("n_marked"):
        done = "marked no row agree or disagree" if isinstance(review, dict) else "not done"
        return Answer("review", NOT_MEASURED, f"{done}: `posttrain review {run.path}`, mark the sheet, then "
                                              f"`posttrain review {run.path} --score {run.path / 'review' / 'marks.json'}`")
    agreement, (low, high) = review["agreement"], review["ci95"]
    numbers = {"agreement": agreement, "ci95": [low, high], "n_marked": review["n_marked"], "step": review.get("step")}
    detail = (f"agreement {agreement:.3f} [{low:.3f}, {high:.3f}] over {review['n_marked']} marked rows of step {review.get('step')}, "
              f"{review.get('disagreements', 0)} disagreements (links.acceptance.human_review)")
    if agreement < MIN_AGREEMENT:
        return Answer("review", NO, f"{detail}: below {MIN_AGREEMENT}", numbers)
    return Answer("review", YES, detail, numbers)


def signal_answer(run: Run) -> Answer:
    """8. The training signal: unscorable rows, groups without reward variance, steps without signal."""
    signal = run.card.get("training_signal")
    if not isinstance(signal, dict) or not signal.get("rows"):
        return Answer("signal", NOT_MEASURED, f"{run.recipe} scores no rows while training (no training_signal section)")
    unscorable = (signal.get("infra_error_rate") or 0) + (signal.get("data_error_rate") or 0)
    zero = signal.get("zero_variance_group_fraction")
    numbers = {key: signal.get(key) for key in ("steps", "rows", "infra_error_rate", "data_error_rate", "zero_variance_group_fraction",
                                                "steps_without_reward_signal", "alarm")}
    detail = (f"{signal['rows']} rows over {signal['steps']} steps: {signal['infra_error_rate']:.1%} infra errors, "
              f"{signal['data_error_rate']:.1%} data errors" + ("" if zero is None else f", {zero:.1%} of groups without reward variance")
              + f", {signal['steps_without_reward_signal']} steps without reward signal (card: training_signal)")
    problems = ([f"more than {MAX_UNSCORABLE:.0%} unscorable"] if unscorable > MAX_UNSCORABLE else []) \
        + ([f"more than {MAX_ZERO_VARIANCE:.0%} of groups without variance"] if zero is not None and zero > MAX_ZERO_VARIANCE else []) \
        + ([f"the alarm rang: {signal['alarm']}"] if signal.get("alarm") else [])
    if problems or signal.get("steps_without_reward_signal"):
        return Answer("signal", NO, detail + (": " + "; ".join(problems) if problems else ""), numbers)
    return Answer("signal", YES, detail, numbers)


def seeds_answer(run: Run, seeds: list | None = None) -> Answer:
    """9. How many seeds the claim rests on: `seeds` are those of the given runs with this run's
    links and settings (None: this run's own)."""
    seeds = sorted(set(seeds if seeds is not None else [run.seed]), key=str)
    if len(seeds) > 1:
        return Answer("seeds", YES, f"{len(seeds)} seeds ({', '.join(map(str, seeds))}) of the same links among the runs given",
                      {"seeds": seeds})
    return Answer("seeds", NO, f"one seed ({seeds[0]}): one seed is one sample; run more and pass them all to "
                               "`posttrain checklist`", {"seeds": seeds})


def checklist(run: Run, seeds: list | None = None) -> Checklist:
    """Every question of `QUESTIONS` answered for `run`, and the verdict."""
    answers = [heldout_answer(run), independent_answer(run), interval_answer(run), shifted_answer(run), audit_answer(run),
               alarms_answer(run), review_answer(run), signal_answer(run), seeds_answer(run, seeds)]
    answers = {answer.name: answer for answer in answers}
    return Checklist(run, answers, verdict(answers))


def verdict(answers: dict[str, Answer]) -> str:
    """One sentence: whether the held-out gain supports the claim, what weakens it, what was not measured."""
    gain, numbers = answers["interval"], answers["interval"].numbers
    figure = f"{numbers['change']:+.3f} [{numbers['ci95'][0]:+.3f}, {numbers['ci95'][1]:+.3f}]" if numbers.get("ci95") else ""
    cautions = []
    if answers["independent"].answer == NO:
        cautions.append("the checker is not independent of the training reward, so the gain may be the checker's blind spot")
    if answers["heldout"].answer == NO:
        cautions.append("no held-out problem was kept apart from training")
    if answers["alarms"].answer == NO:
        cautions.append(f"the {answers['alarms'].numbers['alarm']} alarm rang")
    if answers["shifted"].answer == NO:
        fell = [name for name, entry in answers["shifted"].numbers.items() if entry and entry["direction"] == "reversed"]
        cautions.append(f"the shifted held-out set{'s' if len(fell) > 1 else ''} {', '.join(fell)} fell")
    if answers["signal"].answer == NO:
        cautions.append("the training signal was weak")
    if answers["review"].answer == NO:
        cautions.append("a person disagreed with the checker too often")
    but = "; ".join(cautions)
    if gain.answer == YES and not cautions:
        head = f"Supported on this task: the held-out gain {figure} on problems never trained on, by an independent checker, no alarm rang"
    elif gain.answer == YES:
        head = f"Not yet supported: the held-out gain is {figure}, but {but}"
    elif gain.answer == NO:
        said = "the held-out score fell" if numbers["ci95"][1] < 0 else "the held-out change is within noise"
        head = f"Not supported: {said}, {figure}" + (f"; {but}" if but else "")
    else:
        head = "Nothing to conclude: no held-out gain with an interval" + (f"; {but}" if but else "")
    unmeasured = [name for name, answer in answers.items() if answer.answer == NOT_MEASURED]
    tail = (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "") + (
        "; one seed is one sample" if answers["seeds"].answer == NO else "")
    return head + tail + "."


def card_section(run_dir: str | Path, card: dict[str, Any]) -> dict[str, Any]:
    """The run card's "checklist" section of the run being closed in `run_dir` (its `card` in
    memory, results included): every answer and the verdict, for this run alone (one seed)."""
    found = checklist(read_run(run_dir, card))
    return {"answers": [answer.record() for answer in found.answers.values()], "verdict": found.verdict}


MISSING = object()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys: {"group": {"scale": "group"}} -> {"group.scale": "group"}."""
    if not isinstance(value, dict) or not value:
        return {prefix: value} if prefix else {}
    flat: dict[str, Any] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def link_view(run: Run, link: str) -> dict[str, Any]:
    """What a comparison compares of `link`: the data and loss links as the card states them; the
    reward as the verifier describes itself (an online run's training reward, a preference run's
    labeller: so GRPO and DPO on the same program's verdicts have the same reward link); `other`,
    the `OTHER_SETTINGS` of the run's config; `start`, the model it started from."""
    if link == "reward":
        reward = run.link("reward")
        described = run.link("acceptance").get("training_reward") or reward.get("verifier_settings")
        return described if isinstance(described, dict) else {k: v for k, v in reward.items() if k not in ("passed_as", "resolved_from")}
    if link == "other":
        config = run.card.get("run", {}).get("config", {})
        return {key: config[key] for key in OTHER_SETTINGS if key in config}
    if link == "start":
        return {"model": run.start_model}
    return run.link(link)


def link_summary(run: Run, link: str) -> str:
    """A link in a few words, for the side-by-side table."""
    view = link_view(run, link)
    if link == "data":
        options = view.get("options")
        return f"{view.get('source') or 'gold answers (imitation)'}; task {view.get('task')}" + (f" {json.dumps(options)}" if options else "")
    if link == "reward":
        return str(view.get("verifier") or view.get("kind") or json.dumps(view))
    if link == "loss":
        return str(view.get("algorithm") or view.get("objective") or "?")
    if link == "start":
        return str(view["model"])
    return ", ".join(f"{key}: {value}" for key, value in flatten(view).items() if key.startswith(("optim.lr", "max_steps"))) or "-"


@dataclass
class LinkRow:
    """One link of two runs side by side: each run's summary and the settings that differ."""

    link: str
    base: str
    other: str
    changes: list[str]

    @property
    def same(self) -> bool:
        return not self.changes

    def state(self, limit: int = 4) -> str:
        """'same', or what changed: the summaries when they differ (the table shows both), else the settings."""
        if self.same:
            return "same"
        if self.link == "acceptance":
            return f"changed: {self.changes[0]}"
        if self.base != self.other and self.link != "other":
            return "changed"
        return "changed: " + "; ".join(self.changes[:limit]) + (f"; +{len(self.changes) - limit} more" if len(self.changes) > limit else "")


def link_rows(base: Run, other: Run) -> list[LinkRow]:
    """data, reward, loss, the other settings both runs have, and the start model, each compared."""
    rows = []
    for link in (*LINKS, "other", "start"):
        left, right = link_view(base, link), link_view(other, link)
        if link == "other":
            left, right = ({key: value for key, value in view.items() if key in left and key in right} for view in (left, right))
        left, right = flatten(left), flatten(right)
        changes = [f"{key}: {left.get(key, '-')} -> {right.get(key, '-')}" for key in sorted(set(left) | set(right))
                   if left.get(key, MISSING) != right.get(key, MISSING)]
        rows.append(LinkRow(link, link_summary(base, link), link_summary(other, link), changes))
    return rows


@dataclass
class SetRow:
    """One held-out set of two runs: comparable (the same problems, the same checker) or why not,
    and the paired difference (other - base) of their gains, or of their final scores when a run
    has no start evaluation of those problems."""

    name: str
    comparable: bool
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)


def _problems(found: dict[str, Any]) -> list:
    return [(row.get("id"), row.get("prompt")) for row in found.get("rows", []) if isinstance(row, dict)]


def _correct(found: dict[str, Any] | None) -> list | None:
    return (found or {}).get("summary", {}).get("correct")


def compare_set(base: Run, other: Run, name: str) -> SetRow:
    """Set `name` of both runs read from their eval files: refused when the problems or the checker
    differ; else the paired difference of the gains (start to end) over the same problems."""
    points = [run.results["sets"][name] for run in (base, other)]
    ends = [eval_file(run, name, point["end"]["step"]) for run, point in zip((base, other), points)]
    if None in ends or None in map(_correct, ends):
        return SetRow(name, False, "an eval file with its per-problem scores is missing")
    if ends[0]["summary"].get("checker") != ends[1]["summary"].get("checker"):
        return SetRow(name, False, f"scored by different checkers ({json.dumps(ends[0]['summary'].get('checker'))} vs "
                                   f"{json.dumps(ends[1]['summary'].get('checker'))})")
    if _problems(ends[0]) != _problems(ends[1]) or len(_correct(ends[0])) != len(_correct(ends[1])):
        return SetRow(name, False, f"different problems ({len(_correct(ends[0]))} vs {len(_correct(ends[1]))}, "
                                   "or the same number in another order or with other prompts)")
    starts = [eval_file(run, name, point["start"]["step"]) if "change" in point else None for run, point in zip((base, other), points)]
    if all(start and _problems(start) == _problems(ends[0]) for start in starts):
        before, after = ([None if None in (s, e) else e - s for s, e in zip(_correct(start), _correct(end))]
                         for start, end in zip(starts, ends))
        measure = "gain (end - start)"
    else:
        before, after, measure = _correct(ends[0]), _correct(ends[1]), "final pass@1"
    try:
        value, low, high = paired_difference_ci(before, after)
    except ValueError:
        return SetRow(name, False, "no problem was scored by both runs")
    scored = sum(a is not None and b is not None for a, b in zip(before, after))
    starts_equal = all(starts) and _correct(starts[0]) == _correct(starts[1])
    return SetRow(name, True, f"the same {len(_problems(ends[0]))} problems, the same checker", {
        "measure": measure, "difference": value, "ci95": [low, high], "n": scored, "same_start_scores": starts_equal,
        "base_end": points[0]["end"]["pass@1"], "other_end": points[1]["end"]["pass@1"]})


@dataclass
class Comparison:
    """`other` against `base`: the links side by side, each common held-out set, the answers and the verdict."""

    base: Run
    other: Run
    links: list[LinkRow]
    sets: list[SetRow]
    only_in_one: list[str]
    answers: dict[str, Answer]
    verdict: str

    def record(self) -> dict[str, Any]:
        """The comparison as JSON (--json)."""
        return {"base": str(self.base.path), "other": str(self.other.path),
                "links": [{"link": row.link, "base": row.base, "other": row.other, "same": row.same, "changes": row.changes}
                          for row in self.links],
                "sets": [asdict(row) for row in self.sets], "sets_in_one_run_only": self.only_in_one,
                "answers": [answer.record() for answer in self.answers.values()], "verdict": self.verdict}


def compare(base: Run, other: Run) -> Comparison:
    """`other` compared with `base`: which links changed, whether their held-out sets can be
    compared, the paired difference on each, and a verdict that refuses to attribute a difference
    to one link when several changed."""
    links = link_rows(base, other)
    names = [name for name in base.results.get("sets", {}) if name in other.results.get("sets", {})]
    only = sorted(set(base.results.get("sets", {})) ^ set(other.results.get("sets", {})))
    sets = [compare_set(base, other, name) for name in names]
    refused = [row for row in sets if not row.comparable]
    main = next((row for row in sets if row.name == IN_DISTRIBUTION), None)
    if main is None or refused:
        comparable = Answer("comparable", NO, f"{IN_DISTRIBUTION} is not held out by both runs" if main is None
                            else "; ".join(f"{row.name}: {row.reason}" for row in refused))
    else:
        comparable = Answer("comparable", YES, "; ".join(f"{row.name}: {row.reason}" for row in sets)
                            + (f"; held out by one run only: {', '.join(only)}" if only else ""))
    links.insert(len(LINKS), LinkRow("acceptance", _acceptance_summary(base), _acceptance_summary(other),
                                     [] if comparable.answer == YES else [comparable.detail]))
    changed = [row.link for row in links if not row.same and row.link in LINKS]
    confounds = [row for row in links if not row.same and row.link in ("other", "start")]
    differing = [NAMES[row.link] + ("" if row.link in LINKS else f" ({', '.join(row.changes[:3])})") for row in links
                 if not row.same and row.link != "acceptance"]
    if len(changed) == 1 and not confounds:
        attributable = Answer("attributable", YES, f"only the {NAMES[changed[0]]} differs", {"changed": changed})
    elif not differing:
        attributable = Answer("attributable", NO, "nothing differs but the seed: the difference measures run-to-run noise",
                              {"changed": changed})
    else:
        attributable = Answer("attributable", NO, _joined(differing) + " differ",
                              {"changed": changed, "other": [row.link for row in confounds]})
    answers = {"comparable": comparable, "attributable": attributable}
    return Comparison(base, other, links, sets, only, answers, comparison_verdict(base, other, answers, main, differing))


def _acceptance_summary(run: Run) -> str:
    """The checker and the held-out sets of a run, from its card."""
    acceptance = run.link("acceptance")
    checker = acceptance.get("checker_resolved") or (acceptance.get("checker_settings") or {}).get("verifier") or acceptance.get("checker")
    return f"checker {checker}; sets: {', '.join(run.results.get('sets', {})) or 'none'}"


def _joined(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def comparison_verdict(base: Run, other: Run, answers: dict[str, Answer], main: SetRow | None, differing: list[str]) -> str:
    """One sentence: refused, or the paired difference and whether one link explains it."""
    if answers["comparable"].answer != YES:
        return f"Refused: the two runs' held-out numbers cannot be compared ({answers['comparable'].detail})."
    numbers = main.numbers
    low, high = numbers["ci95"]
    clear = "higher" if low > 0 else "lower" if high < 0 else "not clearly different"
    difference = (f"{other.path.name} - {base.path.name} in {numbers['measure']} on {IN_DISTRIBUTION}: {numbers['difference']:+.3f} "
                  f"[{low:+.3f}, {high:+.3f}] paired over {numbers['n']} problems ({clear})")
    if answers["attributable"].answer == YES:
        return f"Only the {differing[0]} changed: {difference}, attributable to it (one seed each)."
    if not differing:
        return f"Nothing but the seed differs: {difference}, which measures run-to-run noise."
    return (f"The {_joined(differing)} differ: {difference}; the comparison cannot attribute it to one of them "
            "(change one link at a time).")


def seed_groups(runs: list[Run]) -> dict[Path, list]:
    """Each run's seeds: those of the given runs whose links, other settings and start all equal its own."""
    def signature(run: Run) -> str:
        views = {link: link_view(run, link) for link in (*LINKS, "other", "start")}
        views["acceptance"] = {key: value for key, value in run.link("acceptance").items() if key != "human_review"}
        return json.dumps(views, sort_keys=True, default=str)

    signatures = {run.path: signature(run) for run in runs}
    return {run.path: [other.seed for other in runs if signatures[other.path] == signatures[run.path]] for run in runs}


def check_runs(run_dirs: list[str | Path]) -> tuple[list[Checklist], list[Comparison]]:
    """`posttrain checklist`: every run's checklist (its seeds counted among the runs given) and,
    for two or more runs, each later run compared with the first."""
    runs = [read_run(path) for path in run_dirs]
    seeds = seed_groups(runs)
    return [checklist(run, seeds[run.path]) for run in runs], [compare(runs[0], run) for run in runs[1:]]


def unmet(checklists: list[Checklist], comparisons: list[Comparison], required: list[str]) -> list[str]:
    """'RUN: NAME (ANSWER)' for every required answer that is not yes (a comparison question with
    one run given counts as not measured)."""
    found = []
    for name in required:
        if name in COMPARISON_QUESTIONS and not comparisons:
            found.append(f"{name} (not measured: one run, nothing to compare)")
        for entry in checklists:
            if name in entry.answers and entry.answers[name].answer != YES:
                found.append(f"{entry.run.path}: {name} ({entry.answers[name].answer})")
        for comparison in comparisons:
            if name in comparison.answers and comparison.answers[name].answer != YES:
                found.append(f"{comparison.other.path} vs {comparison.base.path}: {name} ({comparison.answers[name].answer})")
    return found


def markdown(entry: Checklist) -> list[str]:
    """A run's checklist as a markdown table and its verdict (the demo's report)."""
    lines = ["| # | question | answer | the run's number and its source |", "|---|---|---|---|"]
    lines += [f"| {number} | {answer.question} | **{answer.answer}** | {_cell(answer.detail)} |"
              for number, answer in enumerate(entry.answers.values(), 1)]
    return lines + ["", f"**Verdict.** {entry.verdict}", ""]


def comparison_markdown(comparison: Comparison) -> list[str]:
    """A comparison as markdown: the links side by side (changed ones in bold), each held-out set's
    paired difference or refusal, the answers and the verdict."""
    base, other = comparison.base.path.name, comparison.other.path.name
    lines = [f"| link | {base} | {other} | |", "|---|---|---|---|"]
    for row in comparison.links:
        lines.append(f"| {row.link} | {_cell(row.base)} | {_cell(row.other)} | {'same' if row.same else '**' + _cell(row.state()) + '**'} |")
    lines += ["", f"| held-out set | {other} - {base} (95% CI) | |", "|---|---|---|"]
    for row in comparison.sets:
        if row.comparable:
            low, high = row.numbers["ci95"]
            lines.append(f"| {row.name} | {row.numbers['difference']:+.3f} [{low:+.3f}, {high:+.3f}] | {row.numbers['measure']}, "
                         f"paired over {row.numbers['n']} problems |")
        else:
            lines.append(f"| {row.name} | refused | {_cell(row.reason)} |")
    lines += [""] + [f"- {answer.question}: **{answer.answer}** ({_cell(answer.detail)})" for answer in comparison.answers.values()]
    return lines + ["", f"**Verdict.** {comparison.verdict}", ""]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def text(checklists: list[Checklist], comparisons: list[Comparison]) -> str:
    """The command's plain-text output: each run's answers, one a line, and its verdict; then each comparison."""
    lines = []
    for entry in checklists:
        lines.append(f"{entry.run.path} ({entry.run.recipe}, seed {entry.run.seed})")
        lines += [f"  {number}. {answer.question:<52} {answer.answer:<13} {answer.detail}"
                  for number, answer in enumerate(entry.answers.values(), 1)]
        lines += [f"  verdict: {entry.verdict}", ""]
    for comparison in comparisons:
        lines.append(f"{comparison.other.path} vs {comparison.base.path}")
        for row in comparison.links:
            lines.append(f"  {row.link:<10} {row.base[:44]:<44} | {row.other[:44]:<44} {row.state().replace('changed', 'CHANGED', 1)}")
        for row in comparison.sets:
            if row.comparable:
                low, high = row.numbers["ci95"]
                lines.append(f"  held-out {row.name}: {row.numbers['difference']:+.3f} [{low:+.3f}, {high:+.3f}] "
                             f"({row.numbers['measure']}, paired over {row.numbers['n']} problems)")
            else:
                lines.append(f"  held-out {row.name}: refused ({row.reason})")
        lines += [f"  {answer.question:<52} {answer.answer:<13} {answer.detail}" for answer in comparison.answers.values()]
        lines += [f"  verdict: {comparison.verdict}", ""]
    return "\n".join(lines).rstrip() + "\n"
